# SPDX-License-Identifier: Apache-2.0
"""The Sage8 entry points as ``torch.library`` custom ops with fake (meta) implementations, so a
``torch.compile``d model traces through attention instead of breaking its graph there.

Ops (namespace ``dist_attn``; ``impl`` is ``"triton"``, ``"gluon"`` or ``"cute"``):

* ``sage8_dense(q, k, v, softmax_scale, impl) -> out``          q/k/v/out ``[B, T, H, D]``
* ``sage8_dense_out(q, k, v, softmax_scale, impl, out) -> ()``   writes ``out`` in place
* ``sage8_dense_lse(q, k, v, softmax_scale, impl) -> (out, lse)`` lse ``[B, H, T]`` float32
* ``sage8_dense_lse_kv(q, k, v, softmax_scale, impl, kv_len) -> (out, lse)``  keys ``[0, kv_len)`` only
* ``sage8_varlen(q, k, v, cu_seqlens, max_seqlen, used, softmax_scale, impl) -> out``  ``[T, H, D]``
* ``sage8_varlen_out(..., out) -> ()``

Registering them imports torch only; the kernels load on the first real call.
"""

from __future__ import annotations

import torch

from dist_attn.kernels.sage8.api import sage8_dense, sage8_varlen

__all__ = ["dense", "dense_out", "dense_lse", "dense_lse_kv", "varlen", "varlen_out"]


@torch.library.custom_op("dist_attn::sage8_dense", mutates_args=())
def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, impl: str) -> torch.Tensor:
    return sage8_dense(q, k, v, softmax_scale=softmax_scale, impl=impl)


@dense.register_fake
def _(q, k, v, softmax_scale, impl):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("dist_attn::sage8_dense_out", mutates_args=("out",))
def dense_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, impl: str,
              out: torch.Tensor) -> None:
    sage8_dense(q, k, v, softmax_scale=softmax_scale, impl=impl, out=out)


@dense_out.register_fake
def _(q, k, v, softmax_scale, impl, out):
    return None


@torch.library.custom_op("dist_attn::sage8_dense_lse", mutates_args=())
def dense_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
              impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    return sage8_dense(q, k, v, softmax_scale=softmax_scale, impl=impl, return_lse=True)


@dense_lse.register_fake
def _(q, k, v, softmax_scale, impl):
    B, T, H, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((B, H, T), dtype=torch.float32, device=q.device))


@torch.library.custom_op("dist_attn::sage8_dense_lse_kv", mutates_args=())
def dense_lse_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, impl: str,
                 kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return sage8_dense(q, k, v, softmax_scale=softmax_scale, impl=impl, return_lse=True, kv_len=kv_len)


@dense_lse_kv.register_fake
def _(q, k, v, softmax_scale, impl, kv_len):
    B, T, H, _ = q.shape
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty((B, H, T), dtype=torch.float32, device=q.device))


@torch.library.custom_op("dist_attn::sage8_varlen", mutates_args=())
def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           used: int, softmax_scale: float, impl: str) -> torch.Tensor:
    return sage8_varlen(q, k, v, cu_seqlens, max_seqlen, used=used, softmax_scale=softmax_scale, impl=impl)


@varlen.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, used, softmax_scale, impl):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("dist_attn::sage8_varlen_out", mutates_args=("out",))
def varlen_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
               used: int, softmax_scale: float, impl: str, out: torch.Tensor) -> None:
    sage8_varlen(q, k, v, cu_seqlens, max_seqlen, used=used, softmax_scale=softmax_scale, impl=impl, out=out)


@varlen_out.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, used, softmax_scale, impl, out):
    return None
