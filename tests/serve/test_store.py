# SPDX-License-Identifier: Apache-2.0
"""The SQLite job store alone: transitions, order, the cap on waiting jobs, and the restart
semantics (queued jobs stay, a running one is re-queued once and then failed, cancels asked for
a running job are carried out, finished jobs stay listed). A "crash" here is a second store opened
on the same file while the first never finished its job, as after a kill -9."""

from __future__ import annotations

import logging
import shutil
import sqlite3

import pytest

from dist_attn.models.h3.serve.jobs.store import MAX_ATTEMPTS, JobStatus, JobStore
from dist_attn.models.h3.serve.jobs.videos import VideoRequest

REQ = VideoRequest(prompt="a cat", frames=124, height=64, width=64, steps=2, seed=1, rows=100)


def test_transitions_order_and_cap(tmp_path):
    store = JobStore(str(tmp_path))
    a, b = (store.submit(REQ, max_queued=2) for _ in range(2))
    assert store.submit(REQ, max_queued=2) is None  # two waiting: full
    assert [j.id for j in store.queued()] == [a.id, b.id]
    assert store.queue_position(b) == 1 and a.id.startswith("vid_") and a.id != b.id
    running = store.start_next()
    assert running.id == a.id and running.status is JobStatus.RUNNING and running.attempts == 1
    assert store.submit(REQ, max_queued=2) is not None  # a slot freed
    store.succeed(a.id, output="videos/a.mp4", thumbnail="videos/a.png", timings={"total_s": 1.5})
    done = store.get(a.id)
    assert (done.status, done.output, done.timings) == (JobStatus.SUCCEEDED, "videos/a.mp4",
                                                        {"total_s": 1.5})
    assert done.finished_at >= done.started_at >= done.created_at
    assert store.request_cancel(b.id).status is JobStatus.CANCELLED  # queued: at once
    assert store.request_cancel(a.id).status is JobStatus.SUCCEEDED  # finished: unchanged
    assert store.request_cancel("vid_nope") is None
    counts = store.counts()
    assert counts[JobStatus.SUCCEEDED] == 1 and counts[JobStatus.CANCELLED] == 1
    assert counts[JobStatus.QUEUED] == 1 and counts[JobStatus.RUNNING] == 0
    assert [j.id for j in store.list(limit=2)][1] == b.id  # newest first
    assert [j.id for j in store.list(status=JobStatus.SUCCEEDED)] == [a.id]
    assert store.get(a.id).request == REQ


def test_the_file_is_wal_and_every_commit_is_synced(tmp_path):
    JobStore(str(tmp_path)).submit(REQ, max_queued=8)
    db = sqlite3.connect(str(tmp_path / "jobs.sqlite3"))
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0] == 1  # committed, visible


def test_restart_requeues_a_running_job_once_then_fails_it(tmp_path):
    first = JobStore(str(tmp_path))
    ids = [first.submit(REQ, max_queued=8).id for _ in range(3)]
    assert first.start_next().id == ids[0]
    # crash: the store is reopened with the job still 'running'
    second = JobStore(str(tmp_path))
    rec = second.recover()
    assert rec.requeued == [ids[0]] and rec.failed == [] and rec.queued == 3
    again = second.get(ids[0])
    assert again.status is JobStatus.QUEUED and "re-queued" in again.history[0]
    assert [j.id for j in second.queued()] == ids  # it keeps its place
    assert second.start_next().id == ids[0]
    third = JobStore(str(tmp_path))  # a second crash while it runs
    rec = third.recover()
    assert rec.failed == [ids[0]] and rec.requeued == []
    failed = third.get(ids[0])
    assert failed.status is JobStatus.FAILED and f"{MAX_ATTEMPTS} times" in failed.error
    assert [j.id for j in third.queued()] == ids[1:]


def test_a_clean_stop_gives_the_attempt_back(tmp_path):
    store = JobStore(str(tmp_path))
    job = store.submit(REQ, max_queued=8)
    store.start_next()
    store.requeue(job.id, "re-queued: the server was stopped while this job ran")
    back = store.get(job.id)
    assert back.status is JobStatus.QUEUED and back.attempts == 0 and back.started_at is None
    for _ in range(3):  # clean stops never fail it
        store.start_next()
        store.requeue(job.id, "again")
    assert store.get(job.id).status is JobStatus.QUEUED


def test_a_cancel_asked_while_running_is_carried_out_at_restart(tmp_path):
    store = JobStore(str(tmp_path))
    job = store.submit(REQ, max_queued=8)
    store.start_next()
    marked = store.request_cancel(job.id)
    assert marked.status is JobStatus.RUNNING and marked.cancel_requested
    rec = JobStore(str(tmp_path)).recover()
    assert rec.cancelled == [job.id]
    assert store.get(job.id).status is JobStatus.CANCELLED


@pytest.mark.parametrize("status", list(JobStatus))
def test_statuses_round_trip(tmp_path, status):
    assert JobStatus(status.value) is status
    assert status.final == (status in (JobStatus.SUCCEEDED, JobStatus.FAILED,
                                       JobStatus.CANCELLED))


def test_a_video_job_fits_the_control_message():
    """The worker ranks rebuild the job from the control message's integers (a field the message
    does not carry once crashed the rank-0 loop at the first video job)."""
    from dist_attn.models.h3.serve.jobs.runner import video_from_wire, video_wire
    from dist_attn.models.h3.serve.wire import WIRE_FIELDS

    wire = video_wire(REQ)
    assert len(wire) == len(WIRE_FIELDS)
    back = video_from_wire(wire)
    assert (back.frames, back.height, back.width, back.steps, back.seed) == (
        REQ.frames, REQ.height, REQ.width, REQ.steps, REQ.seed)


def test_a_backup_of_the_main_file_alone_holds_the_finished_jobs(tmp_path):
    """The jobs lived in jobs.sqlite3-wal while the main file stayed at 4 KB: a copy of
    jobs.sqlite3 alone held no job. The store checkpoints after every job's end and at close."""
    live, backup = tmp_path / "live", tmp_path / "backup"
    store = JobStore(str(live))
    done = store.submit(REQ, max_queued=8)
    store.start_next()
    store.succeed(done.id, output="videos/a.mp4", thumbnail=None, timings={})
    waiting = store.submit(REQ, max_queued=8)  # committed to the WAL; no job ended since
    backup.mkdir()
    shutil.copy(live / "jobs.sqlite3", backup / "jobs.sqlite3")  # the server still running
    copy = JobStore(str(backup))
    assert [(j.id, j.status) for j in copy] == [(done.id, JobStatus.SUCCEEDED)]
    copy.close()
    store.close()  # the shutdown: everything into the main file
    shutil.copy(live / "jobs.sqlite3", backup / "jobs.sqlite3")
    assert [j.id for j in JobStore(str(backup))] == [done.id, waiting.id]


def test_mp4s_the_store_does_not_list_log_a_warning(tmp_path, caplog):
    """A store restored without its WAL started empty, without a word, although videos/ held
    every MP4: the start now warns, naming the store, the count and the jobs."""
    from dist_attn.models.h3.serve.jobs.store_open import open_job_store

    out = tmp_path / "out"
    (out / "videos").mkdir(parents=True)
    (out / "videos" / "vid_lost.mp4").write_bytes(b"an mp4")
    caplog.set_level(logging.INFO)
    store = open_job_store(str(out))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"job store {out / 'jobs.sqlite3'} lists 0 job(s), but "
                                  f"{out / 'videos'} holds 1 MP4(s) of jobs it does not list "
                                  "(vid_lost)"), warnings
    job = store.submit(REQ, max_queued=8)
    store.start_next()
    store.succeed(job.id, output=f"videos/{job.id}.mp4", thumbnail=None, timings={})
    (out / "videos" / f"{job.id}.mp4").write_bytes(b"an mp4")
    (out / "videos" / "vid_lost.mp4").unlink()
    store.close()
    caplog.clear()
    open_job_store(str(out)).close()  # every MP4 listed: no warning
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_a_corrupt_store_file_is_an_error_naming_it_and_what_to_do(tmp_path):
    """A corrupt jobs.sqlite3 raised sqlite3.DatabaseError from deep in the start-up; a damaged
    page past a valid header passed the open and failed later. Both name the file now."""
    from dist_attn.models.h3.serve.jobs.store import StoreError

    path = tmp_path / "jobs.sqlite3"
    path.write_bytes(b"not a database " * 600)
    with pytest.raises(StoreError) as garbage:
        JobStore(str(tmp_path))
    message = str(garbage.value)
    assert message.startswith(f"{path} is not a readable SQLite job store (SQLite: file is not "
                              "a database)"), message
    assert "move jobs.sqlite3 (with jobs.sqlite3-wal and jobs.sqlite3-shm if present)" in message
    path.unlink()
    store = JobStore(str(tmp_path))
    for _ in range(200):  # a few pages of jobs
        store.submit(REQ, max_queued=1000)
    store.close()
    data = bytearray(path.read_bytes())
    page = 4096
    data[2 * page:3 * page] = b"\xff" * page  # one damaged table page, the header intact
    path.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="is not a readable SQLite job store"):
        JobStore(str(tmp_path))


def test_a_store_path_that_is_a_directory_is_one_launch_failure(tmp_path):
    """``mkdir OUT/jobs.sqlite3`` raised sqlite3.OperationalError from sqlite3.connect, outside
    the store's checks: a raw traceback instead of the launch failure a corrupt file gets."""
    from dist_attn.models.h3.serve.config import apply_overrides, load_config
    from dist_attn.models.h3.serve.jobs.store import StoreError
    from dist_attn.models.h3.serve.launch.start import _open_store

    (tmp_path / "jobs.sqlite3").mkdir()
    with pytest.raises(StoreError) as info:
        JobStore(str(tmp_path))
    assert str(info.value) == (f"{tmp_path / 'jobs.sqlite3'} is a directory, not a SQLite job "
                               "store file: move it out of the output directory (the server "
                               "then starts with an empty job store) or choose another "
                               "--output-dir")
    cfg = apply_overrides(load_config(None), {"jobs.runner": "synthetic",
                                              "jobs.output_dir": str(tmp_path)})
    failures: list[str] = []
    assert _open_store(cfg, failures) is None
    assert failures == [f"job store: {info.value}"]
