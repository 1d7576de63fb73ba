"""The Sage8 attention kernel, warp-specialized, in Gluon for Hopper (imports triton).

FA3's structure on the operands of :func:`quant.quantize`:

* one CTA = 128 query rows of one (segment, head), split between two consumer warpgroups of 64
  rows each; a 1-warp producer partition loads both Q tiles once and then every key block (K as
  INT8 ``[BN, D]``, V^T as FP8 ``[D, BN]``) by TMA into a ring of ``stages`` shared-memory slots,
  signalled by mbarriers (``ready``: the TMA bytes landed; ``empty``: both consumers are done);
* inside a consumer the QK wgmma of block j and the PV wgmma of block j-1 are issued
  asynchronously before the softmax of block j runs, so the tensor cores work under the
  softmax; the second warpgroup fills the tensor cores while this one exponentiates. ``pingpong``
  makes the two warpgroups take turns issuing their wgmmas (an mbarrier pair) as FA3 does; it
  measured 6% slower here and is off by default;
* scores: INT8 x INT8 -> int32 with the accumulator initialised to 0x4B400000, so the result read
  as fp32 is 12582912 + s exactly (numerics.MAGIC_I), then one FFMA and one exp2 per score
  (``exp16``, two exponentials per ``ex2.approx.f16x2``, measured slower: ptxas splits it);
* P -> FP8 e4m3, stored to a double-buffered shared tile per warpgroup and read from there by the
  PV wgmma (B = V^T tile, K-major). ``p_smem=False`` feeds P from registers instead, but Gluon's
  layout conversion to the A-operand fragment costs ~230 byte-permute/shuffle instructions per
  block (14.7 vs 12.6 ms at h3-ref, benchmarks/KERNEL_NOTES.md);
* P V of each key block goes into a fresh MMA accumulator (``use_acc=False``) and is added into the
  fp32 output with one FFMA, which also applies the previous block's rescale
  (``pv_accum="block"``): Hopper's FP8 wgmma keeps only ~13 bits of its running sum, and summing a
  whole row inside it (``"running"``, v2) gave 0.37 rel-L2 at 38k keys when V has channel means
  (benchmarks/KERNEL_NOTES.md v3);
* every segment of a varlen layout in one launch (grid axis 1), padding keys masked in the last
  block only; an optional natural-log LSE per row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dist_attn.kernels.sage8 import numerics
from dist_attn.kernels.sage8.attn_triton import lse_args, pv_block
from dist_attn.kernels.sage8.quant import Quantized, seg_strides

__all__ = ["GluonConfig", "V_ORDER", "attention", "BLOCK_M", "BLOCK_N"]

#: query rows per consumer warpgroup (one m64 wgmma) and keys per block; a CTA covers 2 * BLOCK_M
#: = PAD rows, so its tiles never leave a segment's padded rows.
BLOCK_M = 64
BLOCK_N = 128
_PAD = gl.constexpr(numerics.PAD)
_MAGIC_I = gl.constexpr(numerics.MAGIC_I)
_MAGIC_F = gl.constexpr(numerics.MAGIC_F)
_LOG2_PSCALE = gl.constexpr(numerics.LOG2_PSCALE)
_LN2 = gl.constexpr(math.log(2.0))
#: the order of V's keys this loop reads (numerics.V_KEY_ORDERS)
V_ORDER = "keys"


@dataclass(frozen=True)
class GluonConfig:
    """Launch parameters of the warp-specialized kernel (defaults: the fastest measured).

    ``maxnreg`` x 384 threads (2 consumer warpgroups + the producer's warpgroup) is the CTA's
    register file share; the producer gives back to ``producer_regs`` and the consumers take
    ``consumer_regs`` (168 x 384 = 240 x 256 + 24 x 128: all 64K registers of an SM).

    ``pv_accum``: "block" (each key block's P V into a fresh MMA accumulator, added into fp32
    registers: the accurate default) or "running" (v2: the whole row's sum inside the FP8 MMA,
    0.37 rel-L2 at 38k keys with V channel means; kept to measure against). ``pv_first``: issue
    block j-1's P V before block j's scores and finish it first (measured slower: 14.63 ms).
    ``add_magic``: see the score-init comment in ``_consumer``.
    """

    stages: int = 3
    exp16: bool = False
    pingpong: bool = False
    p_smem: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168
    pv_accum: Literal["block", "running"] = "block"
    pv_first: bool = False
    add_magic: bool = True

    def __post_init__(self):
        pv_block(self.pv_accum)  # raises on an unknown value
        if self.pv_first and self.pingpong:
            # the pv_first loop has no turn hand-over: the other warpgroup would wait forever
            raise ValueError("GluonConfig(pv_first=True, pingpong=True): the P-V-first loop does not take "
                             "turns; set one of them")


@gluon.jit
def _seg_bounds(cu, seg, used, T, DENSE: gl.constexpr):
    """(lo, L, pst): first source row, clipped length and padded start of segment ``seg``."""
    if DENSE:
        lo = gl.to_tensor(0)
        hi = T
        pst = ((T + _PAD - 1) // _PAD) * _PAD * seg
    else:
        lo = gl.load(cu + seg).to(gl.int32)
        hi = gl.load(cu + seg + 1).to(gl.int32)
        hi = gl.minimum(hi, used)
        lo = gl.minimum(lo, hi)
        pst = ((lo + _PAD - 1) // _PAD) * _PAD + _PAD * seg
    return lo, hi - lo, pst


@gluon.jit
def _exp2(x, EXP16: gl.constexpr):
    if EXP16:
        # two exponentials per MUFU op; x <= LOG2_PSCALE, so p <= 2**8.75 fits fp16 and e4m3
        return gl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x.to(gl.float16)],
                                         dtype=gl.float16, is_pure=True, pack=2)
    else:
        return gl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)


@gluon.jit
def _softmax_block(s, m_i, l_i, rs, lim, p_layout: gl.constexpr, BN: gl.constexpr, EXP16: gl.constexpr,
                   P_SMEM: gl.constexpr, ADD_MAGIC: gl.constexpr):
    """int32 scores (+0x4B400000 unless ADD_MAGIC) of one key block -> (P in e4m3, m, l, alpha); P
    in the A-operand register layout of the PV wgmma, or (P_SMEM) in the scores' layout, to be
    stored to smem."""
    if ADD_MAGIC:
        s = s + _MAGIC_I
    f = s.to(gl.float32, bitcast=True)  # 12582912 + s, exactly
    if lim < BN:
        # the last, partial key block: padding keys are zeros in Ki8/Vt8 but must get p = 0
        cols = gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        f = gl.where(gl.expand_dims(cols < lim, 0), f, float("-inf"))
    m_new = gl.maximum(m_i, (gl.max(f, axis=1) - _MAGIC_F) * rs)
    # one FFMA per score: f * rs - (12582912 * rs + m_new - LOG2_PSCALE)
    bias = _MAGIC_F * rs + m_new - _LOG2_PSCALE
    p = _exp2(f * gl.expand_dims(rs, 1) - gl.expand_dims(bias, 1), EXP16)
    # fp16 row sums stay exact enough: at most 128 * 2**8.75 = 55,100 < 65,504
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1).to(gl.float32)
    if P_SMEM:
        p8 = p.to(gl.float8e4nv)
    else:
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
    return p8, m_new, l_i, alpha


@gluon.jit
def _pv_operand(p8, p_smem, WG: gl.constexpr, j, P_SMEM: gl.constexpr):
    """The A operand of the PV wgmma of block j: registers, or P stored in this warpgroup's shared
    slot j % 2 (slots 2 WG and 2 WG + 1)."""
    if P_SMEM:
        slot = p_smem.index(2 * WG + j % 2)
        slot.store(p8)
        fence_async_shared()
        return slot
    else:
        return p8


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn, Qs, Ks, Vscale, Out, Q, Ksum,
              Lse, h, seg, lo, L, pst, mrow0, R, H, n_blocks, sob, sot, soh, sqb, sqt, sqh, slb, slh, qk_scale,
              WG: gl.constexpr, D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              WITH_LSE: gl.constexpr, EXP16: gl.constexpr, PINGPONG: gl.constexpr, P_SMEM: gl.constexpr,
              PV_BLOCK: gl.constexpr, PV_FIRST: gl.constexpr, ADD_MAGIC: gl.constexpr):
    BM: gl.constexpr = q_smem.type.shape[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BN, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 32])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)

    row0 = mrow0 + WG * BM  # first row of this warpgroup's tile, within the segment
    h64 = h.to(gl.int64)
    qs = gl.load(Qs + h64 * R + pst + row0 + gl.arange(0, BM, layout=srow))
    ks_ptr = Ks + h64 * (R // BN) + pst // BN
    # Scores read as fp32 must be 12582912 + s: either the wgmma accumulator starts at 0x4B400000
    # (v2: a 64-register constant, re-materialized with 64 MOVs per block) or, ADD_MAGIC, the wgmma
    # overwrites the previous block's dead scores (use_acc=False) and one integer add per score
    # follows. Next to PV_BLOCK's second fp32 accumulator the constant costs registers the loop
    # lacks: 15.78 vs 13.94 ms at h3-ref x 14 heads on the H200 (KERNEL_NOTES.md v3).
    if ADD_MAGIC:
        magic = gl.zeros([BM, BN], gl.int32, s_layout)
    else:
        magic = gl.full([BM, BN], _MAGIC_I, gl.int32, s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, srow)
    l_i = gl.zeros([BM], gl.float32, srow)
    acc = gl.zeros([BM, D], gl.float32, o_layout)
    q = q_smem.index(WG)
    mbarrier.wait(q_bar, 0)

    # block 0: scores only (its PV is issued with the scores of block 1)
    if PINGPONG:
        mbarrier.wait(turn.index(WG), 1 ^ WG)
    mbarrier.wait(ready.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), magic, use_acc=not ADD_MAGIC, is_async=True)
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG))
    s = warpgroup_mma_wait(0, deps=[s_tok])
    ks_next = gl.load(ks_ptr + 1)  # one block ahead: its latency hides under this block's work
    p8, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qs * gl.load(ks_ptr), L, p_layout, BN, EXP16, P_SMEM,
                                         ADD_MAGIC)
    pa = _pv_operand(p8, p_smem, WG, 0, P_SMEM)
    # PV_BLOCK: acc holds blocks < j-1 relative to the max before block j-1; `alpha` is the rescale
    # that block j-1's max applies to it (block 0's is exp2(-inf) = 0 on acc = 0). Each block's P V
    # is written over the previous one's registers (use_acc=False ignores their value), which are
    # dead once added into acc: passing acc there would make the compiler copy it first.
    pv = gl.zeros([BM, D], gl.float32, o_layout)
    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        ks_j = ks_next
        ks_next = gl.load(ks_ptr + j + 1)  # the scale array has a spare entry past every segment
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        if PV_FIRST:
            # block j-1's P V first, then block j's scores: waiting for the P V (one group left in
            # flight) frees its registers before the softmax needs its own, at the price of the
            # softmax no longer overlapping this warpgroup's P V (the other warpgroup's still does)
            o_tok = warpgroup_mma(pa, v_smem.index(prev).permute((1, 0)), pv, use_acc=False, is_async=True)
            if ADD_MAGIC:
                s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
            else:
                s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), magic, is_async=True)
            pv = warpgroup_mma_wait(1, deps=[o_tok])
            mbarrier.arrive(empty.index(prev))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1) + pv
            s = warpgroup_mma_wait(0, deps=[s_tok])
            p8, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qs * ks_j, L - j * BN, p_layout, BN, EXP16, P_SMEM,
                                                 ADD_MAGIC)
            pa = _pv_operand(p8, p_smem, WG, j, P_SMEM)
        else:
            if ADD_MAGIC:
                s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
            else:
                s_tok = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), magic, is_async=True)
            if PV_BLOCK:
                o_tok = warpgroup_mma(pa, v_smem.index(prev).permute((1, 0)), pv, use_acc=False, is_async=True)
            else:
                o_tok = warpgroup_mma(pa, v_smem.index(prev).permute((1, 0)), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG))
            s = warpgroup_mma_wait(1, deps=[s_tok])
            alpha_prev = alpha
            p8, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, qs * ks_j, L - j * BN, p_layout, BN, EXP16, P_SMEM,
                                                 ADD_MAGIC)
            # (P, read from registers by the PV wgmma, cannot be a dependency here: triton 3.6 rejects
            # 8-bit values in the wait; ptxas tracks the registers of in-flight wgmmas itself)
            pv = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(empty.index(prev))
            if PV_BLOCK:
                # one FFMA: the rescale that block j-1 brought, then block j-1's P V in fp32
                acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, orow), 1) + pv
            else:
                acc = pv * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
            pa = _pv_operand(p8, p_smem, WG, j, P_SMEM)
    last = (n_blocks - 1) % STAGES
    if PV_BLOCK:
        o_tok = warpgroup_mma(pa, v_smem.index(last).permute((1, 0)), pv, use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=[o_tok])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1) + pv
    else:
        o_tok = warpgroup_mma(pa, v_smem.index(last).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(empty.index(last))

    offs_d = gl.arange(0, D, layout=ocol)
    seg64 = seg.to(gl.int64)
    vsc = gl.load(Vscale + (seg64 * H + h) * D + offs_d)
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_i, orow), 1) * gl.expand_dims(vsc, 0)
    rows = row0 + gl.arange(0, BM, layout=orow)
    optr = (Out + seg64 * sob + h64 * soh + gl.expand_dims((lo + rows).to(gl.int64) * sot, 1)
            + gl.expand_dims(offs_d, 0))
    gl.store(optr, o.to(Out.dtype.element_ty), mask=gl.expand_dims(rows < L, 1))
    if WITH_LSE:
        # natural-log LSE of softmax_scale * q.k: undo the K smoothing (+ scale * q.mean) with the
        # caller's q, once per tile
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        lrows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, ld))
        lcols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        mean = gl.load(Ksum + (seg64 * H + h) * D + lcols) / gl.maximum(L, 1).to(gl.float32)
        qp = (Q + seg64 * sqb + h64 * sqh + gl.expand_dims((lo + lrows).to(gl.int64) * sqt, 1)
              + gl.expand_dims(lcols, 0))
        qv = gl.load(qp, mask=gl.expand_dims(lrows < L, 1), other=0.0).to(gl.float32)
        shift = gl.convert_layout(gl.sum(qv * gl.expand_dims(mean, 0), axis=1), srow) * qk_scale
        lse = (m_i + gl.log2(l_i) - _LOG2_PSCALE + shift) * _LN2
        srows = row0 + gl.arange(0, BM, layout=srow)
        gl.store(Lse + seg64 * slb + h64 * slh + lo + srows, lse, mask=srows < L)


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
              h, R, pst, mrow0, n_blocks, D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    qrow = h * R + pst + mrow0  # Qi8 viewed as [H * R, D]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [qrow, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [qrow + BM, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        stage = j % STAGES
        # a fresh mbarrier counts as having completed the phase before phase 0: the first
        # STAGES waits pass at once
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [h * R + pst + j * BN, 0], bar, k_smem.index(stage))
        tma.async_copy_global_to_shared(v_desc, [h * D, pst + j * BN], bar, v_smem.index(stage))


# sizes and strides stay runtime values: one binary serves every shape (a value of 1 would otherwise
# become a compile-time constant and a new compilation)
@gluon.jit(do_not_specialize=["used", "T", "H", "R", "sob", "sot", "soh", "sqb", "sqt", "sqh", "slb", "slh"])
def _attn_ws_kernel(q_desc, k_desc, v_desc, Qs, Ks, Vscale, Out, Q, Ksum, Lse, cu, used, T, H, R,
                    sob, sot, soh, sqb, sqt, sqh, slb, slh, qk_scale,
                    D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, DENSE: gl.constexpr,
                    WITH_LSE: gl.constexpr, EXP16: gl.constexpr, PINGPONG: gl.constexpr, P_SMEM: gl.constexpr,
                    PV_BLOCK: gl.constexpr, PV_FIRST: gl.constexpr, ADD_MAGIC: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    mb = gl.program_id(0)
    seg = gl.program_id(1)
    h = gl.program_id(2)
    lo, L, pst = _seg_bounds(cu, seg, used, T, DENSE)
    mrow0 = mb * (2 * BM)
    if mrow0 < L:
        q_smem = gl.allocate_shared_memory(gl.int8, [2, BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_desc.layout)
        # P of each warpgroup, double-buffered (a 1 KB placeholder without P_SMEM)
        if P_SMEM:
            p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, BM, BN],
                                               gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float8e4nv))
        else:
            p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 8, 32],
                                               gl.NVMMASharedLayout.get_default_for([8, 32], gl.float8e4nv))
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a slot
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()
        n_blocks = gl.cdiv(L, BN)
        # a warpgroup whose rows all lie past L still runs the loop (its stores are masked off):
        # the producer waits for both warpgroups on every slot
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn, Qs, Ks, Vscale, Out, Q,
                         Ksum, Lse, h, seg, lo, L, pst, mrow0, R, H, n_blocks, sob, sot, soh, sqb, sqt, sqh, slb,
                         slh, qk_scale, 0, D, BN, STAGES, WITH_LSE, EXP16, PINGPONG, P_SMEM, PV_BLOCK,
                         PV_FIRST, ADD_MAGIC)),
            (_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn, Qs, Ks, Vscale, Out, Q,
                         Ksum, Lse, h, seg, lo, L, pst, mrow0, R, H, n_blocks, sob, sot, soh, sqb, sqt, sqh, slb,
                         slh, qk_scale, 1, D, BN, STAGES, WITH_LSE, EXP16, PINGPONG, P_SMEM, PV_BLOCK,
                         PV_FIRST, ADD_MAGIC)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                         h, R, pst, mrow0, n_blocks, D, BN, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(qz: Quantized):
    """TMA descriptors of the quantized Q, K and V^T buffers (Gluon's, with their smem layouts)."""
    H, R, D = qz.qi8.shape
    ql = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.int8)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.int8)
    vl = gl.NVMMASharedLayout.get_default_for([D, BLOCK_N], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(qz.qi8.view(H * R, D), [BLOCK_M, D], ql),
            TensorDescriptor.from_tensor(qz.ki8.view(H * R, D), [BLOCK_N, D], kl),
            TensorDescriptor.from_tensor(qz.vt8.view(H * D, R), [D, BLOCK_N], vl))


def attention(qz: Quantized, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
              softmax_scale: float, cfg: GluonConfig):
    """Launches the warp-specialized kernel on ``qz``; same contract as :func:`attn_triton.attention`."""
    lay = qz.layout
    assert qz.kblock == BLOCK_N and 2 * BLOCK_M == numerics.PAD and qz.v_order == V_ORDER
    H, R, D = qz.qi8.shape
    q_desc, k_desc, v_desc = descriptors(qz)
    lse_arg, sl = lse_args(lse, lay.dense, qz.qscale)
    cu = qz.qscale if lay.dense else lay.cu
    return _attn_ws_kernel[(triton.cdiv(lay.max_seqlen, 2 * BLOCK_M), lay.nseg, H)](
        q_desc, k_desc, v_desc, qz.qscale, qz.kscale, qz.vscale, out, q, qz.ksum, lse_arg, cu,
        lay.used, lay.total, H, R, *seg_strides(out, lay.dense), *seg_strides(q, lay.dense), *sl,
        softmax_scale * math.log2(math.e),
        D=D, BN=BLOCK_N, STAGES=cfg.stages, DENSE=lay.dense, WITH_LSE=lse is not None, EXP16=cfg.exp16,
        PINGPONG=cfg.pingpong, P_SMEM=cfg.p_smem, PV_BLOCK=pv_block(cfg.pv_accum),
        PV_FIRST=cfg.pv_first and pv_block(cfg.pv_accum), ADD_MAGIC=cfg.add_magic, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=cfg.maxnreg)


def compile_sm90(cfg: GluonConfig, *, head_dim: int = 128, dense: bool = True, with_lse: bool = False,
                 out_dtype: str = "bf16"):
    """Compiles the kernel for compute capability 9.0 without a GPU (ptxas ships with triton).

    Returns triton's compiled kernel: ``.asm`` holds the ttgir, PTX and cubin, ``.metadata`` the
    shared memory; lets CPU CI and the notes check registers, spills and instructions.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    class _Fake:  # what TensorDescriptor and mangle_type read off a tensor
        def __init__(self, dtype, shape):
            self.dtype, self.shape = dtype, shape

        def data_ptr(self):
            return 1 << 20

        def stride(self):
            return tuple(int(math.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    D = head_dim
    rows = 4096
    descs = [TensorDescriptor.from_tensor(_Fake(dt, shape), block, gl.NVMMASharedLayout.get_default_for(block, gdt))
             for dt, gdt, shape, block in ((torch.int8, gl.int8, [rows, D], [BLOCK_M, D]),
                                           (torch.int8, gl.int8, [rows, D], [BLOCK_N, D]),
                                           (torch.float8_e4m3fn, gl.float8e4nv, [D, rows], [D, BLOCK_N]))]
    fn = _attn_ws_kernel
    sig, consts = {}, {}
    ptr = {"Out": f"*{out_dtype}", "Q": f"*{out_dtype}", "cu": "*i32"}
    values = dict(zip(("q_desc", "k_desc", "v_desc"), descs))
    constexprs = dict(D=D, BN=BLOCK_N, STAGES=cfg.stages, DENSE=dense, WITH_LSE=with_lse, EXP16=cfg.exp16,
                      PINGPONG=cfg.pingpong, P_SMEM=cfg.p_smem, PV_BLOCK=pv_block(cfg.pv_accum),
                      PV_FIRST=cfg.pv_first and pv_block(cfg.pv_accum), ADD_MAGIC=cfg.add_magic, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs)
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(fn.arg_names.index(name),)] = constexprs[name]
        elif name in values:
            sig[name] = mangle_type(values[name])
        elif name in ("Qs", "Ks", "Vscale", "Ksum", "Lse"):
            sig[name] = "*fp32"
        elif name in ptr:
            sig[name] = ptr[name]
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.maxnreg})
