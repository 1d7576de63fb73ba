# SPDX-License-Identifier: Apache-2.0
"""Warm-up at launch: two denoise steps of each configured geometry before the server answers.

The first forward of a shape pays for what later ones reuse: torch.compile of the blocks
(``runtime.compile``; 10-20 s for an H3 block on an H200), the Triton JIT of the sage8 kernels,
cuBLAS/cuDNN heuristics and, with ``model.linear_precision = "fp8"``, the activation quantizers.
``runtime.warmup_shapes`` lists ``(frames, height, width)`` geometries; two steps cover the
shapes every later step has (the first step's video and audio timesteps are one value, the
others two, so the blocks see a second shape from step 2 on); every rank runs
:func:`warm_up` after the model is built and before
:func:`dist_attn.models.h3.serve.ranks.loop.serve` starts the HTTP server, so ``/health`` only
answers (and answers ok) once they are warm. Every rank runs the same steps in the same order: the
forward's collectives line up as for a request.

Video jobs run the same transformer module through the pipeline, so its compiled code and kernels
are reused by jobs of a warmed geometry. A job's sequence holds its prompt's tokens and is padded
to a multiple of ``runtime.sequence_bucket`` rows; the warm-up runs each bucket a geometry reaches
with prompts of 1 to ``runtime.warmup_prompt_tokens`` tokens (and with the stand-in's
``tokens.text_tokens``), one two-step run a bucket, the text rows set to a length in it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.sections import WARMUP_STEPS
from dist_attn.models.h3.serve.config.tokens import padded_rows
from dist_attn.models.h3.serve.jobs.requests import Request, parse_request

__all__ = ["WARMUP_STEPS", "WarmupRun", "bucket_text_rows", "warm_up", "warmup_request"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class WarmupRun:
    """One warmed geometry."""

    frames: int
    height: int
    width: int
    text_rows: int
    """Text rows of the run (a prompt length in its bucket)."""
    rows: int
    """Packed rows of the run (H3's rules)."""
    padded_rows: int
    """Rows once padded to the bucket: what the compiled blocks were warmed for."""
    seconds: float
    """Wall time of its denoise steps on this rank, compilation included."""


def warmup_request(cfg: Config, index: int) -> Request:
    """The request that warms ``cfg.runtime.warmup_shapes[index]``: :data:`WARMUP_STEPS` steps, seed 0."""
    frames, height, width = cfg.runtime.warmup_shapes[index]
    return parse_request({"frames": frames, "height": height, "width": width, "steps": WARMUP_STEPS,
                          "seed": 0}, cfg, request_id=f"warmup-{index}")


def bucket_text_rows(base: int, prompt_tokens: int, extra: int, *, world: int,
                     bucket: int) -> list[int]:
    """One text row count per padded length that sequences of ``base`` non-text rows reach with
    1 to ``prompt_tokens`` text rows or with ``extra``: the longest such count in each, in
    increasing order."""
    chosen: dict[int, int] = {}
    for text in (*range(1, prompt_tokens + 1), extra):
        padded = padded_rows(base + text, world, bucket)
        chosen[padded] = max(text, chosen.get(padded, 0))
    return [chosen[k] for k in sorted(chosen)]


def warm_up(engine: Any, cfg: Config, *, pipeline: Any = None) -> list[WarmupRun]:
    """Runs :data:`WARMUP_STEPS` denoise steps of every ``runtime.warmup_shapes`` geometry, once
    for each sequence bucket its prompts reach (:func:`bucket_text_rows`), then (with a video
    pipeline) one video decode of each geometry's latents, on this rank (call it on every rank,
    in the same place); returns what each denoise run took. Empty list when none is configured.

    Args:
        engine: the :class:`dist_attn.models.h3.serve.h3.engine.Engine` that will serve.
        cfg: the validated config.
        pipeline: the :class:`dist_attn.models.h3.serve.h3.pipeline.H3Pipeline` of the video jobs
        (None:
            no decode to warm): its decode of each geometry compiles the decoder's blocks
            (``decode.compile``) for the geometry's tile batches and JITs its kernels.
    """
    device = engine.env.device.type
    world, bucket = engine.env.world_size, cfg.runtime.bucket(device)
    # eager blocks compile nothing per length: one run a geometry JITs its kernels
    prompt_tokens = cfg.runtime.warmup_prompt_tokens if cfg.runtime.compiled(device) else 0
    runs = []
    shapes = cfg.runtime.warmup_shapes
    for i in range(len(shapes)):
        req = warmup_request(cfg, i)
        layout = req.layout(cfg)
        base = layout.used - layout.text
        for text in bucket_text_rows(base, prompt_tokens, cfg.tokens.text_tokens, world=world,
                                     bucket=bucket):
            padded = padded_rows(base + text, world, bucket)
            t0 = time.perf_counter()
            engine.run(req, text_rows=text)
            seconds = time.perf_counter() - t0
            runs.append(WarmupRun(frames=req.frames, height=req.height, width=req.width,
                                  text_rows=text, rows=base + text, padded_rows=padded,
                                  seconds=seconds))
            log.info("warm-up %d/%d: %d frames %dx%d, %d text rows (%d rows, padded to %d), %d "
                     "steps in %.2f s", i + 1, len(shapes), req.frames, req.width, req.height,
                     text, base + text, padded, req.steps, seconds)
        if pipeline is not None:
            seconds = pipeline.decoder.warm(layout.latent_shape)
            log.info("warm-up %d/%d: the video decode of %d frames %dx%d (%s decoder blocks) in "
                     "%.2f s", i + 1, len(shapes), req.frames, req.width, req.height,
                     "compiled" if pipeline.decoder.compiled else "eager", seconds)
    return runs
