# SPDX-License-Identifier: Apache-2.0
"""Rank 0's side that HTTP faces: the /v1/generate queue, the metrics, when every rank last
answered, and the :class:`~dist_attn.models.h3.serve.http.state.ServerState` that shares them with
the HTTP thread; at a shutdown it answers every waiting request 503 at once."""

from __future__ import annotations

from typing import Any

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.http.metrics import Metrics
from dist_attn.models.h3.serve.http.state import ServerState, VideoJobs
from dist_attn.models.h3.serve.jobs.queue import JobQueue, Liveness
from dist_attn.models.h3.serve.wire.abort import Abort

__all__ = ["Front"]


class Front:
    """What the HTTP thread and the rank-0 loop share, built once per server."""

    def __init__(self, cfg: Config, info: dict[str, Any], api_key: str | None,
                 videos: VideoJobs | None = None) -> None:
        self.jobs = JobQueue(cfg.serve.queue_size)
        self.metrics = Metrics(lambda: len(self.jobs))
        if videos is not None:
            store = videos.store
            self.metrics.watch_jobs(lambda: {k.value: n for k, n in store.counts().items()})
        self.liveness = Liveness()
        self.state = ServerState(cfg=cfg, jobs=self.jobs, metrics=self.metrics,
                                 liveness=self.liveness, info=info, api_key=api_key,
                                 videos=videos)

    def refuse_queued(self) -> None:
        """Answers every waiting request 503 at once (runs on its own thread at a signal)."""
        self.liveness.stopping = True
        for job in self.jobs.drain():
            self.metrics.cancelled(Abort.SHUTDOWN.label)
            job.fail(503, "server is shutting down")
