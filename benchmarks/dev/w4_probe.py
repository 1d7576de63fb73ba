# SPDX-License-Identifier: Apache-2.0
"""Dev probe for the W = 4 block's two largest parts, interleaved rounds in one process:

* the FFN-in GEMM (5376 -> 28672, rowwise FP8, ``torch._scaled_mm``) whole, as 2 or 4 column
  slices of its weight, and transposed (``W x^T``), at 38,016 and 9,504 rows: is the whole GEMM's
  lower TFLOP/s (1281 against 1400-1520 for the other shapes, archive/h3-fp8-single-pass_h200_2026-12-05) its shape?
* sage8 through the bridge (``attend_varlen``, the receive buffer's strided q/k/v views, H3's
  trailing padding) at 3, 4, 6, 7, 8 and 14 heads, and the direct dense call at the same widths:
  where the head chunks of ``overlap_chunks`` lose time (waves of CTAs, or the bridge per call).

With ``--profile``: only the sage8 cases, each call's kernels by torch.profiler (where the bridge's
strided receive-buffer views cost more than contiguous inputs at 14 heads, if they do).

    python3 -m benchmarks.dev.w4_probe --out $OUT     # one GPU, ~1 min
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton.testing

from benchmarks.dev import write_probe_json

__all__ = ["main"]

TOTAL, USED, D = 38016, 37980, 128
HID, FF = 5376, 14336


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def _gemm_cases(dev):
    """name -> callable, per rows: rowwise FP8 operands as torchao hands them to _scaled_mm."""
    f8 = torch.float8_e4m3fn
    w = (torch.randn(2 * FF, HID, device=dev) * 0.02).to(f8)          # [N, K], rows = out channels
    ws = torch.rand(1, 2 * FF, device=dev) + 0.5
    cases = {}
    for rows in (38016, 9504):
        x = torch.randn(rows, HID, device=dev).to(f8)
        xs = torch.rand(rows, 1, device=dev) + 0.5
        for fast in (True, False):
            tag = f"{rows}{'_fast' if fast else ''}"

            def whole(x=x, xs=xs, fast=fast):
                return torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16,
                                        use_fast_accum=fast)

            def split(n, x=x, xs=xs, fast=fast):
                step = 2 * FF // n
                return [torch._scaled_mm(x, w[i:i + step].t(), scale_a=xs, scale_b=ws[:, i:i + step].contiguous(),
                                         out_dtype=torch.bfloat16, use_fast_accum=fast)
                        for i in range(0, 2 * FF, step)]

            def transposed(x=x, xs=xs, fast=fast):
                return torch._scaled_mm(w, x.t(), scale_a=ws.t().contiguous(), scale_b=xs.t().contiguous(),
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)

            cases[f"ff_in_{tag}_whole"] = whole
            cases[f"ff_in_{tag}_split2"] = lambda split=split: split(2)
            cases[f"ff_in_{tag}_split4"] = lambda split=split: split(4)
            cases[f"ff_in_{tag}_transposed"] = transposed
    return cases


def _attn_cases(dev):
    from dist_attn import backends as da_backends
    from dist_attn.comm import unpack_qkv
    from dist_attn.kernels.sage8.api import sage8_dense
    from dist_attn.varlen import attend_varlen, segment_layout

    be = da_backends.get_backend("sage8")
    cu = torch.tensor([0, USED, TOTAL], dtype=torch.int32, device=dev)
    layout = segment_layout([0, USED, TOTAL], total=TOTAL, valid_len=USED)
    cases = {}
    for w in (3, 4, 6, 7, 8, 14):
        recv = torch.randn(TOTAL * 3 * w * D, device=dev).to(torch.bfloat16)
        qv, kv, vv = unpack_qkv(recv, TOTAL, w, D)
        o = torch.empty(TOTAL, w, D, device=dev, dtype=torch.bfloat16)
        cases[f"bridge_{w}h"] = (lambda qv=qv, kv=kv, vv=vv, o=o: attend_varlen(
            be, qv[None], kv[None], vv[None], layout=layout, cu_seqlens=cu, softmax_scale=D ** -0.5,
            k_is_scratch=True, out=o[None]))
        q, k, v = (torch.randn(1, USED, w, D, device=dev).to(torch.bfloat16) for _ in range(3))
        cases[f"dense_{w}h"] = lambda q=q, k=k, v=v: sage8_dense(q, k, v, softmax_scale=D ** -0.5)
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="the sage8 cases' kernels instead of the timing")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    if args.profile:
        from benchmarks.harness import kernel_table

        prof = {}
        with torch.no_grad():
            for name, fn in _attn_cases(dev).items():
                fn()
                fn()
                prof[name] = kernel_table(fn, dev, top=8)
                print(name)
                for k in prof[name]:
                    print(f"   {k['ms']:8.3f} ms  x{k['calls']:.0f}  {k['kernel'][:80]}")
        write_probe_json(args.out, "w4-probe-profile.json", prof)
        return 0
    cases = {**_gemm_cases(dev), **_attn_cases(dev)}
    with torch.no_grad():
        for fn in cases.values():
            fn()
        torch.cuda.synchronize()
        runs = {name: [] for name in cases}
        for r in range(args.rounds):
            for name, fn in cases.items():
                runs[name].append(_bench(fn))
            print("round", r, "done", flush=True)
    res = {name: {"median_ms": statistics.median(ts), "rounds_ms": ts} for name, ts in runs.items()}
    for rows in (38016, 9504):
        flop = 2 * rows * HID * 2 * FF
        for name, r in res.items():
            if name.startswith(f"ff_in_{rows}"):
                r["tflops"] = flop / r["median_ms"] / 1e9
    for name, r in res.items():
        print(f"{name:32s} {r['median_ms']:8.3f} ms  " + " ".join(f"{t:.3f}" for t in r["rounds_ms"])
              + (f"  {r['tflops']:.0f} TFLOP/s" if "tflops" in r else ""))
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": args.rounds}
    write_probe_json(args.out, "w4-probe.json", {"meta": meta, "results": res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
