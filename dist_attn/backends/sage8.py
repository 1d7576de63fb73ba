"""``"sage8"``: dist_attn's own INT8-QK / FP8-PV kernel for Hopper (:mod:`dist_attn.kernels`).

Importing this module never imports triton: the kernels load on their first call, and
:meth:`Sage8Backend.unsupported_reason` says when triton (or a Hopper GPU) is missing.
"""

from __future__ import annotations

import torch

from dist_attn import kernels
from dist_attn.backends.base import AttentionBackend

__all__ = ["Sage8Backend"]


class Sage8Backend(AttentionBackend):
    """INT8 Q/K with smoothed K, FP8 P and V, fp32 accumulation (SageAttention 2's recipe)."""

    name = "sage8"
    exact = False
    head_dims = tuple(kernels.SUPPORTED_HEAD_DIMS)

    def __init__(self) -> None:
        self.varlen = self._varlen

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        return kernels.unsupported_reason(q)

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        return kernels.sage8_dense(q, k, v, softmax_scale=softmax_scale, out=out)

    def _varlen(self, q, k, v, cu_seqlens, max_seqlen, *, used, softmax_scale, out):
        return kernels.sage8_varlen(q, k, v, cu_seqlens, max_seqlen, used=used,
                                    softmax_scale=softmax_scale, out=out)
