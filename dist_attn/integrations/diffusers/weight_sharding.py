# SPDX-License-Identifier: Apache-2.0
"""A diffusers transformer's weights sharded over the ranks with FSDP2: one call.

    quantize_linears(pipe.transformer, "fp8")      # optional, first
    enable_ulysses(pipe.transformer)               # first too: it reads the model's class
    shard_weights(pipe.transformer)                # each rank keeps 1/W of the weights
    compile_blocks / block.compile(...)            # last

Every transformer block (and H3's token-refiner blocks) is one FSDP2 unit: gathered just before
it runs, freed after, the next block's gather issued while the current one computes; the
parameters outside the blocks (embedders, output heads) are gathered for the forward. The
contracts (inference only, bit-identical outputs, FP8 weights sharded as e4m3 bytes) are
:func:`dist_attn.weight_sharding.shard_module`'s.
"""

from __future__ import annotations

from torch import nn

from dist_attn.weight_sharding import (ShardedWeights, is_sharded, meta_parameters, shard_module,
                                       sharded_weights)

__all__ = ["ShardedWeights", "shard_weights", "sharded_weights", "weight_units"]

# class name -> the ModuleLists whose blocks are units, in the order the forward runs them
_UNITS: dict[str, tuple[str, ...]] = {
    "MiniMaxH3Transformer3DModel": ("token_refiner.refiner_blocks", "transformer_blocks"),
    "WanTransformer3DModel": ("blocks",),
    "LTXVideoTransformer3DModel": ("transformer_blocks",),
}


def weight_units(transformer: nn.Module) -> list[str]:
    """Dotted names of ``transformer``'s FSDP2 units (its blocks, in forward order); TypeError
    for a class without a plan."""
    cls = type(transformer).__name__
    if cls not in _UNITS:
        raise TypeError(f"shard_weights has no plan for {cls}; supported: {', '.join(_UNITS)}")
    return [f"{lists}.{i}" for lists in _UNITS[cls]
            for i in range(len(transformer.get_submodule(lists)))]


def shard_weights(transformer: nn.Module, group=None, *, prefetch: int = 1) -> ShardedWeights:
    """Shards ``transformer``'s weights over the ranks of ``group`` (FSDP2), in place, no undo.

    Call it on every rank of ``group``, each holding the same weights on its device, after
    :func:`~dist_attn.models.h3.fp8.quantize_linears` and
    :func:`~dist_attn.integrations.diffusers.enable_ulysses` (same group) and before compiling
    the blocks; then call the transformer (or its pipeline) on every rank with the same inputs,
    under ``torch.no_grad()`` or ``torch.inference_mode()``, as ``enable_ulysses`` asks anyway.

    Args:
        transformer: a diffusers transformer of a class with a plan (MiniMax-H3, Wan, LTX-Video).
        group: process group (None = the default group; not initialised: nothing is sharded).
        prefetch: blocks whose gather is issued ahead of the running one (1: the next).

    Returns:
        A :class:`~dist_attn.weight_sharding.ShardedWeights` (also logged).

    Raises:
        TypeError: no plan for the transformer's class.
        ValueError: see :func:`dist_attn.weight_sharding.shard_module`.
    """
    if is_sharded(transformer):  # FSDP2 renamed its class: say what happened
        raise ValueError("this transformer's weights are already sharded (shard_weights ran before)")
    meta = meta_parameters(transformer, "transformer")
    if meta:
        raise ValueError(f"shard_weights: {meta}: load its weights first (from_pretrained); to "
                         "build on the meta device and fill each block as it is sharded, use "
                         "dist_attn.weight_sharding.shard_module(materialize=, device=)")
    return shard_module(transformer, weight_units(transformer), group, prefetch=prefetch)
