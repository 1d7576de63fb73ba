# SPDX-License-Identifier: Apache-2.0
"""The interface every dense attention kernel implements, and its shared defaults.

A backend computes non-causal attention on ``[B, T, H, D]`` tensors (batch, tokens, heads,
head_dim), the last dim contiguous and the others arbitrarily strided. The varlen bridge
(:mod:`dist_attn.varlen`) turns packed varlen attention into calls of this interface. A backend
may also offer a native ``varlen`` entry; the bridge then hands it the whole packed layout.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from dist_attn.plan import KernelWaves

__all__ = ["AttentionBackend", "BackendUnavailableError", "default_softmax_scale"]


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on these inputs; the message says why and what to do."""


class AttentionBackend:
    """Interface of a dense attention kernel.

    Attributes:
        name: registry key, e.g. ``"sdpa"``.
        exact: True for kernels that compute in the input precision (no 8-bit quantization);
            the ``"lossless"`` quality tier admits only these.
        head_dims: the head_dim values the kernel accepts (None = any); configs check it
            before any tensor exists.
        accuracy_verified: for a kernel that is not exact, True only once it met dist_attn's
            accuracy targets against float64 on real-model activations and long sequences with
            V channel means, on the GPU (``tests/core/test_kernel_accuracy.py`` asserts them for
            every backend that sets it). ``"auto"`` chooses only exact or verified kernels.
    """

    name: str = ""
    exact: bool = True
    head_dims: tuple[int, ...] | None = None
    accuracy_verified: bool = False

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        """None if this backend can run on tensors like ``q`` (``[..., D]``), else why not and how to fix it."""
        raise NotImplementedError

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
              k_is_scratch: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """Non-causal attention.

        Args:
            q, k, v: ``[B, T, H, D]``, one dtype and device, last dim contiguous.
            softmax_scale: multiplier of q.k before the softmax.
            k_is_scratch: True when ``k`` lives in a buffer dist_attn owns (the all-to-all receive
                buffer) and may be overwritten; False when it is the caller's tensor.
            out: optional ``[B, T, H, D]`` destination. A kernel that can write there does and
                returns it; others ignore it and the bridge copies their result in.

        Returns:
            ``[B, T, H, D]`` in q's dtype; a tensor no caller input aliases.
        """
        raise NotImplementedError

    def dense_lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  softmax_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention that also returns the log-sum-exp of each query row's scores,
        which ring attention needs to merge partial results exactly.

        Args:
            q: ``[B, Tq, H, D]``; k, v: ``[B, Tk, H, D]`` (ring attention pairs query rows of one
                chunk with key rows of another, so Tq and Tk may differ); one dtype and device,
                last dim contiguous.
            softmax_scale: multiplier of q.k before the softmax.

        Returns:
            ``(out, lse)``: out ``[B, Tq, H, D]`` in q's dtype; lse ``[B, H, Tq]`` float32, the
            natural log of ``sum_j exp(softmax_scale * q.k_j)``.
        """
        raise NotImplementedError(f"backend {self.name!r} does not return a log-sum-exp")

    @property
    def supports_lse(self) -> bool:
        """Whether :meth:`dense_lse` is implemented for any key length (ring attention needs it:
        its steps pair a query chunk with a key chunk of another length)."""
        return type(self).dense_lse is not AttentionBackend.dense_lse

    def kernel_waves(self, layout, q: torch.Tensor) -> KernelWaves | None:
        """How one call of this kernel on every row of ``layout`` (a
        :class:`dist_attn.varlen.SegmentLayout`) fills q's GPU, per head; None when not known.

        Pipelined Ulysses chunks (``overlap_chunks > 1``) use it to cut the heads into the split
        whose kernel calls take the fewest waves (:func:`dist_attn.plan.chunk_widths`). The
        answer must depend only on the layout, q's head_dim and dtype, and the kind of GPU, so
        that every rank of a group gives the same one (the core checks that they do)."""
        return None

    # A backend that handles packed varlen natively sets this to a callable
    # (q, k, v, cu_seqlens, max_seqlen, *, used, softmax_scale, out) -> out.
    varlen: Callable | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def default_softmax_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the scale every kernel here defaults to; head_dim must be >= 1."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim={head_dim!r} must be a positive int (the softmax scale is "
                         "1 / sqrt(head_dim))")
    return 1.0 / math.sqrt(head_dim)
