# SPDX-License-Identifier: Apache-2.0
"""The served DiT as every rank builds it at launch: diffusers' H3 built (or loaded), its linears
in the configured precision, made sequence-parallel, its weights sharded over the ranks when
asked, its blocks compiled, in that order (each step's contract names the one before it)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.config.deployment import Config

__all__ = ["ServedModel", "build_served"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ServedModel:
    """What :func:`build_served` made on this rank."""

    model: nn.Module
    timer: Any
    """The :class:`dist_attn.PhaseTimer` every eager attention call reports to."""
    sharded: Any = None
    """The :class:`dist_attn.weight_sharding.ShardedWeights` when the weights are sharded."""


def build_served(cfg: Config, env: DistEnv, dtype: torch.dtype, backend: str,
                 checkpoint: str | None, *, shard: bool) -> ServedModel:
    """Builds the sequence-parallel H3 on this rank (call it on every rank alike).

    ``shard``: the weights are sharded over every rank with FSDP2 (``parallel.shard_weights``,
    resolved): the model is built on the meta device and materialised block by block, each
    block sharded as soon as it is filled, so no rank ever holds a whole replica. With one rank
    there is nothing to shard over: the model is built whole (logged).

    Raises:
        WeightsError: a bad checkpoint (every rank reads the same files, so all raise alike).
        ImportError: an extra is missing.
    """
    from dist_attn.profiling import PhaseTimer
    from dist_attn.models.h3.serve.h3.model import (build_h3, compile_blocks, meta_h3, parallelize,
                                                    shard_h3)

    device_type = env.device.type
    mesh = None
    if cfg.parallel.ring_degree > 1:
        from dist_attn.mesh import init_usp_mesh

        # global rank r*U + u sits at mesh coordinate (r, u) and holds shard r*U + u: the rows
        # enable_ulysses gives it over the default group
        mesh = init_usp_mesh(cfg.parallel.ring_degree, cfg.parallel.resolved_ulysses(env.world_size),
                             device_type=device_type)
    if shard and not env.distributed:
        log.info("parallel.shard_weights: one rank, nothing to shard over; the model is built whole")
        shard = False
    if shard:
        model = meta_h3(cfg.model, device=env.device, dtype=dtype, fp32_modules=checkpoint is not None)
    else:
        model = build_h3(cfg.model, device=env.device, dtype=dtype, checkpoint=checkpoint)
    timer = PhaseTimer(env.device)
    parallelize(model, mesh=mesh, backend=backend, timer=timer,
                overlap_chunks=cfg.parallel.overlap_chunks,
                sequence_bucket=cfg.runtime.bucket(device_type))
    sharded = None
    if shard:  # after enable_ulysses (it reads the model's class), before compiling
        sharded = shard_h3(model, cfg.model, device=env.device, dtype=dtype, checkpoint=checkpoint)
    if cfg.runtime.compiled(device_type):
        compile_blocks(model)
    return ServedModel(model=model, timer=timer, sharded=sharded)
