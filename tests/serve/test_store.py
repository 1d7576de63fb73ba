"""The SQLite job store alone: transitions, order, the cap on waiting jobs, and the restart
semantics (queued jobs stay, a running one is re-queued once and then failed, cancels asked for
a running job are carried out, finished jobs stay listed). A "crash" here is a second store opened
on the same file while the first never finished its job, as after a kill -9."""

from __future__ import annotations

import sqlite3

import pytest

from dist_attn.serve.store import MAX_ATTEMPTS, JobStatus, JobStore
from dist_attn.serve.videos import VideoRequest

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
    from dist_attn.serve.protocol import WIRE_FIELDS
    from dist_attn.serve.runner import video_from_wire, video_wire

    wire = video_wire(REQ)
    assert len(wire) == len(WIRE_FIELDS)
    back = video_from_wire(wire)
    assert (back.frames, back.height, back.width, back.steps, back.seed) == (
        REQ.frames, REQ.height, REQ.width, REQ.steps, REQ.seed)
