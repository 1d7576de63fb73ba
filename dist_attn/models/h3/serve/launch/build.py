# SPDX-License-Identifier: Apache-2.0
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


def build_model(cfg: Any, env: Any, dtype: Any, backend: str, checkpoint: str | None, *, shard: bool,
                report: Callable[[str], None]) -> tuple[Any, Any]:
    """``(model, timer)``: the sequence-parallel H3 on every rank (``shard``: its weights sharded
    with FSDP2, :func:`dist_attn.models.h3.serve.h3.build.build_served`). A bad checkpoint or a
    missing package fails on every rank alike (all read the same files, before any collective): its
    message goes to ``report`` and the answer is ``(None, None)``."""
    from dist_attn.models.h3.serve.h3.build import build_served
    from dist_attn.models.h3.serve.h3.weights import WeightsError
    from dist_attn.models.h3.serve.launch.logs import count_in_units

    try:
        served = build_served(cfg, env, dtype, backend, checkpoint, shard=shard)
    except (WeightsError, ImportError) as e:
        report(str(e))
        return None, None
    model, sharded = served.model, served.sharded
    weight_bytes = sharded.bytes_total if sharded is not None else sum(
        p.numel() * p.element_size() for p in model.parameters())
    compiled = cfg.runtime.compiled(env.device.type)
    log.info("built %s (MiniMaxH3Transformer3DModel): %d blocks + %d refiner blocks, %s "
             "parameters, %.2f GB of weights%s, %s on %s (fp32 modules kept, block linears %s), %s, "
             "attention backend %s%s", cfg.model.name, cfg.model.num_layers, cfg.model.num_refiner_layers,
             count_in_units(sum(p.numel() for p in model.parameters())), weight_bytes / 1e9,
             f" sharded over {env.world_size} ranks ({sharded.bytes_per_rank / 1e9:.2f} GB here)"
             if sharded is not None else "", dtype, env.device, block_linears(cfg, dtype),
             f"checkpoint {checkpoint}" if checkpoint else f"own init, seed {cfg.model.weight_seed}",
             backend, ", blocks compiled" if compiled else "")
    return model, served.timer
