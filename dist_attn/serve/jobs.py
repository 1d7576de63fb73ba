"""Rank 0's bookkeeping of requests: a job per request, a bounded queue, and why a job stops.

The HTTP thread creates jobs and waits on their futures; the rank-0 loop takes them from the
queue, runs them on every rank and resolves the futures. A job can be cancelled from either side
(client gone, deadline passed, shutdown); the loop drops a cancelled job from the queue, or
aborts it between denoise steps on every rank together.
"""

from __future__ import annotations

import collections
import enum
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from dist_attn.serve.protocol import Request

__all__ = ["Abort", "JobError", "Job", "QueueFull", "JobQueue", "Liveness"]


class Abort(enum.IntEnum):
    """Why a job stops early; travels between ranks as an integer (max over ranks wins)."""

    NONE = 0
    CLIENT_GONE = 1
    DEADLINE = 2
    SHUTDOWN = 3

    @property
    def label(self) -> str:
        """The metrics label of this reason."""
        return self.name.lower()


class JobError(Exception):
    """A job that ends without a result: the HTTP status and the client-facing message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(kw_only=True, eq=False)
class Job:
    """One request in flight on rank 0. Times are ``time.perf_counter()`` seconds."""

    request: Request
    received: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")
    future: Future = field(default_factory=Future)
    _cancelled: Abort = Abort.NONE

    def cancel(self, reason: Abort) -> None:
        """Marks the job to be dropped or aborted (the first reason sticks)."""
        if self._cancelled is Abort.NONE:
            self._cancelled = reason

    def abort_reason(self) -> Abort:
        """Why this job should stop now, or Abort.NONE."""
        if self._cancelled is not Abort.NONE:
            return self._cancelled
        return Abort.DEADLINE if time.perf_counter() > self.deadline else Abort.NONE

    def finish(self, result: object) -> None:
        """Resolves the job with its result (no-op if already resolved)."""
        if not self.future.done():
            self.future.set_result(result)

    def fail(self, status: int, message: str) -> None:
        """Resolves the job with an error answer (no-op if already resolved)."""
        if not self.future.done():
            self.future.set_exception(JobError(status, message))


class QueueFull(Exception):
    """The queue holds ``maxsize`` jobs."""


class JobQueue:
    """A bounded FIFO of jobs that also supports removing a job from the middle (a client that
    left must not hold a slot until its turn)."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._jobs: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: Job) -> None:
        """Appends ``job``; raises :class:`QueueFull` when full."""
        with self._cond:
            if len(self._jobs) >= self.maxsize:
                raise QueueFull
            self._jobs.append(job)
            self._cond.notify()

    def get(self, timeout: float) -> Job | None:
        """The oldest job, waiting up to ``timeout`` seconds; None if none came."""
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout)
            return self._jobs.popleft() if self._jobs else None

    def remove(self, job: Job) -> bool:
        """Removes ``job`` if it is still waiting; returns whether it was."""
        with self._cond:
            try:
                self._jobs.remove(job)
                return True
            except ValueError:
                return False

    def drain(self) -> list[Job]:
        """Removes and returns every waiting job."""
        with self._cond:
            jobs = list(self._jobs)
            self._jobs.clear()
            return jobs


class Liveness:
    """When rank 0 last heard from every rank: after each heartbeat and each denoise step (both
    are collectives every rank must enter). Read by /health on the HTTP thread."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.stopping = False
        """True once a shutdown started: /health answers 503 and new requests are refused."""

    def contact(self) -> None:
        """Every rank has just answered."""
        self._last = time.perf_counter()

    def silent_s(self) -> float:
        """Seconds since every rank last answered."""
        return time.perf_counter() - self._last
