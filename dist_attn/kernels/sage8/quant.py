# SPDX-License-Identifier: Apache-2.0
"""Quantization pre-pass of Sage8 (Triton; importing this module imports triton).

Two passes read the caller's Q, K, V (any strides with a contiguous last dim) and write the
8-bit operands of the attention kernels into a padded row space (:func:`numerics.padded_rows`):

1. ``_stats_kernel`` reads K and V (and Q when balancing) once, in chunks of rows, and writes
   per-chunk channel statistics: sum K, max |V| (and max K, min K, max |Q| when balancing);
   ``_finish_kernel`` reduces them over the chunks (a few KB; fixed order, no float atomics) into
   K's channel mean, V's channel scales and the balancing factors.
2. ``_quant_kernel`` reads Q, K, V once more, one block of rows per program (Q blocks and K/V
   blocks in separate programs): Q -> INT8 with one scale per row (``softmax_scale * log2(e)``
   folded in); K minus its per-(segment, head) channel mean -> INT8 with one scale per block;
   V -> FP8 e4m3 with one scale per channel, stored transposed (``[H, D, R]``) because Hopper's
   8-bit wgmma needs its B operand K-major, its keys in the order the attention loop reads them
   (``numerics.V_KEY_ORDERS``).

Padding rows of a segment's last block are written as zeros in every buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dist_attn.kernels.sage8 import numerics

__all__ = ["PackedLayout", "QuantConfig", "Quantized", "quantize", "seg_bounds", "seg_strides", "to_fp8"]

_PAD = tl.constexpr(numerics.PAD)
_I8MAX = tl.constexpr(numerics.INT8_MAX)
_FP8MAX = tl.constexpr(numerics.FP8_MAX)
#: kernel 1 gets about this many programs (enough to fill 132 SMs several times over)
_STATS_PROGRAMS = 1024
#: chunks of partial statistics the finishing kernel reads per step
_FINISH_CHUNKS = 64


@dataclass(frozen=True)
class PackedLayout:
    """Where the rows of each segment live, in the caller's tensors and in the padded row space.

    ``dense``: ``nseg`` batches of ``total`` rows each (``cu`` unused). Varlen: ``nseg`` segments
    of one packed axis of ``total`` rows with bounds ``cu`` (a device tensor, never read on the
    host), clipped to ``[0, used)``. ``max_seqlen`` bounds every segment's length (sizes grids).
    """

    dense: bool
    nseg: int
    total: int
    used: int
    max_seqlen: int
    cu: torch.Tensor | None

    @property
    def rows(self) -> int:
        return numerics.padded_rows(self.total, self.nseg, self.dense)


@dataclass(frozen=True)
class QuantConfig:
    """Options of the pre-pass.

    ``balance``: per-channel Q/K balancing before INT8 (see :func:`reference.quantize`); costs one
    more read of Q. ``tile`` rows per step of Q's quantization, ``stats_tile`` rows per step of the
    statistics pass (its partials are ``[stats_tile, D]`` registers per statistic), ``warps`` per
    program.
    """

    balance: bool = False
    tile: int = 64
    stats_tile: int = 16
    warps: int = 4

    def __post_init__(self):
        # refused when the config is made, not when Triton fails to compile a block shape
        for name in ("tile", "stats_tile", "warps"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 1 or val & (val - 1):
                raise ValueError(f"QuantConfig.{name}={val!r} must be a power of two")


@dataclass(frozen=True)
class Quantized:
    """The 8-bit operands of one forward, in the padded row space of ``layout`` (R rows)."""

    layout: PackedLayout
    qi8: torch.Tensor     # [H, R, D] int8
    qscale: torch.Tensor  # [H, R] fp32: amax/127 * softmax_scale * log2(e) per row
    ki8: torch.Tensor     # [H, R, D] int8, K minus its segment mean
    kscale: torch.Tensor  # [H, R // kblock] fp32, one per key block
    vt8: torch.Tensor     # [H, D, R] float8_e4m3fn, V / vscale, transposed
    vscale: torch.Tensor  # [nseg, H, D] fp32: max |V| / 448 per channel (1 for all-zero channels)
    ksum: torch.Tensor    # [nseg, H, D] fp32: sum of K per channel (mean = ksum / length)
    kblock: int
    v_order: str = "keys"  # how vt8's columns hold the keys: one of numerics.V_KEY_ORDERS


@triton.jit
def seg_bounds(cu, seg, used, T, DENSE: tl.constexpr):
    """(lo, L, pst): first source row, clipped length and padded start of segment ``seg``.

    The one rule: the Gluon kernel's ``_seg_bounds`` is derived from this body (a test checks)."""
    if DENSE:
        lo = 0
        hi = T
        pst = ((T + _PAD - 1) // _PAD) * _PAD * seg
    else:
        lo = tl.load(cu + seg).to(tl.int32)
        hi = tl.load(cu + seg + 1).to(tl.int32)
        # rows [used, T) are trailing padding: never read, never written (the caller zeroes them)
        hi = tl.minimum(hi, used)
        lo = tl.minimum(lo, hi)
        pst = ((lo + _PAD - 1) // _PAD) * _PAD + _PAD * seg
    return lo, hi - lo, pst


@triton.jit
def _round_i8(x):
    # round half away from zero; |x| <= 127 by construction of the scale, so no clamp is needed
    return (x + tl.where(x >= 0, 0.5, -0.5)).to(tl.int32).to(tl.int8)


@triton.jit
def to_fp8(x, INTERP: tl.constexpr):
    """fp32 -> e4m3, round to nearest even (the GPU's cvt.rn)."""
    if INTERP:
        # Triton 3.9's interpreter rounds fp32 -> e4m3 without carrying a mantissa overflow into the
        # exponent (1.97 -> 1.0, seen on CPU), which doubled the error. Round to 3 mantissa bits
        # (nearest-even) on the fp32 bits first so the cast itself is exact.
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
        x = b.to(tl.float32, bitcast=True)
    return x.to(tl.float8e4nv)


@triton.jit
def _load_rows(base, src, stride, offs_d, valid):
    """[TILE, D] fp32 tile of rows ``src`` (masked by ``valid``, zeros elsewhere)."""
    return tl.load(base + src * stride + offs_d[None, :], mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _stats_kernel(Q, K, V, Pstat, cu, used, T, H, NCHUNK, ROWS_PER,
                  sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                  D: tl.constexpr, TILE: tl.constexpr, DENSE: tl.constexpr, BALANCE: tl.constexpr):
    """Per-chunk channel statistics: sum K and max |V| (max K, min K and max |Q| when balancing;
    those slots of ``Pstat`` are left unwritten otherwise)."""
    chunk = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    lo, L, pst = seg_bounds(cu, seg, used, T, DENSE)
    r0 = chunk * ROWS_PER
    r1 = tl.minimum(r0 + ROWS_PER, L)
    offs_d = tl.arange(0, D)
    seg64 = seg.to(tl.int64)
    h64 = h.to(tl.int64)
    qb = Q + seg64 * sqb + h64 * sqh
    kb = K + seg64 * skb + h64 * skh
    vb = V + seg64 * svb + h64 * svh
    # elementwise partials over the chunk's tiles, reduced across rows once at the end (a reduction
    # per tile crosses warps through shared memory, a barrier each time). K's max and min and Q's
    # max |Q| feed only the balancing factors.
    ksum = tl.zeros([TILE, D], dtype=tl.float32)
    vmax = tl.zeros([TILE, D], dtype=tl.float32)
    if BALANCE:
        kmax = tl.full([TILE, D], float("-inf"), dtype=tl.float32)
        kmin = tl.full([TILE, D], float("inf"), dtype=tl.float32)
        qmax = tl.zeros([TILE, D], dtype=tl.float32)
    for r in range(r0, r1, TILE):
        rows = r + tl.arange(0, TILE)
        valid = (rows < r1)[:, None]
        src = (lo + rows).to(tl.int64)[:, None]
        k = _load_rows(kb, src, skt, offs_d, valid)
        ksum += k
        vmax = tl.maximum(vmax, tl.abs(_load_rows(vb, src, svt, offs_d, valid)))
        if BALANCE:
            kmax = tl.maximum(kmax, tl.where(valid, k, float("-inf")))
            kmin = tl.minimum(kmin, tl.where(valid, k, float("inf")))
            qmax = tl.maximum(qmax, tl.abs(_load_rows(qb, src, sqt, offs_d, valid)))
    base = Pstat + (seg64 * NCHUNK + chunk) * 5 * H * D + h * D + offs_d
    tl.store(base, tl.sum(ksum, axis=0))
    tl.store(base + 3 * H * D, tl.max(vmax, axis=0))
    if BALANCE:
        tl.store(base + H * D, tl.max(kmax, axis=0))
        tl.store(base + 2 * H * D, tl.min(kmin, axis=0))
        tl.store(base + 4 * H * D, tl.max(qmax, axis=0))


@triton.jit
def _quant_kernel(Q, K, V, Qi8, Qs, Ki8, Ks, Vt8, Stat, cu, used, T, H, R, NKB, qk_scale,
                  sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                  D: tl.constexpr, BN: tl.constexpr, QTILE: tl.constexpr, DENSE: tl.constexpr,
                  BALANCE: tl.constexpr, INTERP: tl.constexpr, V_MMA: tl.constexpr):
    """Program j < NKB: Q rows of block j to INT8; program NKB + j: K and V of block j."""
    pid = tl.program_id(0)
    seg = tl.program_id(1)
    h = tl.program_id(2)
    j = pid % NKB
    lo, L, pst = seg_bounds(cu, seg, used, T, DENSE)
    if j * BN >= L:
        return
    offs_d = tl.arange(0, D)
    seg64 = seg.to(tl.int64)
    h64 = h.to(tl.int64)
    sidx = (seg64 * 4 * H + h) * D + offs_d  # Stat: [nseg, 4, H, D] = mean K, K balance, V scale, Q balance
    if pid < NKB:
        # Q: one scale per row, so QTILE rows at a time (fewer registers than a whole block)
        for r in range(j * BN, j * BN + BN, QTILE):
            rows = r + tl.arange(0, QTILE)
            valid = (rows < L)[:, None]
            q = _load_rows(Q + seg64 * sqb + h64 * sqh, (lo + rows).to(tl.int64)[:, None], sqt, offs_d, valid)
            if BALANCE:  # (q * s).(k / s) = q.k, per channel
                q = q * tl.load(Stat + sidx + 3 * H * D)[None, :]
            amax = tl.max(tl.abs(q), axis=1)
            # an all-zero row would give scale 0 and 0/0 = NaN: use 1 (the row quantizes to zeros)
            sc = tl.where(amax > 0, amax / _I8MAX, 1.0)
            dst = pst + rows
            tl.store(Qi8 + h64 * R * D + dst[:, None] * D + offs_d[None, :], _round_i8(q / sc[:, None]))
            tl.store(Qs + h64 * R + dst, sc * qk_scale)
    else:
        rows = j * BN + tl.arange(0, BN)
        valid = (rows < L)[:, None]
        src = (lo + rows).to(tl.int64)[:, None]
        dst = pst + rows
        # smoothing: q.(k - m) = q.k - q.m, a constant per query row, so softmax is unchanged while
        # the INT8 range is spent on what varies between keys. Padding rows stay exactly zero.
        k = _load_rows(K + seg64 * skb + h64 * skh, src, skt, offs_d, valid)
        kc = tl.where(valid, k - tl.load(Stat + sidx)[None, :], 0.0)
        if BALANCE:
            kc = kc * tl.load(Stat + sidx + H * D)[None, :]
        kamax = tl.max(tl.max(tl.abs(kc), axis=1), axis=0)
        ksc = tl.where(kamax > 0, kamax / _I8MAX, 1.0)
        tl.store(Ki8 + h64 * R * D + dst[:, None] * D + offs_d[None, :], _round_i8(kc / ksc))
        tl.store(Ks + h64 * (R // BN) + pst // BN + j, ksc)
        vsc = tl.load(Stat + sidx + 2 * H * D)
        if V_MMA:
            # numerics.V_KEY_ORDERS "mma": column 16 h + 4 t + 2 j + e of each 16 holds key
            # 16 h + 8 j + 2 t + e (numerics.mma_key_order). The rows are gathered in that order so
            # that the transposed store below stays contiguous along the keys (16-byte stores; a
            # scattered store compiles to one byte per instruction).
            c = tl.arange(0, BN)
            rows = j * BN + ((c & -16) | (((c >> 1) & 1) << 3) | (((c >> 2) & 3) << 1) | (c & 1))
            valid = (rows < L)[:, None]
            src = (lo + rows).to(tl.int64)[:, None]
        v = _load_rows(V + seg64 * svb + h64 * svh, src, svt, offs_d, valid)
        # transposed store: [BN, D] tile -> Vt8[h, d, column]
        tl.store(Vt8 + h64 * D * R + offs_d[None, :] * R + dst[:, None], to_fp8(v / vsc[None, :], INTERP))


def _stats_grid(max_seqlen: int, nseg: int, heads: int) -> tuple[int, int]:
    """(NCHUNK, ROWS_PER): about _STATS_PROGRAMS programs for kernel 1, ROWS_PER a multiple of PAD."""
    pad = numerics.PAD
    nblk = max(1, triton.cdiv(max_seqlen, pad))
    nchunk = max(1, min(nblk, triton.cdiv(_STATS_PROGRAMS, max(1, nseg * heads))))
    rows_per = triton.cdiv(nblk, nchunk) * pad
    nchunk = triton.cdiv(nblk * pad, rows_per)
    return nchunk, rows_per


@triton.jit
def _finish_kernel(Pstat, Stat, Ksum, Vscale, cu, used, T, H, NCHUNK,
                   D: tl.constexpr, CT: tl.constexpr, DENSE: tl.constexpr, BALANCE: tl.constexpr):
    """One (segment, head): the chunks' partial statistics -> K's channel mean and sum, V's channel
    scales and the balancing factors (Stat[seg, :, h] = mean K, 1 / s, V scale, s; s = 1 unless
    balancing). Chunks are added in a fixed order: deterministic."""
    seg = tl.program_id(0)
    h = tl.program_id(1)
    lo, L, pst = seg_bounds(cu, seg, used, T, DENSE)
    offs_d = tl.arange(0, D)
    seg64 = seg.to(tl.int64)
    ksum = tl.zeros([D], dtype=tl.float32)
    vmax = tl.zeros([D], dtype=tl.float32)
    kmax = tl.full([D], float("-inf"), dtype=tl.float32)
    kmin = tl.full([D], float("inf"), dtype=tl.float32)
    qmax = tl.zeros([D], dtype=tl.float32)
    for c0 in range(0, NCHUNK, CT):
        ch = c0 + tl.arange(0, CT)
        ok = (ch < NCHUNK)[:, None]
        base = Pstat + ((seg64 * NCHUNK + ch) * 5 * H + h)[:, None] * D + offs_d[None, :]
        ksum += tl.sum(tl.load(base, mask=ok, other=0.0), axis=0)
        vmax = tl.maximum(vmax, tl.max(tl.load(base + 3 * H * D, mask=ok, other=0.0), axis=0))
        if BALANCE:
            kmax = tl.maximum(kmax, tl.max(tl.load(base + H * D, mask=ok, other=float("-inf")), axis=0))
            kmin = tl.minimum(kmin, tl.min(tl.load(base + 2 * H * D, mask=ok, other=float("inf")), axis=0))
            qmax = tl.maximum(qmax, tl.max(tl.load(base + 4 * H * D, mask=ok, other=0.0), axis=0))
    mean = ksum / tl.maximum(L, 1).to(tl.float32)
    # an all-zero V channel would get scale 0 and 0/0 = NaN: use 1 (the channel quantizes to zeros)
    vsc = tl.where(vmax > 0, vmax / _FP8MAX, 1.0)
    s = tl.full([D], 1.0, dtype=tl.float32)
    if BALANCE:
        # s = sqrt(amax|K - mean| / amax|Q|) per channel; Q is multiplied by s, centred K divided
        kamax = tl.maximum(kmax - mean, mean - kmin)
        good = (kamax > 0) & (qmax > 0)
        s = tl.where(good, tl.sqrt(kamax / tl.where(good, qmax, 1.0)), 1.0)
    out = Stat + (seg64 * 4 * H + h) * D + offs_d
    tl.store(out, mean)
    tl.store(out + H * D, 1.0 / s)
    tl.store(out + 2 * H * D, vsc)
    tl.store(out + 3 * H * D, s)
    tl.store(Ksum + (seg64 * H + h) * D + offs_d, ksum)
    tl.store(Vscale + (seg64 * H + h) * D + offs_d, vsc)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: PackedLayout, softmax_scale: float,
             *, kblock: int, config: QuantConfig = QuantConfig(), interpret: bool = False,
             v_order: str = "keys") -> Quantized:
    """Both launches of the pre-pass. q/k/v: ``[B, T, H, D]`` views (B = 1 for varlen); ``v_order``
    one of ``numerics.V_KEY_ORDERS`` (what the attention loop that follows reads)."""
    if v_order not in numerics.V_KEY_ORDERS:
        raise ValueError(f"v_order={v_order!r} is not one of {numerics.V_KEY_ORDERS}")
    balance, tile, warps = config.balance, config.tile, config.warps
    B, T, H, D = q.shape
    R = layout.rows
    dev = q.device
    nseg = layout.nseg
    qi8 = torch.empty((H, R, D), dtype=torch.int8, device=dev)
    qsc = torch.empty((H, R), dtype=torch.float32, device=dev)
    ki8 = torch.empty((H, R, D), dtype=torch.int8, device=dev)
    ksc = torch.empty((H, R // kblock), dtype=torch.float32, device=dev)
    vt8 = torch.empty((H, D, R), dtype=torch.float8_e4m3fn, device=dev)
    nchunk, rows_per = _stats_grid(layout.max_seqlen, nseg, H)
    pstat = torch.empty((nseg, nchunk, 5, H, D), dtype=torch.float32, device=dev)
    cu = pstat if layout.dense else layout.cu  # dense: never read, any pointer will do
    sq, sk, sv = (seg_strides(t, layout.dense) for t in (q, k, v))
    _stats_kernel[(nchunk, nseg, H)](
        q, k, v, pstat, cu, layout.used, T, H, nchunk, rows_per, *sq, *sk, *sv,
        D=D, TILE=config.stats_tile, DENSE=layout.dense, BALANCE=balance, num_warps=warps)
    stat = torch.empty((nseg, 4, H, D), dtype=torch.float32, device=dev)
    ksum = torch.empty((nseg, H, D), dtype=torch.float32, device=dev)
    vscale = torch.empty((nseg, H, D), dtype=torch.float32, device=dev)
    _finish_kernel[(nseg, H)](pstat, stat, ksum, vscale, cu, layout.used, T, H, nchunk, D=D, CT=_FINISH_CHUNKS,
                              DENSE=layout.dense, BALANCE=balance, num_warps=4)
    nkb = triton.cdiv(layout.max_seqlen, kblock)
    _quant_kernel[(2 * nkb, nseg, H)](
        q, k, v, qi8, qsc, ki8, ksc, vt8, stat, cu, layout.used, T, H, R, nkb, softmax_scale * math.log2(math.e),
        *sq, *sk, *sv, D=D, BN=kblock, QTILE=tile, DENSE=layout.dense, BALANCE=balance, INTERP=interpret,
        V_MMA=v_order == "mma", num_warps=warps)
    return Quantized(layout=layout, qi8=qi8, qscale=qsc, ki8=ki8, kscale=ksc, vt8=vt8,
                     vscale=vscale, ksum=ksum, kblock=kblock, v_order=v_order)


def seg_strides(t: torch.Tensor, dense: bool) -> tuple[int, int, int]:
    """(segment, row, head) strides of a [B, T, H, D] view; varlen segments share the one row axis."""
    return (t.stride(0) if dense else 0), t.stride(1), t.stride(2)
