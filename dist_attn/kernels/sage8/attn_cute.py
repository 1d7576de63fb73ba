# SPDX-License-Identifier: Apache-2.0
"""The Sage8 attention loop in CuTe DSL for sm_90a (``impl="cute"``; imports cutlass).

Reads the operands of :func:`quant.quantize` (``v_order="mma"``, 128-key blocks) and computes what
:mod:`attn_triton` computes, rounding for rounding, on a warp-specialized schedule:

* one CTA = 128 query rows of one (segment, head), three warpgroups: warpgroup 0 loads (one warp
  issues TMA copies of the Q tile and of every key block's K and V^T tiles into a ring of
  ``stages`` shared-memory slots), warpgroups 1 and 2 each own 64 query rows;
* per key block: INT8 Q K^T into an int32 wgmma accumulator pre-set to ``MAGIC_I`` (so its bits
  read as the float ``MAGIC_F + s``), online softmax in exp2 with one FFMA per score, P -> e4m3
  renamed inside each thread into the wgmma A-operand order (V's keys are stored in the same
  order, ``numerics.V_KEY_ORDERS``), FP8 P V into a fresh accumulator added into fp32 registers
  (the FP8 MMA never sums over more than one key block);
* ``overlap``: the QK wgmma of block j + 1 is issued before the softmax of block j, and the two
  consumer warpgroups take turns at the tensor cores (named barriers), so the softmax of one
  warpgroup runs while the other's MMAs do.

Kernels are compiled once per configuration (:func:`compiled`) and cached for the process.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.runtime import from_dlpack

from dist_attn.kernels.sage8 import numerics
from dist_attn.kernels.sage8.attn_cute_config import CuteConfig
from dist_attn.kernels.sage8.attn_cute_steps import BLOCK_M, BlockSteps

if TYPE_CHECKING:  # the pre-pass imports triton; this loop does not need it
    from dist_attn.kernels.sage8.quant import Quantized

__all__ = ["CuteConfig", "V_ORDER", "BLOCK_M", "attention", "compiled", "compile_seconds"]

#: the order of V's keys this loop reads (numerics.V_KEY_ORDERS)
V_ORDER = "mma"


def _a_shape_of_acc(acc_shape, a_value_shape):
    """The wgmma A-operand register shape that holds an accumulator of shape ((2, 2, N / 8), M, 1):
    each 32-column k-step becomes one ``a_value_shape`` (4, 2, 2) group, k-steps in the last mode.
    A compact tensor of this shape stores bytes (k % 4) + 4 (row half) + 8 ((k // 16) % 2) +
    16 (k // 32); the same storage viewed with the accumulator's compact layout holds element
    (e, r, i) at e + 2 r + 4 i."""
    return (a_value_shape, acc_shape[1], cute.size(acc_shape[0]) // cute.size(a_value_shape))


class _Sage8Cute(BlockSteps):
    """One compiled configuration: head_dim ``D``, dense or varlen, with or without the LSE."""

    def __init__(self, head_dim: int, dense: bool, with_lse: bool, cfg: CuteConfig):
        self.D = head_dim
        self.dense = dense
        self.with_lse = with_lse
        self.cfg = cfg
        self.stages = cfg.stages

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mQs: cute.Tensor,
                 mKs: cute.Tensor, mVs: cute.Tensor, mKsum: cute.Tensor, mO: cute.Tensor,
                 mQin: cute.Tensor, mLse: cute.Tensor, mCu: cute.Tensor, used: Int32, total: Int32,
                 rows: Int32, qk_scale: Float32, grid_m: Int32, nseg: Int32, nheads: Int32,
                 stream: cuda.CUstream):
        D = self.D
        row_major = utils.LayoutEnum.ROW_MAJOR
        # S = Q K^T: A = Q tile (M=128 rows, K=D), B = K tile (N=128 keys, K=D), int32 accumulator
        mma_qk = sm90_utils.make_trivial_tiled_mma(
            cutlass.Int8, cutlass.Int8, row_major.sm90_mma_major_mode(), row_major.sm90_mma_major_mode(),
            Int32, (2, 1, 1), (64, self.cfg.block_n))
        # O += P V: A = P from registers (M=128, K=128 keys), B = V^T tile (N=D, K=128 keys)
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, row_major.sm90_mma_major_mode(),
            row_major.sm90_mma_major_mode(), Float32, (2, 1, 1), (64, D), warpgroup.OperandSource.RMEM)
        # p_smem: the same product with P read from shared memory (its register layout above says
        # where each thread stores its P values)
        mma_pv_ss = sm90_utils.make_trivial_tiled_mma(
            cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, row_major.sm90_mma_major_mode(),
            row_major.sm90_mma_major_mode(), Float32, (2, 1, 1), (64, D))
        tile_qk = (BLOCK_M, self.cfg.block_n, D)
        tile_pv = (BLOCK_M, D, self.cfg.block_n)
        sQ_layout = sm90_utils.make_smem_layout_a(row_major, tile_qk, cutlass.Int8, 1)
        sK_layout = sm90_utils.make_smem_layout_b(row_major, tile_qk, cutlass.Int8, self.stages)
        sV_layout = sm90_utils.make_smem_layout_b(row_major, tile_pv, cutlass.Float8E4M3FN, self.stages)
        sP_layout = sm90_utils.make_smem_layout_a(row_major, tile_pv, cutlass.Float8E4M3FN, 2)  # 2 buffers
        p_elems = cute.cosize(sP_layout) if self.cfg.p_smem else 1024
        op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tQ = cpasync.make_tiled_tma_atom(op, mQ, cute.slice_(sQ_layout, (None, None, 0)), (BLOCK_M, D))
        tma_k, tK = cpasync.make_tiled_tma_atom(op, mK, cute.slice_(sK_layout, (None, None, 0)), (self.cfg.block_n, D))
        tma_v, tV = cpasync.make_tiled_tma_atom(op, mVt, cute.slice_(sV_layout, (None, None, 0)), (D, self.cfg.block_n))
        self.q_bytes = cute.size_in_bytes(cutlass.Int8, cute.slice_(sQ_layout, (None, None, 0)))
        self.k_bytes = cute.size_in_bytes(cutlass.Int8, cute.slice_(sK_layout, (None, None, 0)))
        self.v_bytes = cute.size_in_bytes(cutlass.Float8E4M3FN, cute.slice_(sV_layout, (None, None, 0)))

        @cute.struct
        class Storage:
            bar_q: cute.struct.MemRange[cutlass.Int64, 2]
            bar_k: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            bar_v: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[cutlass.Int8, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, cute.cosize(sV_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[cutlass.Float8E4M3FN, p_elems], 1024]

        self.storage = Storage
        self.kernel(mma_qk, mma_pv, mma_pv_ss, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout,
                    sV_layout, sP_layout,
                    mQs, mKs, mVs, mKsum, mO, mQin, mLse, mCu, used, total, rows, qk_scale).launch(
            grid=[grid_m, nseg, nheads], block=[384, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, mma_pv_ss: cute.TiledMma,
               tma_q: cute.CopyAtom, tQ: cute.Tensor,
               tma_k: cute.CopyAtom, tK: cute.Tensor, tma_v: cute.CopyAtom, tV: cute.Tensor,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout,
               mQs: cute.Tensor, mKs: cute.Tensor, mVs: cute.Tensor, mKsum: cute.Tensor, mO: cute.Tensor,
               mQin: cute.Tensor, mLse: cute.Tensor, mCu: cute.Tensor, used: Int32, total: Int32,
               rows: Int32, qk_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        mb, seg, h = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # the segment's source rows [lo, lo + L) and its first row in the padded row space
        lo = Int32(0)
        L = total
        Lk = cutlass.min(total, used)  # dense: keys [used, T) are not attended (ring pieces)
        pst = ((total + numerics.PAD - 1) // numerics.PAD) * numerics.PAD * seg
        if const_expr(not self.dense):
            lo = Int32(mCu[seg])
            hi = cutlass.min(Int32(mCu[seg + 1]), used)
            lo = cutlass.min(lo, hi)
            L = hi - lo
            Lk = L
            pst = ((lo + numerics.PAD - 1) // numerics.PAD) * numerics.PAD + numerics.PAD * seg
        if mb * BLOCK_M < L:
            self._tile(mma_qk, (mma_pv, mma_pv_ss), tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout,
                       (sV_layout, sP_layout),
                       mQs, mKs, mVs, mKsum, mO, mQin, mLse, tidx, warp_idx, mb, seg, h, lo, L, Lk, pst,
                       rows, qk_scale)

    @cute.jit
    def _tile(self, mma_qk, mma_pvs, tma_q, tQ, tma_k, tK, tma_v, tV, sQ_layout, sK_layout, sVP_layouts,
              mQs, mKs, mVs, mKsum, mO, mQin, mLse, tidx, warp_idx, mb, seg, h, lo, L, Lk, pst, rows,
              qk_scale):
        D = self.D
        smem = utils.SmemAllocator()
        st = smem.allocate(self.storage)
        pipe_q, pipe_k, pipe_v = self._pipelines(st)

        sQ = st.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (128, D, 1)
        sK = st.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (128, D, stages)
        sV_layout, sP_layout = sVP_layouts
        sV = st.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (D, 128, stages)
        sP = st.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (128, BN, 2); p_smem only

        BN = self.cfg.block_n
        n_full = Lk // BN
        lim = Lk - n_full * BN
        # arithmetic, not a Python conditional on a traced value (c1's `n_full + (1 if lim > 0
        # else 0)`, a suspect in its hang on one-block segments)
        n_blocks = (Lk + BN - 1) // BN
        # the segment's first Q tile and first K block in [H * R, D]
        q0 = (h * rows + pst) // BLOCK_M
        k0 = (h * rows + pst) // BN

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.cfg.producer_regs)
            if warp_idx == 0:
                self._produce((tma_q, tQ, tma_k, tK, tma_v, tV), sQ, sK, sV, (pipe_q, pipe_k, pipe_v),
                              q0 + mb, k0, h, pst // BN, n_blocks)
        else:
            cute.arch.setmaxregister_increase(self.cfg.consumer_regs)
            self._consume(mma_qk, mma_pvs, sQ, sK, sV, sP, pipe_q, pipe_k, pipe_v, mQs, mKs, mVs, mKsum, mO,
                          mQin, mLse, tidx - 128, mb, seg, h, lo, L, pst, rows, n_full, lim, n_blocks,
                          qk_scale)

    @cute.jit
    def _pipelines(self, st):
        """The Q, K and V^T TMA pipelines on ``st``'s barriers (one producer thread, the 8 consumer
        warps), initialised and fenced for the whole CTA."""
        one = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, 8)  # the 8 consumer warps
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bar_q.data_ptr(), num_stages=1, producer_group=one,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bar_k.data_ptr(), num_stages=self.stages, producer_group=one,
            consumer_group=consumers, tx_count=self.k_bytes, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=st.bar_v.data_ptr(), num_stages=self.stages, producer_group=one,
            consumer_group=consumers, tx_count=self.v_bytes, defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipe_q, pipe_k, pipe_v

    @cute.jit
    def _produce(self, tmas, sQ, sK, sV, pipes, q_tile, k0, h, v0, n_blocks):
        """The producer warp: Q tile ``q_tile``, then key blocks ``k0 + j`` of K and ``v0 + j`` of
        head ``h``'s V^T for j < ``n_blocks``, each into the next free slot of the ring."""
        tma_q, tQ, tma_k, tK, tma_v, tV = tmas
        pipe_q, pipe_k, pipe_v = pipes
        D = self.D
        BN = self.cfg.block_n
        cpasync.prefetch_descriptor(tma_q)
        cpasync.prefetch_descriptor(tma_k)
        cpasync.prefetch_descriptor(tma_v)
        gQ = cute.local_tile(tQ, (BLOCK_M, D), (None, 0))  # (128, D, H * R / 128)
        gK = cute.local_tile(tK, (BN, D), (None, 0))  # (BN, D, H * R / BN)
        gV = cute.local_tile(tV, (D, BN), (None, None))  # (D, BN, H, R / BN)
        tQs, tQg = cpasync.tma_partition(tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                         cute.group_modes(gV, 0, 2))
        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(state_q)
        cute.copy(tma_q, tQg[None, q_tile], tQs[None, 0],
                  tma_bar_ptr=pipe_q.producer_get_barrier(state_q))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        for j in cutlass.range(n_blocks, unroll=1):
            pipe_k.producer_acquire(state)
            cute.copy(tma_k, tKg[None, k0 + j], tKs[None, state.index],
                      tma_bar_ptr=pipe_k.producer_get_barrier(state))
            pipe_v.producer_acquire(state)
            cute.copy(tma_v, tVg[None, h, v0 + j], tVs[None, state.index],
                      tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()
        # no producer_tail: it guards a cluster's CTAs against exiting while a peer still
        # arrives on their barriers, and this kernel has no cluster. Both tails were called
        # on one state, which the first advances in place: the prime suspect for the hang
        # on segments of one key block (c1-c3; T = 129 and longer run)

    @cute.jit
    def _consume(self, mma_qk, mma_pvs, sQ, sK, sV, sP, pipe_q, pipe_k, pipe_v, mQs, mKs, mVs, mKsum, mO, mQin,
                 mLse, tidx, mb, seg, h, lo, L, pst, rows, n_full, lim, n_blocks, qk_scale):
        D = self.D
        if const_expr(self.cfg.p_fence):
            # 0 at run time (rows < 2 ** 31), unknown to the compilers: folded into the new P
            self.zero = Uint32(rows) >> Uint32(31)
        thr_qk = mma_qk.get_slice(tidx)
        mma_pv, mma_pv_ss = mma_pvs
        thr_pv = mma_pv.get_slice(tidx)
        tSrQ = thr_qk.make_fragment_A(thr_qk.partition_A(sQ))  # (MMA, 1, D / 32, 1)
        tSrK = thr_qk.make_fragment_B(thr_qk.partition_B(sK))  # (MMA, 1, D / 32, stages)
        tOrV = thr_pv.make_fragment_B(thr_pv.partition_B(sV))  # (MMA, 1, 128 / 32, stages)
        acc_s = thr_qk.make_fragment_C(thr_qk.partition_shape_C((BLOCK_M, self.cfg.block_n)))  # int32
        acc_o = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BLOCK_M, D)))  # fp32
        acc_b = thr_pv.make_fragment_C(thr_pv.partition_shape_C((BLOCK_M, D)))  # one block's P V
        p8 = cute.make_rmem_tensor(_a_shape_of_acc(acc_s.shape, mma_pv.tv_layout_A.shape[1]),
                                   cutlass.Float8E4M3FN)
        p8_as_acc = cute.make_tensor(p8.iterator, acc_s.layout)
        p8_words = cute.recast_tensor(p8, Uint32)
        f_s = cute.recast_tensor(acc_s, Float32)
        # (row, column) of each accumulator element within the CTA tile
        cS = thr_qk.partition_C(cute.make_identity_tensor((BLOCK_M, self.cfg.block_n)))
        cO = thr_pv.partition_C(cute.make_identity_tensor((BLOCK_M, D)))

        # per row (two per thread: values v with (v // 2) % 2 == r): Q's scale, running max, sum
        qs = cute.make_rmem_tensor((2,), Float32)
        m_i = cute.make_rmem_tensor((2,), Float32)
        l_i = cute.make_rmem_tensor((2,), Float32)
        alpha = cute.make_rmem_tensor((2,), Float32)
        qrow0 = h * rows + pst + mb * BLOCK_M
        for r in cutlass.range_constexpr(2):
            qs[r] = Float32(mQs[qrow0 + cS[2 * r][0]])
            m_i[r] = -Float32.inf
            l_i[r] = Float32(0.0)
        acc_o.fill(0.0)
        ks_row = (h * rows + pst) // self.cfg.block_n

        state_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(state_q)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        # p_smem: P's two shared-memory buffers as the SS wgmma reads them, and as this thread
        # stores its register fragment into them
        thr_pv_ss = mma_pv_ss.get_slice(tidx)
        tOsP = thr_pv_ss.make_fragment_A(thr_pv_ss.partition_A(sP))  # (MMA, 1, BN / 32, 2)
        tPsP = thr_pv.partition_A(sP)  # p8's shape, (.., 2)
        mma = (mma_qk, mma_pv, tSrQ, tSrK, tOrV, acc_s, acc_b, p8, mma_pv_ss, tOsP, tPsP)
        # this thread's first score column; its columns 8 i + e past `rem` are padding keys
        rem = lim - 2 * (tidx % 4)
        st = (mma, pipe_k, pipe_v, mKs, ks_row, f_s, qs, m_i, l_i, alpha, p8_as_acc, p8_words, acc_o,
              acc_b, rem)
        if const_expr(self.cfg.overlap):
            self._overlap_loop(st, state, n_full, lim, n_blocks)
        else:
            for j in cutlass.range(n_full, unroll=1):
                state = self._plain_step(st, state, j, False)
            if lim > 0:
                state = self._plain_step(st, state, n_full, True)
        self._epilogue(acc_o, cO, m_i, l_i, mVs, mKsum, mO, mQin, mLse, seg, h, lo, L, mb, qk_scale)

    @cute.jit
    def _overlap_loop(self, st, state, n_full, lim, n_blocks):
        """The ``overlap`` schedule over a segment's ``n_blocks`` key blocks (``n_full`` full ones,
        then one of ``lim`` keys when ``lim`` > 0): block 0's S and softmax, the steps, and the last
        block's P V; the output's promotion complete on return."""
        mma, pipe_k, pipe_v, mKs, ks_row, f_s, qs, m_i, l_i, alpha, p8_as_acc, p8_words, acc_o, acc_b, rem = st
        # defer_add: the P V waiting in acc_b for its fp32 promotion, and its block's alpha
        alpha_pend = cute.make_rmem_tensor((2,), Float32)
        alpha_pend.fill(1.0)
        acc_b.fill(0.0)
        self._turn_init()
        # block 0: S, softmax, P (its P V is issued with the next block's S)
        ks0 = Float32(mKs[ks_row])
        if const_expr(self.cfg.ks_ahead):  # K's scale of the block the loop starts with
            self.last_block = n_blocks - 1
            self.ks_next = cute.make_rmem_tensor((1,), Float32)
            self.ks_next[0] = Float32(mKs[ks_row + cutlass.min(1, self.last_block)])
        self._issue_qk(pipe_k, state, mma, sync_turn=False)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        # block 0 is masked when it is the partial one, without a branch around the softmax
        # (c1's branch is the other suspect in its hang): a full block masks no column
        rem0 = cutlass.select_(n_full == 0, rem, Int32(self.cfg.block_n))
        alpha0 = alpha if const_expr(self.cfg.adds_late) else alpha_pend
        self._softmax(f_s, qs, ks0, m_i, l_i, alpha0, True, rem0)
        self._to_p8(f_s, p8_as_acc, p8_words)
        if const_expr(self.cfg.p_smem):
            self._store_p(mma, 0)
        for j in cutlass.range(1, n_full, unroll=1):
            state = self._overlap_step(st, alpha_pend, state, j, False)
        if lim > 0:
            if n_full > 0:
                state = self._overlap_step(st, alpha_pend, state, n_full, True)
        if const_expr(self.cfg.adds_late):  # the P V in acc_b, then the last block's
            self._promote(acc_o, alpha_pend, acc_b, alpha)
        self._issue_pv(pipe_v, state, mma, (n_blocks - 1) % 2)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state)
        self._add_block(acc_o, alpha_pend, acc_b)


_CACHE: dict = {}
_COMPILE_SECONDS: dict = {}


def _dyn(t: torch.Tensor, align: int = 16):
    """``t`` as a CuTe tensor with dynamic shape and strides (fp8 through a uint8 view)."""
    if t.dtype == torch.float8_e4m3fn:
        ct = from_dlpack(t.view(torch.uint8), assumed_align=align)
        ct.element_type = cutlass.Float8E4M3FN
    else:
        ct = from_dlpack(t, assumed_align=align)
    return ct.mark_layout_dynamic(leading_dim=t.dim() - 1)


def compile_seconds() -> dict:
    """Seconds each configuration took to JIT-compile in this process, keyed as the cache is."""
    return dict(_COMPILE_SECONDS)


def compiled(key, args):
    """The compiled kernel for ``key`` = (head_dim, dense, with_lse, out dtype, cu_seqlens dtype,
    config), compiling
    it on first use with ``args`` (CuTe tensors and scalars of a real call)."""
    fn = _CACHE.get(key)
    if fn is None:
        D, dense, with_lse, _, _, cfg = key
        t0 = time.perf_counter()
        fn = cute.compile(_Sage8Cute(D, dense, with_lse, cfg), *args)
        _COMPILE_SECONDS[key] = time.perf_counter() - t0
        _CACHE[key] = fn
    return fn


def attention(qz: Quantized, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
              softmax_scale: float, cfg: CuteConfig) -> None:
    """Launches the CuTe loop on ``qz``; writes ``out`` ([B, T, H, D] view) and, when given,
    ``lse`` ([B, H, T] fp32, natural log). ``q`` is the caller's query (read for the LSE only)."""
    lay = qz.layout
    assert qz.kblock == cfg.block_n and qz.v_order == V_ORDER and numerics.PAD % BLOCK_M == 0
    H, R, D = qz.qi8.shape
    dummy = qz.qscale
    lse_t = lse if lse is not None else dummy.view(1, 1, -1)
    cu = qz.qscale if lay.dense else lay.cu
    stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    args = [_dyn(qz.qi8.view(H * R, D)), _dyn(qz.ki8.view(H * R, D)), _dyn(qz.vt8.view(H * D, R)),
            _dyn(qz.qscale.view(-1), 4), _dyn(qz.kscale.view(-1), 4), _dyn(qz.vscale, 4), _dyn(qz.ksum, 4),
            _dyn(out, 2), _dyn(q, 2), _dyn(lse_t, 4), _dyn(cu, 4),
            Int32(lay.used), Int32(lay.total), Int32(R), Float32(softmax_scale),
            Int32(-(-lay.max_seqlen // BLOCK_M)), Int32(lay.nseg), Int32(H), stream]
    key = (D, lay.dense, lse is not None, out.dtype, cu.dtype, cfg)
    compiled(key, args)(*args)
