# SPDX-License-Identifier: Apache-2.0
"""Dev probe: H3's pre-norm AdaLN modulation followed by the FP8 recipe's row quantization, as
inductor compiles it, with and without ``triton.multi_kernel`` (one GPU, ~1 min).

In the compiled FP8 block, ``norm1(x) * (1 + scale[idx]) + shift[idx]`` and the activation
quantization of the q/k/v projections (and ``norm2`` ... of the FFN's projection) compile into one
looped reduction (``triton_red_fused__fused_rms_norm__scaled_mm_...``, ~0.7 ms at 38,016 rows x
5,376 on an H100) that reads its row three times: inductor keeps reductions over more than 1,024
values out of registers unless ``triton.multi_kernel`` (which raises that bound 16-fold and times
both kinds once), and the one-pass kernel (``dist_attn.models.h3.fp8.adaln_kernel``; a draft of it in the
run of 2026-12-07) at 8 and 16 warps. The bytes of one read of x and one write of the codes are
reported as a rate.
Writes ``adaln-quant-probe.json``.

    python3 -m benchmarks.dev.adaln_quant_probe --out $OUT
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks.dev import probe_parser, write_probe_json

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__).parse_args(argv)
    from benchmarks.harness import time_fn
    from dist_attn.models.h3.fp8.linear import ACTIVATION_AMAX_FLOOR, quantize_rows_e4m3
    import dist_attn.models.h3.fp8.adaln_kernel as kernel_mod
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows

    dev, K, T = torch.device("cuda"), 5376, 2 * 3
    norm = nn.RMSNorm(K, eps=1e-5).to(dev, torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    table = torch.randn(T, 6 * K, device=dev, generator=g).mul(0.1).to(torch.bfloat16)
    shift, scale = table.chunk(6, dim=-1)[:2]  # strided views, as the block's adaln_proj gives

    def route(x, idx):
        y = norm(x) * (1.0 + scale.index_select(0, idx)) + shift.index_select(0, idx)
        return quantize_rows_e4m3(y, amax_floor=ACTIVATION_AMAX_FLOOR)

    compiled = {
        "inductor default": torch.compile(route, fullgraph=True, dynamic=False),
        "inductor multi_kernel=1": torch.compile(route, fullgraph=True, dynamic=False,
                                                 options={"triton.multi_kernel": 1}),
    }
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "rows": {}}
    with torch.no_grad():
        for rows in (38016, 9504):
            x = torch.randn(rows, K, device=dev, generator=g).mul(3).to(torch.bfloat16)
            idx = torch.randint(0, T, (rows,), device=dev, generator=g)
            ref_codes, ref_scales = route(x, idx)
            entry = {}
            paths = dict(compiled)
            for nw in (8, 16):
                def one(x, idx, nw=nw):
                    kernel_mod.NUM_WARPS = nw
                    return adaln_e4m3_rows(x, norm.weight, 1e-5, scale, shift, idx)
                paths[f"one pass, {nw} warps"] = one
            for name, fn in paths.items():
                codes, scales = fn(x, idx)
                same = (codes.view(torch.uint8) == ref_codes.view(torch.uint8)).float().mean().item()
                entry[name] = {"codes_equal_to_eager": same,
                               "scales_max_rel_diff": ((scales - ref_scales).abs() / ref_scales).max().item()}
            for _ in range(3):  # interleaved rounds
                for name, fn in paths.items():
                    ms = time_fn(lambda: fn(x, idx), device=dev, iters=args.iters, warmup=3).median_ms
                    entry[name].setdefault("rounds_ms", []).append(ms)
            gbytes = rows * K * 3 / 1e9  # read bf16 x, write e4m3 codes
            for name, e in entry.items():
                e["ms"] = sorted(e["rounds_ms"])[1]
                e["tb_s"] = gbytes / e["ms"]
                print(f"{rows} rows  {name:26s} {e['ms']:.3f} ms  {e['tb_s']:.2f} TB/s  "
                      f"codes equal to eager {e['codes_equal_to_eager']:.5f}", flush=True)
            res["rows"][str(rows)] = entry
    write_probe_json(args.out, "adaln-quant-probe", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
