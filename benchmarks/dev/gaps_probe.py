# SPDX-License-Identifier: Apache-2.0
"""Dev probe: where the compiled H3 block's GPU waits (one GPU, ~1 min).

The compiled FP8-fast + sage8 block's kernels (profiled) added up to ~1 ms less than its wall
time per call (unprofiled; ``h3-fp8-gaps``: 0.9 ms at W = 4's rows): does the GPU wait? This
runs the compiled block (FP8 fast + sage8 and bf16 + sage8 at W = 1's rows, the FP8 fast rest at
W = 4's) under torch.profiler with CPU and CUDA activities and reports, per call: wall ms, the kernels' busy ms, the GPU's idle ms (the gaps between
consecutive kernels on the stream), the largest gaps with the kernels on each side, and the CUDA
runtime calls that make the host wait (synchronize, blocking copies, malloc / free) with their
counts. Writes ``gaps-probe.json`` (and a chrome trace of the W = 1 block) to ``--out``.
On one H100 (2026-12-06, ``results/gaps-probe_h100_2026-12-06.json``): 0.06-0.08 ms of gaps a
call and no host sync inside the block: it does not wait.

    python3 -m benchmarks.dev.gaps_probe --out $OUT
"""

from __future__ import annotations

import argparse
import os

import torch

from benchmarks.dev import write_probe_json

__all__ = ["main"]

_BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaStreamWaitEvent")


def _analyse(prof, calls: int) -> dict:
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and e.device_resource_id is not None and not e.is_user_annotation),
                     key=lambda e: e.time_range.start)
    spans = [(e.time_range.start, e.time_range.end, e.name) for e in kernels]
    busy = sum(b - a for a, b, _ in spans)
    gaps = [(spans[i + 1][0] - spans[i][1], spans[i][2][:70], spans[i + 1][2][:70])
            for i in range(len(spans) - 1)]
    idle = sum(g for g, _, _ in gaps if g > 0)
    runtime: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and any(s in e.name for s in _BLOCKING):
            r = runtime.setdefault(e.name, [0, 0.0])
            r[0] += 1
            r[1] += e.cpu_time_total
    return {"kernels_per_call": len(spans) / calls, "busy_ms": busy / 1e3 / calls,
            "gaps_ms": idle / 1e3 / calls,
            "largest_gaps": [{"us": g, "after": a, "before": b} for g, a, b in sorted(gaps, reverse=True)[:12]],
            "host_waits": {k: {"calls_per_call": n / calls, "us_per_call": t / calls}
                           for k, (n, t) in sorted(runtime.items(), key=lambda kv: -kv[1][1])}}


def _profile(fn, calls: int, trace: str | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    torch.cuda.synchronize()
    wall = s.elapsed_time(e) / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    return {"wall_ms_unprofiled": wall, **_analyse(prof, calls)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from diffusers.utils import logging as diffusers_logging

    from benchmarks.h3_block import block_inputs, h3_ref_layout, padded_total
    from benchmarks.h3_fp8 import _models, _set_attention
    from dist_attn.models.h3.serve.config import load_config

    diffusers_logging.set_verbosity_error()
    dev = torch.device("cuda")
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "h3.toml"))
    m, lay = cfg.model, h3_ref_layout()
    total = padded_total(lay.used)
    _, models = _models(cfg, dev, emulate=False)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    w1 = block_inputs(m, lay, lay.used, lay.used, 0, dev, torch.bfloat16)
    w4 = block_inputs(m, lay, total, total // 4, 0, dev, torch.bfloat16)
    with torch.no_grad():
        for name, attn, inputs in (("w1 fp8fast:sage8", "sage8", w1), ("w4 fp8fast:none", "none", w4),
                                   ("w1 bf16:sage8", "sage8", w1)):
            block = models["copy"](name.split()[1].split(":")[0]).transformer_blocks[0]
            _set_attention(block, attn, m.num_heads, m.head_dim, lay.used)
            fn = torch.compile(block, fullgraph=True, dynamic=False)
            trace = os.path.join(args.out, "gaps-trace-w1.json") if name == "w1 fp8fast:sage8" else None
            res[name] = _profile(lambda fn=fn, inputs=inputs: fn(*inputs), args.calls, trace)
            r = res[name]
            print(f"{name}: wall {r['wall_ms_unprofiled']:.2f} ms, kernels {r['busy_ms']:.2f} ms "
                  f"({r['kernels_per_call']:.0f}), gaps {r['gaps_ms']:.3f} ms; host waits "
                  f"{ {k: round(v['calls_per_call'], 1) for k, v in r['host_waits'].items()} }", flush=True)
            for g in r["largest_gaps"][:6]:
                print(f"   gap {g['us']:.0f} us after {g['after']} before {g['before']}", flush=True)
            del block, fn
            torch._dynamo.reset()
    write_probe_json(args.out, "gaps-probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
