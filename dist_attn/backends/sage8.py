# SPDX-License-Identifier: Apache-2.0
"""``"sage8"``: dist_attn's own INT8-QK / FP8-PV kernels for Hopper (:mod:`dist_attn.kernels.sage8`).

Two attention loops share one quantization pre-pass: the plain Triton kernel and the
warp-specialized Gluon kernel. ``"sage8"`` runs the faster one (:data:`SAGE8_IMPL`, timed by
``benchmarks/kernels.py``; see docs/kernels.md); the other stays registered under its own name
(``"sage8_gluon"``). Calls go through ``torch.library`` custom ops, so ``torch.compile`` traces
through them. Importing this module never imports triton: the kernels load on their first call,
and :meth:`Sage8Backend.unsupported_reason` says when triton, Gluon or a Hopper GPU is missing.
"""

from __future__ import annotations

import torch

from dist_attn import kernels
from dist_attn.backends.base import AttentionBackend
from dist_attn.kernels.sage8 import ops
from dist_attn.plan import KernelWaves

__all__ = ["Sage8Backend", "SAGE8_IMPL"]

#: the kernel behind the name "sage8": the Triton loop, the faster of the two at the same accuracy
#: (benchmarks/kernels.py times both beside SageAttention 2; the figures are in docs/kernels.md)
SAGE8_IMPL = "triton"


def _rows_to(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ([B, n, H, D]) with zero rows appended up to ``rows`` (``t`` itself when n == rows)."""
    if t.shape[1] == rows:
        return t
    return torch.cat([t, t.new_zeros((t.shape[0], rows - t.shape[1], *t.shape[2:]))], dim=1)


class Sage8Backend(AttentionBackend):
    """INT8 Q/K with smoothed K, FP8 P and V, fp32 accumulation (SageAttention 2's recipe)."""

    exact = False
    head_dims = tuple(kernels.SUPPORTED_HEAD_DIMS)
    # Each key block's P V is added into fp32 registers, which meets the accuracy targets that
    # tests/core/test_kernel_accuracy.py checks on a GPU (see docs/kernels.md, Accuracy)
    accuracy_verified = True

    def __init__(self, name: str = "sage8", impl: str = SAGE8_IMPL) -> None:
        self.name = name
        self.impl = impl
        # "auto" passes the CuTe DSL loop over (name it to use it): it matches the Triton loop's
        # accuracy but measured level with it, so it stays opt-in.
        self.accuracy_verified = impl != "cute"
        self.varlen = self._varlen

    @classmethod
    def alternate(cls) -> "Sage8Backend":
        """The kernel that ``"sage8"`` does not run, under its own name."""
        other = "triton" if SAGE8_IMPL == "gluon" else "gluon"
        return cls(f"sage8_{other}", other)

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        return kernels.unsupported_reason(q, impl=self.impl)

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        # k_is_scratch is irrelevant: the kernels smooth K into their own INT8 copy
        if out is None:
            return ops.dense(q, k, v, softmax_scale, self.impl)
        ops.dense_out(q, k, v, softmax_scale, self.impl, out)
        return out

    def dense_lse(self, q, k, v, *, softmax_scale):
        if q.shape[1] == k.shape[1]:
            return ops.dense_lse(q, k, v, softmax_scale, self.impl)
        if not self.supports_lse:
            raise ValueError(f"backend {self.name!r} returns a log-sum-exp only for q and k of one "
                             f"length, got {q.shape[1]} and {k.shape[1]} rows: use backend 'sage8_cute'")
        # A ring piece: pad the shorter side with zero rows to one length T; the kernel attends
        # keys [0, Lk) only, and query rows past Lq are dropped (zero rows change neither K's
        # smoothing, which the LSE undoes with the same mean, nor V's channel scales).
        lq, lk = q.shape[1], k.shape[1]
        T = max(lq, lk)
        out, lse = ops.dense_lse_kv(_rows_to(q, T), _rows_to(k, T), _rows_to(v, T), softmax_scale, self.impl, lk)
        return out[:, :lq], lse[:, :, :lq]

    @property
    def supports_lse(self) -> bool:
        # The Triton and Gluon loops return a log-sum-exp only when q and k have the same length;
        # ring steps pair chunks of different lengths (19,008 query rows against 18,972 key rows
        # at h3-ref with ring 2), which would fail on some ranks only, so "auto" under a ring
        # skips them. The CuTe loop attends a key prefix of a padded chunk (kv_len).
        return self.impl == "cute"

    def kernel_waves(self, layout, q):
        # The Triton loop's programs are BM query rows of one head each, with a register cap that
        # bounds how many share an SM: exactly at head_dim 128, where the loop fills the cap
        # (tests/core/test_kernel_waves_gpu.py checks it against the driver's occupancy). None
        # (unknown): the Gluon loop, other head dims, or segments of different tile counts, whose
        # programs run for different times, so that waves say little.
        if self.impl != "triton" or q.device.type != "cuda" or q.shape[-1] != 128:
            return None
        from dist_attn.kernels.sage8 import attn_triton, launch
        cfg = launch.default_config("triton")
        props = torch.cuda.get_device_properties(q.device)
        ctas = attn_triton.resident_ctas(
            cfg, q.shape[-1], regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
            smem_per_sm=props.shared_memory_per_multiprocessor,
            threads_per_sm=props.max_threads_per_multi_processor)
        if not ctas:
            return None
        per_segment = {-(-(b - a) // cfg.block_m) for a, b in layout.segments}
        if len(per_segment) != 1:
            return None
        tiles = per_segment.pop() * len(layout.segments)
        return KernelWaves(tiles_per_head=tiles, slots=ctas * props.multi_processor_count)

    def _varlen(self, q, k, v, cu_seqlens, max_seqlen, *, used, softmax_scale, out):
        if out is None:
            return ops.varlen(q, k, v, cu_seqlens, max_seqlen, used, softmax_scale, self.impl)
        ops.varlen_out(q, k, v, cu_seqlens, max_seqlen, used, softmax_scale, self.impl, out)
        return out
