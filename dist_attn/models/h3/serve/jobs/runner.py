# SPDX-License-Identifier: Apache-2.0
"""The job runner: what the rank-0 loop calls to turn one stored video job into an MP4, behind a
small interface so that the job store and the HTTP API are testable without a model.

A runner has two halves: :meth:`VideoRunner.lead` on rank 0 and :meth:`VideoRunner.follow` on
every other rank, called after the loop broadcast the job (``Op.VIDEO``). Both run the same
denoise steps; after each step but the last, every rank votes (one all-reduce, rank 0's vote
decides) whether to go on, so a cancel or a shutdown stops every rank at the same step. What only
rank 0 does (decoding, muxing, writing) fails the job alone: the outcome carries the error and the
server serves on.

Runners: :class:`dist_attn.models.h3.serve.h3.pipeline.H3Runner` (the MiniMax-H3 pipeline) and
:class:`dist_attn.models.h3.serve.jobs.synthetic.SyntheticRunner` (a test pattern and a tone, no
model: the serving layer's own cost, for tests and load tests of the jobs API).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from dist_attn.models.h3.serve.jobs.mp4 import VideoFile
from dist_attn.models.h3.serve.jobs.videos import VideoRequest, VideoRules
from dist_attn.models.h3.serve.wire.abort import Abort
from dist_attn.models.h3.serve.wire.control import WIRE_FIELDS

__all__ = ["StepHook", "VideoOutcome", "VideoRunner", "video_wire", "video_from_wire"]

#: Rank 0's hook after denoise step ``k`` (1-based) took ``seconds``: its vote to go on.
StepHook = Callable[[int, float], Abort]


@dataclass(kw_only=True)
class VideoOutcome:
    """What rank 0 learns from one run."""

    aborted: Abort = Abort.NONE
    """Why the denoise loop stopped early (NONE: it ran every step)."""
    step_s: list[float] = field(default_factory=list)
    """Seconds of each denoise step that ran."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds per phase (``text_encode``, ``denoise``, ``decode_video``, ``decode_audio``,
    ``mux``, ...), measured on rank 0."""
    file: VideoFile | None = None
    """The MP4 written (None when aborted or failed)."""
    error: str | None = None
    """A rank-0-only failure (decode, muxing, disk): this job fails, the server serves on."""


class VideoRunner(Protocol):
    """Runs one video job on every rank."""

    rules: VideoRules
    """What requests it accepts (checked on rank 0 before a job is stored)."""

    def lead(self, req: VideoRequest, *, mp4_path: str, png_path: str | None,
             on_step: StepHook) -> VideoOutcome:
        """Rank 0's half: runs the job, writes ``mp4_path`` (and ``png_path``) atomically."""
        ...

    def follow(self, req: VideoRequest) -> None:
        """Every other rank's half of the same job."""
        ...


def video_wire(req: VideoRequest) -> tuple[int, ...]:
    """The integers the other ranks need, in the control message's slots (``WIRE_FIELDS``, the
    /v1/generate request's fields, whose names a video request shares); the prompt stays on rank
    0: its encoding is broadcast by the runner."""
    values = {"frames": req.frames, "height": req.height, "width": req.width,
              "steps": req.steps, "seed": req.seed}
    missing = [name for name in WIRE_FIELDS if name not in values]
    assert not missing, f"the control message carries {missing}, which a video job has not"
    return tuple(values[name] for name in WIRE_FIELDS)


def video_from_wire(values: tuple[int, ...]) -> VideoRequest:
    """A request rebuilt on a worker rank from :func:`video_wire` (no prompt; rows unknown)."""
    got = dict(zip(WIRE_FIELDS, values))
    return VideoRequest(prompt="", frames=got["frames"], height=got["height"],
                        width=got["width"], steps=got["steps"], seed=got["seed"])
