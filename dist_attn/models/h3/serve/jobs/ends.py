# SPDX-License-Identifier: Apache-2.0
"""Job ends the store could not commit yet (a full disk): held in memory, shown by every read of
the store, and committed when it can.

A job whose end cannot be written is never left 'running' to clients (a frozen progress, a
metric counting it running, a DELETE accepted but never carried out): the store keeps such an end
here (:class:`HeldEnds`) and reads it over the file's row (:meth:`JobEnd.apply`), so clients see
the job finished at once; :meth:`dist_attn.models.h3.serve.jobs.store.JobStore.flush` commits it
once the disk has room. A process that dies with ends held leaves those jobs 'running' in the file,
and the restart semantics apply (re-queued once).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass, field
from typing import Any

from dist_attn.models.h3.serve.jobs.records import JobRecord, JobStatus

__all__ = ["JobEnd", "HeldEnds"]


@dataclass(kw_only=True, frozen=True)
class JobEnd:
    """How a running job ended: the columns its end writes."""

    status: JobStatus
    """A final status."""
    finished_at: float
    """Unix seconds."""
    error: str | None = None
    output: str | None = None
    """The MP4, relative to the output directory (succeeded jobs)."""
    thumbnail: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.status.final:
            raise ValueError(f"status={self.status.value!r} is not a job's end: one of "
                             f"{[s.value for s in JobStatus if s.final]}")

    def apply(self, record: JobRecord) -> JobRecord:
        """``record`` (the file's row) as this end makes it."""
        return dataclasses.replace(record, status=self.status, finished_at=self.finished_at,
                                   error=self.error, output=self.output,
                                   thumbnail=self.thumbnail, timings=self.timings)


class HeldEnds:
    """The ends not committed yet, oldest first, by job id. Thread-safe: the rank-0 loop holds
    and commits them, the HTTP threads read them."""

    def __init__(self) -> None:
        self._ends: dict[str, JobEnd] = {}
        self._lock = threading.Lock()

    def hold(self, job_id: str, end: JobEnd) -> None:
        with self._lock:
            self._ends[job_id] = end

    def snapshot(self) -> dict[str, JobEnd]:
        """The held ends, oldest first (a copy)."""
        with self._lock:
            return dict(self._ends)

    def release(self, job_id: str, end: JobEnd) -> None:
        """``end`` of ``job_id`` is committed: no longer held."""
        with self._lock:
            if self._ends.get(job_id) is end:
                del self._ends[job_id]

    def view(self, record: JobRecord) -> JobRecord:
        """``record`` with its held end applied (as it is when none is held)."""
        with self._lock:
            end = self._ends.get(record.id)
        return record if end is None else end.apply(record)
