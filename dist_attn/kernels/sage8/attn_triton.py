# SPDX-License-Identifier: Apache-2.0
"""The Sage8 attention kernel in plain Triton (backend ``"sage8"``; imports triton).

One program = BM query rows of one (segment, head): INT8 Q K^T -> int32 on the tensor cores,
online softmax in exp2 with fp32 statistics, P -> FP8 e4m3 with its columns renamed into V's
"mma" key order (numerics.V_KEY_ORDERS: no shuffles to reach the wgmma's register A operand),
FP8 P V of each key block into a fresh
MMA accumulator, added into the fp32 output with one FFMA per element (``pv_accum="block"``: the
FP8 MMA keeps only ~13 bits of its sum, so a sum run inside it over the whole sequence drifts;
see benchmarks/KERNEL_NOTES.md), V's channel scales applied once to the output.
Operands come from :func:`quant.quantize` through TMA descriptors.

Triton 3.6 waits on every QK wgmma right after issuing it, so within one warpgroup the softmax and
the tensor cores take turns; BM = 64 with 4 warps lets two CTAs share an SM and overlap each
other (benchmarks/KERNEL_NOTES.md). The Gluon kernel (:mod:`attn_gluon`) overlaps them explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dist_attn.kernels.sage8 import numerics
from dist_attn.kernels.sage8.quant import Quantized, seg_bounds, seg_strides, to_fp8

__all__ = ["TritonConfig", "V_ORDER", "attention", "epilogue_lse", "exp2_ftz", "kscale_direct", "lse_args",
           "pv_block", "resident_ctas"]

_PAD = tl.constexpr(numerics.PAD)
_MAGIC_I = tl.constexpr(numerics.MAGIC_I)
_MAGIC_F = tl.constexpr(numerics.MAGIC_F)
_LOG2_PSCALE = tl.constexpr(numerics.LOG2_PSCALE)
_LN2 = tl.constexpr(math.log(2.0))
#: the order of V's keys this loop reads (numerics.V_KEY_ORDERS)
V_ORDER = "mma"


@dataclass(frozen=True)
class TritonConfig:
    """Launch parameters; the defaults are the fastest that ``benchmarks/kernels.py`` measured.

    ``num_stages=2`` with ``maxnreg=168`` lets three CTAs share an SM (72 KB of shared memory and
    168 x 128 registers each, no spills): 5% faster at 38,016 x 14 x 128 than 3 stages at 2 CTAs
    per SM (241 registers), the output bit-identical (see benchmarks/KERNEL_NOTES.md).

    ``pv_accum``: "block" adds each key block's P V into fp32 registers; "running" accumulates the
    whole row inside the MMA (kept to measure against: 0.37 rel-L2 at 38k rows
    when V has channel means).

    ``kscale_load``: how each key block's INT8 scale is read: "direct" (one load per block, see
    :func:`_times_kscale`) or "pipelined" (a plain ``tl.load``, which Triton turns into a cp.async ring;
    kept to measure against). The interpreter always takes the plain load.
    """

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = 168
    pv_accum: Literal["block", "running"] = "block"
    kscale_load: Literal["direct", "pipelined"] = "direct"

    def __post_init__(self):
        # refused when the config is made, not at the first launch
        pv_block(self.pv_accum)
        kscale_direct(self.kscale_load)


@triton.jit
def exp2_ftz(x, FAST: tl.constexpr):
    if FAST:
        # tl.math.exp2 lowers to the non-ftz ex2, which ptxas wraps in a compare and two predicated
        # multiplies for denormal results; .ftz is a single MUFU.EX2. Underflow to 0 is harmless.
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.math.exp2(x)


@triton.jit
def _times_kscale(like, ptr, DIRECT: tl.constexpr):
    """``like`` ([BM]) times the key block's INT8 scale at ``ptr``.

    A plain ``tl.load`` here is software-pipelined by Triton into a cp.async ring with its own
    shared-memory slot and barrier waits: 37 of the steady loop's 577 SASS instructions per block.
    ``DIRECT``: one plain load (the same 4 bytes for every thread, an L1 hit after the first), which
    ptxas issues just before the QK MMA whose wait hides its latency (553 instructions)."""
    if DIRECT:
        rs = like * tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=f,l",
                                              [ptr + tl.zeros_like(like).to(tl.int32)], dtype=tl.float32,
                                              is_pure=True, pack=1)
    else:
        rs = like * tl.load(ptr)
    return rs


@triton.jit
def _mma_key_columns(p, BN: tl.constexpr):
    """P's columns in V's "mma" key order (numerics.V_KEY_ORDERS): column 16 h + 8 j + 2 t + e of
    each 32 moves to 16 h + 4 t + 2 j + e. In the scores' accumulator layout that is a renaming
    inside each thread, so the layout change to the P V wgmma's A operand needs no shuffles
    (steady loop 565 SASS instructions instead of 613; 16 SHFL and 16 PRMT fewer per block)."""
    BM: tl.constexpr = p.shape[0]
    x = tl.reshape(p, [BM, BN // 32, 2, 2, 4, 2])  # [m, group, h, j, t, e]
    x = tl.permute(x, (0, 1, 2, 4, 3, 5))  # [m, group, h, t, j, e]
    return tl.reshape(x, [BM, BN])


@triton.jit
def _key_block(acc, l_i, m_i, q, qs, k_desc, v_desc, ks_ptr, h, R, pst, j, lim,
               D: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, FAST_EXP: tl.constexpr,
               PV_BLOCK: tl.constexpr, INTERP: tl.constexpr, KS_DIRECT: tl.constexpr):
    """Key block j of the segment starting at padded row pst: s = Q K^T (int32) -> online softmax
    -> acc = acc * alpha + P8 @ V8 (fp32)."""
    k = k_desc.load([h * R + pst + j * BN, 0])   # Ki8 viewed as [H * R, D]
    vt = v_desc.load([h * D, pst + j * BN])      # Vt8 viewed as [H * D, R]
    s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)  # [BM, BN] int32, exact
    rs = _times_kscale(qs, ks_ptr + j, KS_DIRECT)  # [BM]: q scale * k scale * softmax_scale * log2(e)
    # the compiler folds this add into the wgmma accumulator init (MOV 0x4b400000 in SASS)
    f = (s + _MAGIC_I).to(tl.float32, bitcast=True)  # 12582912 + s, exactly
    if MASK:
        # the last, partial key block: padding keys are zeros in Ki8/Vt8 but must get p = 0
        f = tl.where((tl.arange(0, BN) < lim)[None, :], f, float("-inf"))
    m_new = tl.maximum(m_i, (tl.max(f, axis=1) - _MAGIC_F) * rs)
    # one FFMA per score: f * rs - (12582912 * rs + m_new - LOG2_PSCALE)
    bias = _MAGIC_F * rs + m_new - _LOG2_PSCALE
    p = exp2_ftz(f * rs[:, None] - bias[:, None], FAST_EXP)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p8 = to_fp8(_mma_key_columns(p, BN), INTERP)  # V's keys are stored in the same order
    if PV_BLOCK:
        # a fresh MMA accumulator per block (use_acc=False: no zero fill), promoted with one FFMA
        acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
    else:
        acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def epilogue_lse(m_i, l_i, Q, Ksum, seg, h, lo, L, rows, offs_d, sqb, sqt, sqh, H, qk_scale,
                 D: tl.constexpr):
    """Natural-log LSE of softmax_scale * q.k per row (K smoothing undone: + scale * q.mean)."""
    valid = rows < L
    seg64 = seg.to(tl.int64)
    mean = tl.load(Ksum + (seg64 * H + h) * D + offs_d) / tl.maximum(L, 1).to(tl.float32)
    qp = Q + seg64 * sqb + h.to(tl.int64) * sqh + (lo + rows).to(tl.int64)[:, None] * sqt + offs_d[None, :]
    q = tl.load(qp, mask=valid[:, None], other=0.0).to(tl.float32)
    shift = tl.sum(q * mean[None, :], axis=1) * qk_scale
    return (m_i + tl.math.log2(l_i) - _LOG2_PSCALE + shift) * _LN2


@triton.jit
def _attn_kernel(q_desc, k_desc, v_desc, Qs, Ks, Vscale, Out, Q, Ksum, Lse, cu, used, T, H, R,
                 sob, sot, soh, sqb, sqt, sqh, slb, slh, qk_scale,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DENSE: tl.constexpr,
                 WITH_LSE: tl.constexpr, FAST_EXP: tl.constexpr, PV_BLOCK: tl.constexpr,
                 INTERP: tl.constexpr, KS_DIRECT: tl.constexpr):
    mb = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    lo, L, pst = seg_bounds(cu, seg, used, T, DENSE)
    if mb * BM >= L:
        return
    pst = tl.multiple_of(pst, _PAD)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BM)
    qrow = pst + mb * BM
    q = q_desc.load([h * R + qrow, 0])
    qs = tl.load(Qs + h.to(tl.int64) * R + qrow + offs_m)
    ks_ptr = Ks + h.to(tl.int64) * (R // BN) + pst // BN
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    n_full = L // BN
    lim = L - n_full * BN
    # steady state: full key blocks, no per-element mask
    for j in range(0, n_full):
        acc, l_i, m_i = _key_block(acc, l_i, m_i, q, qs, k_desc, v_desc, ks_ptr, h, R, pst, j, BN,
                                   D, BN, False, FAST_EXP, PV_BLOCK, INTERP, KS_DIRECT)
    if lim > 0:
        acc, l_i, m_i = _key_block(acc, l_i, m_i, q, qs, k_desc, v_desc, ks_ptr, h, R, pst, n_full, lim,
                                   D, BN, True, FAST_EXP, PV_BLOCK, INTERP, KS_DIRECT)
    vsc = tl.load(Vscale + (seg.to(tl.int64) * H + h) * D + offs_d)
    o = acc * (1.0 / l_i)[:, None] * vsc[None, :]
    rows = mb * BM + offs_m
    optr = (Out + seg.to(tl.int64) * sob + h.to(tl.int64) * soh + (lo + rows).to(tl.int64)[:, None] * sot
            + offs_d[None, :])
    tl.store(optr, o.to(Out.dtype.element_ty), mask=(rows < L)[:, None])
    if WITH_LSE:
        lse = epilogue_lse(m_i, l_i, Q, Ksum, seg, h, lo, L, rows, offs_d, sqb, sqt, sqh, H, qk_scale, D)
        tl.store(Lse + seg.to(tl.int64) * slb + h.to(tl.int64) * slh + lo + rows, lse, mask=rows < L)


#: shared memory the driver keeps back for every CTA (cudaDevAttrReservedSharedMemoryPerBlock, sm_80+)
RESERVED_SMEM_PER_CTA = 1024


def resident_ctas(cfg: TritonConfig, head_dim: int, *, regs_per_sm: int, smem_per_sm: int,
                  threads_per_sm: int) -> int | None:
    """How many programs of :func:`attention` one SM holds at once; None when ``cfg`` sets no
    register cap (the count then depends on what ptxas allocates).

    Registers: ``maxnreg`` per thread, allocated per warp in units of 256. Shared memory: the
    8-bit Q tile and ``num_stages`` K and V tiles, plus the driver's reserve. At the defaults and
    head_dim 128 on sm_90 (64K registers, 228 KB): 21,504 registers and 73 KB a program, so 3
    (tests/core/test_kernel_waves_gpu.py checks this against the compiled kernel)."""
    if cfg.maxnreg is None:
        return None
    regs = -(-cfg.maxnreg * 32 // 256) * 256 * cfg.num_warps
    smem = (cfg.block_m * head_dim + cfg.num_stages * 2 * cfg.block_n * head_dim
            + RESERVED_SMEM_PER_CTA)
    return min(regs_per_sm // regs, smem_per_sm // smem, threads_per_sm // (32 * cfg.num_warps))


def lse_args(lse: torch.Tensor | None, dense: bool, dummy: torch.Tensor):
    """(pointer, (segment stride, head stride)) of a [B, H, T] LSE (varlen: [1, H, T]); a dummy
    pointer when no LSE is asked for."""
    if lse is None:
        return dummy, (0, 0)
    return lse, ((lse.stride(0) if dense else 0), lse.stride(1))


def attention(qz: Quantized, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
              softmax_scale: float, cfg: TritonConfig, *, interpret: bool = False):
    """Launches the attention kernel on ``qz``; writes ``out`` ([B, T, H, D] view) and, when given,
    ``lse`` ([B, H, T] fp32, natural log). ``q`` is the caller's query (read only for the LSE's
    smoothing correction). Returns the compiled kernel (its registers, shared memory and SASS are
    what the benchmarks report)."""
    lay = qz.layout
    BM, BN = cfg.block_m, cfg.block_n
    assert numerics.PAD % BM == 0 and BN == qz.kblock and numerics.PAD % BN == 0 and qz.v_order == V_ORDER
    H, R, D = qz.qi8.shape
    q_desc = TensorDescriptor.from_tensor(qz.qi8.view(H * R, D), [BM, D])
    k_desc = TensorDescriptor.from_tensor(qz.ki8.view(H * R, D), [BN, D])
    v_desc = TensorDescriptor.from_tensor(qz.vt8.view(H * D, R), [D, BN])
    so = seg_strides(out, lay.dense)
    sq = seg_strides(q, lay.dense)
    lse_arg, sl = lse_args(lse, lay.dense, qz.qscale)
    cu = qz.qscale if lay.dense else lay.cu
    extra = {} if cfg.maxnreg is None or interpret else {"maxnreg": cfg.maxnreg}
    return _attn_kernel[(triton.cdiv(lay.max_seqlen, BM), lay.nseg, H)](
        q_desc, k_desc, v_desc, qz.qscale, qz.kscale, qz.vscale, out, q, qz.ksum, lse_arg, cu,
        lay.used, lay.total, H, R, *so, *sq, *sl, softmax_scale * math.log2(math.e),
        D=D, BM=BM, BN=BN, DENSE=lay.dense, WITH_LSE=lse is not None, FAST_EXP=not interpret,
        PV_BLOCK=pv_block(cfg.pv_accum), INTERP=interpret, KS_DIRECT=kscale_direct(cfg.kscale_load) and not interpret,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)


def pv_block(pv_accum: str) -> bool:
    """Whether ``pv_accum`` (a launch config's field) is the two-level "block" accumulation."""
    if pv_accum not in ("block", "running"):
        raise ValueError(f"pv_accum={pv_accum!r} is not one of 'block', 'running'")
    return pv_accum == "block"


def kscale_direct(kscale_load: str) -> bool:
    """Whether ``kscale_load`` (a launch config's field) is the "direct" load of :func:`_times_kscale`."""
    if kscale_load not in ("direct", "pipelined"):
        raise ValueError(f"kscale_load={kscale_load!r} is not one of 'direct', 'pipelined'")
    return kscale_load == "direct"
