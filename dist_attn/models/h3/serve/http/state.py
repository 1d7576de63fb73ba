# SPDX-License-Identifier: Apache-2.0
"""What the HTTP thread shares with the rank-0 loop: the server's state (:class:`ServerState`) and,
within it, the video jobs' (:class:`VideoJobs`, with the running one's :class:`VideoProgress`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.http.metrics import Metrics
from dist_attn.models.h3.serve.jobs.queue import Job, JobQueue, Liveness, StepTimes
from dist_attn.models.h3.serve.jobs.records import JobRecord, JobStatus
from dist_attn.models.h3.serve.jobs.space import space_refusal
from dist_attn.models.h3.serve.jobs.store import JobStore
from dist_attn.models.h3.serve.jobs.videos import VideoRequest, VideoRules

__all__ = ["ServerState", "VideoJobs", "VideoProgress"]


@dataclass(kw_only=True)
class VideoProgress:
    """The running video job, as the rank-0 loop updates it after every step."""

    job_id: str
    rows: int
    steps: int
    step: int = 0
    """Steps done."""
    started: float = field(default_factory=time.time)
    """Unix time the run started."""


@dataclass(kw_only=True)
class VideoJobs:
    """What the HTTP thread and the rank-0 loop share about video jobs."""

    store: JobStore
    rules: VideoRules
    max_queued: int
    output_dir: str
    """Where the store and the videos live (files are named relative to it)."""
    thumbnail: bool = True
    """Write the first frame as a PNG beside each MP4."""
    running: VideoProgress | None = None
    cancels: set[str] = field(default_factory=set)
    """Running jobs whose DELETE arrived (the loop votes CANCELLED at the next step)."""

    def remaining_s(self, times: StepTimes) -> float:
        """Expected seconds until the running video job is done (0 when none)."""
        run = self.running
        if run is None:
            return 0.0
        return times.running_s(run.rows, run.steps, "video", steps_done=run.step,
                               elapsed_s=time.time() - run.started)

    def space_refusal(self, req: VideoRequest) -> str | None:
        """Why the output directory cannot take ``req`` now (507), or None
        (:func:`dist_attn.models.h3.serve.jobs.space.space_refusal`)."""
        ahead = [j.request for j in self.store.list(limit=self.max_queued + 1,
                                                      status=JobStatus.RUNNING)]
        ahead += [j.request for j in self.store.queued()]
        return space_refusal(self.output_dir, req, ahead, fps=self.rules.fps,
                             thumbnail=self.thumbnail)

    def backlog_s(self, times: StepTimes, queued: list[JobRecord] | None = None) -> float:
        """Expected seconds until every queued video job is done."""
        queued = self.store.queued() if queued is None else queued
        return self.remaining_s(times) + sum(
            times.job_s(j.request.rows, j.request.steps, "video") for j in queued)


@dataclass(kw_only=True)
class ServerState:
    """What the HTTP thread shares with the rank-0 loop."""

    cfg: Config
    jobs: JobQueue
    metrics: Metrics
    liveness: Liveness
    info: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    step_times: StepTimes = field(default_factory=StepTimes)
    """Measured step and overhead times (fed by the rank-0 loop): Retry-After and estimates."""
    running: Job | None = None
    """The /v1/generate job the rank-0 loop is running (None when idle or running a video)."""
    videos: VideoJobs | None = None
    """The video jobs (store, rules, the running one); None serves /v1/generate alone."""

    def __post_init__(self) -> None:
        if self.api_key == "":  # would refuse every request (process.resolve_api_key says why)
            raise ValueError("api_key='' is not a key: pass None for no key")

    def slot_s(self) -> float:
        """Expected seconds until a full queue has a free slot: until the rank-0 loop ends what
        it runs (a /v1/generate request or a video job) and takes the next waiting job. From
        measured step times; 0 when it runs nothing."""
        times, running = self.step_times, self.running
        if running is not None and running.started is not None:
            return times.running_s(running.rows, running.request.steps, "generate",
                                   steps_done=running.steps_done,
                                   elapsed_s=time.perf_counter() - running.started)
        return self.videos.remaining_s(times) if self.videos is not None else 0.0
