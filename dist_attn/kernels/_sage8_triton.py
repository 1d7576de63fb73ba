"""Triton kernels behind :mod:`dist_attn.kernels.sage8` (imported lazily: this module imports triton).

Three launches per forward, all on one packed layout:

1. ``_prep_q_kernel``   reads Q, K and V once: quantizes Q to INT8 (one scale per row) and writes
   per-chunk partial sums of K and partial max|V| per channel (deterministic: no float atomics).
2. ``_prep_kv_kernel``  reads K and V a second time: subtracts the per-segment key mean, quantizes K
   to INT8 (one scale per key block) and V to FP8 e4m3 (one scale per channel), V written
   transposed ([D, rows]) because Hopper's 8-bit wgmma wants both operands K-major.
3. ``_attn_kernel``     the flash loop: INT8 QK^T -> int32, online softmax in exp2, P to FP8 e4m3,
   FP8 PV into fp32, V's channel scales applied once to the output.

The quantized copies live in a *padded* row space: segment ``s`` starts at
``roundup(lo_s, PAD) + PAD * s`` (PAD = 128), so every key/query block starts 128-aligned (16-byte
vector loads, no masks on loads) and the padding rows inside a segment's last block are zeros.
That start needs no prefix sum over the segments, hence no extra launch and no host sync:
``roundup(a) + roundup(b) <= roundup(a + b) + PAD`` keeps consecutive segments disjoint.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["PAD", "sage8_forward", "DEFAULT_CONFIG"]

#: Row alignment of every segment in the quantized buffers; a multiple of every BLOCK_M/BLOCK_N.
PAD = 128

# 0x4B400000 is the float 1.5 * 2**23. For |i| < 2**22 the bit pattern (0x4B400000 + i) is the float
# 12582912 + i exactly, so an int32 dot result turns into a float with one integer add instead of
# I2F, which Hopper issues at a quarter of the FFMA rate (16 vs 64+ lanes/clk/SM). Bound holds:
# |q.k| <= D * 127 * 127 = 2,064,512 < 4,194,304 for D <= 128.
_MAGIC_I = 0x4B400000
_MAGIC_F = 12582912.0
# P is quantized as p * 2**LOG2_PSCALE (< 448, the e4m3 maximum) so that small probabilities keep
# e4m3's normal range (2**-6) instead of flushing; the factor cancels in acc / l.
_LOG2_PSCALE = 8.75

#: Used by the public API; chosen from the H200 measurements in benchmarks/KERNEL_NOTES.md.
# H200 run 2 (14 heads x 38,016 x 128): BLOCK_M 64 / 4 warps / 3 stages / TMA = 13.28 ms (1.256x cuDNN),
# BLOCK_M 128 / 8 warps = 14.22 ms: at 179 registers and 106 KB of shared memory two 4-warp CTAs fit
# on an SM and overlap each other's softmax with their tensor-core work; one 8-warp CTA syncs both
# warpgroups at every TMA stage (BAR.SYNC in SASS) so MMA and softmax alternate instead.
# Run 3: quantization passes with 64-row tiles 0.320 ms vs 0.417 (32 rows), bit-identical output.
DEFAULT_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3, MAGIC=True, FAST_EXP=True,
                      USE_TMA=True, PIPE=False, PREP_TILE=64, PREP_WARPS=4, maxnreg=None)


@triton.jit
def _seg_bounds(cu, seg, used, T, PADC: tl.constexpr, DENSE: tl.constexpr):
    """(lo, L, pst): first source row, clipped length and padded start of segment ``seg``."""
    if DENSE:
        lo = 0
        hi = T
        pst = ((T + PADC - 1) // PADC) * PADC * seg
    else:
        lo = tl.load(cu + seg).to(tl.int32)
        hi = tl.load(cu + seg + 1).to(tl.int32)
        # rows [used, T) are trailing padding: never read, never written (the wrapper zeroes them)
        hi = tl.minimum(hi, used)
        lo = tl.minimum(lo, hi)
        pst = ((lo + PADC - 1) // PADC) * PADC + PADC * seg
    return lo, hi - lo, pst


@triton.jit
def _round_i8(x):
    # round half away from zero; |x| <= 127 by construction of the scale, so no clamp is needed
    return (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int32).to(tl.int8)


@triton.jit
def _to_fp8(x, INTERP: tl.constexpr):
    if INTERP:
        # Triton 3.9's interpreter rounds fp32 -> e4m3 without carrying a mantissa overflow into the
        # exponent (1.97 -> 1.0, seen on CPU), which doubled the error. Round to 3 mantissa bits
        # (nearest-even) on the fp32 bits first so the cast itself is exact. The GPU uses cvt.rn.
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _prep_q_kernel(Q, K, V, Qi8, Qs, Psum, Pmax, cu, used, T, H, R, NCHUNK, ROWS_PER, qk_scale,
                   sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                   D: tl.constexpr, TILE: tl.constexpr, PADC: tl.constexpr, DENSE: tl.constexpr):
    chunk = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    lo, L, pst = _seg_bounds(cu, seg, used, T, PADC, DENSE)
    lpad = ((L + PADC - 1) // PADC) * PADC
    r0 = chunk * ROWS_PER
    r1 = tl.minimum(r0 + ROWS_PER, lpad)
    offs_d = tl.arange(0, D)
    seg64 = seg.to(tl.int64)
    h64 = h.to(tl.int64)
    qb = Q + seg64 * sqb + h64 * sqh
    kb = K + seg64 * skb + h64 * skh
    vb = V + seg64 * svb + h64 * svh
    ksum = tl.zeros([D], dtype=tl.float32)
    vmax = tl.zeros([D], dtype=tl.float32)
    for r in range(r0, r1, TILE):
        rows = r + tl.arange(0, TILE)
        valid = (rows < L)[:, None]
        src = (lo + rows).to(tl.int64)[:, None]
        q = tl.load(qb + src * sqt + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(q), axis=1)
        # an all-zero row would give scale 0 and 0/0 = NaN: use 1 (the row quantizes to zeros)
        sc = tl.where(amax > 0, amax / 127.0, 1.0)
        qi = _round_i8(q / sc[:, None])
        dst = pst + rows
        tl.store(Qi8 + h64 * R * D + dst[:, None] * D + offs_d[None, :], qi)
        tl.store(Qs + h64 * R + dst, sc * qk_scale)
        k = tl.load(kb + src * skt + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)
        ksum += tl.sum(k, axis=0)
        v = tl.load(vb + src * svt + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v), axis=0))
    pidx = ((seg64 * NCHUNK + chunk) * H + h) * D + offs_d
    tl.store(Psum + pidx, ksum)
    tl.store(Pmax + pidx, vmax)


@triton.jit
def _prep_kv_kernel(K, V, Ki8, Ks, Vt8, Ksum, Vmax, cu, used, T, H, R,
                    skb, skt, skh, svb, svt, svh,
                    D: tl.constexpr, BN: tl.constexpr, PADC: tl.constexpr, DENSE: tl.constexpr,
                    INTERP: tl.constexpr):
    j = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    lo, L, pst = _seg_bounds(cu, seg, used, T, PADC, DENSE)
    if j * BN >= L:
        return
    offs_d = tl.arange(0, D)
    rows = j * BN + tl.arange(0, BN)
    valid = (rows < L)[:, None]
    seg64 = seg.to(tl.int64)
    h64 = h.to(tl.int64)
    src = (lo + rows).to(tl.int64)[:, None]
    sidx = (seg64 * H + h) * D + offs_d
    mean = tl.load(Ksum + sidx) / tl.maximum(L, 1).to(tl.float32)
    k = tl.load(K + seg64 * skb + h64 * skh + src * skt + offs_d[None, :], mask=valid, other=0.0)
    # smoothing: q.(k - m) = q.k - q.m, a constant per query row, so softmax is unchanged while the
    # INT8 range is spent on what varies between keys. Padding rows stay exactly zero.
    kc = tl.where(valid, k.to(tl.float32) - mean[None, :], 0.0)
    amax = tl.max(tl.max(tl.abs(kc), axis=1), axis=0)
    sc = tl.where(amax > 0, amax / 127.0, 1.0)
    ki = _round_i8(kc / sc)
    dst = pst + rows
    tl.store(Ki8 + h64 * R * D + dst[:, None] * D + offs_d[None, :], ki)
    tl.store(Ks + h64 * (R // BN) + pst // BN + j, sc)
    vamax = tl.load(Vmax + sidx)
    vsc = tl.where(vamax > 0, vamax / 448.0, 1.0)
    v = tl.load(V + seg64 * svb + h64 * svh + src * svt + offs_d[None, :], mask=valid, other=0.0)
    v8 = _to_fp8(v.to(tl.float32) / vsc[None, :], INTERP)
    # transposed store: [BN, D] tile -> Vt8[h, d, row]
    tl.store(Vt8 + h64 * D * R + offs_d[None, :] * R + dst[:, None], v8)


@triton.jit
def _exp2(x, FAST: tl.constexpr):
    if FAST:
        # tl.math.exp2 lowers to the non-ftz ex2, which ptxas wraps in a compare and two predicated
        # multiplies for denormal results; .ftz is a single MUFU.EX2. Underflow to 0 is harmless.
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.math.exp2(x)


@triton.jit
def _softmax_pv(acc, l_i, m_i, s, qs, vt, ks, lim,
                BN: tl.constexpr, MASK: tl.constexpr, MAGIC: tl.constexpr, FAST_EXP: tl.constexpr,
                INTERP: tl.constexpr):
    """One key block: s = int32 scores [BM, BN] -> online softmax -> acc += P8 @ V8 (fp32)."""
    rs = qs * ks  # [BM] per-row factor: q scale * k scale * softmax_scale * log2(e)
    if MAGIC:
        # the compiler folds the add into the wgmma accumulator init (seen in SASS: MOV 0x4b400000)
        f = (s + 0x4B400000).to(tl.float32, bitcast=True)  # 12582912 + s, exactly
        off = 12582912.0
    else:
        f = s.to(tl.float32)
        off = 0.0
    if MASK:
        cols = tl.arange(0, BN)
        f = tl.where((cols < lim)[None, :], f, float("-inf"))
    m_new = tl.maximum(m_i, (tl.max(f, axis=1) - off) * rs)
    # one FFMA per score: f * rs - (off * rs + m_new - log2(Pscale))
    bias = off * rs + m_new - 8.75
    p = _exp2(f * rs[:, None] - bias[:, None], FAST_EXP)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = tl.dot(_to_fp8(p, INTERP), tl.trans(vt), acc)
    return acc, l_i, m_new


@triton.jit
def _attn_kernel(Qi8, Qs, Ki8, Ks, Vt8, Vmax, Out, cu, used, T, H, R,
                 sob, sot, soh, q_desc, k_desc, v_desc,
                 D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PADC: tl.constexpr,
                 DENSE: tl.constexpr, MAGIC: tl.constexpr, FAST_EXP: tl.constexpr,
                 USE_TMA: tl.constexpr, PIPE: tl.constexpr, INTERP: tl.constexpr):
    mb = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    lo, L, pst = _seg_bounds(cu, seg, used, T, PADC, DENSE)
    if mb * BM >= L:
        return
    pst = tl.multiple_of(pst, PADC)
    h64 = h.to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    qrow = pst + mb * BM
    if USE_TMA:
        q = q_desc.load([(h * R + qrow).to(tl.int32), 0])
    else:
        q = tl.load(Qi8 + h64 * R * D + (qrow + offs_m)[:, None] * D + offs_d[None, :])
    qs = tl.load(Qs + h64 * R + qrow + offs_m)
    kb = Ki8 + h64 * R * D + pst * D + offs_n[:, None] * D + offs_d[None, :]
    vb = Vt8 + h64 * D * R + offs_d[:, None] * R + pst + offs_n[None, :]
    ksb = Ks + h64 * (R // BN) + pst // BN
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    n_full = L // BN
    lim = L - n_full * BN
    if PIPE:
        # software pipelining by hand: the scores of block j+1 are issued before the softmax of
        # block j, so the tensor cores can work while the MUFU/FMA units do the softmax (the
        # one-stage loop leaves them idle in turn: 2857 clk per tile ~ MMA + MUFU + ALU summed).
        # The prefetch past the last block reads allocated rows (R has PAD spare rows) and is dropped.
        if USE_TMA:
            k = k_desc.load([h * R + pst, 0])
        else:
            k = tl.load(kb)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
        for j in range(0, n_full):
            if USE_TMA:
                k = k_desc.load([h * R + pst + (j + 1) * BN, 0])
                vt = v_desc.load([h * D, pst + j * BN])
            else:
                k = tl.load(kb + (j + 1) * (BN * D))
                vt = tl.load(vb + j * BN)
            s_next = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            ks = tl.load(ksb + j)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, qs, vt, ks, BN, BN, False, MAGIC, FAST_EXP, INTERP)
            s = s_next
        if lim > 0:
            if USE_TMA:
                vt = v_desc.load([h * D, pst + n_full * BN])
            else:
                vt = tl.load(vb + n_full * BN)
            ks = tl.load(ksb + n_full)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, qs, vt, ks, lim, BN, True, MAGIC, FAST_EXP, INTERP)
    else:
        # steady state: full key blocks, no per-element mask
        for j in range(0, n_full):
            if USE_TMA:
                k = k_desc.load([h * R + pst + j * BN, 0])
                vt = v_desc.load([h * D, pst + j * BN])
            else:
                k = tl.load(kb + j * (BN * D))
                vt = tl.load(vb + j * BN)
            ks = tl.load(ksb + j)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)  # [BM, BN] int32, exact
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, qs, vt, ks, BN, BN, False, MAGIC, FAST_EXP, INTERP)
        if lim > 0:
            # last, partial key block: the padding keys are zeros in Ki8/Vt8 but must get p = 0
            if USE_TMA:
                k = k_desc.load([h * R + pst + n_full * BN, 0])
                vt = v_desc.load([h * D, pst + n_full * BN])
            else:
                k = tl.load(kb + n_full * (BN * D))
                vt = tl.load(vb + n_full * BN)
            ks = tl.load(ksb + n_full)
            s = tl.dot(q, tl.trans(k), out_dtype=tl.int32)
            acc, l_i, m_i = _softmax_pv(acc, l_i, m_i, s, qs, vt, ks, lim, BN, True, MAGIC, FAST_EXP, INTERP)
    sidx = (seg.to(tl.int64) * H + h) * D + offs_d
    vamax = tl.load(Vmax + sidx)
    vsc = tl.where(vamax > 0, vamax / 448.0, 1.0)
    o = acc * (1.0 / l_i)[:, None] * vsc[None, :]
    rows = mb * BM + offs_m
    optr = Out + seg.to(tl.int64) * sob + h64 * soh + (lo + rows).to(tl.int64)[:, None] * sot + offs_d[None, :]
    tl.store(optr, o.to(Out.dtype.element_ty), mask=(rows < L)[:, None])


#: the compiled kernels of the last launch (benchmarks read registers / SASS from them)
_LAST: dict = {}


def _stats_grid(max_seqlen: int, nseg: int, heads: int) -> tuple[int, int]:
    """(NCHUNK, ROWS_PER): about 1024 programs for kernel 1, ROWS_PER a multiple of PAD."""
    nblk = max(1, triton.cdiv(max_seqlen, PAD))
    nchunk = max(1, min(nblk, triton.cdiv(1024, max(1, nseg * heads))))
    rows_per = triton.cdiv(nblk, nchunk) * PAD
    nchunk = triton.cdiv(nblk * PAD, rows_per)
    return nchunk, rows_per


def _prepare(q, k, v, cu_seqlens, nseg, max_seqlen, used, dense, softmax_scale, R, BN, sq, sk, sv,
             interpret, tile, warps):
    """Launches 1 and 2: INT8 Q (+ per-row scales), INT8 smoothed K (+ per-block scales), FP8 V^T."""
    B, T, H, D = q.shape
    dev = q.device
    qi8 = torch.empty((H, R, D), dtype=torch.int8, device=dev)
    qsc = torch.empty((H, R), dtype=torch.float32, device=dev)
    ki8 = torch.empty((H, R, D), dtype=torch.int8, device=dev)
    ksc = torch.empty((H, R // BN), dtype=torch.float32, device=dev)
    vt8 = torch.empty((H, D, R), dtype=torch.float8_e4m3fn, device=dev)
    nchunk, rows_per = _stats_grid(max_seqlen, nseg, H)
    psum = torch.empty((nseg, nchunk, H, D), dtype=torch.float32, device=dev)
    pmax = torch.empty((nseg, nchunk, H, D), dtype=torch.float32, device=dev)
    cu = psum if dense else cu_seqlens  # dense: never read, any pointer will do
    qk_scale = softmax_scale * math.log2(math.e)
    _LAST["prep_q"] = _prep_q_kernel[(nchunk, nseg, H)](
        q, k, v, qi8, qsc, psum, pmax, cu, used, T, H, R, nchunk, rows_per, qk_scale,
        sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        D=D, TILE=tile, PADC=PAD, DENSE=dense, num_warps=warps)
    # tiny deterministic reductions over the chunk axis: [nseg, NCHUNK, H, D] -> [nseg, H, D]
    ksum = psum.sum(dim=1)
    vmax = pmax.amax(dim=1)
    nkb = triton.cdiv(max_seqlen, BN)
    _LAST["prep_kv"] = _prep_kv_kernel[(nkb, nseg, H)](
        k, v, ki8, ksc, vt8, ksum, vmax, cu, used, T, H, R,
        sk[0], sk[1], sk[2], sv[0], sv[1], sv[2],
        D=D, BN=BN, PADC=PAD, DENSE=dense, INTERP=interpret, num_warps=warps)
    return qi8, qsc, ki8, ksc, vt8, vmax, cu


def sage8_forward(q, k, v, out, *, cu_seqlens, nseg: int, max_seqlen: int, used: int, dense: bool,
                  softmax_scale: float, config: dict | None = None, interpret: bool = False):
    """Runs the three launches. q/k/v/out are 4-D views [B, T, H, D] (B = 1 for varlen, strides may be
    anything with stride(-1) == 1); ``cu_seqlens`` is a device int tensor (ignored when ``dense``);
    ``nseg`` segments (= B when dense). Writes rows of each segment into ``out``; leaves others."""
    cfg = dict(DEFAULT_CONFIG)
    if config:
        cfg.update(config)
    if interpret:
        cfg["FAST_EXP"] = False  # inline PTX cannot run in the interpreter
    BM, BN = cfg["BLOCK_M"], cfg["BLOCK_N"]
    assert PAD % BM == 0 and PAD % BN == 0
    B, T, H, D = q.shape
    dev = q.device
    # padded rows: sum over segments of roundup(len, PAD) + PAD per segment (module docstring), plus
    # PAD spare rows so that a one-block-ahead prefetch never leaves the buffer
    if dense:
        R = nseg * triton.cdiv(T, PAD) * PAD + PAD
    else:
        R = triton.cdiv(T, PAD) * PAD + PAD * nseg + PAD
    phase = cfg.get("PHASE", "all")  # benchmarks only: "prep" or "attn" time one half
    sq, sk, sv, so = (list(t.stride()) for t in (q, k, v, out))
    if not dense:
        # varlen: all segments live in the one packed [T] axis; program axis 1 is the segment index
        sq[0] = sk[0] = sv[0] = so[0] = 0
    if phase == "attn":
        qi8, qsc, ki8, ksc, vt8, vmax, cu = _LAST["bufs"]
    else:
        qi8, qsc, ki8, ksc, vt8, vmax, cu = _prepare(q, k, v, cu_seqlens, nseg, max_seqlen, used, dense,
                                                     softmax_scale, R, BN, sq, sk, sv, interpret,
                                                     cfg["PREP_TILE"], cfg["PREP_WARPS"])
        if phase == "prep":
            _LAST["bufs"] = (qi8, qsc, ki8, ksc, vt8, vmax, cu)
            return out
    if cfg["USE_TMA"]:
        from triton.tools.tensor_descriptor import TensorDescriptor
        q_desc = TensorDescriptor.from_tensor(qi8.view(H * R, D), [BM, D])
        k_desc = TensorDescriptor.from_tensor(ki8.view(H * R, D), [BN, D])
        v_desc = TensorDescriptor.from_tensor(vt8.view(H * D, R), [D, BN])
    else:
        q_desc = k_desc = v_desc = qi8  # unused
    nmb = triton.cdiv(max_seqlen, BM)
    extra = {} if cfg["maxnreg"] is None or interpret else {"maxnreg": cfg["maxnreg"]}
    _LAST["attn"] = _attn_kernel[(nmb, nseg, H)](
        qi8, qsc, ki8, ksc, vt8, vmax, out, cu, used, T, H, R,
        so[0], so[1], so[2], q_desc, k_desc, v_desc,
        D=D, BM=BM, BN=BN, PADC=PAD, DENSE=dense, MAGIC=cfg["MAGIC"], FAST_EXP=cfg["FAST_EXP"],
        USE_TMA=cfg["USE_TMA"], PIPE=cfg["PIPE"], INTERP=interpret, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra)
    return out
