"""Warm-up at launch: two denoise steps of each configured geometry before the server answers.

The first forward of a shape pays for what later ones reuse: torch.compile of the blocks
(``runtime.compile``; 10-20 s for an H3 block on an H200), the Triton JIT of the sage8 kernels,
cuBLAS/cuDNN heuristics and, with ``model.linear_precision = "fp8"``, the activation quantizers.
``runtime.warmup_shapes`` lists ``(frames, height, width)`` geometries; two steps cover the
shapes every later step has (the first step's video and audio timesteps are one value, the
others two, so the blocks see a second shape from step 2 on); every rank runs
:func:`warm_up` after the model is built and before :func:`dist_attn.serve.ranks.loop.serve`
starts the HTTP server, so ``/health`` only answers (and answers ok) once they are warm. Every rank runs the
same steps in the same order: the forward's collectives line up as for a request.

Video jobs run the same transformer module through the pipeline, so its compiled code and kernels
are reused by jobs of a warmed geometry.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dist_attn.serve.config.deployment import Config
from dist_attn.serve.config.sections import WARMUP_STEPS
from dist_attn.serve.jobs.requests import Request, parse_request

__all__ = ["WARMUP_STEPS", "WarmupRun", "warm_up", "warmup_request"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class WarmupRun:
    """One warmed geometry."""

    frames: int
    height: int
    width: int
    rows: int
    """Packed rows of the geometry (H3's rules)."""
    seconds: float
    """Wall time of its denoise steps on this rank, compilation included."""


def warmup_request(cfg: Config, index: int) -> Request:
    """The request that warms ``cfg.runtime.warmup_shapes[index]``: :data:`WARMUP_STEPS` steps, seed 0."""
    frames, height, width = cfg.runtime.warmup_shapes[index]
    return parse_request({"frames": frames, "height": height, "width": width, "steps": WARMUP_STEPS,
                          "seed": 0}, cfg, request_id=f"warmup-{index}")


def warm_up(engine: Any, cfg: Config) -> list[WarmupRun]:
    """Runs :data:`WARMUP_STEPS` denoise steps of every ``runtime.warmup_shapes`` geometry on this rank (call it on
    every rank, in the same place); returns what each took. Empty list when none is configured.

    Args:
        engine: the :class:`dist_attn.serve.h3.engine.Engine` that will serve.
        cfg: the validated config.
    """
    runs = []
    for i in range(len(cfg.runtime.warmup_shapes)):
        req = warmup_request(cfg, i)
        rows = req.layout(cfg).used
        t0 = time.perf_counter()
        engine.run(req)
        seconds = time.perf_counter() - t0
        runs.append(WarmupRun(frames=req.frames, height=req.height, width=req.width, rows=rows,
                              seconds=seconds))
        log.info("warm-up %d/%d: %d frames %dx%d (%d rows), %d steps in %.2f s", i + 1,
                 len(cfg.runtime.warmup_shapes), req.frames, req.width, req.height, rows, req.steps, seconds)
    return runs
