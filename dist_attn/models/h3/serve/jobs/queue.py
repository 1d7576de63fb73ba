# SPDX-License-Identifier: Apache-2.0
"""Rank 0's bookkeeping of requests: a job per request, a bounded queue, and why a job stops.

The HTTP thread creates jobs and waits on their futures; the rank-0 loop takes them from the
queue, runs them on every rank and resolves the futures. A job can be cancelled from either side
(client gone, deadline passed, shutdown); the loop drops a cancelled job from the queue, or
aborts it between denoise steps on every rank together.
"""

from __future__ import annotations

import bisect
import collections
import math
import statistics
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from dist_attn.models.h3.serve.jobs.requests import Request
from dist_attn.models.h3.serve.wire.abort import Abort

__all__ = ["JobError", "Job", "QueueFull", "JobQueue", "Liveness", "StepTimes"]


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
    rows: int = 0
    """Packed rows of the request (what its step time depends on)."""
    steps_done: int = 0
    """Denoise steps finished (set by the rank-0 loop while it runs)."""
    started: float | None = None
    """When the rank-0 loop started it (None while it waits)."""
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

    def snapshot(self) -> list[Job]:
        """The waiting jobs, oldest first (a copy)."""
        with self._cond:
            return list(self._jobs)

    def wake(self) -> None:
        """Makes a waiting :meth:`get` return now (other work arrived: a video job)."""
        with self._cond:
            self._cond.notify_all()

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


class StepTimes:
    """Measured seconds per denoise step by packed length, and measured seconds a job spends
    outside its steps (setup, text encoding, decode, muxing) by kind: what Retry-After and the
    jobs' estimated remaining time are computed from.

    Each packed length (and each kind's time outside the steps) is the median of its last
    ``window`` measurements: one cold or stalled measurement does not move it. A length never
    measured takes the nearest measured one scaled by the length ratio (linear: exact for the
    row-wise work, optimistic for attention's quadratic share); with no measurement at all a
    step counts ``default_step_s``. Thread-safe.
    """

    def __init__(self, *, default_step_s: float = 1.0, window: int = 9) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be a positive integer")
        self.default_step_s = default_step_s
        self.window = window
        self._step: dict[int, collections.deque[float]] = {}
        self._rows: list[int] = []  # sorted keys of _step
        self._overhead: dict[str, collections.deque[float]] = {}
        self._lock = threading.Lock()

    def observe_step(self, rows: int, seconds: float) -> None:
        """One denoise step of a ``rows``-row request took ``seconds``."""
        with self._lock:
            if rows not in self._step:
                bisect.insort(self._rows, rows)
                self._step[rows] = collections.deque(maxlen=self.window)
            self._step[rows].append(seconds)

    def observe_overhead(self, kind: str, seconds: float) -> None:
        """A job of ``kind`` spent ``seconds`` outside its denoise steps."""
        with self._lock:
            self._overhead.setdefault(kind, collections.deque(maxlen=self.window)
                                      ).append(seconds)

    def step_s(self, rows: int) -> float:
        """Expected seconds of one step of a ``rows``-row request."""
        with self._lock:
            if rows in self._step:
                return statistics.median(self._step[rows])
            if not self._rows:
                return self.default_step_s
            i = bisect.bisect_left(self._rows, rows)
            near = min(self._rows[max(0, i - 1):i + 1], key=lambda r: abs(r - rows))
            return statistics.median(self._step[near]) * rows / max(near, 1)

    def job_s(self, rows: int, steps: int, kind: str) -> float:
        """Expected seconds of a whole job of ``kind``: its steps and its time outside them."""
        with self._lock:
            seen = self._overhead.get(kind)
            overhead = statistics.median(seen) if seen else 0.0
        return steps * self.step_s(rows) + overhead

    def running_s(self, rows: int, steps: int, kind: str, *, steps_done: int,
                  elapsed_s: float) -> float:
        """Expected seconds left of a job of ``kind`` that has run ``elapsed_s`` seconds and
        ``steps_done`` steps: its whole expected time less the time run, and at least the time
        of its steps left (0 once it has run longer than expected and has no step left)."""
        left = max(steps - steps_done, 0) * self.step_s(rows)
        return max(left, self.job_s(rows, steps, kind) - elapsed_s, 0.0)

    @staticmethod
    def retry_after(seconds: float) -> int:
        """A Retry-After value (whole seconds, at least 1) for ``seconds`` of work ahead."""
        return max(1, math.ceil(seconds))
