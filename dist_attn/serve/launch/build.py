"""The served DiT built on every rank: diffusers' H3 class (own init or a checkpoint), made
sequence-parallel, compiled where the config says, logged once."""

from __future__ import annotations

import logging
from typing import Any, Callable

__all__ = ["block_linears", "build_model"]

log = logging.getLogger(__name__)


def block_linears(cfg: Any, dtype: Any) -> str:
    """What the blocks' linear layers run in: "fp8" (with " fast-accum"), or, for
    ``linear_precision = "bf16"`` (not FP8), the blocks' own dtype, which is float32 on a CPU."""
    if cfg.model.linear_precision == "fp8":
        return "fp8" + (" fast-accum" if cfg.model.fp8_fast_accum else "")
    return str(dtype).removeprefix("torch.")


def build_model(cfg: Any, env: Any, dtype: Any, backend: str, checkpoint: str | None, *,
                report: Callable[[str], None]) -> tuple[Any, Any]:
    """``(model, timer)``: the sequence-parallel H3 on every rank. A bad checkpoint or a missing
    package fails on every rank alike (all read the same files, before any collective): its
    message goes to ``report`` and the answer is ``(None, None)``."""
    from dist_attn.profiling import PhaseTimer
    from dist_attn.serve.h3.model import build_h3, compile_blocks, parallelize
    from dist_attn.serve.h3.weights import WeightsError
    from dist_attn.serve.launch.logs import count_in_units

    try:
        model = build_h3(cfg.model, device=env.device, dtype=dtype, checkpoint=checkpoint)
    except (WeightsError, ImportError) as e:
        report(str(e))
        return None, None
    timer = PhaseTimer(env.device)
    mesh = None
    if cfg.parallel.ring_degree > 1:
        from dist_attn.mesh import init_usp_mesh

        # global rank r*U + u sits at mesh coordinate (r, u) and holds shard r*U + u: the rows
        # enable_ulysses gives it over the default group
        mesh = init_usp_mesh(cfg.parallel.ring_degree, cfg.parallel.resolved_ulysses(env.world_size),
                             device_type=env.device.type)
    parallelize(model, mesh=mesh, backend=backend, timer=timer,
                overlap_chunks=cfg.parallel.overlap_chunks,
                sequence_bucket=cfg.runtime.bucket(env.device.type))
    if cfg.runtime.compiled(env.device.type):
        compile_blocks(model)
    log.info("built %s (MiniMaxH3Transformer3DModel): %d blocks + %d refiner blocks, %s "
             "parameters, %s on %s (fp32 modules kept, block linears %s), %s, attention "
             "backend %s%s", cfg.model.name, cfg.model.num_layers, cfg.model.num_refiner_layers,
             count_in_units(sum(p.numel() for p in model.parameters())), dtype, env.device,
             block_linears(cfg, dtype),
             f"checkpoint {checkpoint}" if checkpoint else f"own init, seed {cfg.model.weight_seed}",
             backend, ", blocks compiled" if cfg.runtime.compiled(env.device.type) else "")
    return model, timer
