"""The Sage8 scheme in plain torch: what the kernels compute, rounding step by rounding step.

Runs anywhere torch does (CPU CI included): the GPU tests compare the kernels' quantized operands
and outputs with it, and the accuracy notes measure variants of the scheme with it before any
kernel exists (e.g. ``balance=True`` below).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dist_attn.kernels.sage8.numerics import FP8_MAX, INT8_MAX, LOG2_PSCALE

__all__ = ["RefQuantized", "quantize", "attention", "sage8_reference"]


@dataclass(frozen=True)
class RefQuantized:
    """One segment's 8-bit operands (shapes for T rows, H heads, head_dim D, kblock keys a block)."""

    qi8: torch.Tensor     # [T, H, D] int8
    qscale: torch.Tensor  # [T, H] fp32, includes softmax_scale * log2(e)
    ki8: torch.Tensor     # [T, H, D] int8 of K minus its channel mean
    kscale: torch.Tensor  # [ceil(T / kblock), H] fp32
    v8: torch.Tensor      # [T, H, D] float8_e4m3fn of V / vscale
    vscale: torch.Tensor  # [H, D] fp32
    kmean: torch.Tensor   # [H, D] fp32
    kblock: int


def _round_i8(x: torch.Tensor) -> torch.Tensor:
    # round half away from zero, as the kernels do
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def _scale_of(amax: torch.Tensor, top: float) -> torch.Tensor:
    # an all-zero group quantizes to zeros with scale 1 (0 / 0 would be NaN)
    return torch.where(amax > 0, amax / top, torch.ones_like(amax))


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, *,
             kblock: int = 128, balance: bool = False) -> RefQuantized:
    """Quantizes one segment. q/k/v: ``[T, H, D]`` float tensors (any float dtype).

    ``balance``: before INT8, multiply Q's channel c by s_c and divide centred K's by s_c with
    s_c = sqrt(amax|K_c| / amax|Q_c|) per head: Q.K is unchanged exactly, and an outlier channel of
    one side is shared by both. (A variant of the scheme; the kernels do not implement it.)
    """
    T, H, D = q.shape
    qf, kf, vf = q.float(), k.float(), v.float()
    kmean = kf.mean(dim=0)  # [H, D]
    kc = kf - kmean
    if balance:
        qa = qf.abs().amax(dim=0)
        ka = kc.abs().amax(dim=0)
        s = torch.where((qa > 0) & (ka > 0), (ka / qa.clamp_min(1e-30)).sqrt(), torch.ones_like(qa))
        qf = qf * s
        kc = kc / s
    qsc = _scale_of(qf.abs().amax(dim=-1), INT8_MAX)  # [T, H]
    qi8 = _round_i8(qf / qsc[..., None])
    nblk = -(-T // kblock)
    pad = nblk * kblock - T
    kpad = torch.cat([kc, kc.new_zeros(pad, H, D)]).view(nblk, kblock, H, D)
    ksc = _scale_of(kpad.abs().amax(dim=(1, 3)), INT8_MAX)  # [nblk, H]
    ki8 = _round_i8(kpad / ksc[:, None, :, None]).view(nblk * kblock, H, D)[:T]
    vsc = _scale_of(vf.abs().amax(dim=0), FP8_MAX)  # [H, D]
    v8 = (vf / vsc).to(torch.float8_e4m3fn)
    return RefQuantized(qi8=qi8, qscale=qsc * (softmax_scale * math.log2(math.e)), ki8=ki8, kscale=ksc,
                        v8=v8, vscale=vsc, kmean=kmean, kblock=kblock)


def attention(rq: RefQuantized, q: torch.Tensor | None = None,
              softmax_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention loop on ``rq`` in float64, block by block as the kernels do it: running max
    per key block, P rounded to e4m3 after scaling by 2**LOG2_PSCALE, V's scales applied at the end.

    Returns ``(out [T, H, D] float64, lse [H, T] float64 or None)``; the LSE (natural log of the
    scaled scores' sum) needs the caller's ``q`` and ``softmax_scale`` to undo the K smoothing.
    """
    T, H, D = rq.qi8.shape
    qi = rq.qi8.double().transpose(0, 1)  # [H, T, D]
    ki = rq.ki8.double().transpose(0, 1)
    v8 = rq.v8.double().transpose(0, 1)
    qs = rq.qscale.double().T  # [H, T]
    m = torch.full((H, T), float("-inf"), dtype=torch.float64)
    l_sum = torch.zeros((H, T), dtype=torch.float64)
    acc = torch.zeros((H, T, D), dtype=torch.float64)
    for j, a in enumerate(range(0, T, rq.kblock)):
        b = min(a + rq.kblock, T)
        x = (qi @ ki[:, a:b].transpose(1, 2)) * (qs * rq.kscale[j].double()[:, None])[..., None]
        m_new = torch.maximum(m, x.amax(dim=-1))
        p = torch.exp2(x - m_new[..., None] + LOG2_PSCALE).float()
        alpha = torch.exp2(m - m_new)
        l_sum = l_sum * alpha + p.double().sum(-1)
        p8 = p.to(torch.float8_e4m3fn).double()
        acc = acc * alpha[..., None] + p8 @ v8[:, a:b]
        m = m_new
    out = (acc / l_sum[..., None] * rq.vscale.double()[:, None, :]).transpose(0, 1)
    lse = None
    if q is not None:
        shift = torch.einsum("thd,hd->ht", q.double(), rq.kmean.double()) * softmax_scale
        lse = (m + torch.log2(l_sum) - LOG2_PSCALE) * math.log(2.0) + shift
    return out, lse


def sage8_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    *, kblock: int = 128, balance: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Sage8 on one segment ``[T, H, D]``: ``(out [T, H, D] float64, lse [H, T] float64)``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    rq = quantize(q, k, v, scale, kblock=kblock, balance=balance)
    return attention(rq, q, scale)
