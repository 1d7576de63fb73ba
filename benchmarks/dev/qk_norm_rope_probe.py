# SPDX-License-Identifier: Apache-2.0
"""Dev probe: the fused per-head RMSNorm + RoPE kernel (``dist_attn.kernels.qk_norm_rope``) against
inductor's compilation of what H3's processor runs (``nn.RMSNorm`` on q and k, then the bf16
rotate-half RoPE), one GPU, ~1 min.

At H3's shapes (56 heads x 128, RoPE on 96 channels) and 38,016 / 9,504 rows (W = 1 / W = 4's
rows a rank): CUDA-event medians of three interleaved rounds, the kernel at several
(rows, heads) a program, the bytes of one read and one write of q and k as a rate, and each
route's rel-L2 against float64. Writes ``qk-norm-rope-probe.json``.

    python3 -m benchmarks.dev.qk_norm_rope_probe --out $OUT
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.dev import probe_parser, write_probe_json

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    from benchmarks.harness import time_fn
    from dist_attn.integrations.diffusers._minimax_h3 import _rotate
    from dist_attn.kernels import qk_norm_rope as mod

    dev, H, D, R, eps = torch.device("cuda"), 56, 128, 96, 1e-5
    norm_q, norm_k = (nn.RMSNorm(D, eps=eps).to(dev, torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        for n in (norm_q, norm_k):
            n.weight.uniform_(0.5, 1.5)

    def diffusers_route(q, k, cos, sin):
        return _rotate(norm_q(q), cos, sin), _rotate(norm_k(k), cos, sin)

    compiled = torch.compile(diffusers_route, fullgraph=True, dynamic=False)
    configs = [(16, 8), (16, 56), (32, 8), (8, 8), (16, 4)]
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": {}}
    with torch.no_grad():
        for rows in (38016, 9504):
            g = torch.Generator(device=dev).manual_seed(rows)
            q, k = (torch.randn(1, rows, H, D, device=dev, generator=g).mul(2).add(0.3).to(torch.bfloat16)
                    for _ in range(2))
            ang = torch.rand(rows, R // 2, device=dev, generator=g) * 6
            cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

            def fused(cfg):
                def call():
                    mod.ROWS, mod.HEADS = cfg
                    return mod.qk_norm_rope(q, k, norm_q.weight, norm_k.weight, eps, cos, sin)
                return call

            paths = {"inductor (diffusers' ops compiled)": lambda: compiled(q, k, cos, sin)}
            paths.update({f"fused rows={r} heads={h}": fused((r, h)) for r, h in configs})
            per = {name: [] for name in paths}
            for _ in range(3):
                for name, fn in paths.items():
                    per[name].append(time_fn(fn, device=dev, iters=args.iters, warmup=3).median_ms)
            bytes_moved = 4 * q.numel() * 2
            out = {name: {"ms": sorted(ts)[1], "rounds_ms": ts, "one_pass_gbs": bytes_moved / sorted(ts)[1] / 1e6}
                   for name, ts in per.items()}
            exact = mod.qk_norm_rope_reference(q, k, norm_q.weight, norm_k.weight, eps, cos, sin, dtype=torch.float64)
            mod.ROWS, mod.HEADS = 16, 8
            for name, got in (("inductor (diffusers' ops compiled)", compiled(q, k, cos, sin)),
                              ("fused rows=16 heads=8", fused((16, 8))())):
                out[name]["rel_l2_vs_float64"] = [((a.double() - b).norm() / b.norm()).item()
                                                  for a, b in zip(got, exact)]
            for name, row in out.items():
                print(rows, name, row, flush=True)
            res["rows"][rows] = out
    write_probe_json(args.out, "qk-norm-rope-probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
