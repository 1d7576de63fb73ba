# SPDX-License-Identifier: Apache-2.0
"""The CuTe DSL sage8 loop on a GPU: correctness against the Triton loop and float64, then speed.

    python -m benchmarks.dev.sage8_cute_check [--out DIR] [--skip-speed] [--rounds 3] [--cfg k=v,...]
                                              [--variants 'p_smem=1;stages=3'] [--isolate S]

1. Small cases (dense, varlen with several documents, the bridge's trailing padding, 1-56 heads,
   head_dim 64 and 128, fp16 and bf16, with and without the LSE): the CuTe loop's output against
   the Triton loop's on the same quantized operands (the same scheme: differences are summation
   order and exp2 rounding) and both against float64 attention; every output row written, padding
   rows exactly zero.
2. Speed at 38,016 rows x 128 (h3-ref), 14 / 56 / 7 heads, quantization included: cuDNN SDPA, the
   Triton loop, the CuTe loop and its --variants, interleaved rounds, median of round medians.
Every case runs for the default config and each variant. Rows print as JSON lines as they come (a
hung kernel leaves them in the log).
Prints a table last; writes sage8-cute-check.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time

import torch
import torch.nn.functional as F


def _ref64(q, k, v, scale, segs):
    """float64 attention per segment [(lo, hi)]: rows outside every segment stay zero."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64, device=q.device)
    for lo, hi in segs:
        if hi <= lo:
            continue
        qs, ks, vs = (t[lo:hi].double().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        s = qs @ ks.transpose(1, 2) * scale
        lse[:, lo:hi] = torch.logsumexp(s, dim=-1)
        out[lo:hi] = (torch.softmax(s, dim=-1) @ vs).transpose(0, 1)
    return out, lse


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _inputs(T, H, D, dtype, seed, vmean=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn((T, H, D), generator=g, device="cuda") for _ in range(3))
    k += 0.5
    if vmean:
        v += torch.rand((H, D), generator=g, device="cuda") * 2
    return tuple(t.to(dtype) for t in (q, k, v))


def correctness(cfg, only: str = "") -> list[dict]:
    from dist_attn.kernels.sage8 import sage8_dense, sage8_varlen
    rows = []
    cases = [
        # name, T, H, D, dtype, cu (None: dense), used
        ("dense-b1", 1000, 3, 128, torch.bfloat16, None, None),
        ("dense-1row", 1, 2, 128, torch.bfloat16, None, None),
        ("dense-1block", 128, 2, 128, torch.bfloat16, None, None),  # one full key block: c1 hung
        ("dense-2blocks", 129, 2, 128, torch.bfloat16, None, None),
        ("dense-d64", 300, 4, 64, torch.float16, None, None),
        ("varlen-3docs", 2000, 2, 128, torch.bfloat16, [0, 700, 701, 2000], None),
        ("bridge-pad", 1100, 5, 128, torch.bfloat16, [0, 1037, 1100], 1037),
        ("varlen-empty", 600, 1, 128, torch.float16, [0, 0, 255, 255, 600], None),
        ("h56", 384, 56, 128, torch.bfloat16, None, None),
    ]
    for name, T, H, D, dtype, cu, used in cases:
        if only and not re.search(only, name):
            continue
        q, k, v = _inputs(T, H, D, dtype, seed=T + H)
        scale = 1 / math.sqrt(D)
        if cu is None:
            segs = [(0, T)]
            res = {}
            for impl in ("triton", "cute"):
                o, l = sage8_dense(q[None], k[None], v[None], impl=impl, return_lse=True, config=cfg if impl == "cute" else None)
                res[impl] = (o[0], l[0])
        else:
            cut = torch.tensor(cu, dtype=torch.int32, device="cuda")
            u = T if used is None else used
            segs = [(min(a, u), min(b, u)) for a, b in zip(cu[:-1], cu[1:])]
            res = {}
            for impl in ("triton", "cute"):
                out = torch.full_like(q, float("nan"))
                o, l = sage8_varlen(q, k, v, cut, max(b - a for a, b in segs), used=used, impl=impl,
                                    return_lse=True, out=out, config=cfg if impl == "cute" else None)
                res[impl] = (o, l)
        ref, lref = _ref64(q, k, v, scale, segs)
        oc, lc = res["cute"]
        ot, lt = res["triton"]
        covered = torch.zeros(T, dtype=torch.bool, device="cuda")
        for a, b in segs:
            covered[a:b] = True
        row = {
            "case": name, "T": T, "H": H, "D": D, "dtype": str(dtype).split(".")[-1],
            "finite": bool(oc[covered].isfinite().all()),
            "cute_vs_f64": _rel(oc[covered], ref[covered]),
            "triton_vs_f64": _rel(ot[covered], ref[covered]),
            "cute_vs_triton": _rel(oc[covered], ot[covered]),
            "lse_cute_vs_f64_max": (lc.double()[:, covered] - lref[:, covered]).abs().max().item() if covered.any() else 0.0,
            "lse_triton_vs_f64_max": (lt.double()[:, covered] - lref[:, covered]).abs().max().item() if covered.any() else 0.0,
            "pad_rows_zero": bool((oc[~covered] == 0).all()) if used is not None else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def speed(cfg, rounds: int, variants=()) -> list[dict]:
    import triton.testing
    from dist_attn.kernels.sage8 import sage8_dense
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out = []
    for H in (14, 56, 7):
        q, k, v = _inputs(38016, H, 128, torch.bfloat16, seed=H, vmean=False)
        qb, kb, vb = (t[None] for t in (q, k, v))
        qt, kt, vt = (t.transpose(1, 2) for t in (qb, kb, vb))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt)

        fns = {"cudnn": cudnn,
               "triton": lambda: sage8_dense(qb, kb, vb, impl="triton"),
               "cute": lambda: sage8_dense(qb, kb, vb, impl="cute", config=cfg)}
        for name, vcfg in variants:  # more CuTe configs in the same rounds
            fns[name] = lambda vcfg=vcfg: sage8_dense(qb, kb, vb, impl="cute", config=vcfg)
        for f in fns.values():
            f()
        torch.cuda.synchronize()
        times = {n: [] for n in fns}
        for _ in range(rounds):
            for n, f in fns.items():
                times[n].append(triton.testing.do_bench(f, warmup=100, rep=600, return_mode="median"))
        med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
        flops = 4 * 38016 ** 2 * H * 128
        row = {"heads": H, **{f"{n}_ms": med[n] for n in med},
               **{f"{n}_x_cudnn": med["cudnn"] / med[n] for n in med},
               "cute_tops": flops / med["cute"] / 1e9}
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _config(cls, text: str):
    """A CuteConfig from 'field=value,...' (boolean fields take 0/1)."""
    import dataclasses
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}
    kw = {}
    for item in filter(None, text.split(",")):
        k, v = item.split("=")
        kw[k] = bool(int(v)) if kinds[k] in (bool, "bool") else int(v)
    return cls(**kw)


def _child(args: list[str], timeout_s: float) -> tuple[list[dict], bool]:
    """This script in a child process under ``timeout_s`` (a hung kernel cannot be interrupted
    in-process): the JSON lines it printed, even when killed, and whether it finished."""
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "benchmarks.dev.sage8_cute_check", *args]
    try:
        r = subprocess.run(cmd, timeout=timeout_s, stdout=subprocess.PIPE, text=True)
        text, done = r.stdout, r.returncode == 0
    except subprocess.TimeoutExpired as e:
        out = e.stdout or ""
        text, done = out.decode() if isinstance(out, bytes) else out, False
    print(text, end="", flush=True)
    lines = [json.loads(t) for t in text.splitlines() if t.startswith("{")]
    return lines, done


def _isolated(text: str, timeout_s: float, only: str = "") -> tuple[list[dict], str]:
    """One config's correctness cases in a child process: its rows and 'ok', 'wrong: <cases>',
    'hung after <case>' or 'failed'."""
    rows, done = _child(["--cfg", text, "--variants", "", "--skip-speed", "--cases", only,
                         "--json", os.devnull], timeout_s)
    rows = [r for r in rows if "case" in r]
    bad = [r["case"] for r in rows
           if not r["finite"] or not r["cute_vs_triton"] < 0.01 or r["pad_rows_zero"] is False]
    if bad:
        return rows, "wrong: " + ",".join(bad)
    if not done:
        return rows, f"hung after {rows[-1]['case'] if rows else 'start'} ({timeout_s:.0f} s)"
    return rows, "ok"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cfg", default="", help="CuteConfig fields, e.g. stages=3,overlap=0")
    ap.add_argument("--variants", default="p_smem=1;stages=3",
                    help="';'-separated CuteConfig changes also checked and timed beside the default")
    ap.add_argument("--isolate", type=float, default=0.0, metavar="S",
                    help="check each config in a child process killed after S seconds (a hang "
                         "costs S, not the run); only configs that pass are timed")
    ap.add_argument("--json", default="", help="write the result to this file")
    ap.add_argument("--cases", default="", help="only the correctness cases whose name matches this regex")
    ap.add_argument("--speed-timeout", type=float, default=150.0,
                    help="with --isolate: each config's timing child is killed after this")
    ap.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    os.environ.setdefault("DIST_ATTN_SAGE8_CUTE", "1")  # this script is the check the opt-in waits for
    from dist_attn.kernels.sage8.attn_cute import CuteConfig, compile_seconds
    cfg = _config(CuteConfig, a.cfg)
    variants = [(f"cute[{v}]", _config(CuteConfig, v)) for v in filter(None, a.variants.split(";"))]
    t0 = time.time()
    rows = []
    status = {}
    speed_by_config = {}
    if a.speed_only:
        for r in speed(cfg, a.rounds, ()):
            print(json.dumps(dict(r, speed=True)), flush=True)
        return
    if a.isolate:
        # each config's cases in a child; then each config that was not wrong timed in a child
        # of its own beside cuDNN and the Triton loop (a config that hangs on short segments may
        # still run h3-ref's, and a hang there costs --speed-timeout)
        configs = [("cute", a.cfg), *((f"cute[{v}]", v) for v in filter(None, a.variants.split(";")))]
        for name, text in configs:
            got, status[name] = _isolated(text, a.isolate, a.cases)
            print(json.dumps({"config": name, "status": status[name]}), flush=True)
            rows += [dict(r, config=name) for r in got]
        for name, text in configs:
            if a.skip_speed or status[name].startswith(("wrong", "failed")):
                continue
            got, done = _child(["--cfg", text, "--speed-only", "--rounds", str(a.rounds)], a.speed_timeout)
            speed_by_config[name] = {"rows": [r for r in got if r.get("speed")], "finished": done}
        a.skip_speed = True
    else:
        for name, c in [("cute", cfg), *variants]:
            rows += [dict(r, config=name) for r in correctness(c, a.cases)]
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "config": repr(cfg),
           "correctness": rows, "status": status, "speed_by_config": speed_by_config,
           "correctness_s": time.time() - t0,
           "compile_s": {repr(k): v for k, v in compile_seconds().items()}}
    if not a.skip_speed:
        res["speed"] = speed(cfg, a.rounds, variants)
    os.makedirs(a.out, exist_ok=True)
    with open(a.json or os.path.join(a.out, "sage8-cute-check.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\nconfig             case            cute/f64  triton/f64  cute/triton  lse(cute)  pad0")
    for r in rows:
        print(f"{r['config'][:18]:<18} {r['case']:<15} {r['cute_vs_f64']:.5f}   {r['triton_vs_f64']:.5f}     {r['cute_vs_triton']:.5f}    "
              f"{r['lse_cute_vs_f64_max']:.2e}  {r['pad_rows_zero']}")
    for r in res.get("speed", []):
        print(f"H={r['heads']:>2}: cudnn {r['cudnn_ms']:.2f}  triton {r['triton_ms']:.2f} ({r['triton_x_cudnn']:.3f}x)  "
              f"cute {r['cute_ms']:.2f} ({r['cute_x_cudnn']:.3f}x, {r['cute_tops']:.0f} TOPS)  "
              + "  ".join(f"{k[:-3]} {v:.2f}" for k, v in r.items() if k.startswith("cute[") and k.endswith("_ms")))
    for name, got in speed_by_config.items():
        for r in got["rows"]:
            print(f"{name:<28} H={r['heads']:>2}: cudnn {r['cudnn_ms']:.2f}  triton {r['triton_ms']:.2f} "
                  f"({r['triton_x_cudnn']:.3f}x)  cute {r['cute_ms']:.2f} ({r['cute_x_cudnn']:.3f}x)")
        if not got["finished"]:
            print(f"{name:<28} timing did not finish (hung or --speed-timeout)")
    for name, st in status.items():
        print(f"{name:<28} correctness: {st}")
    print("compile s:", res["compile_s"])


if __name__ == "__main__":
    main()
