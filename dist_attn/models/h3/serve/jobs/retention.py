# SPDX-License-Identifier: Apache-2.0
"""How long a succeeded video job keeps its files: the newest ``jobs.videos_kept`` jobs, and none
older than ``jobs.videos_max_age_s`` when that is set. Deleted files are recorded in the store
(the job keeps no output name), so the job stays listed and its content answers 410."""

from __future__ import annotations

import logging
import os

from dist_attn.models.h3.serve.jobs.store import JobStore

__all__ = ["prune_videos", "remove_files"]

log = logging.getLogger(__name__)


def remove_files(directory: str, names: list[str | None]) -> None:
    """Deletes the files ``names`` (relative to ``directory``; None skipped) that exist. One
    that cannot be deleted is logged and left."""
    for name in names:
        if name is None:
            continue
        path = os.path.join(directory, name)
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.error("%s cannot be deleted (%s); it stays", path, e.strerror or e)


def prune_videos(store: JobStore, directory: str, *, keep: int, max_age_s: float,
                 now: float) -> list[str]:
    """Deletes the files of the succeeded jobs past the newest ``keep``, or finished more than
    ``max_age_s`` seconds before ``now`` (Unix seconds; ``max_age_s`` 0: no age limit), and
    records it in ``store``. Returns those jobs' ids, oldest first. Raises StoreError when the
    store cannot be read or written (files already deleted stay recorded as present, and are
    recorded at the next call)."""
    expired = store.expired_files(keep=keep,
                                  finished_before=now - max_age_s if max_age_s > 0 else None)
    for job_id, output, thumbnail in expired:
        # deleted before it is recorded: a crash in between leaves a job whose file is gone
        # (answered 410, recorded at the next call), never a file no job names
        remove_files(directory, [output, thumbnail])
        store.forget_files(job_id)
    return [job_id for job_id, _, _ in expired]
