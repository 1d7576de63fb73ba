# SPDX-License-Identifier: Apache-2.0
"""A pre-norm AdaLN input and its FP8 row quantization in one pass (Triton on the GPU; importing
this module imports triton).

Before each of its two GEMM groups (q/k/v, then the FFN's projection) an H3 block computes
``y = RMSNorm(x) * (1 + scale[idx]) + shift[idx]`` over its rows, and with FP8 linears the recipe
then quantizes ``y`` per row (:func:`dist_attn.models.h3.fp8.linear.quantize_rows_e4m3`). Compiled,
inductor fuses the two into one looped reduction that reads ``x`` three times; here one program
holds a row in registers: one read of ``x`` and one write of the codes (timed against inductor by
``benchmarks/dev/adaln_quant_probe.py``; see benchmarks/KERNEL_NOTES.md).

Before the FFN's norm the block first takes its attention residual step,
``h = x + gate[idx] * attn_output``; compiled, inductor folded that sum into the same reduction,
which a custom op would prevent (a separate pass over ``h``: write it, read it back).
:func:`residual_adaln_e4m3_rows` does the step in the same pass, rounded as diffusers' bf16 ops
round it (after the product and after the sum), and writes ``h`` beside the codes.

Arithmetic: float32 from the inputs (the norm, its weight, ``1 + scale``, the product and the
shift), one rounding of ``y`` to bfloat16 (the dtype the linear's input has), then the recipe on
that bf16 row: ``amax`` floored at ``ACTIVATION_AMAX_FLOOR``, ``scale = bf16(amax / 448)``, codes
``e4m3(clamp(y / scale))`` with the division exact (as in
:mod:`dist_attn.models.h3.fp8.swiglu_kernel`). diffusers' eager path rounds to bf16 after the norm,
after ``1 + scale``, after the product and after the sum; inductor's compiled path keeps float32
between them, as here. On the GPU the row's sum runs in another order and ``rsqrt`` is the
hardware's: a float32 ulp or two that rarely moves the bf16 rounding (a code one e4m3 step off;
tests/integrations/test_fp8_gpu.py bounds how often). The kernel is compiled without floating-point
contraction (``enable_fp_fusion=False``): with it, LLVM narrowed the residual step's float32 ops on
bf16 values to bf16 ones (exact so far) and the backend then fused them into one ``fma.rn.bf16x2``,
which rounds ``x + gate * update`` once where diffusers' ops round twice (one bf16 step off on a
GPU; the PTX test in tests/core/test_kernel_adaln_fp8.py checks that no contracted FMA is left).
Under Triton's interpreter (CPU tests) the roundings are done on the bits and the kernel is
:func:`adaln_e4m3_rows_reference` bit for bit on finite rows (a row with a NaN or an inf has a NaN
scale either way; its codes are NaN in the reference and on the GPU, numbers under the interpreter,
whose fp8 cast has no NaN).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dist_attn.kernels._op_support import forward_only, launchable
from dist_attn.models.h3.fp8.linear import quantize_rows_e4m3
from dist_attn.models.h3.fp8.numerics import ACTIVATION_AMAX_FLOOR, ADALN_MAX_HIDDEN, E4M3_MAX
from dist_attn.models.h3.fp8.swiglu_kernel import _FLOOR_BF16, _bf16, _quantize_row

__all__ = ["adaln_e4m3_rows", "adaln_e4m3_rows_reference", "residual_adaln_e4m3_rows",
           "residual_adaln_e4m3_rows_reference"]

#: warps of one program (one row) at H3's 5,376: 8 read a row in 0.304 ms at 38,016 rows on an
#: H100, faster than 16 (benchmarks/dev/adaln_quant_probe.py)
NUM_WARPS = 8


@triton.jit
def _adaln_e4m3_kernel(x_ptr, g_ptr, u_ptr, h_ptr, w_ptr, sc_ptr, sh_ptr, idx_ptr, codes_ptr, scales_ptr,
                       K, seq, stride_x, stride_g, stride_u, stride_h, stride_sc, stride_sh, stride_codes,
                       eps, amax_floor, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
                       FP8_MAX: tl.constexpr, INTERP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < K
    t = tl.load(idx_ptr + row % seq).to(tl.int64)  # the row's (timestep, modality) entry
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:  # x + gate[t] * update, rounded to bf16 after the product and after the sum
        g = tl.load(g_ptr + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        x = _bf16(x + _bf16(g * u, INTERP), INTERP)
        tl.store(h_ptr + row * stride_h + cols, x.to(tl.bfloat16), mask=mask)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    sc = tl.load(sc_ptr + t * stride_sc + cols, mask=mask, other=0.0).to(tl.float32)
    sh = tl.load(sh_ptr + t * stride_sh + cols, mask=mask, other=0.0).to(tl.float32)
    y = _bf16(y * (1.0 + sc) + sh, INTERP)  # the linear's bf16 input
    q, scale = _quantize_row(y, amax_floor, FP8_MAX, INTERP)
    tl.store(codes_ptr + row * stride_codes + cols, q.to(tl.float8e4nv), mask=mask)
    tl.store(scales_ptr + row, scale)


def adaln_e4m3_rows_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                              scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch (float32, one bf16 rounding; see the module docstring).
    Arguments as :func:`adaln_e4m3_rows` with ``x`` 2-D ``[M, K]``; ``M`` a multiple of
    ``index.numel()``. Returns ``codes [M, K]`` and ``scales [M, 1]``."""
    m, k = x.shape
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(torch.float32)
    rows = _table_rows(index, m)
    y = y * (1.0 + scale.index_select(0, rows).to(torch.float32)) + shift.index_select(0, rows).to(torch.float32)
    return quantize_rows_e4m3(y.to(torch.bfloat16), amax_floor=ACTIVATION_AMAX_FLOOR)


def residual_adaln_e4m3_rows_reference(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                                       weight: torch.Tensor | None, eps: float, scale: torch.Tensor,
                                       shift: torch.Tensor, index: torch.Tensor
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`residual_adaln_e4m3_rows` in torch: ``h = x + gate[rows] * update`` in bf16 ops (as
    diffusers' block computes it), then :func:`adaln_e4m3_rows_reference` of ``h``. 2-D
    arguments; returns ``(h, codes, scales)``."""
    h = x + gate.index_select(0, _table_rows(index, x.shape[0])) * update
    return (h, *adaln_e4m3_rows_reference(h, weight, eps, scale, shift, index))


def _table_rows(index: torch.Tensor, m: int) -> torch.Tensor:
    """The table row of each of ``m`` rows of x (``index`` repeated over x's leading dims)."""
    return index.repeat(m // index.numel()) if index.numel() else index


def _launch(x, gate, update, weight, eps, scale, shift, index):
    """Runs the kernel on 2-D ``x [M, K]`` (and ``update [M, K]`` when ``gate`` is given);
    returns ``(h or None, codes, scales)``."""
    m, k = x.shape
    codes = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scales = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if gate is not None else None
    res = (gate, update, h) if gate is not None else (x, x, x)  # unread without HAS_RES
    block = triton.next_power_of_2(k)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _adaln_e4m3_kernel[(m,)](x, *res, weight if weight is not None else x, scale, shift, index, codes,
                                 scales, k, index.numel(), x.stride(0), res[0].stride(0), res[1].stride(0),
                                 res[2].stride(0), scale.stride(0), shift.stride(0), codes.stride(0),
                                 eps, _FLOOR_BF16, BLOCK=block, HAS_RES=gate is not None,
                                 HAS_W=weight is not None, FP8_MAX=E4M3_MAX, INTERP=not x.is_cuda,
                                 num_warps=NUM_WARPS if block <= 8192 else 16, enable_fp_fusion=False)
    return h, codes, scales


@torch.library.custom_op("dist_attn::adaln_e4m3_rows", mutates_args=())
def _adaln_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor,
              shift: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not launchable(x):  # the CPU without Triton's interpreter: the same arithmetic in torch
        return adaln_e4m3_rows_reference(x, weight, eps, scale, shift, index)
    _, codes, scales = _launch(x, None, None, weight, eps, scale, shift, index)
    return codes, scales


@_adaln_op.register_fake
def _(x, weight, eps, scale, shift, index):
    m, k = x.shape
    return x.new_empty(m, k, dtype=torch.float8_e4m3fn), x.new_empty(m, 1, dtype=torch.float32)


@torch.library.custom_op("dist_attn::residual_adaln_e4m3_rows", mutates_args=())
def _residual_adaln_op(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor, weight: torch.Tensor | None,
                       eps: float, scale: torch.Tensor, shift: torch.Tensor, index: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if not launchable(x):
        return residual_adaln_e4m3_rows_reference(x, gate, update, weight, eps, scale, shift, index)
    return _launch(x, gate, update, weight, eps, scale, shift, index)


@_residual_adaln_op.register_fake
def _(x, gate, update, weight, eps, scale, shift, index):
    m, k = x.shape
    return (x.new_empty(m, k), x.new_empty(m, k, dtype=torch.float8_e4m3fn),
            x.new_empty(m, 1, dtype=torch.float32))


forward_only(_adaln_op, "quantize_linears(fuse_adaln=False)")
forward_only(_residual_adaln_op, "quantize_linears(fuse_adaln=False)")


def adaln_e4m3_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor,
                    shift: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm(x) * (1 + scale[index]) + shift[index]``, quantized per row to e4m3, in one pass.

    Args:
        x: ``[..., S, K]`` bfloat16 (a block's hidden states), last dim contiguous,
            ``K <= ADALN_MAX_HIDDEN``. Not modified.
        weight: the norm's ``[K]`` weight (contiguous), or None (no affine weight).
        eps: the norm's epsilon (> 0).
        scale, shift: ``[T, K]`` tables (rows of the block's AdaLN modulation; strided rows are
            fine), last dim contiguous, on x's device.
        index: ``[S]`` integers in ``[0, T)``: the table row of each sequence position (the same
            for every leading index of ``x``).

    Returns:
        ``codes [..., S, K]`` float8_e4m3fn and ``scales [..., S, 1]`` float32 (the recipe of
        :mod:`dist_attn.models.h3.fp8.linear` applied to ``y`` rounded once to bf16).

    Raises:
        ValueError: a dtype, shape, stride or ``eps`` outside the rules above. An index outside
            ``[0, T)`` is not checked (it would cost a device sync): the caller's tables decide.
    """
    _check(x, weight, eps, scale, shift, index)
    k = x.shape[-1]
    codes, scales = _adaln_op(x.reshape(-1, k), weight, float(eps), scale, shift, index.contiguous())
    return codes.view(x.shape), scales.view(*x.shape[:-1], 1)


def residual_adaln_e4m3_rows(x: torch.Tensor, gate: torch.Tensor, update: torch.Tensor,
                             weight: torch.Tensor | None, eps: float, scale: torch.Tensor,
                             shift: torch.Tensor, index: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The residual step before a block's second norm and that norm's quantized AdaLN input, in
    one pass: ``h = x + gate[index] * update``, then :func:`adaln_e4m3_rows` of ``h``.

    ``h`` is rounded as diffusers' bf16 ops round it (to bf16 after the product, and after the
    sum), so the residual stream is theirs bit for bit; the pass reads ``x`` and ``update`` once
    and writes ``h`` and the codes, where separately the sum is written and read back.

    Args:
        x: ``[..., S, K]`` bfloat16, the residual stream. Not modified.
        gate: ``[T, K]`` bfloat16 table (the block's attention gate), last dim contiguous, rows
            as ``scale``'s.
        update: x's shape, bfloat16, last dim contiguous (the attention's output).
        weight, eps, scale, shift, index: as :func:`adaln_e4m3_rows`.

    Returns:
        ``h`` (x's shape, bfloat16), ``codes`` and ``scales`` of ``RMSNorm(h) * (1 + scale[index])
        + shift[index]`` as :func:`adaln_e4m3_rows` returns them.

    Raises:
        ValueError: as :func:`adaln_e4m3_rows`, and for a ``gate`` or ``update`` outside the rules
            above.
    """
    _check(x, weight, eps, scale, shift, index)
    k = x.shape[-1]
    if gate.dtype != torch.bfloat16 or tuple(gate.shape) != tuple(scale.shape) or gate.stride(1) != 1:
        raise ValueError(f"gate has shape {tuple(gate.shape)}, dtype {gate.dtype} and strides "
                         f"{gate.stride()}; it must be bfloat16 [{scale.shape[0]}, {k}] (scale's rows) "
                         "with its last dim contiguous")
    if update.dtype != torch.bfloat16 or update.shape != x.shape or update.stride(-1) != 1:
        raise ValueError(f"update has shape {tuple(update.shape)}, dtype {update.dtype} and strides "
                         f"{update.stride()}; it must be bfloat16 of x's shape {tuple(x.shape)} with "
                         "its last dim contiguous")
    for name, t in (("gate", gate), ("update", update)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} and x on {x.device}; they must share a device")
    h, codes, scales = _residual_adaln_op(x.reshape(-1, k), gate, update.reshape(-1, k), weight, float(eps),
                                          scale, shift, index.contiguous())
    return h.view(x.shape), codes.view(x.shape), scales.view(*x.shape[:-1], 1)


def _check(x: torch.Tensor, weight: torch.Tensor | None, eps: float, scale: torch.Tensor,
           shift: torch.Tensor, index: torch.Tensor) -> None:
    """The argument rules of :func:`adaln_e4m3_rows` (ValueError naming the broken one)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x.dtype={x.dtype}: the fused AdaLN quantization takes bfloat16")
    if x.dim() < 2 or x.shape[-1] > ADALN_MAX_HIDDEN or x.stride(-1) != 1:
        raise ValueError(f"x has shape {tuple(x.shape)} and strides {x.stride()}: it must be "
                         f"[..., S, K] with K <= {ADALN_MAX_HIDDEN} and its last dim contiguous")
    k, s = x.shape[-1], x.shape[-2]
    if weight is not None and (tuple(weight.shape) != (k,) or weight.stride(0) != 1):
        raise ValueError(f"weight has shape {tuple(weight.shape)} and strides {weight.stride()}; it "
                         f"must be ({k},) and contiguous, or None")
    for name, t in (("scale", scale), ("shift", shift)):
        if t.dim() != 2 or t.shape[1] != k or t.stride(1) != 1:
            raise ValueError(f"{name} has shape {tuple(t.shape)} and strides {t.stride()}; it must "
                             f"be [T, {k}] with its last dim contiguous")
    if scale.shape[0] != shift.shape[0]:
        raise ValueError(f"scale has {scale.shape[0]} rows and shift {shift.shape[0]}; they must "
                         "have the same rows (one per table entry)")
    for name, t in (("weight", weight), ("scale", scale), ("shift", shift), ("index", index)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} and x on {x.device}; they must share a device")
    if tuple(index.shape) != (s,) or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index has shape {tuple(index.shape)} and dtype {index.dtype}; it must be "
                         f"({s},) integers (one table row per sequence position of x)")
    if isinstance(eps, bool) or not (isinstance(eps, (int, float)) and eps > 0):
        raise ValueError(f"eps={eps!r} must be a positive number")
