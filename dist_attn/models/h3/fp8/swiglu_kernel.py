# SPDX-License-Identifier: Apache-2.0
"""SwiGLU and the FP8 row quantization of its output in one pass (Triton; importing this module
imports triton).

A SwiGLU feed-forward with FP8 linears runs ``h = x W_in^T`` (``[M, 2I]``), ``y = h[:, :I] *
silu(h[:, I:])`` (``[M, I]``, bf16) and then quantizes ``y`` per row for the down projection
(:func:`dist_attn.models.h3.fp8.linear.quantize_rows_e4m3`). Compiled, inductor fuses the two into
one looped reduction that reads ``h`` twice. Here one program holds a whole row in registers: ``h``
is read once (timed against inductor by ``benchmarks/dev/swiglu_probe.py``; see
benchmarks/KERNEL_NOTES.md).

The steps are the recipe's, in its order and with its roundings: ``silu`` in float32 rounded to
bf16, the product rounded to bf16 (diffusers' eager bf16 SwiGLU), the row maximum of ``|y|``
floored at ``ACTIVATION_AMAX_FLOOR``, divided by 448 and rounded to bf16 (the scale), codes
``e4m3(clamp(y / scale))`` rounded to nearest even. On the GPU the exponential and the division
are the fast hardware forms (``ex2.approx``, ``div.full``), as in inductor's own fused kernel, so a
code may differ by one e4m3 step from torch's eager path where ``silu`` lands within a few ulps
of a bf16 rounding boundary (tests/integrations/test_fp8_gpu.py bounds how often); the division
by the scale is made exact. A NaN or an inf gives what the recipe gives: a NaN makes the row's
scale and every code NaN; an inf makes the scale inf, its own code NaN and the others 0. Under Triton's
interpreter (the CPU tests) exp and division are exact and the casts, which truncate there, are
done on the bits: the output is then the recipe bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dist_attn.kernels._op_support import forward_only
from dist_attn.models.h3.fp8.numerics import ACTIVATION_AMAX_FLOOR, E4M3_MAX, SWIGLU_MAX_INNER

__all__ = ["NUM_WARPS", "swiglu_e4m3_rows"]


@triton.jit
def _round_bf16(x):
    """float32 -> the nearest bfloat16 (ties to even), kept in float32. By the bits, because
    Triton's interpreter truncates a bf16 cast whatever rounding it is asked for."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _round_e4m3(x):
    """float32 in [-448, 448] -> the nearest e4m3 value (ties to even), kept in float32, so that
    the cast after it is exact whatever its rounding (the interpreter's truncates). Normal e4m3
    values (|x| >= 2^-6) keep 3 mantissa bits; below, the subnormal grid is 2^-9."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds |v| < 2^22 to an integer, ties to even
    sub = ((tl.abs(x) * 512.0 + magic) - magic) * 0.001953125  # 2^9 and 2^-9: exact scalings
    # x's sign bit on the result: -0 and a negative value that rounds to zero stay -0, as in torch
    sub = (sub.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) >= 0.015625, normal, sub)


@triton.jit
def _bf16(x, INTERP: tl.constexpr):
    """float32 -> the nearest bfloat16, kept in float32 (the hardware cast; on the bits under the
    interpreter)."""
    if INTERP:
        return _round_bf16(x)
    return x.to(tl.bfloat16).to(tl.float32)


@triton.jit
def _quantize_row(y, amax_floor, FP8_MAX: tl.constexpr, INTERP: tl.constexpr):
    """The recipe's row quantization of ``y`` (float32 holding bf16 values, one row): returns
    (codes as float32 e4m3 values, to cast; the row's scale). The amax is floored, a NaN in the
    row makes the scale NaN, the scale is ``bf16(amax / FP8_MAX)``, the division by it is exact."""
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor)  # tl.max skips NaN: put it back
    amax = tl.where(tl.sum((y != y).to(tl.int32), axis=0) > 0, float("nan"), amax)
    scale = _bf16(tl.math.div_rn(amax, FP8_MAX), INTERP)  # once a row: the IEEE division
    if INTERP:
        q = y / scale
    else:
        # y / scale correctly rounded (the GPU's "/" is a reciprocal times y, off by an ulp at
        # times, which moves e4m3 ties: bf16 over bf16 lands on one for ~3e-3 of the codes): a
        # correctly rounded reciprocal once a row, then one Newton step on the residual
        inv = tl.math.div_rn(1.0, scale)
        q0 = y * inv
        q = tl.where(scale < float("inf"), tl.fma(tl.fma(-q0, scale, y), inv, q0), q0)
    q = tl.minimum(tl.maximum(q, -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                   propagate_nan=tl.PropagateNan.ALL)  # NaN stays NaN, as in the recipe
    if INTERP:
        q = _round_e4m3(q)
    return q, scale


@triton.jit
def _swiglu_e4m3_kernel(h_ptr, codes_ptr, scales_ptr, n_inner, stride_h, stride_codes, amax_floor,
                        BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_inner
    src = h_ptr + row * stride_h
    a = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(src + n_inner + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _bf16(g / (1.0 + tl.exp(-g)), INTERP)
    y = _bf16(a * silu, INTERP)  # the product of two bf16 values is exact in float32
    q, scale = _quantize_row(y, amax_floor, FP8_MAX, INTERP)
    tl.store(codes_ptr + row * stride_codes + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + row, scale)


#: the recipe's amax floor as a bf16 value (h is bf16), computed once, not per call
_FLOOR_BF16 = torch.tensor(ACTIVATION_AMAX_FLOOR, dtype=torch.bfloat16).item()
#: warps of one program (one row) at H3's 37,980 x 14,336: 8, 16 and 32 timed equal, 0.871 ms
#: (benchmarks/dev/swiglu_probe.py)
NUM_WARPS = 16


@torch.library.custom_op("dist_attn::swiglu_e4m3_rows", mutates_args=())
def _swiglu_op(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, two_i = h.shape
    n_inner = two_i // 2
    codes = torch.empty(m, n_inner, device=h.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, 1, device=h.device, dtype=torch.float32)
    block = triton.next_power_of_2(n_inner)
    with torch.cuda.device(h.device) if h.is_cuda else contextlib.nullcontext():
        _swiglu_e4m3_kernel[(m,)](h, codes, scales, n_inner, h.stride(0), codes.stride(0), _FLOOR_BF16,
                                  BLOCK=block, FP8_MAX=E4M3_MAX, INTERP=not h.is_cuda,
                                  num_warps=NUM_WARPS if block >= 8192 else 4)
    return codes, scales


@_swiglu_op.register_fake
def _(h):
    m, two_i = h.shape
    return (h.new_empty(m, two_i // 2, dtype=torch.float8_e4m3fn),
            h.new_empty(m, 1, dtype=torch.float32))


forward_only(_swiglu_op, "quantize_linears(fuse_swiglu=False)")


def swiglu_e4m3_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = h[..., :I] * silu(h[..., I:])`` quantized per row to e4m3, in one pass.

    Args:
        h: ``[..., 2I]`` bfloat16 (the SwiGLU projection's output; its last dim contiguous),
            ``I <= SWIGLU_MAX_INNER``. Not modified.

    Returns:
        ``codes [M, I]`` float8_e4m3fn and ``scales [M, 1]`` float32 with ``M = h[..., 0].numel()``:
        ``quantize_rows_e4m3(y, amax_floor=ACTIVATION_AMAX_FLOOR)`` of diffusers' eager bf16
        SwiGLU output ``y``, up to the fast exponential and division on the GPU (module doc).

    Raises:
        ValueError: ``h`` is not bfloat16, its last dim is odd or over ``2 * SWIGLU_MAX_INNER``, or not
            contiguous.
    """
    if h.dtype != torch.bfloat16:
        raise ValueError(f"h.dtype={h.dtype}: the fused SwiGLU quantization takes bfloat16")
    two_i = h.shape[-1]
    if two_i % 2 or two_i // 2 > SWIGLU_MAX_INNER:
        raise ValueError(f"h.shape[-1]={two_i} must be even and at most 2 * SWIGLU_MAX_INNER = "
                         f"{2 * SWIGLU_MAX_INNER} (the gate and the value halves of one SwiGLU row)")
    if h.stride(-1) != 1:
        raise ValueError(f"h.stride(-1)={h.stride(-1)}: the last dim must be contiguous")
    return _swiglu_op(h.reshape(-1, two_i))
