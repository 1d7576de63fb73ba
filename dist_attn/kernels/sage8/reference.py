# SPDX-License-Identifier: Apache-2.0
"""The Sage8 scheme in plain torch: what the kernels compute, rounding step by rounding step.

Runs anywhere torch does (CPU CI included): the GPU tests compare the kernels' quantized operands
and outputs with it, and the accuracy notes measure variants of the scheme with it before any
kernel exists (e.g. ``balance=True`` below).

The P.V product is modelled as the tensor cores compute it (``pv_accum``): Hopper's FP8 wgmma keeps
only ~``MMA_ACC_BITS`` mantissa bits of its running sum, so an output accumulated inside the MMA over
a whole sequence ("running", kept to measure against) loses low bits at every k-step, biased
toward zero; "block" (what the kernels do) starts every key block in a fresh MMA accumulator and
adds it into fp32 registers; "exact" sums in float64 (what Triton's CPU interpreter does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dist_attn.kernels.sage8.numerics import FP8_MAX, INT8_MAX, LOG2_PSCALE, MMA_ACC_BITS, MMA_K_STEP

__all__ = ["PvAccum", "RefQuantized", "quantize", "attention", "mma_truncate", "sage8_reference"]

#: how P.V is accumulated (see the module docstring)
PvAccum = Literal["block", "running", "exact"]


@dataclass(frozen=True)
class RefQuantized:
    """One segment's 8-bit operands (shapes for Tq query and Tk key rows, H heads, head_dim D,
    kblock keys a block)."""

    qi8: torch.Tensor     # [Tq, H, D] int8
    qscale: torch.Tensor  # [Tq, H] fp32, includes softmax_scale * log2(e)
    ki8: torch.Tensor     # [Tk, H, D] int8 of K minus its channel mean
    kscale: torch.Tensor  # [ceil(Tk / kblock), H] fp32
    v8: torch.Tensor      # [Tk, H, D] float8_e4m3fn of (V - vmean) / vscale
    vscale: torch.Tensor  # [H, D] fp32
    kmean: torch.Tensor   # [H, D] fp32
    vmean: torch.Tensor   # [H, D] fp32: V's channel mean when smoothing V, else zeros
    kblock: int


def _round_i8(x: torch.Tensor) -> torch.Tensor:
    # round half away from zero, as the kernels do
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def _scale_of(amax: torch.Tensor, top: float) -> torch.Tensor:
    # an all-zero group quantizes to zeros with scale 1 (0 / 0 would be NaN)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def mma_truncate(x: torch.Tensor, bits: int = MMA_ACC_BITS) -> torch.Tensor:
    """``x`` (float64) with ``bits`` explicit mantissa bits kept, truncated toward zero: the model
    of the FP8 wgmma accumulator after one k-step."""
    m, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    s = float(2 ** (bits + 1))
    return torch.ldexp(torch.trunc(m * s) / s, e)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, *,
             kblock: int = 128, balance: bool = False, smooth_v: bool = False) -> RefQuantized:
    """Quantizes one segment. q: ``[Tq, H, D]``, k/v: ``[Tk, H, D]`` float tensors (any float
    dtype; a ring piece has Tq != Tk).

    ``smooth_v``: subtract V's per-head channel mean before FP8 and add it back to the output
    (exact up to rounding: the softmax weights of a row sum to one). A studied variant the kernels
    do not implement: it lowers the error when V has channel means and raises it on zero-mean V
    (see benchmarks/KERNEL_NOTES.md).

    ``balance``: before INT8, multiply Q's channel c by s_c and divide centred K's by s_c with
    s_c = sqrt(amax|K_c| / amax|Q_c|) per head: Q.K is unchanged exactly, and an outlier channel of
    one side is shared by both. (A variant of the scheme; the kernels do not implement it.)
    """
    if q.dim() != 3 or q.shape[1:] != k.shape[1:] or k.shape != v.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q "
                         "[Tq, H, D] and k, v [Tk, H, D] of one H and D")
    T, H, D = k.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    kmean = kf.mean(dim=0)  # [H, D]
    kc = kf - kmean
    if balance:
        qa = qf.abs().amax(dim=0)
        ka = kc.abs().amax(dim=0)
        s = torch.where((qa > 0) & (ka > 0), (ka / qa.clamp_min(1e-30)).sqrt(), torch.ones_like(qa))
        qf = qf * s
        kc = kc / s
    qsc = _scale_of(qf.abs().amax(dim=-1), INT8_MAX)  # [Tq, H]
    qi8 = _round_i8(qf / qsc[..., None])
    nblk = -(-T // kblock)
    pad = nblk * kblock - T
    kpad = torch.cat([kc, kc.new_zeros(pad, H, D)]).view(nblk, kblock, H, D)
    ksc = _scale_of(kpad.abs().amax(dim=(1, 3)), INT8_MAX)  # [nblk, H]
    ki8 = _round_i8(kpad / ksc[:, None, :, None]).view(nblk * kblock, H, D)[:T]
    vmean = vf.mean(dim=0) if smooth_v else vf.new_zeros(H, D)  # [H, D]
    vc = vf - vmean
    vsc = _scale_of(vc.abs().amax(dim=0), FP8_MAX)  # [H, D]
    v8 = (vc / vsc).to(torch.float8_e4m3fn)
    return RefQuantized(qi8=qi8, qscale=qsc * (softmax_scale * math.log2(math.e)), ki8=ki8, kscale=ksc,
                        v8=v8, vscale=vsc, kmean=kmean, vmean=vmean, kblock=kblock)


def _mma_sum(p8: torch.Tensor, v8: torch.Tensor, acc: torch.Tensor, bits: int) -> torch.Tensor:
    """``acc + p8 @ v8`` as one MMA accumulator computes it: each ``MMA_K_STEP``-key step's
    products summed exactly, then added to the accumulator and truncated to ``bits`` bits."""
    for s in range(0, p8.shape[-1], MMA_K_STEP):
        acc = mma_truncate(acc + p8[..., s:s + MMA_K_STEP] @ v8[:, s:s + MMA_K_STEP], bits)
    return acc


def attention(rq: RefQuantized, q: torch.Tensor | None = None, softmax_scale: float | None = None, *,
              pv_accum: PvAccum = "block", acc_bits: int = MMA_ACC_BITS,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention loop on ``rq`` in float64, block by block as the kernels do it: running max
    per key block, P rounded to e4m3 after scaling by 2**LOG2_PSCALE, P.V accumulated as
    ``pv_accum`` says (with ``acc_bits`` bits in the MMA accumulator), V's scales (and V's mean when
    smoothing) applied at the end.

    ``rows``: indices of the query rows to compute (default all): the long-sequence accuracy tests
    check a sample of rows against every key.

    Returns ``(out [R, H, D] float64, lse [H, R] float64 or None)`` for the R computed rows; the LSE
    (natural log of the scaled scores' sum) needs the caller's ``q`` and ``softmax_scale`` to undo
    the K smoothing.
    """
    T, H, D = rq.ki8.shape
    sel = slice(None) if rows is None else rows
    qi = rq.qi8[sel].double().transpose(0, 1)  # [H, R, D]
    ki = rq.ki8.double().transpose(0, 1)  # [H, T, D]
    v8 = rq.v8.double().transpose(0, 1)
    qs = rq.qscale[sel].double().T  # [H, R]
    R = qi.shape[1]
    m = torch.full((H, R), float("-inf"), dtype=torch.float64)
    l_sum = torch.zeros((H, R), dtype=torch.float64)
    acc = torch.zeros((H, R, D), dtype=torch.float64)
    for j, a in enumerate(range(0, T, rq.kblock)):
        b = min(a + rq.kblock, T)
        x = (qi @ ki[:, a:b].transpose(1, 2)) * (qs * rq.kscale[j].double()[:, None])[..., None]
        m_new = torch.maximum(m, x.amax(dim=-1))
        p = torch.exp2(x - m_new[..., None] + LOG2_PSCALE).float()
        alpha = torch.exp2(m - m_new)
        l_sum = l_sum * alpha + p.double().sum(-1)
        p8 = p.to(torch.float8_e4m3fn).double()
        if pv_accum == "exact":
            acc = acc * alpha[..., None] + p8 @ v8[:, a:b]
        elif pv_accum == "running":
            # the rescale is an fp32 multiply in registers; the sum stays inside the MMA
            acc = _mma_sum(p8, v8[:, a:b], (acc * alpha[..., None]).float().double(), acc_bits)
        elif pv_accum == "block":
            # a fresh accumulator per key block, added into fp32 registers with one FFMA
            part = _mma_sum(p8, v8[:, a:b], torch.zeros_like(acc), acc_bits)
            acc = (acc * alpha[..., None] + part).float().double()
        else:
            raise ValueError(f"pv_accum={pv_accum!r} is not one of 'block', 'running', 'exact'")
        m = m_new
    out = acc / l_sum[..., None] * rq.vscale.double()[:, None, :] + rq.vmean.double()[:, None, :]
    out = out.transpose(0, 1)
    lse = None
    if q is not None:
        shift = torch.einsum("thd,hd->ht", q[sel].double(), rq.kmean.double()) * softmax_scale
        lse = (m + torch.log2(l_sum) - LOG2_PSCALE) * math.log(2.0) + shift
    return out, lse


def sage8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    *, kblock: int = 128, balance: bool = False, smooth_v: bool = False,
                    pv_accum: PvAccum = "block", acc_bits: int = MMA_ACC_BITS,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sage8 on one segment, q ``[Tq, H, D]`` against k, v ``[Tk, H, D]``: ``(out [R, H, D]
    float64, lse [H, R] float64)`` for the query ``rows`` (default all Tq). The defaults model
    the shipped kernels."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    rq = quantize(q, k, v, scale, kblock=kblock, balance=balance, smooth_v=smooth_v)
    return attention(rq, q, scale, pv_accum=pv_accum, acc_bits=acc_bits, rows=rows)
