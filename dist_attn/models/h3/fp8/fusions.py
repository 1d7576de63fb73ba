# SPDX-License-Identifier: Apache-2.0
"""Which blocks of a transformer take :func:`~dist_attn.models.h3.fp8.quantize_linears`'
fused FP8 kernels (the SwiGLU FFN, the norm + AdaLN step), checked before anything changes, and
the FFN swap itself."""

from __future__ import annotations

import logging
from typing import Collection

import torch
from torch import nn

from dist_attn.models.h3.fp8.block import adaln_unfusable_reason
from dist_attn.models.h3.fp8.linear import Fp8SwiGLUFeedForward
from dist_attn.models.h3.fp8.numerics import SWIGLU_MAX_INNER

__all__ = ["adaln_blocks", "fuse_swiglu_ffns", "swiglu_blocks"]

logger = logging.getLogger("dist_attn.models.h3.fp8.quantize")


def _blocks(transformer: nn.Module, only: Collection[int] | None):
    return [(i, b) for i, b in enumerate(transformer.transformer_blocks) if only is None or i in only]


def swiglu_blocks(transformer: nn.Module, strict: bool, emulate: bool,
                  device: torch.device, only: Collection[int] | None = None) -> list[tuple[int, nn.Module]]:
    """``(index, block)`` of the blocks whose ``ff`` the fused kernel takes: diffusers' bias-free
    SwiGLU ``FeedForward`` (``net = [SwiGLU(proj), Dropout, Linear]``; the dropout is the identity
    in eval) of inner size <= ``SWIGLU_MAX_INNER``, on CUDA, not emulated. ``strict``
    (``fuse_swiglu=True``): every block or an error, raised before anything changes; otherwise
    ("auto") the others are left as they are."""
    from diffusers.models.activations import SwiGLU

    if not strict and (emulate or device.type != "cuda"):
        return []
    found = []
    for i, block in _blocks(transformer, only):
        net = getattr(block.ff, "net", None)
        if (net is None or len(net) != 3 or not isinstance(net[0], SwiGLU)
                or not isinstance(net[1], nn.Dropout) or not isinstance(net[2], nn.Linear)
                or net[2].bias is not None):
            if strict:
                raise TypeError(f"fuse_swiglu=True: transformer_blocks.{i}.ff is not diffusers' "
                                f"bias-free SwiGLU FeedForward ({type(block.ff).__name__}); pass "
                                "fuse_swiglu='auto' or False")
            continue
        if net[2].in_features > SWIGLU_MAX_INNER:
            if strict:
                raise ValueError(f"fuse_swiglu=True: transformer_blocks.{i}.ff's inner size "
                                 f"{net[2].in_features} is over the fused kernel's {SWIGLU_MAX_INNER}; "
                                 "pass fuse_swiglu='auto' or False")
            continue
        found.append((i, block))
    if emulate or device.type != "cuda":
        if strict:
            raise ValueError(f"fuse_swiglu=True needs torchao on a CUDA device (the kernel is Triton); "
                             f"emulate={emulate}, weights on {device}: pass fuse_swiglu='auto' or False")
        return []
    if found:
        try:  # triton missing: True fails here, before any change; "auto" fuses nothing, and says so
            import dist_attn.models.h3.fp8.swiglu_kernel  # noqa: F401
        except ImportError as exc:
            if strict:
                raise
            logger.info("quantize_linears: FFNs not fused (fuse_swiglu='auto'): %s", exc)
            return []
    return found


def adaln_blocks(transformer: nn.Module, strict: bool, emulate: bool,
                 device: torch.device, only: Collection[int] | None = None) -> list[tuple[int, nn.Module]]:
    """``(index, block)`` of the blocks that take the fused AdaLN forward, checked before the
    quantization (whose targets include the linears the forward feeds). ``strict``
    (``fuse_adaln=True``): every block or an error, raised before anything changes; "auto": the
    blocks it applies to, only with torchao on CUDA."""
    if not strict and (emulate or device.type != "cuda"):
        return []
    found = []
    for i, block in _blocks(transformer, only):
        reason = adaln_unfusable_reason(block, quantized=False)
        if reason is None:
            found.append((i, block))
        elif strict:
            raise TypeError(f"fuse_adaln=True: transformer_blocks.{i}: {reason}; pass "
                            "fuse_adaln='auto' or False")
    if found:
        try:  # triton missing: True fails here; "auto" fuses nothing, and says so
            import dist_attn.models.h3.fp8.adaln_kernel  # noqa: F401
        except ImportError as exc:
            if strict:
                raise ImportError(f"fuse_adaln=True runs a Triton kernel and triton cannot be "
                                  f"imported ({exc}); pass fuse_adaln='auto' or False") from exc
            logger.info("quantize_linears: AdaLN inputs not fused (fuse_adaln='auto'): %s", exc)
            return []
        import diffusers

        from dist_attn.integrations.diffusers import TESTED_DIFFUSERS

        if diffusers.__version__ != TESTED_DIFFUSERS:
            logger.warning("quantize_linears(fuse_adaln): the fused H3 block forward follows "
                           "diffusers %s's MiniMaxH3TransformerBlock.forward; diffusers %s is "
                           "installed", TESTED_DIFFUSERS, diffusers.__version__)
    return found


def fuse_swiglu_ffns(blocks: list[tuple[int, nn.Module]], fast_accum: bool) -> tuple[str, ...]:
    """Each (torchao-quantized) block FFN -> :class:`Fp8SwiGLUFeedForward`, same weights."""
    for _, block in blocks:
        net = block.ff.net
        down = net[2].weight
        block.ff = Fp8SwiGLUFeedForward(net[0].proj, down.qdata, down.scale, fast_accum=fast_accum)
    return tuple(f"transformer_blocks.{i}.ff" for i, _ in blocks)
