# SPDX-License-Identifier: Apache-2.0
"""The varlen bridge: packed varlen attention as dense kernel calls, and the ONE owner of the
rule that says which rows are documents and which are padding.

Bounds are documents, never padding. Padding is said by the caller with ``valid_len``: rows
``>= valid_len`` are never attended (segments are clipped to ``[0, valid_len)``) and come back
exactly zero. The bounds ``(0, S, 2S)`` therefore mean two documents of S rows: a classifier-free-
guidance pair is not mistaken for one request padded at the end.

Paths, chosen from host integers only:

* the valid rows form one segment starting at row 0 (one request, padded or not: the H3 layout):
  ONE dense call on rows ``[0, valid_len)``; the padding rows are zeroed, never computed (at most
  0.4% over the bare dense call in ``benchmarks/kernels.py``; docs/library.md, Measured costs);
* a backend with a native varlen kernel gets the whole layout (batch 1);
* anything else: one dense call per non-empty segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dist_attn.backends import AttentionBackend, default_softmax_scale, resolve_backend
from dist_attn.validation import (as_host_int, check_bounds, check_no_grad, check_qkv,
                                  check_softmax_scale, host_bounds, host_valid_len)

__all__ = ["SegmentLayout", "segment_layout", "sage_varlen", "trailing_padding_used_len",
           "attend_varlen"]


@dataclass(frozen=True)
class SegmentLayout:
    """Which rows of a packed sequence attend to which."""

    total: int
    """Rows of the packed sequence, padding included."""
    valid_len: int
    """Rows ``[valid_len, total)`` are padding (``valid_len == total``: none)."""
    bounds: tuple[int, ...]
    """The caller's segment bounds, 0 ... total."""
    segments: tuple[tuple[int, int], ...]
    """Non-empty segments clipped to ``[0, valid_len)``; each attends only to itself."""

    @property
    def single_segment(self) -> bool:
        """True when the valid rows are one segment starting at row 0 (one dense call)."""
        return self.segments == ((0, self.valid_len),)

    @property
    def longest(self) -> int:
        """Rows of the longest segment (0 when there is none)."""
        return max((b - a for a, b in self.segments), default=0)


def segment_layout(bounds: Sequence[int], *, total: int, valid_len=None, max_seqlen=None,
                   src: str = "cu_seqlens") -> SegmentLayout:
    """Validates ``valid_len`` and ``max_seqlen`` against validated ``bounds`` (0 ... total).

    Args:
        bounds: host segment bounds, already checked by :func:`dist_attn.validation.host_bounds`.
        total: rows of the packed sequence.
        valid_len: None (no padding), or a Python int or one-element integer CPU tensor (read on
            the host) in ``[1, total]``.
        max_seqlen: None, or an int that is at least the longest clipped segment.
        src: the argument name the bounds came from (for messages).
    """
    valid_len = host_valid_len(valid_len)
    if valid_len is None:
        valid_len = total
    elif not 1 <= valid_len <= total:
        raise ValueError(f"valid_len={valid_len} must lie in [1, {total}] (the global packed length)")
    segments = tuple((a, min(b, valid_len)) for a, b in zip(bounds[:-1], bounds[1:]) if a < min(b, valid_len))
    layout = SegmentLayout(total=total, valid_len=valid_len, bounds=tuple(bounds), segments=segments)
    max_seqlen = as_host_int("max_seqlen", max_seqlen)
    if max_seqlen is not None:
        if max_seqlen <= 0:
            raise ValueError(f"max_seqlen={max_seqlen} must be > 0")
        if max_seqlen < layout.longest:
            hint = ""
            if valid_len == total and len(bounds) == 3 and bounds[1] == max_seqlen:
                hint = (f"; if rows [{bounds[1]}, {total}) are padding rather than a document, "
                        f"pass valid_len={bounds[1]}")
            raise ValueError(f"max_seqlen={max_seqlen} is below the longest segment ({layout.longest} "
                             f"rows in {src}){hint}")
    return layout


def trailing_padding_used_len(*, total_tokens: int, max_seqlen: int, bounds: Sequence[int]) -> int | None:
    """SGLang's inference, for :func:`sage_varlen` only: ``used`` when ``bounds == (0, used,
    total_tokens)`` with ``used == max_seqlen`` and ``0 < used < total_tokens`` (read as one
    request padded at the end), else None. The bounds alone cannot tell this from two documents;
    the Ulysses layer never guesses and takes ``valid_len`` instead."""
    if len(bounds) != 3:
        return None
    start, used, end = (int(b) for b in bounds)
    if start != 0 or end != total_tokens or used != max_seqlen:
        return None
    if not 0 < used < total_tokens:
        return None
    return used


def attend_varlen(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                  layout: SegmentLayout, cu_seqlens, softmax_scale: float, k_is_scratch: bool,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-diagonal attention of already-validated packed tensors.

    Args:
        backend: the resolved kernel.
        q, k, v: ``[B, T, H, D]``, last dim contiguous; every sample has the same segments.
        layout: from :func:`segment_layout`.
        cu_seqlens: the caller's bounds tensor or None (a device copy is made only for a native
            varlen kernel).
        softmax_scale: score multiplier.
        k_is_scratch: whether ``k`` may be overwritten (see :class:`AttentionBackend`).
        out: optional ``[B, T, H, D]`` destination; a fresh tensor is allocated if None.

    Returns:
        ``out`` (or the fresh tensor), ``[B, T, H, D]`` in q's dtype; padding rows exactly zero.
    """
    total, valid = layout.total, layout.valid_len
    if layout.single_segment:
        if out is None and valid == total:
            return _dense(backend, q, k, v, None, softmax_scale, k_is_scratch)
        if out is None:
            out = q.new_empty(q.shape)
        _dense(backend, q[:, :valid], k[:, :valid], v[:, :valid], out[:, :valid], softmax_scale,
               k_is_scratch)
        out[:, valid:].zero_()
        return out
    if backend.varlen is not None and q.shape[0] == 1 and layout.segments:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.device != q.device:
            cu_seqlens = torch.tensor(layout.bounds, dtype=torch.int32, device=q.device)
        res = backend.varlen(q[0], k[0], v[0], cu_seqlens, layout.longest, used=valid,
                             softmax_scale=softmax_scale, out=None if out is None else out[0])
        return res[None] if out is None else out
    if out is None:
        out = q.new_empty(q.shape)
    for a, b in layout.segments:  # contiguous: together they cover [0, valid_len)
        _dense(backend, q[:, a:b], k[:, a:b], v[:, a:b], out[:, a:b], softmax_scale, k_is_scratch)
    out[:, valid:].zero_()
    return out


def _dense(backend: AttentionBackend, q, k, v, out, softmax_scale, k_is_scratch) -> torch.Tensor:
    """One dense call on ``[B, L, H, D]`` tensors, its result in ``out`` when given."""
    res = backend.dense(q, k, v, softmax_scale=softmax_scale, k_is_scratch=k_is_scratch, out=out)
    if out is None:
        return res
    if res.data_ptr() != out.data_ptr():  # the kernel could not write into out
        out.copy_(res)
    return out


def sage_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None,
                max_seqlen=None, cu_seqlens_host: Sequence[int] | None = None, *,
                valid_len: int | None = None, backend: str = "auto",
                softmax_scale: float | None = None) -> torch.Tensor:
    """Packed varlen attention on one device (the bridge), block-diagonal over segments.

    Drops into SGLang's varlen attention: q, k, v positionally, then the keywords ``cu_seqlens``,
    ``max_seqlen`` and ``cu_seqlens_host`` of its ``forward_varlen``. For that drop-in use it keeps
    SGLang's padding inference: when ``valid_len`` is None and the bounds are exactly
    ``(0, used, T)`` with ``used == max_seqlen`` and ``0 < used < T``, rows ``[used, T)`` are taken
    as padding (zero output), as SGLang packs one request padded at the end. That inference also
    catches two real documents whose first is the longest (``(0, 9, 12)`` with ``max_seqlen=9``, or
    a CFG pair ``(0, S, 2S)`` with ``max_seqlen=S``): their second document comes back zero. Pass
    ``valid_len`` to say what is padding (``valid_len=T``: none); every call with ``valid_len``
    follows the explicit rule: bounds are documents and only rows ``>= valid_len`` are padding.
    :func:`dist_attn.ulysses_attention` never infers.

    Args:
        q, k, v: ``[T, H, D]`` or ``[B, T, H, D]`` fp16/bf16/fp32, one device, last dim
            contiguous. Never modified.
        cu_seqlens: ``[num_segments + 1]`` bounds 0, ..., T: an int32/int64 tensor (q's device or
            CPU) or a list of ints; None means one segment of T rows.
        max_seqlen: the longest segment (an int, or None to take it from the bounds).
        cu_seqlens_host: optional list/tuple of the same bounds as Python ints; when given, no
            device-to-host synchronisation happens (it is trusted: not compared with the device
            tensor, which would need that synchronisation).
        valid_len: rows ``>= valid_len`` are padding (see above).
        backend: ``"auto"``, ``"sage8"``, ``"sage8_gluon"``, ``"sage"``, ``"fa3"``, ``"sdpa"`` or
            another registered name.
        softmax_scale: a number in ``(0, 1e24]`` (:func:`dist_attn.validation.check_softmax_scale`);
            defaults to ``1 / sqrt(D)``.

    Returns:
        Fresh tensor of q's shape, dtype and device; padding rows exactly zero.
    """
    check_qkv(q, k, v)
    check_no_grad(q, k, v)
    check_softmax_scale(softmax_scale)  # nan and 1e300 gave an all-NaN output here
    check_bounds(cu_seqlens, device=q.device)
    batched = q.ndim == 4
    q4, k4, v4 = (t if batched else t[None] for t in (q, k, v))  # [T, H, D] -> [1, T, H, D]
    total = q4.shape[1]
    bounds = host_bounds(cu_seqlens, cu_seqlens_host, total=total)
    if valid_len is None and max_seqlen is not None:
        valid_len = trailing_padding_used_len(total_tokens=total, max_seqlen=as_host_int(
            "max_seqlen", max_seqlen), bounds=bounds)
    layout = segment_layout(bounds, total=total, valid_len=valid_len, max_seqlen=max_seqlen)
    be = resolve_backend(backend, q)
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out = attend_varlen(be, q4, k4, v4, layout=layout, cu_seqlens=cu_seqlens, softmax_scale=scale,
                        k_is_scratch=False)
    return out if batched else out[0]
