"""One Sage8 forward: the quantization pre-pass, then the chosen attention loop (imports triton)."""

from __future__ import annotations

import functools

import torch

from dist_attn.kernels.sage8.quant import PackedLayout, QuantConfig, quantize

__all__ = ["attention_loop", "dense_layout", "varlen_layout", "forward", "default_config", "key_block", "v_order"]


def dense_layout(batch: int, rows: int) -> PackedLayout:
    """``batch`` independent sequences of ``rows`` rows each."""
    return PackedLayout(dense=True, nseg=batch, total=rows, used=rows, max_seqlen=rows, cu=None)


def varlen_layout(cu_seqlens: torch.Tensor, total: int, used: int, max_seqlen: int) -> PackedLayout:
    """Segments ``cu_seqlens`` (device tensor) of one packed axis, clipped to ``[0, used)``."""
    return PackedLayout(dense=False, nseg=cu_seqlens.numel() - 1, total=total, used=used,
                        max_seqlen=max_seqlen, cu=cu_seqlens)


def default_config(impl: str):
    """The measured default launch config of ``impl``."""
    if impl == "gluon":
        from dist_attn.kernels.sage8.attn_gluon import GluonConfig
        return GluonConfig()
    from dist_attn.kernels.sage8.attn_triton import TritonConfig
    return TritonConfig()


def key_block(impl: str, config) -> int:
    """Keys per block of the attention loop: the granularity of K's quantization scales."""
    if impl == "gluon":
        from dist_attn.kernels.sage8.attn_gluon import BLOCK_N
        return BLOCK_N
    return config.block_n


def v_order(impl: str) -> str:
    """The order of V's keys that ``impl``'s attention loop reads (``numerics.V_KEY_ORDERS``)."""
    if impl == "gluon":
        from dist_attn.kernels.sage8.attn_gluon import V_ORDER
        return V_ORDER
    from dist_attn.kernels.sage8.attn_triton import V_ORDER
    return V_ORDER


def attention_loop(impl: str, *, interpret: bool = False):
    """``impl``'s attention launch: ``fn(qz, q, out, lse, softmax_scale, config)`` on operands that
    :func:`quant.quantize` made for it; ``interpret``: the Triton loop under Triton's interpreter."""
    if impl == "gluon":
        from dist_attn.kernels.sage8.attn_gluon import attention
        return attention
    from dist_attn.kernels.sage8.attn_triton import attention
    return functools.partial(attention, interpret=interpret)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, *,
            layout: PackedLayout, softmax_scale: float, impl: str, config=None,
            quant_config: QuantConfig | None = None, interpret: bool = False) -> None:
    """Writes ``out`` (and ``lse``) for ``layout``. q/k/v/out: ``[B, T, H, D]`` views (B = 1 for
    varlen); lse: ``[B, H, T]`` float32 or None."""
    cfg = default_config(impl) if config is None else config
    qz = quantize(q, k, v, layout, softmax_scale, kblock=key_block(impl, cfg),
                  config=QuantConfig() if quant_config is None else quant_config, interpret=interpret,
                  v_order=v_order(impl))
    attention_loop(impl, interpret=interpret)(qz, q, out, lse, softmax_scale, cfg)
