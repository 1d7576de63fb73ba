# SPDX-License-Identifier: Apache-2.0
"""Opening the job store at launch (rank 0, before the model is built): the store file checked,
the restart recovery run and logged, partial MP4s removed, and a warning when ``videos/`` holds
MP4s of jobs the store does not list.

Contract:

* The launcher calls it before any weight is loaded and before the launch checks
  (:func:`dist_attn.models.h3.serve.launch.checks.run_launch_checks`): a store that cannot be opened
  (a file that is not a readable SQLite database) raises
  :class:`~dist_attn.models.h3.serve.jobs.store.StoreError`, whose message names the file and what
  to do; the launch reports it as one failed condition and every rank exits 1.
* MP4s under ``videos/`` whose jobs the store does not list are not served; they mean a store that
  was replaced or restored without its ``-wal`` file, and :func:`open_job_store` logs one WARNING
  naming up to three of them (the store checkpoints its WAL after every job, so ``jobs.sqlite3``
  alone lists every finished job).
"""

from __future__ import annotations

import logging
import os

from dist_attn.models.h3.serve.jobs.mp4 import TMP_MARKER, remove_stale_temporaries
from dist_attn.models.h3.serve.jobs.store import STORE_NAME, JobStore

__all__ = ["open_job_store", "unlisted_videos"]

log = logging.getLogger(__name__)

# How many unlisted job ids a warning names (the count says how many there are).
_NAMED = 3


def unlisted_videos(store: JobStore) -> list[str]:
    """Job ids of the MP4s in ``<store directory>/videos/`` that the store does not list,
    sorted."""
    videos = os.path.join(store.directory, "videos")
    try:
        names = os.listdir(videos)
    except FileNotFoundError:
        return []
    on_disk = {n[:-len(".mp4")] for n in names if n.endswith(".mp4") and TMP_MARKER not in n}
    return sorted(on_disk - store.ids())


def open_job_store(output_dir: str) -> JobStore:
    """The job store of ``output_dir`` after its restart recovery, logged. Raises
    :class:`~dist_attn.models.h3.serve.jobs.store.StoreError` (a file that is not a readable SQLite
    database: the message names it and what to do) or OSError (the directory cannot be made)."""
    store = JobStore(output_dir)
    try:
        recovery = store.recover()
        stale = remove_stale_temporaries(os.path.join(output_dir, "videos"))
        unlisted = unlisted_videos(store)
    except BaseException:
        store.close()
        raise
    log.info("job store %s: %d queued (re-queued after a stop: %s; failed after a second: %s; "
             "cancelled: %s); %d partial file(s) removed", store.path, recovery.queued,
             recovery.requeued or "none", recovery.failed or "none",
             recovery.cancelled or "none", len(stale))
    if unlisted:
        known = len(store.ids())
        log.warning("job store %s lists %d job(s), but %s holds %d MP4(s) of jobs it does not "
                    "list (%s%s): the store was replaced, or restored without the %s-wal file "
                    "that held its recent jobs. Those videos are not served; restore %s together "
                    "with its -wal file to list them again", store.path, known,
                    os.path.join(output_dir, "videos"), len(unlisted),
                    ", ".join(unlisted[:_NAMED]), ", ..." if len(unlisted) > _NAMED else "",
                    STORE_NAME, STORE_NAME)
    return store
