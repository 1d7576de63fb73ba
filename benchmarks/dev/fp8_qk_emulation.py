# SPDX-License-Identifier: Apache-2.0
"""Dev probe (CPU, float64, ~1 min): how much accuracy the FlashAttention-3 FP8 route would cost on
real H3 activations, isolated from any kernel.

FA3's FP8 forward (``fa3-fwd``) takes e4m3 q/k/v with one descale per (batch, head); on pre-quantized
operands it is ~12% faster than sage8 at H3's shapes (44.8 vs 50.8 ms at 56 heads, one H200,
``results/archive/kernels-side-final_h200_2026-12-04``). This runs that scheme in float64 on the real first
block's q/k/v (the GPU test's 4,176-row layout, 256 sampled rows, every key) beside sage8's reference
(``dist_attn/kernels/sage8/reference.py``): FP8 Q K with one scale per head against INT8 per row / per
key block, every MMA sum exact, P rounded to e4m3 with or without sage8's 2**8 prescale, V per head
or per channel, with and without K / V smoothing.

    python3 -m benchmarks.dev.fp8_qk_emulation
"""

from __future__ import annotations

import torch

from dist_attn.models.h3.fp8.linear import E4M3_MAX

__all__ = ["emulate"]

E4M3 = torch.float8_e4m3fn


def emulate() -> dict[str, float]:
    """rel-L2 against float64 of sage8's reference and of each FP8-QK scheme; printed and returned."""
    from benchmarks.accuracy import _h3_case, _reference, _rel
    from dist_attn.kernels.sage8.reference import sage8_reference

    q, k, v, bounds = _h3_case(False, small=True)("cpu", 0)
    T, H, D = q.shape
    scale = D ** -0.5
    rows = torch.randperm(T, generator=torch.Generator().manual_seed(0))[:256].sort().values
    ref = _reference(q, k, v, bounds, [rows])

    def e4(t, s):
        return (t / s).float().to(E4M3).double()

    def fp8_scheme(smooth: bool, p_log2: int, v_channel: bool):
        qq, kk, vv = q.double(), k.double(), v.double()
        vm = torch.zeros(1, H, D, dtype=torch.float64)
        if smooth:
            kk, vm = kk - kk.mean(0, keepdim=True), vv.mean(0, keepdim=True)
            vv = vv - vm
        sq, sk = (t.abs().amax((0, 2), keepdim=True) / E4M3_MAX for t in (qq, kk))
        sv = (vv.abs().amax(0, keepdim=True) if v_channel else vv.abs().amax((0, 2), keepdim=True)) / E4M3_MAX
        q8, k8, v8 = e4(qq, sq), e4(kk, sk), e4(vv, sv)
        out = torch.empty(len(rows), H, D, dtype=torch.float64)
        for h in range(H):
            s = q8[rows, h] @ k8[:, h].T * (sq[0, h, 0] * sk[0, h, 0] * scale)
            p = torch.exp(s - s.amax(-1, keepdim=True))
            p8 = (p * 2.0 ** p_log2).float().to(E4M3).double() / 2.0 ** p_log2
            out[:, h] = (p8 @ v8[:, h]) * sv[0, h] / p.sum(-1, keepdim=True) + vm[0, h]
        return out

    res = {"sage8_reference": _rel([sage8_reference(q, k, v, scale, rows=rows)[0]], ref)[0]}
    for smooth, p_log2, v_channel in ((False, 0, False), (True, 0, False), (True, 8, False), (True, 8, True)):
        name = f"fp8_qk_head{'_smooth' if smooth else ''}_p2^{p_log2}{'_vchannel' if v_channel else ''}"
        res[name] = _rel([fp8_scheme(smooth, p_log2, v_channel)], ref)[0]
    for n, r in res.items():
        print(f"{n:36s} rel-L2 {r:.5f}", flush=True)
    return res


if __name__ == "__main__":
    emulate()
