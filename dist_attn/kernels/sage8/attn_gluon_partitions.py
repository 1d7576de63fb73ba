# SPDX-License-Identifier: Apache-2.0
"""The warp-specialized partitions of the Gluon Sage8 kernel (:mod:`.attn_gluon` launches them).

``_consumer`` is one of the two 64-row consumer warpgroups: the QK and PV wgmmas of consecutive key
blocks issued asynchronously around the softmax, P to FP8 (through shared memory or registers),
each block's P V added into the fp32 output; ``_producer`` is the 1-warp TMA partition that loads
both Q tiles and then every key block into the ring of shared-memory slots. The numerics and the
measurements behind each choice are in :mod:`.attn_gluon`'s docstring.

Scores read as fp32 must be 12582912 + s: either the wgmma accumulator starts at 0x4B400000 (a
64-register constant, re-materialized with 64 MOVs per block) or, ``ADD_MAGIC``, the wgmma
overwrites the previous block's dead scores (``use_acc=False``) and one integer add per score
follows. Next to ``PV_BLOCK``'s second fp32 accumulator the constant costs registers the loop
lacks: it spills (benchmarks/kernels.py measures the cost; benchmarks/KERNEL_NOTES.md has it).
"""

from __future__ import annotations

import math

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dist_attn.kernels.sage8 import numerics

#: nothing public: :mod:`.attn_gluon` imports ``_consumer`` and ``_producer`` by name (its kernel
#: calls them as module globals)
__all__: list[str] = []

_MAGIC_I = gl.constexpr(numerics.MAGIC_I)
_MAGIC_F = gl.constexpr(numerics.MAGIC_F)
_LOG2_PSCALE = gl.constexpr(numerics.LOG2_PSCALE)
_LN2 = gl.constexpr(math.log(2.0))


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
def _block_step(q, k_tile, v_tile, empty_bar, turn_other, p_smem, s, pv, acc, pa, magic, m_i, l_i, alpha, rs, lim,
                j, orow: gl.constexpr, p_layout: gl.constexpr, WG: gl.constexpr, BN: gl.constexpr,
                EXP16: gl.constexpr, PINGPONG: gl.constexpr, P_SMEM: gl.constexpr, PV_BLOCK: gl.constexpr,
                PV_FIRST: gl.constexpr, ADD_MAGIC: gl.constexpr):
    """Key block j >= 1 of one consumer warpgroup, its K and V^T tiles in shared memory: block j's
    scores and block j - 1's P V (``pa``) issued, the softmax of j, that P V added into ``acc``;
    releases block j - 1's slot (``empty_bar``) and, with PINGPONG, passes the turn (``turn_other``).
    Returns (s, pv, acc, pa, m_i, l_i, alpha) for block j + 1.

    PV_BLOCK: ``acc`` holds blocks < j - 1 relative to the max before block j - 1; ``alpha`` is the
    rescale that block j - 1's max applies to it (block 0's is exp2(-inf) = 0 on acc = 0). Each
    block's P V is written over the previous one's registers (use_acc=False ignores their value),
    which are dead once added into acc: passing acc there would make the compiler copy it first."""
    if PV_FIRST:
        # block j-1's P V first, then block j's scores: waiting for the P V (one group left in
        # flight) frees its registers before the softmax needs its own, at the price of the
        # softmax no longer overlapping this warpgroup's P V (the other warpgroup's still does)
        o_tok = warpgroup_mma(pa, v_tile, pv, use_acc=False, is_async=True)
        if ADD_MAGIC:
            s_tok = warpgroup_mma(q, k_tile, s, use_acc=False, is_async=True)
        else:
            s_tok = warpgroup_mma(q, k_tile, magic, is_async=True)
        pv = warpgroup_mma_wait(1, deps=[o_tok])
        mbarrier.arrive(empty_bar)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1) + pv
        s = warpgroup_mma_wait(0, deps=[s_tok])
        p8, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, rs, lim, p_layout, BN, EXP16, P_SMEM,
                                             ADD_MAGIC)
        pa = _pv_operand(p8, p_smem, WG, j, P_SMEM)
    else:
        if ADD_MAGIC:
            s_tok = warpgroup_mma(q, k_tile, s, use_acc=False, is_async=True)
        else:
            s_tok = warpgroup_mma(q, k_tile, magic, is_async=True)
        if PV_BLOCK:
            o_tok = warpgroup_mma(pa, v_tile, pv, use_acc=False, is_async=True)
        else:
            o_tok = warpgroup_mma(pa, v_tile, acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_other)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        alpha_prev = alpha
        p8, m_i, l_i, alpha = _softmax_block(s, m_i, l_i, rs, lim, p_layout, BN, EXP16, P_SMEM,
                                             ADD_MAGIC)
        # (P, read from registers by the PV wgmma, cannot be a dependency here: triton 3.6 rejects
        # 8-bit values in the wait; ptxas tracks the registers of in-flight wgmmas itself)
        pv = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(empty_bar)
        if PV_BLOCK:
            # one FFMA: the rescale that block j-1 brought, then block j-1's P V in fp32
            acc = acc * gl.expand_dims(gl.convert_layout(alpha_prev, orow), 1) + pv
        else:
            acc = pv * gl.expand_dims(gl.convert_layout(alpha, orow), 1)
        pa = _pv_operand(p8, p_smem, WG, j, P_SMEM)
    return s, pv, acc, pa, m_i, l_i, alpha


@gluon.jit
def _last_pv(pa, v_tile, empty_bar, pv, acc, alpha, orow: gl.constexpr, PV_BLOCK: gl.constexpr):
    """The last key block's P V added into ``acc`` (returned); releases its slot."""
    if PV_BLOCK:
        o_tok = warpgroup_mma(pa, v_tile, pv, use_acc=False, is_async=True)
        pv = warpgroup_mma_wait(0, deps=[o_tok])
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow), 1) + pv
    else:
        o_tok = warpgroup_mma(pa, v_tile, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
    mbarrier.arrive(empty_bar)
    return acc


@gluon.jit
def _epilogue(acc, m_i, l_i, Vscale, Out, Q, Ksum, Lse, h, seg, lo, L, row0, H, sob, sot, soh, sqb, sqt, sqh,
              slb, slh, qk_scale, o_layout: gl.constexpr, s_layout: gl.constexpr, D: gl.constexpr,
              WITH_LSE: gl.constexpr):
    """out = acc / l * vscale for the warpgroup's rows below L; with WITH_LSE the natural-log LSE
    of each row, K's smoothing undone."""
    orow: gl.constexpr = gl.SliceLayout(1, o_layout)
    ocol: gl.constexpr = gl.SliceLayout(0, o_layout)
    srow: gl.constexpr = gl.SliceLayout(1, s_layout)
    BM: gl.constexpr = acc.type.shape[0]
    h64 = h.to(gl.int64)
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

    row0 = mrow0 + WG * BM  # first row of this warpgroup's tile, within the segment
    h64 = h.to(gl.int64)
    qs = gl.load(Qs + h64 * R + pst + row0 + gl.arange(0, BM, layout=srow))
    ks_ptr = Ks + h64 * (R // BN) + pst // BN
    # scores read as fp32 are 12582912 + s: the accumulator starts at 0x4B400000, or (ADD_MAGIC)
    # one integer add per score follows (the module docstring says when each is chosen)
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
    pv = gl.zeros([BM, D], gl.float32, o_layout)  # each block's P V (PV_BLOCK: see _block_step)
    for j in range(1, n_blocks):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        ks_j = ks_next
        ks_next = gl.load(ks_ptr + j + 1)  # the scale array has a spare entry past every segment
        if PINGPONG:
            mbarrier.wait(turn.index(WG), (j & 1) ^ (1 - WG))
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        s, pv, acc, pa, m_i, l_i, alpha = _block_step(
            q, k_smem.index(stage).permute((1, 0)), v_smem.index(prev).permute((1, 0)), empty.index(prev),
            turn.index(1 - WG), p_smem, s, pv, acc, pa, magic, m_i, l_i, alpha, qs * ks_j, L - j * BN, j,
            orow, p_layout, WG, BN, EXP16, PINGPONG, P_SMEM, PV_BLOCK, PV_FIRST, ADD_MAGIC)
    last = (n_blocks - 1) % STAGES
    acc = _last_pv(pa, v_smem.index(last).permute((1, 0)), empty.index(last), pv, acc, alpha, orow, PV_BLOCK)

    _epilogue(acc, m_i, l_i, Vscale, Out, Q, Ksum, Lse, h, seg, lo, L, row0, H, sob, sot, soh, sqb, sqt,
              sqh, slb, slh, qk_scale, o_layout, s_layout, D, WITH_LSE)


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
