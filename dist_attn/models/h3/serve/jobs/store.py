# SPDX-License-Identifier: Apache-2.0
"""The job store: every video job in one SQLite file under the output directory (the standard
library's ``sqlite3``, WAL mode, ``synchronous=FULL``).

What the store promises (the server's restart semantics):

- A job is in the file, committed and fsync'ed, before its 202 is sent.
- At start (:meth:`JobStore.recover`), after a crash, ``kill -9`` or a clean stop: queued jobs
  stay queued, in submission order; a job that was running is re-queued once, and failed with
  its reason if it was already re-queued after a crash (a job that kills the server each time
  must not take it down forever); a cancel that was asked for a running job is carried out;
  finished jobs (succeeded, failed, cancelled) and their files stay listed.
- A clean shutdown that interrupts a running job puts it back in the queue without counting an
  attempt (:meth:`JobStore.requeue`): the job did not cause the stop.

A job's end that cannot be committed (a full disk) is held in memory and read over its row by
every read (:mod:`dist_attn.models.h3.serve.jobs.ends`): clients see the job finished at once, and
:meth:`JobStore.flush` commits it when the store can (before any job starts, and at close).

Progress (step k of n) is not written per step (an fsync per step would cost ~10% of a tiny CPU
step); the rank-0 loop keeps it in memory and the HTTP layer merges it into the answer.

One connection, shared by the HTTP thread and the rank-0 loop under a lock: each call is one
short transaction (well under a millisecond without the fsync).

The WAL is checkpointed into ``jobs.sqlite3`` after every job's end and at :meth:`JobStore.close`
(the server's shutdown), so a copy of ``jobs.sqlite3`` alone holds every finished job (without
the checkpoint the jobs would live in ``jobs.sqlite3-wal``). A backup of a running server still
copies the three files together, or is taken while the server is stopped.

What SQLite cannot do (a full disk, an I/O error, a file that is not a database) raises
:class:`StoreError`, which the HTTP layer answers 507 (disk full) or 503 naming the job store
instead of a generic 500.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import threading
import time
from typing import Any, Iterator

from dist_attn.models.h3.serve.jobs.ends import HeldEnds, JobEnd
from dist_attn.models.h3.serve.jobs.records import (STORE_NAME, JobRecord, JobStatus, Recovery,
                                                    StoreError, new_job_id)
from dist_attn.models.h3.serve.jobs.store_sql import SCHEMA, Transaction, row_record
from dist_attn.models.h3.serve.jobs.store_sql import store_errors as _store_errors
from dist_attn.models.h3.serve.jobs.videos import VideoRequest

__all__ = ["JobStatus", "JobRecord", "Recovery", "JobStore", "StoreError", "STORE_NAME",
           "MAX_ATTEMPTS", "new_job_id"]

log = logging.getLogger(__name__)

#: A job is started at most this many times; one more interruption while running fails it.
MAX_ATTEMPTS = 2



class JobStore:
    """The SQLite job store at ``<directory>/jobs.sqlite3`` (created if absent)."""

    def __init__(self, directory: str) -> None:
        """Opens (or creates) the store; raises :class:`StoreError` naming the file and what to
        do when it is not a readable SQLite database (a corrupt file, a directory: each gave a
        raw traceback), OSError when the directory cannot be made."""
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.path = os.path.join(directory, STORE_NAME)
        if os.path.isdir(self.path):  # sqlite3.connect raised a bare OperationalError
            raise StoreError(503, f"{self.path} is a directory, not a SQLite job store file: "
                                  "move it out of the output directory (the server then starts "
                                  "with an empty job store) or choose another --output-dir",
                             path=self.path)
        # isolation_level=None: autocommit; multi-statement changes use explicit BEGIN IMMEDIATE.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False,
                                   timeout=30.0)
        self._lock = threading.Lock()
        self._held = HeldEnds()
        try:
            with self._lock:
                mode = self._db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
                if mode.lower() != "wal":
                    raise RuntimeError(f"{self.path}: SQLite refused WAL mode (got {mode!r}); "
                                       "the output directory must be on a local filesystem")
                # A damaged page past the header passes the line above and failed later, in
                # recovery or at some job; quick_check reads every page once (milliseconds for
                # a store of thousands of jobs).
                problems = [r[0] for r in self._db.execute("PRAGMA quick_check").fetchall()]
                if problems != ["ok"]:
                    raise sqlite3.DatabaseError("; ".join(problems[:3]))
                # FULL: every commit is on disk before it returns, so a 202 survives power loss
                # too (NORMAL would survive a process crash only).
                self._db.execute("PRAGMA synchronous=FULL")
                self._db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            self._db.close()
            raise StoreError(503, f"{self.path} is not a readable SQLite job store (SQLite: {e}). "
                                  f"Stop the server, move {STORE_NAME} (with {STORE_NAME}-wal and "
                                  f"{STORE_NAME}-shm if present) out of {directory} or restore "
                                  "all three from one backup, and start again: the server then "
                                  "starts with an empty job store (the videos stay, unlisted)",
                             path=self.path) from e

    def close(self) -> None:
        """Commits the held ends, checkpoints the WAL into the main file and closes (the
        server's shutdown); ends still held are logged: those jobs run again at the next start."""
        try:
            self.flush()
        except StoreError as e:
            log.error("job store %s: the ends of %s cannot be committed (%s); the next start "
                      "re-queues them", self.path, sorted(self._held.snapshot()), e)
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error:  # noqa: S110 - closing checkpoints again, when it can
                pass
            self._db.close()

    @_store_errors
    def checkpoint(self) -> None:
        """Copies the WAL into ``jobs.sqlite3`` now. PASSIVE: never waits for another process
        reading the file (a backup tool), so the rank-0 loop is never held here."""
        with self._lock:
            self._db.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def _checkpoint_after_job(self) -> None:
        """A job's end is committed (in the WAL): copy it into the main file too. A failure
        here loses nothing (the WAL holds the commit), so it is logged, not raised into the
        job's end."""
        try:
            self.checkpoint()
        except StoreError as e:
            log.warning("job store %s: checkpoint after a job failed (%s); the jobs stay in "
                        "%s-wal until the next one", self.path, e, STORE_NAME)

    # ------------------------------------------------------------------ reading

    @_store_errors
    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return None if row is None else self._held.view(row_record(row))

    @_store_errors
    def list(self, *, limit: int = 20, status: JobStatus | None = None,
             before_seq: int | None = None) -> list[JobRecord]:
        """The most recent jobs first (optionally of one status, older than ``before_seq``)."""
        held = list(self._held.snapshot())
        where, args = [], []
        if status is not None:  # a held end changes a row's status: those rows are read too
            where.append(f"(status = ? OR id IN ({', '.join('?' * len(held))}))")
            args += [status.value, *held]
        if before_seq is not None:
            where.append("seq < ?")
            args.append(before_seq)
        sql = "SELECT * FROM jobs" + (" WHERE " + " AND ".join(where) if where else "")
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY seq DESC LIMIT ?",
                                    (*args, limit + len(held))).fetchall()
        jobs = [self._held.view(row_record(r)) for r in rows]
        return [j for j in jobs if status is None or j.status is status][:limit]

    @_store_errors
    def queued(self) -> list[JobRecord]:
        """The waiting jobs, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs WHERE status = 'queued' ORDER BY seq"
                                    ).fetchall()
        return [row_record(r) for r in rows]

    @_store_errors
    def counts(self) -> dict[JobStatus, int]:
        """Jobs per status (every status present, zeros included)."""
        held = self._held.snapshot()
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
            stored = self._db.execute(f"SELECT id, status FROM jobs WHERE id IN "
                                      f"({', '.join('?' * len(held))})", tuple(held)).fetchall()
        got = {s: 0 for s in JobStatus} | {JobStatus(s): n for s, n in rows}
        for job_id, was in stored:  # counted as the held end says
            got[JobStatus(was)] -= 1
            got[held[job_id].status] += 1
        return got

    @_store_errors
    def queue_position(self, job: JobRecord) -> int:
        """How many queued jobs are ahead of ``job``."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued' AND seq < ?",
                                    (job.seq,)).fetchone()[0]

    # ------------------------------------------------------------------ transitions

    @_store_errors
    def submit(self, request: VideoRequest, *, max_queued: int) -> JobRecord | None:
        """Stores a new queued job and returns it once committed; None when ``max_queued`` jobs
        are already waiting (checked in the same transaction)."""
        job_id, now = new_job_id(), time.time()
        with Transaction(self._db, self._lock) as db:
            waiting = db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
            if waiting >= max_queued:
                return None
            db.execute("INSERT INTO jobs (id, status, request, created_at) VALUES (?, ?, ?, ?)",
                       (job_id, JobStatus.QUEUED.value, json.dumps(request.to_json()), now))
        record = self.get(job_id)
        assert record is not None
        return record

    @_store_errors
    def start_next(self) -> JobRecord | None:
        """Marks the oldest queued job running (one more attempt) and returns it; None if none.
        The held ends are committed first: no job starts while one cannot be (StoreError)."""
        self.flush()
        with Transaction(self._db, self._lock) as db:
            row = db.execute("SELECT id FROM jobs WHERE status = 'queued' ORDER BY seq LIMIT 1"
                             ).fetchone()
            if row is None:
                return None
            db.execute("UPDATE jobs SET status = 'running', started_at = ?, "
                       "attempts = attempts + 1 WHERE id = ?", (time.time(), row[0]))
        return self.get(row[0])

    def succeed(self, job_id: str, *, output: str, thumbnail: str | None,
                timings: dict[str, Any]) -> None:
        """A running job finished with its file (relative to the directory)."""
        self._finish(job_id, JobStatus.SUCCEEDED, None, output=output, thumbnail=thumbnail,
                     timings=timings)

    def fail(self, job_id: str, reason: str, *, timings: dict[str, Any] | None = None) -> None:
        self._finish(job_id, JobStatus.FAILED, reason, timings=timings)

    def cancelled(self, job_id: str, reason: str, *, timings: dict[str, Any] | None = None
                  ) -> None:
        """A running job was stopped between steps because its cancel was asked."""
        self._finish(job_id, JobStatus.CANCELLED, reason, timings=timings)

    def _finish(self, job_id: str, status: JobStatus, error: str | None, *,
                output: str | None = None, thumbnail: str | None = None,
                timings: dict[str, Any] | None = None) -> None:
        """Records a running job's end; one that cannot be committed now is held (logged) and
        read as committed until :meth:`flush` commits it. Never raises a StoreError."""
        end = JobEnd(status=status, finished_at=time.time(), error=error, output=output,
                     thumbnail=thumbnail, timings=timings or {})
        self._held.hold(job_id, end)
        try:
            self.flush()
        except StoreError as e:
            log.error("job store %s: the end of %s (%s) cannot be committed: %s. It is held in "
                      "memory, answered to clients, and committed when the store can (a "
                      "restart before then re-queues the job)", self.path, job_id,
                      status.value, e)

    def flush(self) -> None:
        """Commits the held ends, oldest first; raises :class:`StoreError` at the first that
        cannot be (it and those after it stay held)."""
        for job_id, end in self._held.snapshot().items():
            self._commit_end(job_id, end)
            self._held.release(job_id, end)
            self._checkpoint_after_job()

    @_store_errors
    def _commit_end(self, job_id: str, end: JobEnd) -> None:
        with Transaction(self._db, self._lock) as db:
            db.execute("UPDATE jobs SET status = ?, finished_at = ?, error = ?, output = ?, "
                       "thumbnail = ?, timings = ? WHERE id = ?",
                       (end.status.value, end.finished_at, end.error, end.output, end.thumbnail,
                        json.dumps(end.timings), job_id))

    @_store_errors
    def request_cancel(self, job_id: str) -> JobRecord | None:
        """DELETE: a queued job is cancelled at once; a running one is marked (the loop stops it
        between denoise steps); a finished one is left as it is. Returns the job after the
        change, or None for an unknown id."""
        with Transaction(self._db, self._lock) as db:
            row = db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return None
            if row[0] == JobStatus.QUEUED.value:
                db.execute("UPDATE jobs SET status = 'cancelled', cancel = 1, finished_at = ?, "
                           "error = 'cancelled by the client while queued' WHERE id = ?",
                           (time.time(), job_id))
            elif row[0] == JobStatus.RUNNING.value:
                db.execute("UPDATE jobs SET cancel = 1 WHERE id = ?", (job_id,))
        return self.get(job_id)

    @_store_errors
    def requeue(self, job_id: str, note: str) -> None:
        """A clean shutdown interrupted the running job: back to the queue, its attempt given back
        (it keeps its place: the queue is ordered by submission)."""
        with Transaction(self._db, self._lock) as db:
            db.execute("UPDATE jobs SET status = 'queued', started_at = NULL, "
                       "attempts = MAX(attempts - 1, 0), history = json_insert(history, '$[#]', ?) "
                       "WHERE id = ? AND status = 'running'", (note, job_id))

    @_store_errors
    def recover(self) -> Recovery:
        """At start: the restart semantics of the module docstring, in one transaction."""
        requeued, failed, cancelled = [], [], []
        now = time.time()
        with Transaction(self._db, self._lock) as db:
            rows = db.execute("SELECT id, attempts, cancel FROM jobs WHERE status = 'running' "
                              "ORDER BY seq").fetchall()
            for job_id, attempts, cancel in rows:
                if cancel:
                    db.execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, error = "
                               "'cancelled by the client; the server stopped while it ran' "
                               "WHERE id = ?", (now, job_id))
                    cancelled.append(job_id)
                elif attempts >= MAX_ATTEMPTS:
                    db.execute("UPDATE jobs SET status = 'failed', finished_at = ?, error = ? "
                               "WHERE id = ?",
                               (now, f"the server stopped while this job ran, {attempts} times "
                                     f"(it is started at most {MAX_ATTEMPTS} times)", job_id))
                    failed.append(job_id)
                else:
                    db.execute("UPDATE jobs SET status = 'queued', started_at = NULL, history = "
                               "json_insert(history, '$[#]', ?) WHERE id = ?",
                               ("re-queued: the server stopped while this job ran", job_id))
                    requeued.append(job_id)
            queued = db.execute("SELECT COUNT(*) FROM jobs WHERE status = 'queued'").fetchone()[0]
        return Recovery(requeued=requeued, failed=failed, cancelled=cancelled, queued=queued)

    @_store_errors
    def expired_files(self, *, keep: int, finished_before: float | None
                      ) -> list[tuple[str, str, str | None]]:
        """``(id, output, thumbnail)`` of the succeeded jobs that still have their files and are
        past the newest ``keep`` (by when they finished) or finished before ``finished_before``
        (Unix seconds; None: no age limit), the oldest first."""
        sql = ("SELECT id, output, thumbnail, finished_at, seq FROM jobs "
               "WHERE status = 'succeeded' AND output IS NOT NULL")
        with self._lock:
            rows = set(self._db.execute(sql + " ORDER BY finished_at DESC, seq DESC "
                                        "LIMIT -1 OFFSET ?", (keep,)).fetchall())
            if finished_before is not None:
                rows |= set(self._db.execute(sql + " AND finished_at < ?",
                                             (finished_before,)).fetchall())
        return [(r[0], r[1], r[2]) for r in sorted(rows, key=lambda r: (r[3], r[4]))]

    @_store_errors
    def forget_files(self, job_id: str) -> None:
        """The files of the succeeded job ``job_id`` were deleted: it keeps no output name."""
        with Transaction(self._db, self._lock) as db:
            db.execute("UPDATE jobs SET output = NULL, thumbnail = NULL WHERE id = ? AND "
                       "status = 'succeeded'", (job_id,))

    @_store_errors
    def ids(self) -> set[str]:
        """Every job id in the store."""
        with self._lock:
            return {r[0] for r in self._db.execute("SELECT id FROM jobs").fetchall()}

    @_store_errors
    def __iter__(self) -> Iterator[JobRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        return iter([self._held.view(row_record(r)) for r in rows])
