# SPDX-License-Identifier: Apache-2.0
"""Input checks shared by the local bridge and the Ulysses layer.

Every check here reads only shapes, dtypes, devices and host integers, so it gives the same
verdict on every rank of an SPMD program and runs BEFORE any collective: a bad call raises on
all ranks instead of leaving some of them blocked in an all-to-all. Messages name the argument,
its value and the rule it broke.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["SUPPORTED_DTYPES", "check_qkv", "check_bounds", "host_bounds", "check_no_grad", "as_host_int",
           "check_softmax_scale", "MAX_SOFTMAX_SCALE", "check_overlap_chunks", "overlap_chunks_rule",
           "CheckedScalars", "check_scalars", "checked_scalars"]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def as_int(value) -> int | None:
    """``value`` as an int when it is an integer (a Python or numpy int, anything with
    ``__index__``) and not a bool; else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(name: str, value) -> int:
    """``value`` as an int, or ``ValueError("name=value must be a positive int")``."""
    n = as_int(value)
    if n is None or n < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return n


def check_expected_dims(num_heads, head_dim) -> None:
    """``num_heads`` and ``head_dim`` (the H and D a caller expects) are None or positive ints."""
    for name, value in (("num_heads", num_heads), ("head_dim", head_dim)):
        if value is not None:
            positive_int(name, value)


def check_qkv(q, k, v, *, num_heads: int | None = None, head_dim: int | None = None) -> None:
    """Checks q/k/v: tensors ``[T, H, D]`` or ``[B, T, H, D]`` of one shape, dtype and device,
    ``H >= 1`` and ``D >= 1``, dtype fp16/bf16/fp32, and (when given) ``H == num_heads`` and ``D == head_dim``. The last dim
    must be contiguous."""
    check_expected_dims(num_heads, head_dim)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim not in (3, 4):
            raise ValueError(
                f"{name}.ndim={t.ndim} (shape {tuple(t.shape)}); expected 3 dims [tokens, heads, "
                "head_dim] or 4 dims [batch, tokens, heads, head_dim]"
            )
    if not (q.shape == k.shape == v.shape):
        raise ValueError(
            f"q, k, v shapes must be equal, got q={tuple(q.shape)}, k={tuple(k.shape)}, v={tuple(v.shape)}"
        )
    h_axis, d_axis = q.ndim - 2, q.ndim - 1
    for axis, what in ((h_axis, "heads"), (d_axis, "head_dim")):
        if q.shape[axis] < 1:  # an empty head axis would divide by zero in the softmax scale
            raise ValueError(f"q.shape[{axis}]={q.shape[axis]} ({what}, shape {tuple(q.shape)}) "
                             "must be at least 1")
    if num_heads is not None and q.shape[h_axis] != num_heads:
        raise ValueError(f"q.shape[{h_axis}]={q.shape[h_axis]} heads does not match the module's "
                         f"num_heads={num_heads}")
    if head_dim is not None and q.shape[d_axis] != head_dim:
        raise ValueError(f"q.shape[{d_axis}]={q.shape[d_axis]} does not match the module's "
                         f"head_dim={head_dim}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes must be equal, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"q.dtype={q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got q={q.device}, k={k.device}, v={v.device}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{name}.stride(-1)={t.stride(-1)}: the head_dim axis must be contiguous (stride 1)"
            )


def check_softmax_scale_type(softmax_scale) -> None:
    """The type half of :func:`check_softmax_scale`: None, or a Python float or int (not bool).
    Alone at torch.compile's op boundary, where a scale that changes between calls is a symbolic
    float that ``math.isfinite`` cannot read; the op checks the value inside."""
    if softmax_scale is not None and (isinstance(softmax_scale, bool)
                                      or not isinstance(softmax_scale, (int, float))):
        # ValueError, as for a bad value: callers already catch this one class for the scale.
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a Python float or int (not a "
                         f"{type(softmax_scale).__name__}; pass float(x) for a numpy or tensor "
                         "scalar) or None")


#: The largest ``softmax_scale`` accepted. The logits ``scale x q.k`` are float32 in every kernel:
#: for inputs in float16's range (|x| <= 65504) at head_dim <= 256, ``|q.k| <= 1.1e12``, and with
#: the kernels' ``log2(e)`` factor a scale up to ~2e26 keeps them below float32's 3.4e38; 1e24
#: leaves a margin of 100. A scale of 1e300 is inf in float32 and turned every output into NaN.
MAX_SOFTMAX_SCALE = 1e24


def check_softmax_scale(softmax_scale) -> None:
    """Checks ``softmax_scale``: None (the caller uses ``1 / sqrt(D)``) or a number in
    ``(0, MAX_SOFTMAX_SCALE]``.

    The one owner of this rule (:func:`dist_attn.sage_varlen`, :func:`dist_attn.ulysses_attention`,
    the sage8 kernels). 0 or a negative scale turns the masked keys' ``-inf`` scores into NaN or
    +inf in an online softmax; one above :data:`MAX_SOFTMAX_SCALE` (or nan, inf) can overflow the
    float32 logits into an all-NaN output; a bool is refused although Python counts it as an int
    (``True`` is a typo, not a scale of 1).
    """
    check_softmax_scale_type(softmax_scale)
    if softmax_scale is None:
        return
    if not 0 < softmax_scale <= MAX_SOFTMAX_SCALE:  # False for nan too
        raise ValueError(f"softmax_scale={softmax_scale!r} must lie in (0, {MAX_SOFTMAX_SCALE:g}] "
                         "(None: 1/sqrt(head_dim)): a larger scale can overflow the float32 "
                         "logits scale x q.k, zero or a negative one breaks the softmax")


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


def check_valid_len_type(valid_len) -> None:
    """``valid_len`` is None, a Python int, or a one-element integer tensor on the CPU (its range
    is checked against the packed length). Reads no tensor value: under torch.compile the tensor
    is a graph input whose value is not known while tracing."""
    if isinstance(valid_len, torch.Tensor):
        if valid_len.device.type != "cpu" or valid_len.dtype not in (torch.int32, torch.int64) \
                or valid_len.numel() != 1:
            raise TypeError(
                f"valid_len=tensor(shape {tuple(valid_len.shape)}, {valid_len.dtype}, on "
                f"{valid_len.device}) must hold one int32/int64 value on the CPU (read on the host "
                "without a device sync); pass a Python int otherwise")
        return
    if valid_len is not None and not _is_int(valid_len):
        raise TypeError(f"valid_len={valid_len!r} must be a Python int (rows of the global packed "
                        "sequence that are not padding), a one-element integer CPU tensor, or None")


def host_valid_len(valid_len) -> int | None:
    """``valid_len`` (checked by :func:`check_valid_len_type`) as a Python int or None; a CPU
    tensor is read on the host."""
    check_valid_len_type(valid_len)
    if isinstance(valid_len, torch.Tensor):
        return int(valid_len.reshape(()).item())
    return valid_len


def check_op_scalars(*, valid_len, max_seqlen, num_heads, head_dim, softmax_scale,
                     overlap_chunks) -> None:
    """The scalar arguments of :func:`dist_attn.ulysses_attention`, checked before they cross
    torch.compile's custom-op boundary: the op's schema types them int or float, so it would turn
    ``True`` into ``1`` (and ``valid_len=True`` into one valid row) before the op's own checks
    see it. Eager calls check the same rules inside the call."""
    check_valid_len_type(valid_len)
    check_softmax_scale_type(softmax_scale)  # its value is checked inside the op
    check_overlap_chunks(overlap_chunks)
    check_expected_dims(num_heads, head_dim)
    if isinstance(max_seqlen, bool):
        as_host_int("max_seqlen", max_seqlen)  # raises, with the eager message


def check_bounds(cu_seqlens, *, device: torch.device) -> None:
    """Checks ``cu_seqlens`` without reading device values: None, a list/tuple of ints, or a 1-D
    int32/int64 tensor on q's device or on the CPU (a CPU tensor is read without a device sync)."""
    if cu_seqlens is None:
        return
    if isinstance(cu_seqlens, (list, tuple)):
        bad = [x for x in cu_seqlens if not _is_int(x)]
        if bad:
            raise TypeError(f"cu_seqlens must hold Python ints, found {bad[0]!r} ({type(bad[0]).__name__})")
        if len(cu_seqlens) < 2:
            raise ValueError(f"cu_seqlens has {len(cu_seqlens)} entries; expected at least 2 (0 and the total)")
        return
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be None, a list of ints or a torch.Tensor, got "
                        f"{type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens.dtype={cu_seqlens.dtype}; expected torch.int32 or torch.int64")
    if cu_seqlens.ndim != 1:
        raise ValueError(f"cu_seqlens.ndim={cu_seqlens.ndim} (shape {tuple(cu_seqlens.shape)}); expected 1")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens has {cu_seqlens.numel()} entries; expected at least 2 (0 and the total)")
    if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise ValueError(f"cu_seqlens.device={cu_seqlens.device} differs from q.device={device} "
                         "(and is not the CPU)")


def as_host_int(name: str, value, *, allow_none: bool = True) -> int | None:
    """``value`` as a Python int: ints pass, 0-d / one-element integer tensors are read (a CUDA
    tensor costs one device sync), None passes when allowed; anything else raises TypeError."""
    if value is None and allow_none:
        return None
    if _is_int(value):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        return int(value.item())
    raise TypeError(f"{name}={value!r} must be a Python int (or a one-element integer tensor)")


def host_bounds(cu_seqlens, cu_seqlens_host: Sequence[int] | None, *, total: int,
                total_desc: str | None = None) -> tuple[int, ...]:
    """Validates the segment bounds and returns them as host ints.

    Sources, first that applies: ``cu_seqlens_host`` (trusted to equal ``cu_seqlens``; no device
    read, so no host sync), a list/tuple or CPU tensor ``cu_seqlens``, a device ``cu_seqlens``
    (read once with ``tolist()``), or ``(0, total)`` when both are None (one full segment).

    Rules: starts at 0, non-decreasing, ends at ``total``.
    """
    if cu_seqlens_host is not None:
        if not isinstance(cu_seqlens_host, (list, tuple)):
            raise TypeError(
                f"cu_seqlens_host must be a list or tuple of ints, got {type(cu_seqlens_host).__name__}"
            )
        if isinstance(cu_seqlens, (list, tuple)):
            n, desc = len(cu_seqlens), f"len(cu_seqlens)={len(cu_seqlens)}"
        elif cu_seqlens is not None:
            n, desc = cu_seqlens.numel(), f"cu_seqlens.numel()={cu_seqlens.numel()}"
        else:
            n, desc = len(cu_seqlens_host), ""
        if len(cu_seqlens_host) != n:
            raise ValueError(f"len(cu_seqlens_host)={len(cu_seqlens_host)} differs from {desc}")
        bad = [x for x in cu_seqlens_host if not _is_int(x)]
        if bad:
            raise TypeError(f"cu_seqlens_host must hold Python ints, found {bad[0]!r} ({type(bad[0]).__name__})")
        if len(cu_seqlens_host) < 2:
            raise ValueError(f"cu_seqlens_host has {len(cu_seqlens_host)} entries; expected at least 2")
        bounds, src = tuple(cu_seqlens_host), "cu_seqlens_host"
    elif cu_seqlens is None:
        return (0, total)
    elif isinstance(cu_seqlens, (list, tuple)):
        bounds, src = tuple(cu_seqlens), "cu_seqlens"
    else:
        bounds, src = tuple(int(x) for x in cu_seqlens.tolist()), "cu_seqlens"  # one device read
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
    return bounds


def overlap_chunks_rule(overlap_chunks) -> str | None:
    """The broken rule if ``overlap_chunks`` is not an int >= 1 (a bool is refused), else None.
    The one owner of this rule: :func:`check_overlap_chunks` and the served config use it."""
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        return "must be an int >= 1"
    return None


def check_overlap_chunks(overlap_chunks) -> None:
    """Checks ``overlap_chunks`` (:func:`overlap_chunks_rule`; 1 = the plain path), for
    :func:`dist_attn.ulysses_attention`, :class:`dist_attn.UlyssesSageAttention` and
    ``enable_ulysses``."""
    rule = overlap_chunks_rule(overlap_chunks)
    if rule:
        raise ValueError(f"overlap_chunks={overlap_chunks!r} {rule}")


@dataclass(frozen=True)
class CheckedScalars:
    """``softmax_scale`` and ``overlap_chunks`` that met their rules: made by
    :func:`checked_scalars` at a public boundary, taken as they are by the layers inside."""

    softmax_scale: float | None
    overlap_chunks: int


def check_scalars(softmax_scale, overlap_chunks) -> None:
    """:func:`check_softmax_scale` and :func:`check_overlap_chunks`, the call's scalar rules."""
    check_softmax_scale(softmax_scale)
    check_overlap_chunks(overlap_chunks)


def checked_scalars(softmax_scale, overlap_chunks) -> CheckedScalars:
    """:func:`check_scalars`, then both held for the layers inside."""
    check_scalars(softmax_scale, overlap_chunks)
    return CheckedScalars(softmax_scale, overlap_chunks)
