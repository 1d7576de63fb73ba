# SPDX-License-Identifier: Apache-2.0
"""The ``[jobs]`` section of a config: where video jobs live and what runs them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from dist_attn.models.h3.serve.config.fields import field_error, require_positive

__all__ = ["JobsConfig", "RunnerName"]

RunnerName = Literal["h3", "synthetic", "off"]


@dataclass(kw_only=True, frozen=True)
class JobsConfig:
    """Video jobs (``/v1/videos``)."""

    output_dir: str = "outputs"
    """The job store (``jobs.sqlite3``) and the videos (``videos/<id>.mp4``); relative paths are
    relative to the working directory. ``--output-dir`` overrides it."""
    max_queued: int = 256
    """Video jobs waiting beyond this get 429 with Retry-After (they are on disk: the bound is
    the promise a client gets, not memory)."""
    runner: RunnerName = "h3"
    """What runs a job: "h3" (the MiniMax-H3 pipeline), "synthetic" (a test pattern and a tone,
    no model: the serving layer alone, for load tests) or "off" (/v1/generate only)."""
    synthetic_step_s: float = 0.05
    """Seconds one step of the synthetic runner sleeps."""
    thumbnail: bool = True
    """Write the first frame as a PNG beside each MP4."""
    latents_kept: int = 100
    """/v1/generate with ``--output-dir`` saves each request's output latents there as
    ``req-*.safetensors``; after each save only the newest ``latents_kept`` of them stay, older
    ones are deleted (one file per request, forever, would fill the disk). At h3-ref
    (37,296 video rows x 96 + 414 audio rows x 32, float32) a file is 14.4 MB: 1.4 GB for 100.
    ``--once`` outputs (``once-*``) are never deleted; the video jobs' files follow
    ``videos_kept`` and ``videos_max_age_s``."""
    videos_kept: int = 1000
    """After each video job, only the newest ``videos_kept`` succeeded jobs (by when they
    finished) keep their MP4 and PNG; older ones are deleted. The jobs stay listed; their
    content answers 410 naming this rule."""
    videos_max_age_s: float = 0.0
    """Also delete a succeeded job's MP4 and PNG this many seconds after it finished (checked
    after each job and once a minute); 0 keeps them whatever their age."""

    def __post_init__(self) -> None:
        if not isinstance(self.output_dir, str) or not self.output_dir:
            raise field_error("JobsConfig", "output_dir", self.output_dir,
                              "must be a non-empty path")
        require_positive(self, "max_queued", "latents_kept", "videos_kept")
        age = self.videos_max_age_s
        if isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age < math.inf:
            raise field_error("JobsConfig", "videos_max_age_s", age,
                              "must be a finite number of seconds >= 0 (0: no age limit)")
        if self.runner not in get_args(RunnerName):
            raise field_error("JobsConfig", "runner", self.runner,
                              f"must be one of {list(get_args(RunnerName))}")
        if not self.synthetic_step_s >= 0:
            raise field_error("JobsConfig", "synthetic_step_s", self.synthetic_step_s,
                              "must be >= 0")
        if not isinstance(self.thumbnail, bool):
            raise field_error("JobsConfig", "thumbnail", self.thumbnail, "must be true or false")
