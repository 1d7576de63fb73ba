# SPDX-License-Identifier: Apache-2.0
"""The job store's SQLite plumbing: the table, a row as a :class:`JobRecord`, the write
transaction, and what turns SQLite's errors into :class:`StoreError`. Split from
:mod:`dist_attn.models.h3.serve.jobs.store`, its one user."""

from __future__ import annotations

import functools
import json
import sqlite3
import threading
from typing import Any, Callable, TypeVar

from dist_attn.models.h3.serve.jobs.records import STORE_NAME, JobRecord, JobStatus, StoreError
from dist_attn.models.h3.serve.jobs.videos import VideoRequest

__all__ = ["SCHEMA", "Transaction", "row_record", "store_errors"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    id           TEXT NOT NULL UNIQUE,
    status       TEXT NOT NULL CHECK (status IN
                   ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    request      TEXT NOT NULL,
    created_at   REAL NOT NULL,
    started_at   REAL,
    finished_at  REAL,
    attempts     INTEGER NOT NULL DEFAULT 0,
    cancel       INTEGER NOT NULL DEFAULT 0,
    error        TEXT,
    output       TEXT,
    thumbnail    TEXT,
    timings      TEXT,
    history      TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status, seq);
"""

_COLUMNS = ("seq", "id", "status", "request", "created_at", "started_at", "finished_at",
            "attempts", "cancel", "error", "output", "thumbnail", "timings", "history")


def row_record(row: tuple) -> JobRecord:
    """A ``SELECT *`` row of the table as a record."""
    d = dict(zip(_COLUMNS, row))
    return JobRecord(seq=d["seq"], id=d["id"], status=JobStatus(d["status"]),
                     request=VideoRequest.from_json(json.loads(d["request"])),
                     created_at=d["created_at"], started_at=d["started_at"],
                     finished_at=d["finished_at"], attempts=d["attempts"],
                     cancel_requested=bool(d["cancel"]), error=d["error"],
                     output=d["output"], thumbnail=d["thumbnail"],
                     timings=json.loads(d["timings"]) if d["timings"] else {},
                     history=json.loads(d["history"]))


class Transaction:
    """``with Transaction(db, lock) as db:`` one write transaction under ``lock``, committed
    at the end, rolled back on an error."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            # IMMEDIATE takes the write lock up front: read-then-write needs no retry.
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if not exc_type:
                self.db.execute("COMMIT")
            elif self.db.in_transaction:
                # SQLite rolls back by itself on some errors (SQLITE_FULL); a ROLLBACK then
                # raised "no transaction is active" and hid the real error.
                self.db.execute("ROLLBACK")
        finally:
            self.lock.release()


def _is_disk_full(e: sqlite3.Error) -> bool:
    # sqlite_errorcode (an extended code: the primary one in its low byte) exists from Python
    # 3.11; before it, SQLite's fixed text for SQLITE_FULL (13).
    code = getattr(e, "sqlite_errorcode", None)
    return code & 0xFF == 13 if code is not None else str(e) == "database or disk is full"


_F = TypeVar("_F", bound=Callable[..., Any])


def store_errors(method: _F) -> _F:
    """Turns what SQLite cannot do in a method of the job store (``self.path``: its file) into
    :class:`StoreError`, which the HTTP layer answers 507 or 503, never a generic 500. Misuse of
    the API (ProgrammingError, InterfaceError, IntegrityError) stays a bug and propagates as it
    is."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (sqlite3.ProgrammingError, sqlite3.InterfaceError, sqlite3.IntegrityError):
            raise
        except sqlite3.Error as e:
            if _is_disk_full(e):
                raise StoreError(507, f"the job store ({STORE_NAME}) cannot commit: its disk is "
                                      f"full (SQLite: {e}); nothing was stored",
                                 path=self.path) from e
            raise StoreError(503, f"the job store ({STORE_NAME}) cannot be used (SQLite: {e})",
                             path=self.path) from e

    return wrapper  # type: ignore[return-value]
