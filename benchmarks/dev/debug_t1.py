"""Dev: where a 1-row dense sage8 call turns NaN on the H200 (seen 2026-12-03, v3)."""
import dataclasses
import torch
from dist_attn.kernels.sage8 import launch, sage8_dense
from dist_attn.kernels.sage8.quant import QuantConfig, quantize

torch.manual_seed(0)
for T in (1, 2, 3):
    q, k, v = (torch.randn(2, T, 3, 64, device="cuda").half() for _ in range(3))
    for impl in ("triton", "gluon"):
        for sv in (False, True):
            for acc in ("block", "running"):
                cfg = dataclasses.replace(launch.default_config(impl), pv_accum=acc)
                o = sage8_dense(q, k, v, impl=impl, config=cfg, quant_config=QuantConfig(smooth_v=sv))
                print(T, impl, "smooth" if sv else "plain", acc, "finite", o.isfinite().all().item(),
                      "maxerr_vs_v" if T == 1 else "", (o.float() - v.float()).abs().max().item() if T == 1 else "")
lay = launch.dense_layout(2, 1)
q, k, v = (torch.randn(2, 1, 3, 64, device="cuda").half() for _ in range(3))
for sv in (False, True):
    qz = quantize(q, k, v, lay, 0.125, kblock=128, config=QuantConfig(smooth_v=sv))
    for f in ("qscale", "kscale", "vscale", "vmean", "ksum"):
        t = getattr(qz, f)
        print("smooth" if sv else "plain", f, tuple(t.shape), "finite", t.isfinite().all().item(), t.flatten()[:4].tolist())
    print("qi8 rows", qz.qi8[0, :2, :4].tolist(), "vt8 finite", qz.vt8.float().isfinite().all().item(),
          qz.vt8[0, :4, :2].float().tolist())
