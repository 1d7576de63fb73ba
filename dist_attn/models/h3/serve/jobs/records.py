# SPDX-License-Identifier: Apache-2.0
"""The job store's records and its error: what a job is (:class:`JobRecord`), where it is
(:class:`JobStatus`), what a restart did (:class:`Recovery`), and :class:`StoreError`. Split from
:mod:`dist_attn.models.h3.serve.jobs.store` (the SQLite store), which re-exports the records and the
error."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from typing import Any

from dist_attn.models.h3.serve.jobs.videos import VideoRequest

__all__ = ["JobStatus", "JobRecord", "Recovery", "StoreError", "STORE_NAME", "new_job_id"]

#: The store's file name inside the output directory (WAL adds -wal and -shm beside it).
STORE_NAME = "jobs.sqlite3"


class JobStatus(str, enum.Enum):
    """Where a job is; the three last are final."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


@dataclass(kw_only=True, frozen=True)
class JobRecord:
    """One row of the store. Times are Unix seconds (``time.time()``: they survive a restart)."""

    seq: int
    """Submission order."""
    id: str
    status: JobStatus
    request: VideoRequest
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    """Times the job was started (a clean-shutdown interruption gives its attempt back)."""
    cancel_requested: bool
    error: str | None
    """Why it failed or was cancelled."""
    output: str | None
    """The MP4's file name, relative to the output directory."""
    thumbnail: str | None
    """The first frame's PNG, relative to the output directory."""
    timings: dict[str, Any] = field(default_factory=dict)
    history: list[str] = field(default_factory=list)
    """Events a client should know of (re-queued after a restart, ...)."""


@dataclass(kw_only=True, frozen=True)
class Recovery:
    """What :meth:`JobStore.recover` did at start."""

    requeued: list[str]
    """Jobs that were running and run again."""
    failed: list[str]
    """Jobs that were running after a re-queue already: failed."""
    cancelled: list[str]
    """Running jobs whose cancel had been asked: cancelled."""
    queued: int
    """Jobs waiting, in order, after recovery."""


class StoreError(RuntimeError):
    """SQLite could not read or commit. ``status`` is the HTTP answer: 507 when the disk is full,
    503 otherwise. The message of a read or commit error names the store file, not its directory
    (it reaches clients); ``path`` (the whole path) is for the log. An error opening the store names
    the path in its message: it reaches the operator at start, never a client."""

    def __init__(self, status: int, message: str, *, path: str) -> None:
        super().__init__(message)
        self.status = status
        self.path = path


def new_job_id() -> str:
    """``vid_`` + 24 hex digits (random: ids do not reveal how many jobs others submitted)."""
    return f"vid_{uuid.uuid4().hex[:24]}"
