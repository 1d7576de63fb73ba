# SPDX-License-Identifier: Apache-2.0
"""The memory pre-flight at launch, on every rank before any weight is loaded: each rank's peak
estimated by arithmetic (:mod:`dist_attn.models.h3.serve.h3.memory`) against the free memory of
every rank's device, ``parallel.shard_weights = "auto"`` decided from it, and either a logged
estimate or one failure message naming what would fit.

Every rank gathers every rank's free memory (one ``all_gather_object``) and estimates every rank,
so every rank reaches the same decision and, on failure, holds the same message (the worst
rank's); the launch checks then report it once, as they report the quality tier, and every rank
exits 1. After the warm-up :func:`log_measured` logs the estimate beside the measured peak.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dist_attn.agreement import gather_objects
from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.tokens import padded_rows

__all__ = ["Preflight", "component_configs", "decide", "largest_geometry", "log_measured",
           "memory_preflight"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Preflight:
    """What the pre-flight decided on this rank."""

    shard: bool
    """``parallel.shard_weights``, resolved."""
    estimate: Any = None
    """This rank's :class:`~dist_attn.models.h3.serve.h3.memory.MemoryEstimate` (None: no
    pre-flight)."""
    budget: int = 0
    """Bytes the estimate had to stay within (free memory less the headroom)."""
    failure: str | None = None
    """The one message every rank holds when the deployment does not fit."""


def component_configs(checkpoint: str | None, runner: str) -> tuple[Any, dict | None, dict | None]:
    """(text encoder config cut to the layers H3 reads, video VAE config, audio VAE config) of a
    pipeline checkpoint, read from its ``config.json`` files alone; Nones where the server loads
    no such component (``jobs.runner`` other than "h3", a bare transformer checkpoint) or loads
    the CPU default's tiny ones (no checkpoint)."""
    if runner != "h3" or checkpoint is None or not os.path.isdir(os.path.join(checkpoint, "vae")):
        return None, None, None
    from dist_attn.models.h3.serve.h3.text import _cut_config

    def read(name: str) -> dict:
        with open(os.path.join(checkpoint, name, "config.json"), encoding="utf-8") as f:
            return json.load(f)

    return _cut_config(os.path.join(checkpoint, "text_encoder")), read("vae"), read("audio_vae")


def largest_geometry(cfg: Config, world: int, device_type: str) -> Any:
    """The largest (by packed rows) of ``runtime.warmup_shapes`` and the default request, its
    prompt at ``runtime.warmup_prompt_tokens`` or ``tokens.text_tokens``, whichever is longer."""
    from dist_attn.models.h3.serve.h3.memory import Geometry

    shapes = [*cfg.runtime.warmup_shapes, (cfg.request.frames, cfg.request.height, cfg.request.width)]
    text = max(cfg.runtime.warmup_prompt_tokens, cfg.tokens.text_tokens)
    best = None
    for frames, height, width in shapes:
        lay = cfg.layout(frames=frames, height=height, width=width)
        rows = padded_rows(lay.used - lay.text + text, world, cfg.runtime.bucket(device_type))
        if best is None or rows > best.rows:
            best = Geometry(frames=lay.frames, height=height, width=width, rows=rows, text_rows=text,
                            latent_frames_per_clip=cfg.tokens.vae_latents_per_chunk + 2,
                            spatial_compression=cfg.tokens.vae_spatial_compression)
    return best


def _shorter(cfg: Config, geo: Any, world: int, device_type: str) -> Callable[[int], Any]:
    from dataclasses import replace

    def frames_ok(frames: int) -> Any:
        try:
            lay = cfg.layout(frames=frames, height=geo.height, width=geo.width)
        except ValueError:
            return None
        return replace(geo, frames=lay.frames, rows=padded_rows(
            lay.used - lay.text + geo.text_rows, world, cfg.runtime.bucket(device_type)))

    return frames_ok


def memory_preflight(cfg: Config, env: DistEnv, dtype: torch.dtype, checkpoint: str | None, *,
                     mem_get_info: Callable[[], tuple[int, int]] | None = None) -> Preflight:
    """Runs on every rank before any weight is loaded (see the module docstring).

    Args:
        checkpoint: ``--checkpoint`` (a pipeline directory's ``config.json`` files are read).
        mem_get_info: ``() -> (free, total)`` bytes of this rank's device (None:
            ``torch.cuda.mem_get_info``; ``memory.device_gb`` overrides both).
    """
    from dist_attn.models.h3.serve.h3.decode import video_vae_dtype
    from dist_attn.models.h3.serve.h3.memory import model_sizes

    want = cfg.parallel.shard_weights
    device_type = env.device.type
    if not cfg.memory.enabled(device_type):
        if want == "auto":
            log.info("parallel.shard_weights='auto': not sharded (no memory pre-flight on %s "
                     "without memory.device_gb)", device_type)
        return Preflight(shard=want is True)
    if cfg.memory.device_gb > 0:
        free = int(cfg.memory.device_gb * 1e9)
    else:
        if mem_get_info is None and device_type != "cuda":
            return Preflight(shard=want is True, failure=(
                f"memory.preflight={cfg.memory.preflight!r} on {env.device}: there is no device "
                "memory to ask; set memory.device_gb to plan for a GPU of that size"))
        free = int((mem_get_info or (lambda: torch.cuda.mem_get_info(env.device)))()[0])
    frees = gather_objects(free) if env.distributed else [free] * env.world_size
    if device_type != "cuda":  # memory.device_gb plans a GPU: its dtypes, its sequence bucket
        device_type = "cuda"
        dtype = torch.bfloat16 if cfg.runtime.dtype == "auto" else getattr(torch, cfg.runtime.dtype)
    text_cfg, vae_cfg, audio_cfg = component_configs(checkpoint, cfg.jobs.runner)
    sizes = model_sizes(cfg.model, dtype=dtype, vae_dtype=video_vae_dtype(torch.device(device_type)),
                        text_config=text_cfg, vae_config=vae_cfg, audio_vae_config=audio_cfg)
    return decide(cfg, sizes, frees, rank=env.rank, device_type=device_type,
                  elt=torch.finfo(dtype).bits // 8)


def decide(cfg: Config, sizes: Any, frees: list[int], *, rank: int, device_type: str,
           elt: int) -> Preflight:
    """The pre-flight's arithmetic, given every rank's free bytes (``len(frees)`` ranks) and the
    components' :class:`~dist_attn.models.h3.serve.h3.memory.ModelSizes`: ``shard_weights``
    resolved, ``rank``'s estimate, and the one failure message (the worst rank's), the same on every
    rank."""
    from dataclasses import replace

    from dist_attn.integrations.diffusers import tiles_within_budget
    from dist_attn.models.h3.serve.h3.memory import Plan, estimate_peak, suggestions

    world, want = len(frees), cfg.parallel.shard_weights
    budgets = [int(f * (1 - cfg.memory.headroom_fraction)) for f in frees]
    geo = largest_geometry(cfg, world, device_type)
    tiles = cfg.decode.tiles()
    if tiles is None:
        one = estimate_peak(sizes, geo, Plan(world=1, rank=1, shard=False, fp8=False, tiles_per_call=1))
        tiles = tiles_within_budget(one.phases["decode"]["decoder activations"])  # the decode's rule
    plan = Plan(world=world, rank=0, shard=want is True, fp8=cfg.model.linear_precision == "fp8",
                tiles_per_call=tiles, elt=elt)

    def over(p: Plan) -> list[tuple[int, int, Any]]:
        """(excess bytes, rank, estimate) of every rank, worst first."""
        rows = [estimate_peak(sizes, geo, replace(p, rank=r)) for r in range(world)]
        return sorted(((e.peak - budgets[r], r, e) for r, e in enumerate(rows)), key=lambda x: -x[0])

    if want == "auto":
        replica = over(plan)
        plan = replace(plan, shard=replica[0][0] > 0 and world > 1)
        log.info("parallel.shard_weights='auto': %s (a replica's estimated peak %s the budget "
                 "on rank %d: %.1f GB against %.1f GB, free memory less "
                 "memory.headroom_fraction=%g)",
                 "sharded" if plan.shard else "not sharded", "exceeds" if replica[0][0] > 0 else
                 "fits", replica[0][1], replica[0][2].peak / 1e9, budgets[replica[0][1]] / 1e9,
                 cfg.memory.headroom_fraction)
    worst, bad, est = over(plan)[0]
    mine = estimate_peak(sizes, geo, replace(plan, rank=rank))
    for note in sizes.notes:
        log.info("memory pre-flight: %s", note)
    log.info("memory pre-flight (%d frames at %d x %d, %d rows, decode %d tiles a call): %s, "
             "%s %.1f GB (%.1f GB free less memory.headroom_fraction=%g)", geo.frames,
             geo.width, geo.height, geo.rows, tiles, mine.describe(),
             "within" if mine.peak <= budgets[rank] else "OVER the budget of", budgets[rank] / 1e9,
             frees[rank] / 1e9, cfg.memory.headroom_fraction)
    failure = None
    if worst > 0:
        fits = suggestions(sizes, geo, replace(plan, rank=bad), budgets[bad],
                           max_world=min(sizes.heads, 16), fp8_possible=not plan.fp8 and
                           cfg.runtime.quality != "lossless",
                           frames_ok=_shorter(cfg, geo, world, device_type))
        failure = (f"memory: {est.describe()} exceeds {budgets[bad] / 1e9:.1f} GB "
                   f"({frees[bad] / 1e9:.1f} GB free less memory.headroom_fraction="
                   f"{cfg.memory.headroom_fraction:g}) with parallel.shard_weights="
                   f"{str(plan.shard).lower()}, model.linear_precision="
                   f"{cfg.model.linear_precision!r}, decode.tiles_per_call={tiles}; what would fit: "
                   + ("; ".join(fits) if fits else "no single change (shard the weights, FP8 "
                      "linears, more ranks, fewer frames and a smaller decode batch together, "
                      "or a larger GPU)"))
    return Preflight(shard=plan.shard, estimate=mine, budget=budgets[rank], failure=failure)


def log_measured(pre: Preflight, device: torch.device) -> None:
    """After the warm-up: the estimate beside ``torch.cuda.max_memory_allocated`` (CUDA)."""
    if pre.estimate is None:
        return
    if device.type != "cuda":
        log.info("memory: estimated peak %.1f GB; no device memory to measure on %s",
                 pre.estimate.peak / 1e9, device)
        return
    measured = torch.cuda.max_memory_allocated(device)
    log.info("memory: estimated peak %.1f GB (%s phase), measured peak after the warm-up %.1f GB "
             "(torch.cuda.max_memory_allocated; %.1f GB reserved by the allocator): the estimate "
             "is %+.0f%% of the measurement (the warm-up runs the denoise and decode phases, not "
             "the text encoder)", pre.estimate.peak / 1e9, pre.estimate.peak_phase, measured / 1e9,
             torch.cuda.max_memory_reserved(device) / 1e9,
             100 * (pre.estimate.peak / measured - 1) if measured else 0.0)
