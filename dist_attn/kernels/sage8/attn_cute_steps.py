# SPDX-License-Identifier: Apache-2.0
"""The per-block steps of the CuTe DSL sage8 loop's consumer warpgroups (:mod:`attn_cute`):
issuing the two wgmmas, the online softmax, P to the e4m3 A operand, the warpgroups' turns, the
fp32 promotion and the epilogue. Imports cutlass."""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from dist_attn.kernels.sage8 import numerics

__all__ = ["BLOCK_M", "BlockSteps", "advanced"]

#: query rows per CTA: two consumer warpgroups of 64 rows
BLOCK_M = 128
_LN2 = math.log(2.0)


class BlockSteps:
    """Methods of the consumer warpgroups; the kernel class (attn_cute) sets ``cfg`` and ``dense``
    and ``with_lse``."""

    @cute.jit
    def _issue_qk(self, pipe_k, state, mma, sync_turn: cutlass.Constexpr):
        """Waits for K's slot and issues S = Q K^T on top of MAGIC_I (the accumulator's bits then
        read as the float MAGIC_F + s); with ``cfg.prep_early`` on top of zero (the softmax adds
        MAGIC_I); does not wait for the result."""
        from_zero = const_expr(self.cfg.prep_early)
        mma_qk, _, tSrQ, tSrK, _, acc_s, _, _, _, _, _ = mma
        pipe_k.consumer_wait(state)
        if const_expr(sync_turn):
            self._turn_wait()
        if const_expr(not from_zero):
            acc_s.fill(numerics.MAGIC_I)
        warpgroup.fence()
        atom = cute.make_mma_atom(mma_qk.op)  # a fresh atom per call: its fields never outlive a loop body
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            if const_expr(from_zero):
                atom.set(warpgroup.Field.ACCUMULATE, k != 0)
            cute.gemm(atom, acc_s, tSrQ[None, None, k, 0], tSrK[None, None, k, state.index], acc_s)
        warpgroup.commit_group()

    @cute.jit
    def _issue_pv(self, pipe_v, state, mma, buf=None):
        """Waits for V^T's slot and issues acc_b = P V (a fresh accumulator); does not wait. P:
        its registers, or with ``cfg.p_smem`` its shared-memory buffer ``buf``."""
        _, mma_pv, _, _, tOrV, _, acc_b, p8, mma_pv_ss, tOsP, _ = mma
        pipe_v.consumer_wait(state)
        warpgroup.fence()
        if const_expr(self.cfg.p_smem):
            atom = cute.make_mma_atom(mma_pv_ss.op)
            for k in cutlass.range_constexpr(cute.size(tOsP, mode=[2])):
                atom.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(atom, acc_b, tOsP[None, None, k, buf], tOrV[None, None, k, state.index], acc_b)
        else:
            atom = cute.make_mma_atom(mma_pv.op)
            for k in cutlass.range_constexpr(cute.size(p8, mode=[2])):
                atom.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(atom, acc_b, p8[None, None, k], tOrV[None, None, k, state.index], acc_b)
        warpgroup.commit_group()

    @cute.jit
    def _store_p(self, mma, buf):
        """P's register fragment into shared-memory buffer ``buf``, visible to the wgmma (each warp
        stores the 16 rows its part of the wgmma reads, so a warp-level sync suffices)."""
        _, _, _, _, _, _, _, p8, _, _, tPsP = mma
        cute.autovec_copy(p8, tPsP[None, None, None, buf])
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()

    @cute.jit
    def _to_p8(self, f_s, p8_as_acc, p8_words):
        """P -> e4m3 in the accumulator's order, then each pair of words renamed into the A
        operand's bytes (V's keys are stored in the matching order: no shuffles)."""
        p8_as_acc.store(f_s.load().to(cutlass.Float8E4M3FN))
        for w in cutlass.range_constexpr(0, cute.size(p8_words), 2):
            w0 = p8_words[w]
            w1 = p8_words[w + 1]
            p8_words[w] = cute.arch.prmt(w0, w1, numerics.P8_PRMT[0])
            p8_words[w + 1] = cute.arch.prmt(w0, w1, numerics.P8_PRMT[1])

    # The two consumer warpgroups take turns issuing their MMAs: named barrier 1 + g is
    # warpgroup g's turn (g = 0, 1); each waits on its own and, once its MMAs are issued, arrives
    # on the other's. Warpgroup 0 opens by arriving on its own.
    @cute.jit
    def _wg(self):
        tidx, _, _ = cute.arch.thread_idx()
        return cute.arch.make_warp_uniform(tidx // 128 - 1)

    @cute.jit
    def _turn_init(self):
        if const_expr(self.cfg.turns):
            if self._wg() == 0:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)

    # (constant barrier ids under a branch: a computed id is a register held across the loop)
    @cute.jit
    def _turn_wait(self):
        if const_expr(self.cfg.turns):
            if self._wg() == 0:
                cute.arch.barrier(barrier_id=1, number_of_threads=256)
            else:
                cute.arch.barrier(barrier_id=2, number_of_threads=256)

    @cute.jit
    def _turn_pass(self):
        if const_expr(self.cfg.turns):
            if self._wg() == 0:
                cute.arch.barrier_arrive(barrier_id=2, number_of_threads=256)
            else:
                cute.arch.barrier_arrive(barrier_id=1, number_of_threads=256)

    @cute.jit
    def _overlap_step(self, st, alpha_pend, state, j, masked: cutlass.Constexpr):
        """Block j: issue its S and the previous block's P V, softmax of j while that P V runs.
        With ``cfg.adds_late`` the P V of block j - 2 (in acc_b, its alpha in ``alpha_pend``) is
        added into the output between the two issues, so after the P V wait only P's conversion
        (registers) or nothing (``p_smem``: block j's P is stored to buffer j % 2 before it) is
        left; otherwise block j - 1's P V is added after that wait. Every wgmma is waited for
        within the step (ptxas serializes wgmmas whose results are read across the loop's back
        edge). Returns the pipeline state of block j."""
        mma, pipe_k, pipe_v, mKs, ks_row, f_s, qs, m_i, l_i, alpha, p8_as_acc, p8_words, acc_o, acc_b, rem = st
        if const_expr(self.cfg.ks_ahead):
            # K's scale of block j came in one step ago; the next block's is asked for now
            ks = self.ks_next[0]
            self.ks_next[0] = Float32(mKs[ks_row + cutlass.min(j + 1, self.last_block)])
        else:
            ks = Float32(mKs[ks_row + j])  # loaded before the wgmma waits, which hide its latency
        state_v = state.clone()
        state = advanced(state)
        early = const_expr(self.cfg.prep_early)
        if const_expr(early and self.cfg.adds_late):
            # before the turn: between the two issues the promotion held the other warpgroup's
            # turn (with the accumulator preset, ~130 of the ~190 instructions in it)
            self._promote(acc_o, alpha_pend, acc_b, alpha)
        self._issue_qk(pipe_k, state, mma, sync_turn=True)
        if const_expr(self.cfg.adds_late and not early):
            self._promote(acc_o, alpha_pend, acc_b, alpha)
        self._issue_pv(pipe_v, state_v, mma, (j - 1) % 2)
        self._turn_pass()
        warpgroup.wait_group(1)  # S of block j is in
        pipe_k.consumer_release(state)
        self._softmax(f_s, qs, ks, m_i, l_i, alpha, masked, rem)
        if const_expr(self.cfg.p_smem):
            self._to_p8(f_s, p8_as_acc, p8_words)
            self._store_p(mma, j % 2)
        warpgroup.wait_group(0)  # P V of block j - 1 is in: acc_b and P's registers are free
        fenced = []
        if const_expr(self.cfg.p_fence):  # CuteConfig: P in registers
            # the old P read again only now (folded into the new P through a zero the compiler
            # cannot see): its registers stay P's through the softmax above, which ptxas would
            # otherwise hand to softmax temporaries and wait for the P V before it
            for w in cutlass.range_constexpr(cute.size(p8_words)):
                fenced.append(_operand_fence(p8_words[w]))
        pipe_v.consumer_release(state_v)
        if const_expr(not self.cfg.adds_late):
            self._promote(acc_o, alpha_pend, acc_b, alpha)
        if const_expr(not self.cfg.p_smem):
            self._to_p8(f_s, p8_as_acc, p8_words)
        if const_expr(self.cfg.p_fence):  # CuteConfig: P in registers
            for w in cutlass.range_constexpr(cute.size(p8_words)):
                p8_words[w] = p8_words[w] ^ (fenced[w] & self.zero)
        return state

    @cute.jit
    def _promote(self, acc_o, alpha_pend, acc_b, alpha):
        """The P V in acc_b added into the output (scaled by ``alpha_pend``), which then takes
        the newest block's ``alpha``."""
        self._add_block(acc_o, alpha_pend, acc_b)
        alpha_pend[0] = alpha[0]
        alpha_pend[1] = alpha[1]

    @cute.jit
    def _plain_step(self, st, state, j, masked: cutlass.Constexpr):
        """Block j with every wgmma waited for at once. Returns the next pipeline state."""
        mma, pipe_k, pipe_v, mKs, ks_row, f_s, qs, m_i, l_i, alpha, p8_as_acc, p8_words, acc_o, acc_b, rem = st
        ks = Float32(mKs[ks_row + j])  # loaded before the wgmma wait, which hides its latency
        self._issue_qk(pipe_k, state, mma, sync_turn=False)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        self._softmax(f_s, qs, ks, m_i, l_i, alpha, masked, rem)
        self._to_p8(f_s, p8_as_acc, p8_words)
        if const_expr(self.cfg.p_smem):
            self._store_p(mma, 0)
        self._issue_pv(pipe_v, state, mma, 0)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(state)
        self._add_block(acc_o, alpha, acc_b)
        return advanced(state)

    @cute.jit
    def _add_block(self, acc_o, alpha, acc_b):
        """acc_o = acc_o * alpha (per row) + acc_b: one FFMA per element (the fp32 promotion)."""
        for v in cutlass.range_constexpr(cute.size(acc_o)):
            acc_o[v] = acc_o[v] * alpha[(v // 2) % 2] + acc_b[v]

    @cute.jit
    def _softmax(self, f_s, qs, ks, m_i, l_i, alpha, masked: cutlass.Constexpr, rem):
        """Online softmax of one block in place: f_s (floats MAGIC_F + s) becomes
        p = 2 ** (s * rs - m + LOG2_PSCALE); updates m_i, l_i (per-thread partial sums), alpha.
        ``masked``: the segment's last, partial block: columns past ``rem`` get p = 0."""
        n = cute.size(f_s)
        if const_expr(self.cfg.prep_early):  # S started from zero: its bits become MAGIC_F + s here
            i_s = cute.recast_tensor(f_s, Int32)
            for v in cutlass.range_constexpr(n):
                i_s[v] = i_s[v] + Int32(numerics.MAGIC_I)
        if const_expr(masked):
            for v in cutlass.range_constexpr(n):
                off = 8 * (v // 4) + v % 2  # column of value v (e, r, i) past the thread's first
                f_s[v] = cutlass.select_(Int32(off) >= rem, -Float32.inf, f_s[v])
        for r in cutlass.range_constexpr(2):
            rs = qs[r] * ks
            if const_expr(self.cfg.short_chains):  # a tree: 5 dependent FMNMX, not 32
                mx = _tree_max([f_s[e + 2 * r + 4 * i] for i in range(n // 4) for e in range(2)])
            else:
                mx = f_s[2 * r]
                for i in cutlass.range_constexpr(n // 4):
                    for e in cutlass.range_constexpr(2):
                        mx = cute.arch.fmax(mx, f_s[e + 2 * r + 4 * i])
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=1))
            mx = cute.arch.fmax(mx, cute.arch.shuffle_sync_bfly(mx, offset=2))
            m_new = cute.arch.fmax(m_i[r], (mx - numerics.MAGIC_F) * rs)
            bias = numerics.MAGIC_F * rs + m_new - numerics.LOG2_PSCALE
            alpha[r] = cute.math.exp2(m_i[r] - m_new, fastmath=True)
            parts = [Float32(0.0)] * (4 if const_expr(self.cfg.short_chains) else 1)
            for i in cutlass.range_constexpr(n // 4):
                for e in cutlass.range_constexpr(2):
                    v = e + 2 * r + 4 * i
                    if const_expr((2 * i + e) % 8 < self.cfg.poly_exp2):
                        p = _exp2_poly(f_s[v] * rs - bias)
                    else:
                        p = cute.math.exp2(f_s[v] * rs - bias, fastmath=True)
                    f_s[v] = p
                    k = (2 * i + e) % len(parts)  # short_chains: four running sums, not one
                    parts[k] = parts[k] + p
            s = parts[0] if const_expr(len(parts) == 1) else (parts[0] + parts[1]) + (parts[2] + parts[3])
            l_i[r] = l_i[r] * alpha[r] + s
            m_i[r] = m_new

    @cute.jit
    def _epilogue(self, acc_o, cO, m_i, l_i, mVs, mKsum, mO, mQin, mLse, seg, h, lo, L, mb, qk_scale):
        """out = acc / l * vscale (rows < L); with the LSE, the natural log of each row's sum with
        K's smoothing undone (+ qk_scale * q . mean(K))."""
        b = seg if const_expr(self.dense) else 0
        for r in cutlass.range_constexpr(2):
            l_i[r] = l_i[r] + cute.arch.shuffle_sync_bfly(l_i[r], offset=1)
            l_i[r] = l_i[r] + cute.arch.shuffle_sync_bfly(l_i[r], offset=2)
        inv = cute.make_rmem_tensor((2,), Float32)
        for r in cutlass.range_constexpr(2):
            inv[r] = Float32(1.0) / l_i[r]
        for v in cutlass.range_constexpr(cute.size(acc_o)):
            row = mb * BLOCK_M + cO[v][0]
            col = cO[v][1]
            if row < L:
                o = acc_o[v] * inv[(v // 2) % 2] * Float32(mVs[seg, h, col])
                mO[b, lo + row, h, col] = o.to(mO.element_type)
        if const_expr(self.with_lse):
            inv_len = Float32(1.0) / Float32(cutlass.max(L, 1))
            for r in cutlass.range_constexpr(2):
                row = mb * BLOCK_M + cO[2 * r][0]
                # this thread's quarter of q . mean(K): columns of its accumulator values
                part = Float32(0.0)
                if row < L:
                    for v in cutlass.range_constexpr(cute.size(acc_o)):
                        if (v // 2) % 2 == r:
                            col = cO[v][1]
                            part = part + Float32(mQin[b, lo + row, h, col]) * Float32(mKsum[seg, h, col])
                part = part + cute.arch.shuffle_sync_bfly(part, offset=1)
                part = part + cute.arch.shuffle_sync_bfly(part, offset=2)
                if row < L:
                    if _lane_in_quad() == 0:
                        lse = (m_i[r] + cute.math.log2(l_i[r], fastmath=False) - numerics.LOG2_PSCALE) * _LN2
                        mLse[b, h, lo + row] = lse + part * inv_len * qk_scale


@cute.jit
def advanced(state):
    """A copy of the pipeline ``state`` one slot on (rebound by callers, so loops carry it)."""
    nxt = state.clone()
    nxt.advance()
    return nxt


# 2 ** x on the FMA and integer pipes instead of the MUFU: x = j + f with j = rint(x) (the
# MAGIC_F rounding trick) and f in [-0.5, 0.5], 2 ** f by a degree-3 polynomial (relative error
# 7.5e-5 in fp32, against 2 ** -4 for the e4m3 rounding of P that follows), 2 ** j added into the
# exponent bits. x is clamped at -125 (at -127 the sum of the exponents wraps into the sign
# bit), so -inf (masked keys) gives ~2 ** -125, which P's e4m3 and the row sum see as 0.
_EXP2_POLY_PTX = """{
.reg .f32 t, r, j, f, p;
.reg .b32 rb, pb;
max.f32 t, $1, 0fC2FA0000;
add.rn.f32 r, t, 0f4B400000;
sub.rn.f32 j, r, 0f4B400000;
sub.rn.f32 f, t, j;
fma.rn.f32 p, f, 0f3D61FBAB, 0f3E786F0E;
fma.rn.f32 p, p, f, 0f3F31798D;
fma.rn.f32 p, p, f, 0f3F7FFB49;
mov.b32 rb, r;
mov.b32 pb, p;
shl.b32 rb, rb, 23;
add.s32 pb, pb, rb;
mov.b32 $0, pb;
}"""


@dsl_user_op
def _exp2_poly(x: Float32, *, loc=None, ip=None) -> Float32:
    """2 ** x without the MUFU (``_EXP2_POLY_PTX``), for x < 128; x = -inf gives 2 ** -125."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], _EXP2_POLY_PTX,
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


def _tree_max(vals: list):
    """The maximum of ``vals`` (traced values; a power of two of them) by pairs, at trace time."""
    while len(vals) > 1:
        vals = [cute.arch.fmax(vals[k], vals[k + 1]) for k in range(0, len(vals), 2)]
    return vals[0]


@dsl_user_op
def _operand_fence(x: Uint32, *, loc=None, ip=None) -> Uint32:
    """``x`` unchanged, through an empty asm statement that reads and rewrites its register: the
    value is live up to here and cannot be moved across it (CUTLASS's warpgroup operand fence)."""
    return Uint32(llvm.inline_asm(T.i32(), [Uint32(x).ir_value(loc=loc, ip=ip)], "", "=r,0",
                                  has_side_effects=True, is_align_stack=False,
                                  asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def _lane_in_quad():
    tidx, _, _ = cute.arch.thread_idx()
    return tidx % 4
