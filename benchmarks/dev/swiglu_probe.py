# SPDX-License-Identifier: Apache-2.0
"""Dev probe: the fused SwiGLU + FP8 row-quantization kernel alone, beside inductor's fusion of the
same unfused ops (one GPU, ~1 min).

At H3's FFN (inner size 14,336) and 37,980 / 9,504 rows: ``swiglu_e4m3_rows`` at 8, 16 and 32
warps a program, and ``torch.compile`` of diffusers' eager SwiGLU + ``quantize_rows_e4m3`` (what the
compiled block runs unfused); CUDA-event medians of three interleaved rounds, and the bytes one
read of the projection and one write of the codes move, as a rate. Writes ``swiglu-probe.json``.

    python3 -m benchmarks.dev.swiglu_probe --out $OUT
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.dev import probe_parser, write_probe_json

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    from benchmarks.harness import time_fn
    from dist_attn.models.h3.fp8.linear import ACTIVATION_AMAX_FLOOR, quantize_rows_e4m3
    from dist_attn.models.h3.fp8 import swiglu_kernel

    dev, inner = torch.device("cuda"), 14336

    def unfused(h):
        value, gate = h.chunk(2, dim=-1)
        return quantize_rows_e4m3(value * F.silu(gate), amax_floor=ACTIVATION_AMAX_FLOOR)

    compiled = torch.compile(unfused, fullgraph=True, dynamic=False)

    def fused(warps):
        def call(h):
            swiglu_kernel.NUM_WARPS = warps
            return swiglu_kernel.swiglu_e4m3_rows(h)
        return call

    def timed(fn, h) -> float:
        return time_fn(lambda: fn(h), device=dev, iters=args.iters, warmup=3).median_ms

    paths = {"inductor unfused": compiled, "fused 8 warps": fused(8), "fused 16 warps": fused(16),
             "fused 32 warps": fused(32)}
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "inner": inner, "rows": {}}
    with torch.no_grad():
        for rows in (37980, 9504):
            h = (torch.randn(rows, 2 * inner, device=dev) * 2).to(torch.bfloat16)
            bytes_moved = h.numel() * 2 + rows * inner
            per = {name: [] for name in paths}
            for _ in range(3):
                for name, fn in paths.items():
                    per[name].append(timed(fn, h))
            out = {}
            for name, ts in per.items():
                ms = sorted(ts)[1]
                out[name] = {"ms": ms, "rounds_ms": ts, "one_pass_gbs": bytes_moved / ms / 1e6}
                print(rows, name, out[name], flush=True)
            res["rows"][rows] = out
    swiglu_kernel.NUM_WARPS = 16
    write_probe_json(args.out, "swiglu-probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
