"""SageAttention-2-style 8-bit attention forward for Hopper, written in Triton (tracker issue 5).

What it computes: non-causal softmax(Q K^T * scale) V per head, each packed segment attending only to
itself, with the SageAttention-2 recipe (ideas from the papers; the code is this project's own):

* K is smoothed by subtracting its per-channel mean over the segment (into a private INT8 copy;
  the caller's K is never modified - sageattention 1.0.6 does ``k -= k.mean()`` in place, which
  changed the caller's keys by up to 0.55 on N(0,1)+0.5 data, see shared/h3.md);
* Q is quantized to INT8 with one scale per row, K with one scale per key block; both scales and
  ``softmax_scale * log2(e)`` fold into one per-row factor applied to the int32 scores;
* online softmax in exp2 with fp32 statistics; P is quantized to FP8 e4m3 (times 2**8.75 so small
  probabilities stay normal) and V to FP8 e4m3 with one scale per channel, applied once to the output;
  P V accumulates in fp32.

Why 8-bit: on the H200 a plain Triton loop fed with pre-quantized 8-bit operands reached 1.21-1.26x
cuDNN SDPA bf16 (shared/h3.md); the goal here is >= 1.30x with the quantization passes counted.

Triton is imported lazily (first call), so ``import dist_attn.kernels`` works without it.
"""

from __future__ import annotations

import math
import os

import torch

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_DTYPES",
    "unsupported_reason",
    "sage8_dense",
    "sage8_varlen",
]

#: head_dim values the kernels are compiled for (the INT8 -> float trick needs D * 127**2 < 2**22).
SUPPORTED_HEAD_DIMS = (64, 128)
#: input/output dtypes; the output has q's dtype.
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unsupported_reason(q: torch.Tensor) -> str | None:
    """Why the Sage8 kernels cannot run on ``q``, or None if they can.

    Args:
        q: a query tensor whose device, dtype and last dimension (head_dim) are checked.

    Returns:
        None when triton imports, q is fp16/bf16 with head_dim 64 or 128, and q lives on a CUDA
        device of compute capability 9.0 (or on the CPU with ``TRITON_INTERPRET=1``); otherwise one
        sentence saying what is missing and how to fix it.
    """
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not importable: install it (pip install triton) to use the sage8 kernels."
    if q.dtype not in SUPPORTED_DTYPES:
        return f"sage8 takes float16 or bfloat16 inputs, got {q.dtype}: cast q, k and v first."
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        return (f"sage8 supports head_dim {SUPPORTED_HEAD_DIMS}, got {q.shape[-1]}: use another "
                "attention backend for this head size.")
    if q.device.type == "cuda":
        cc = torch.cuda.get_device_capability(q.device)
        if cc != (9, 0):
            return (f"sage8 is tuned for Hopper (compute capability 9.0) and uses its FP8/INT8 wgmma; "
                    f"this GPU is {cc[0]}.{cc[1]}: use another attention backend.")
        return None
    if q.device.type == "cpu" and _interpreting():
        return None
    return (f"sage8 needs a CUDA GPU of compute capability 9.0 (q is on {q.device}); on the CPU it "
            "runs only under Triton's interpreter: set TRITON_INTERPRET=1 before importing triton.")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (stride(-1) == 1), got strides "
                             f"{t.stride()}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape (no GQA), got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    reason = unsupported_reason(q)
    if reason is not None:
        raise RuntimeError(reason)


def _check_out(out: torch.Tensor, q: torch.Tensor) -> None:
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} of {q.dtype} on {q.device} with a contiguous "
                         f"last dim, got {tuple(out.shape)} {out.dtype} {out.device} strides {out.stride()}")


def _scale(softmax_scale: float | None, head_dim: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        # the online softmax multiplies -inf (masked keys) by the scale: 0 or negative breaks it
        raise ValueError(f"softmax_scale must be a finite positive float, got {softmax_scale}")
    return float(softmax_scale)


def sage8_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                softmax_scale: float | None = None, out: torch.Tensor | None = None,
                _config: dict | None = None) -> torch.Tensor:
    """Non-causal 8-bit attention on batched inputs.

    Args:
        q, k, v: ``[B, T, H, D]`` float16/bfloat16, same shape and device; any strides with
            ``stride(-1) == 1`` (no copy is made). Not modified.
        softmax_scale: multiplies Q K^T; default ``1 / sqrt(D)``.
        out: optional ``[B, T, H, D]`` destination of q's dtype (strided views allowed, last dim
            contiguous), e.g. the Ulysses output send buffer: saves a copy of the result.

    Returns:
        ``out``, or a fresh contiguous ``[B, T, H, D]`` tensor of q's dtype.
    """
    _check_qkv(q, k, v, 4)
    B, T, H, D = q.shape
    if out is None:
        out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, q)
    if B == 0 or T == 0 or H == 0:
        return out
    from ._sage8_triton import sage8_forward
    return sage8_forward(q, k, v, out, cu_seqlens=None, nseg=B, max_seqlen=T, used=T, dense=True,
                         softmax_scale=_scale(softmax_scale, D), config=_config,
                         interpret=_interpreting())


def sage8_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                 max_seqlen: int, *, used: int | None = None, softmax_scale: float | None = None,
                 out: torch.Tensor | None = None, _config: dict | None = None) -> torch.Tensor:
    """Non-causal 8-bit attention on packed segments, without any host sync.

    Args:
        q, k, v: ``[T, H, D]`` float16/bfloat16, rows of all segments packed; any strides with
            ``stride(-1) == 1`` (e.g. Ulysses receive-buffer views with strides (3*H*D, D, 1)).
            Not modified.
        cu_seqlens: ``[S + 1]`` int32/int64 on q's device, non-decreasing offsets; segment ``s`` is
            rows ``[cu_seqlens[s], cu_seqlens[s+1])`` and attends only to itself. Empty segments
            are fine. The segments must cover ``[0, used)``: rows outside every segment are not
            written.
        max_seqlen: host int >= the longest segment (sizes the grid; never read from the device).
        used: rows ``[used, T)`` are trailing padding: not read, and returned as exact zeros.
            Segments are clipped to ``[0, used)``. Default ``T``.
        softmax_scale: multiplies Q K^T; default ``1 / sqrt(D)``.
        out: optional ``[T, H, D]`` destination of q's dtype (strided views allowed, last dim
            contiguous); written and returned.

    Returns:
        ``out`` (or a fresh ``[T, H, D]`` tensor of q's dtype).
    """
    _check_qkv(q, k, v, 3)
    T, H, D = q.shape
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor, got {cu_seqlens.dtype} "
                         f"of shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != q.device:
        raise ValueError(f"cu_seqlens must be on q's device {q.device} (no host copy is made), got "
                         f"{cu_seqlens.device}")
    used = T if used is None else int(used)
    if not 0 <= used <= T:
        raise ValueError(f"used={used} must lie in [0, T={T}]")
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    else:
        _check_out(out, q)
    if used < T:
        out[used:].zero_()
    nseg = cu_seqlens.numel() - 1
    if nseg == 0 or used == 0 or max_seqlen <= 0 or H == 0:
        return out
    from ._sage8_triton import sage8_forward
    sage8_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                  cu_seqlens=cu_seqlens, nseg=nseg, max_seqlen=int(max_seqlen), used=used, dense=False,
                  softmax_scale=_scale(softmax_scale, D), config=_config, interpret=_interpreting())
    return out
