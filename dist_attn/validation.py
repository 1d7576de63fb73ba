"""Input checks shared by the local bridge and the Ulysses layer.

Every check here reads only shapes, dtypes, devices and host integers, so it gives the same
verdict on every rank of an SPMD program and runs BEFORE any collective: a bad call raises on
all ranks instead of leaving some of them blocked in an all-to-all. Messages name the argument,
its value and the rule it broke.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["SUPPORTED_DTYPES", "check_qkv", "check_bounds", "host_bounds", "check_no_grad"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_qkv(q, k, v, *, num_heads: int | None = None, head_dim: int | None = None) -> None:
    """Checks q/k/v: tensors ``[T, H, D]`` of one shape, dtype and device, dtype fp16/bf16/fp32,
    and (when given) ``H == num_heads`` and ``D == head_dim``. The last dim must be contiguous."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim != 3:
            raise ValueError(
                f"{name}.ndim={t.ndim} (shape {tuple(t.shape)}); expected 3 dims [tokens, heads, head_dim]"
            )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v shapes must be equal, got q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    if num_heads is not None and q.shape[1] != num_heads:
        raise ValueError(f"q.shape[1]={q.shape[1]} heads does not match the module's num_heads={num_heads}")
    if head_dim is not None and q.shape[2] != head_dim:
        raise ValueError(f"q.shape[2]={q.shape[2]} does not match the module's head_dim={head_dim}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes must be equal, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got q={q.device}, k={k.device}, v={v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[2] > 1 and t.stride(2) != 1:
            raise ValueError(
                f"{name}.stride(2)={t.stride(2)}: the head_dim axis must be contiguous (stride 1)"
            )


def check_no_grad(q, k, v) -> None:
    """dist_attn is forward-only: its staging buffers are reused by the next call, so autograd
    could not keep the tensors it would save. Refuse instead of returning wrong gradients."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        raise RuntimeError(
            "dist_attn attention is forward-only (inference): q/k/v require grad while grad mode is "
            "on; wrap the call in torch.no_grad() or torch.inference_mode()"
        )


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_bounds(cu_seqlens, *, device: torch.device, total: int) -> None:
    """Checks the device tensor ``cu_seqlens`` (shape, dtype, device) without reading its values."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens.dtype={cu_seqlens.dtype}; expected torch.int32 or torch.int64")
    if cu_seqlens.ndim != 1:
        raise ValueError(f"cu_seqlens.ndim={cu_seqlens.ndim} (shape {tuple(cu_seqlens.shape)}); expected 1")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries; expected at least 2 (0 and {total})")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens.device={cu_seqlens.device} differs from q.device={device}")


def host_bounds(cu_seqlens: torch.Tensor, cu_seqlens_host: Sequence[int] | None, *, total: int,
                max_seqlen, total_desc: str | None = None) -> tuple[int, ...]:
    """Validates the segment bounds and returns them as host ints.

    When ``cu_seqlens_host`` is given it is trusted to equal ``cu_seqlens`` (no device read, so no
    host sync); otherwise ``cu_seqlens`` is read once with ``tolist()``.

    Rules: starts at 0, non-decreasing, ends at ``total``; ``max_seqlen`` is a positive int not
    below the longest segment.
    """
    if cu_seqlens_host is not None:
        if not isinstance(cu_seqlens_host, (list, tuple)):
            raise TypeError(
                f"cu_seqlens_host must be a list or tuple of ints, got {type(cu_seqlens_host).__name__}"
            )
        if len(cu_seqlens_host) != cu_seqlens.numel():
            raise ValueError(
                f"len(cu_seqlens_host)={len(cu_seqlens_host)} differs from cu_seqlens.numel()={cu_seqlens.numel()}"
            )
        bad = [x for x in cu_seqlens_host if not _is_int(x)]
        if bad:
            raise TypeError(f"cu_seqlens_host must hold Python ints, found {bad[0]!r} ({type(bad[0]).__name__})")
        bounds = tuple(cu_seqlens_host)
        src = "cu_seqlens_host"
    else:
        bounds = tuple(int(x) for x in cu_seqlens.tolist())  # one device-to-host read
        src = "cu_seqlens"
    if bounds[0] != 0:
        raise ValueError(f"{src}[0]={bounds[0]}; segment bounds must start at 0")
    for i in range(1, len(bounds)):
        if bounds[i] < bounds[i - 1]:
            raise ValueError(
                f"{src}[{i}]={bounds[i]} < {src}[{i - 1}]={bounds[i - 1]}; bounds must be non-decreasing"
            )
    if bounds[-1] != total:
        raise ValueError(
            f"{src}[-1]={bounds[-1]}; bounds must end at the global token count "
            f"{total_desc or total}"
        )
    if not _is_int(max_seqlen):
        raise TypeError(f"max_seqlen={max_seqlen!r} must be a Python int")
    segments = list(zip(bounds[:-1], bounds[1:]))
    if len(bounds) == 3 and bounds[1] == max_seqlen and 0 < max_seqlen < total:
        # Trailing padding (0, used, total): the padding rows never reach a kernel (the bridge
        # zeroes them), so they may outnumber max_seqlen (a 10-token request padded to 64).
        segments = segments[:1]
    longest = max(b - a for a, b in segments)
    if max_seqlen <= 0:
        raise ValueError(f"max_seqlen={max_seqlen} must be > 0")
    if max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen} is below the longest segment ({longest} rows in {src})")
    return bounds
