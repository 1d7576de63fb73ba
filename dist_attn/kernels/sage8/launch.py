# SPDX-License-Identifier: Apache-2.0
"""One Sage8 forward: the quantization pre-pass, then the chosen attention loop (imports triton)."""

from __future__ import annotations

import functools

import torch

from dist_attn.kernels.sage8.quant import PackedLayout, QuantConfig, Quantized, quantize

__all__ = ["attention_loop", "dense_layout", "varlen_layout", "forward", "default_config", "key_block", "prepare",
           "v_order"]


def dense_layout(batch: int, rows: int, kv_len: int | None = None) -> PackedLayout:
    """``batch`` independent sequences of ``rows`` rows each; with ``kv_len``, only keys
    ``[0, kv_len)`` are attended (``used`` carries it; only the CuTe loop reads it when dense)."""
    return PackedLayout(dense=True, nseg=batch, total=rows, used=rows if kv_len is None else int(kv_len),
                        max_seqlen=rows, cu=None)


def varlen_layout(cu_seqlens: torch.Tensor, total: int, used: int, max_seqlen: int) -> PackedLayout:
    """Segments ``cu_seqlens`` (device tensor) of one packed axis, clipped to ``[0, used)``."""
    return PackedLayout(dense=False, nseg=cu_seqlens.numel() - 1, total=total, used=used,
                        max_seqlen=max_seqlen, cu=cu_seqlens)


def _loop(impl: str):
    """The module of ``impl``'s attention loop (importing it imports triton)."""
    if impl == "gluon":
        from dist_attn.kernels.sage8 import attn_gluon
        return attn_gluon
    if impl == "cute":
        from dist_attn.kernels.sage8 import attn_cute
        return attn_cute
    from dist_attn.kernels.sage8 import attn_triton
    return attn_triton


#: each loop's launch-config class, in its module
_CONFIG_CLASS = {"triton": "TritonConfig", "gluon": "GluonConfig", "cute": "CuteConfig"}


def default_config(impl: str):
    """The measured default launch config of ``impl``."""
    return getattr(_loop(impl), _CONFIG_CLASS[impl])()


def key_block(impl: str, config) -> int:
    """Keys per block of the attention loop: the granularity of K's quantization scales."""
    return _loop(impl).BLOCK_N if impl == "gluon" else config.block_n


def v_order(impl: str) -> str:
    """The order of V's keys that ``impl``'s attention loop reads (``numerics.V_KEY_ORDERS``)."""
    return _loop(impl).V_ORDER


def attention_loop(impl: str, *, interpret: bool = False):
    """``impl``'s attention launch: ``fn(qz, q, out, lse, softmax_scale, config)`` on operands that
    :func:`prepare` made for it; ``interpret``: the Triton loop under Triton's interpreter."""
    attention = _loop(impl).attention
    return functools.partial(attention, interpret=interpret) if impl == "triton" else attention


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: PackedLayout, softmax_scale: float,
            impl: str, config, quant_config: QuantConfig | None = None, interpret: bool = False) -> Quantized:
    """The pre-pass as ``impl``'s loop with ``config`` reads it (its key block, V's key order)."""
    return quantize(q, k, v, layout, softmax_scale, kblock=key_block(impl, config),
                    config=QuantConfig() if quant_config is None else quant_config, interpret=interpret,
                    v_order=v_order(impl))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None, *,
            layout: PackedLayout, softmax_scale: float, impl: str, config=None,
            quant_config: QuantConfig | None = None, interpret: bool = False) -> None:
    """Writes ``out`` (and ``lse``) for ``layout``. q/k/v/out: ``[B, T, H, D]`` views (B = 1 for
    varlen); lse: ``[B, H, T]`` float32 or None."""
    cfg = default_config(impl) if config is None else config
    qz = prepare(q, k, v, layout=layout, softmax_scale=softmax_scale, impl=impl, config=cfg,
                 quant_config=quant_config, interpret=interpret)
    attention_loop(impl, interpret=interpret)(qz, q, out, lse, softmax_scale, cfg)
