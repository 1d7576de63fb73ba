"""SwiGLU and the FP8 row quantization of its output in one pass (Triton; importing this module
imports triton).

A SwiGLU feed-forward with FP8 linears runs ``h = x W_in^T`` (``[M, 2I]``), ``y = h[:, :I] *
silu(h[:, I:])`` (``[M, I]``, bf16) and then quantizes ``y`` per row for the down projection
(:func:`dist_attn.fp8_linear.quantize_rows_e4m3`). Compiled, inductor fuses the two into one
looped reduction that reads ``h`` twice; at H3's ``I = 10,752`` it took 1.58 ms of a 26 ms block
rest at 37,980 rows on an H100 (``benchmarks/results/h3-fp8-profile_h100_2026-12-05.md``), where
one read of ``h`` and one write of the codes take ~0.6 ms at the H100's bandwidth. Here one
program holds one whole row in registers: ``h`` is read once.

The result is bit for bit the recipe applied to diffusers' eager SwiGLU output: ``silu`` in
float32 with libdevice's ``expf`` and an IEEE division, rounded to bf16 as torch's bf16 ``silu``
does; the product rounded to bf16; the row maximum of ``|y|`` floored at ``ACTIVATION_AMAX_FLOOR``
(as a bf16), divided by 448 and rounded to bf16; codes ``e4m3(clamp(y / scale))`` with an IEEE
division and round-to-nearest-even. The GPU test checks every code and scale against the recipe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dist_attn.fp8_linear import ACTIVATION_AMAX_FLOOR, E4M3_MAX, SWIGLU_MAX_INNER

__all__ = ["swiglu_e4m3_rows"]


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
    sub = tl.where(x < 0, -sub, sub)  # a negative value that rounds to zero stays -0, as in torch
    return tl.where(tl.abs(x) >= 0.015625, normal, sub)


@triton.jit
def _swiglu_e4m3_kernel(h_ptr, codes_ptr, scales_ptr, n_inner, stride_h, stride_codes, amax_floor,
                        BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_inner
    src = h_ptr + row * stride_h
    a = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(src + n_inner + cols, mask=mask, other=0.0).to(tl.float32)
    # libdevice's expf, as torch's CUDA silu calls (tl.exp is the faster ex2.approx form); Triton's
    # interpreter (the CPU tests) has no libdevice, and numpy's exp stands in there
    if LIBDEVICE_EXP:
        e = tl.extra.cuda.libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    silu = _round_bf16(tl.math.div_rn(g, 1.0 + e))
    y = _round_bf16(a * silu)  # the product of two bf16 values is exact in float32
    amax = tl.maximum(tl.max(tl.abs(y), axis=0), amax_floor)
    scale = _round_bf16(tl.math.div_rn(amax, FP8_MAX))
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_MAX), FP8_MAX)
    tl.store(codes_ptr + row * stride_codes + cols, _round_e4m3(q).to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + row, scale)


@torch.library.custom_op("dist_attn::swiglu_e4m3_rows", mutates_args=())
def _swiglu_op(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, two_i = h.shape
    n_inner = two_i // 2
    codes = torch.empty(m, n_inner, device=h.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, 1, device=h.device, dtype=torch.float32)
    floor = torch.tensor(ACTIVATION_AMAX_FLOOR, dtype=h.dtype).item()  # the floor as h's dtype
    block = triton.next_power_of_2(n_inner)
    _swiglu_e4m3_kernel[(m,)](h, codes, scales, n_inner, h.stride(0), codes.stride(0), floor,
                              BLOCK=block, FP8_MAX=E4M3_MAX, LIBDEVICE_EXP=h.is_cuda,
                              num_warps=16 if block >= 8192 else 4)
    return codes, scales


@_swiglu_op.register_fake
def _(h):
    m, two_i = h.shape
    return (h.new_empty(m, two_i // 2, dtype=torch.float8_e4m3fn),
            h.new_empty(m, 1, dtype=torch.float32))


def swiglu_e4m3_rows(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = h[..., :I] * silu(h[..., I:])`` quantized per row to e4m3, in one pass.

    Args:
        h: ``[..., 2I]`` bfloat16 (the SwiGLU projection's output; its last dim contiguous),
            ``I <= SWIGLU_MAX_INNER``. Not modified.

    Returns:
        ``codes [M, I]`` float8_e4m3fn and ``scales [M, 1]`` float32 with ``M = h[..., 0].numel()``,
        equal to ``quantize_rows_e4m3(y, amax_floor=ACTIVATION_AMAX_FLOOR)`` of diffusers' eager
        bf16 SwiGLU output ``y``.

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
