# SPDX-License-Identifier: Apache-2.0
"""Dev benchmark of the Sage8 kernels: correctness, speed of variants, pre-pass split, varlen, LSE
cost, accuracy, registers and SASS, side by side with cuDNN, in ONE device call.

    PYTHONUNBUFFERED=1 python3 -m benchmarks.dev.sage8_dev --out $OUT          # H200, ~4 minutes
    python3 -m benchmarks.dev.sage8_dev --check --out $OUT                      # correctness only

Every Gluon variant is first checked in a child process with a time limit (``--check``): a wrong
mbarrier phase hangs the GPU, and a hang must cost one variant, not the device call. Only variants
that pass are timed. TFLOP/s-equivalent = 4 * N^2 * H * D / time; every sage8 time includes the
quantization pre-pass unless the row says "attention only".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter

import torch

from dist_attn.kernels.sage8 import reference
from dist_attn.kernels.sage8.api import sage8_dense, sage8_varlen

__all__ = ["main"]

N_ROWS = 38016  # h3-ref: 594 x 64 packed rows
USED = 37980
D = 128

#: Gluon variants (GluonConfig overrides); the first that passes and is fastest becomes "best"
GLUON_VARIANTS = {
    "g_s3_ps": dict(stages=3, p_smem=True, pingpong=False),
    "g_s2_ps": dict(stages=2, p_smem=True, pingpong=False),
    "g_s4_ps": dict(stages=4, p_smem=True, pingpong=False),
    "g_s3_ps_pp": dict(stages=3, p_smem=True, pingpong=True),
}
# measured variants and their times: benchmarks/KERNEL_NOTES.md (v2 versions table)
SASS_OPS = ("IGMMA", "QGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "F2FP", "PRMT", "LOP3",
            "IMAD", "SHFL", "HADD2", "ISETP", "SEL", "LDS", "STS", "LDL", "STL", "BAR", "SYNCS", "WARPGROUP")
ACC_CASES = ("normal", "bias", "outlier_q", "outlier_k", "outlier_qkv", "rms_gain")


def _tflops(n: int, h: int, ms: float) -> float:
    return 4.0 * n * n * h * D / (ms * 1e-3) / 1e12


def _bench(fn, rep_ms: int = 200) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _err(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    return ((a - b).norm() / b.norm()).item(), torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def _f64(q, k, v, scale=None):
    """float64 attention and LSE of [T, H, D] inputs -> ([T, H, D], [H, T])."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    s = (q @ k.transpose(1, 2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    return (torch.softmax(s, -1) @ v).transpose(0, 1), torch.logsumexp(s, -1)


def _case(case: str, shape, seed: int, dtype=torch.bfloat16):
    """q, k, v ``[1, T, H, D]`` of one input family (the accuracy table's rows)."""
    from benchmarks.accuracy import family_case

    q, k, v, _ = family_case(case, shape[1], shape[2], shape[3])("cuda", seed)
    return tuple(t.to(dtype)[None] for t in (q, k, v))


def _gluon_config(over: dict):
    from dist_attn.kernels.sage8.attn_gluon import GluonConfig
    return dataclasses.replace(GluonConfig(), **over)


# ------------------------------------------------------------------------------------------ checks
def check_variant(name: str, over: dict) -> dict:
    """Correctness of one Gluon variant against the torch reference and float64 (small shapes)."""
    cfg = _gluon_config(over)
    res = {"variant": name}
    # dense, several lengths, both head dims and dtypes
    for T, hd, dt in ((1000, 128, torch.bfloat16), (77, 128, torch.bfloat16), (300, 64, torch.float16),
                      (1, 128, torch.bfloat16), (4096, 128, torch.bfloat16)):
        q, k, v = _case("bias", (2, T, 3, hd), seed=T, dtype=dt)
        keep = [t.clone() for t in (q, k, v)]
        out, lse = sage8_dense(q, k, v, impl="gluon", config=cfg, return_lse=True)
        out2 = sage8_dense(q, k, v, impl="gluon", config=cfg)
        torch.cuda.synchronize()
        emu, _ = reference.sage8_reference(q[1].cpu(), k[1].cpu(), v[1].cpu())
        o64, l64 = _f64(q[1], k[1], v[1])
        res[f"dense_T{T}_D{hd}"] = dict(
            vs_reference=_err(out[1].cpu(), emu)[0], vs_f64=_err(out[1], o64)[0],
            lse_max_abs_vs_f64=(lse[1].double() - l64).abs().max().item(),
            finite=bool(out.isfinite().all()), bit_stable=bool(torch.equal(out, out2)),
            inputs_unchanged=all(torch.equal(a, b) for a, b in zip((q, k, v), keep)))
    # varlen: empty segments, a 1-row segment, trailing padding, strided receive-buffer views
    lens = [0, 77, 300, 1, 0, 129, 128, 1000]
    used = sum(lens)
    T = used + 40
    buf = torch.randn((T, 3, 3, 128), device="cuda").to(torch.bfloat16)
    q, k, v = buf[:, 0], buf[:, 1], buf[:, 2]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    obuf = torch.full((T, 2, 3, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out, lse = sage8_varlen(q, k, v, cu, max(lens), used=used, out=obuf[:, 1], impl="gluon", config=cfg,
                            return_lse=True)
    worst = 0.0
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            emu, _ = reference.sage8_reference(q[a:b].cpu(), k[a:b].cpu(), v[a:b].cpu())
            worst = max(worst, _err(out[a:b].cpu(), emu)[0])
    res["varlen"] = dict(worst_vs_reference=worst, tail_zero=bool((out[used:] == 0).all()),
                         lse_tail_neg_inf=bool(torch.isneginf(lse[:, used:]).all()),
                         finite=bool(out[:used].isfinite().all()))
    ok = all(v.get("vs_reference", 0) < 2e-2 and v.get("finite") and v.get("bit_stable", True)
             and v.get("inputs_unchanged", True) for key, v in res.items() if key.startswith("dense"))
    ok = ok and worst < 2e-2 and res["varlen"]["tail_zero"] and res["varlen"]["finite"]
    res["ok"] = bool(ok)
    return res


def _run_checks(names: list[str], limit_s: int) -> dict:
    """The first variant alone, then the others together, each group in a child process under a
    time limit (a hang loses its group only); returns {name: result}."""
    results = {}
    for group in ([names[0]], names[1:]) if len(names) > 1 else ([names[0]],):
        path = os.path.join(tempfile.gettempdir(), f"sage8_check_{group[0]}.json")
        cmd = [sys.executable, "-m", "benchmarks.dev.sage8_dev", "--check", "--variants", ",".join(group),
               "--check-out", path]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s * len(group) ** 0.5)
            found = json.load(open(path)) if proc.returncode == 0 and os.path.exists(path) else {}
            err = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            found, err = {}, f"timed out after {limit_s} s (hang?)"
        for name in group:
            results[name] = found.get(name, {"ok": False, "error": err})
            results[name]["check_s"] = round(time.time() - t0, 1)
            print(f"check {name}: ok={results[name]['ok']} {json.dumps(results[name])[:900]}", flush=True)
    return results


# --------------------------------------------------------------------------------------- measuring
def _sass(kern, save_to: str | None = None) -> dict:
    """Opcode counts of a compiled kernel, whole kernel and its hottest loop (largest backward branch
    target range that contains wgmma), plus registers / spills / shared memory."""
    info = {"regs": getattr(kern, "n_regs", None), "spills": getattr(kern, "n_spills", None),
            "smem": getattr(getattr(kern, "metadata", None), "shared", None)}
    try:
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(kern.asm["cubin"])
        txt = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True, timeout=60).stdout
        if save_to:
            open(save_to, "w").write(txt)
        ins = []
        for line in txt.splitlines():
            m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)[^;]*?(0x[0-9a-f]+)?\s*;", line)
            if m:
                ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
        whole = Counter(op for _, op, _ in ins)
        loops = [(int(t, 16), a) for a, op, t in ins if op == "BRA" and t and int(t, 16) < a]
        loops = [(lo, hi) for lo, hi in loops
                 if any(op in ("IGMMA", "QGMMA") and lo <= a <= hi for a, op, _ in ins)]
        info["whole"] = {k: whole.get(k, 0) for k in SASS_OPS} | {"total": sum(whole.values())}
        if loops:
            lo, hi = min(loops, key=lambda r: r[1] - r[0])
            body = Counter(op for a, op, _ in ins if lo <= a <= hi)
            info["loop"] = {k: body.get(k, 0) for k in SASS_OPS} | {"total": sum(body.values())}
    except Exception as e:  # noqa: BLE001 - diagnostics only
        info["sass_error"] = repr(e)
    return info


def _split(q, k, v, impl, cfg, quant_cfg):
    """(pre-pass ms, attention-only ms, compiled attention kernel) at these inputs."""
    from dist_attn.kernels.sage8 import launch
    B, T, H, _ = q.shape
    scale = 1 / math.sqrt(D)

    def prepare():
        return launch.prepare(q, k, v, layout=launch.dense_layout(B, T), softmax_scale=scale, impl=impl,
                              config=cfg, quant_config=quant_cfg)
    pre = _bench(prepare)
    qz, out, loop = prepare(), torch.empty_like(q), launch.attention_loop(impl)

    def run():
        return loop(qz, q, out, None, scale, cfg)
    kern = run()
    return pre, _bench(run), kern


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--variants", default=",".join(GLUON_VARIANTS))
    ap.add_argument("--check", action="store_true", help="check the variants in this process and exit")
    ap.add_argument("--check-out", default=None)
    ap.add_argument("--check-limit-s", type=int, default=90)
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    if args.check:
        res = {n: check_variant(n, GLUON_VARIANTS[n]) for n in names}
        json.dump(res, open(args.check_out or os.path.join(args.out, "sage8_check.json"), "w"), indent=1)
        return
    os.makedirs(args.out, exist_ok=True)
    import triton
    from dist_attn.kernels.sage8.attn_triton import TritonConfig
    from dist_attn.kernels.sage8.quant import QuantConfig

    t_start = time.time()
    rec = {"date": datetime.datetime.now().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "variants": {}, "checks": {}}

    def save():
        with open(os.path.join(args.out, "sage8_dev.json"), "w") as f:
            json.dump(rec, f, indent=1, default=str)

    rec["checks"] = _run_checks(names, args.check_limit_s)
    passed = [n for n in names if rec["checks"][n].get("ok")]
    save()

    H = 14
    q, k, v = _case("normal", (1, N_ROWS, H, D), seed=0)
    qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    ms_cudnn = _bench(cudnn)
    del qt, kt, vt
    rec["cudnn_14h_ms"] = ms_cudnn
    print(f"cudnn 14h: {ms_cudnn:.2f} ms {_tflops(N_ROWS, H, ms_cudnn):.0f} TFLOP/s", flush=True)
    tab = [("cudnn", H, ms_cudnn)]

    candidates = [("triton", "triton", TritonConfig())] + [(n, "gluon", _gluon_config(GLUON_VARIANTS[n]))
                                                           for n in passed]
    for name, impl, cfg in candidates:
        try:
            ms = _bench(lambda: sage8_dense(q, k, v, impl=impl, config=cfg))
            pre, attn, kern = _split(q, k, v, impl, cfg, QuantConfig())
            e = dict(impl=impl, config=dataclasses.asdict(cfg), ms=ms, tflops=_tflops(N_ROWS, H, ms),
                     x_cudnn=ms_cudnn / ms, prepass_ms=pre, attention_ms=attn,
                     attention_tflops=_tflops(N_ROWS, H, attn), sass=_sass(kern))
            # SM clocks per 128 x 128 tile-equivalent of the attention launch at 1.98 GHz (boost)
            tiles = H * (N_ROWS / 128) ** 2 / torch.cuda.get_device_properties(0).multi_processor_count
            e["clk_per_tile_at_1.98GHz"] = attn * 1e-3 * 1.98e9 / tiles
        except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the run
            e = dict(impl=impl, error=repr(exc)[:2000])
        rec["variants"][name] = e
        print(f"{name}: {json.dumps(e, default=str)[:1500]}", flush=True)
        if "ms" in e:
            tab.append((name, H, e["ms"]))
        save()
    timed = {n: e for n, e in rec["variants"].items() if "ms" in e}
    best_g = min((n for n in timed if timed[n]["impl"] == "gluon"), key=lambda n: timed[n]["ms"], default=None)
    rec["best_gluon"] = best_g
    best_cfg = _gluon_config(GLUON_VARIANTS[best_g]) if best_g else None
    print(f"best gluon: {best_g} ({time.time() - t_start:.0f} s)", flush=True)

    # pre-pass options
    from dist_attn.kernels.sage8 import launch
    from dist_attn.kernels.sage8.quant import quantize
    rec["prepass"] = {}
    lay = launch.dense_layout(1, N_ROWS)
    for label, qc in (("default", QuantConfig()), ("balance", QuantConfig(balance=True)),
                      ("tile128", QuantConfig(tile=128)), ("warps8", QuantConfig(warps=8))):
        rec["prepass"][label] = _bench(lambda: quantize(q, k, v, lay, 1 / math.sqrt(D), kblock=128, config=qc))
    print(f"prepass ms: {rec['prepass']}", flush=True)
    save()

    if best_g:
        g = dict(impl="gluon", config=best_cfg)
        # LSE cost, balance cost, and dense vs varlen, interleaved (clock drift ~2% over a run)
        cu1 = torch.tensor([0, N_ROWS], dtype=torch.int32, device="cuda")
        buf = torch.stack([q[0], k[0], v[0]], dim=1)  # [S, 3, H, D]: the Ulysses receive layout
        cu3 = torch.tensor([0, USED, N_ROWS], dtype=torch.int32, device="cuda")
        fns = {"dense": lambda: sage8_dense(q, k, v, **g),
               "dense+lse": lambda: sage8_dense(q, k, v, return_lse=True, **g),
               "dense+balance": lambda: sage8_dense(q, k, v, quant_config=QuantConfig(balance=True), **g),
               "varlen1": lambda: sage8_varlen(q[0], k[0], v[0], cu1, N_ROWS, **g),
               "h3(0,used,T)": lambda: sage8_varlen(buf[:, 0], buf[:, 1], buf[:, 2], cu3, USED, used=USED, **g)}
        times = {n: [] for n in fns}
        for _ in range(3):
            for n, fn in fns.items():
                times[n].append(_bench(fn, 120))
        rec["gluon_modes_14h"] = {n: sorted(t)[1] for n, t in times.items()}
        print(f"gluon modes (median of 3): {rec['gluon_modes_14h']}", flush=True)
        del buf
        rec["best_sass"] = _sass(_split(q, k, v, "gluon", best_cfg, QuantConfig())[2],
                                 os.path.join(args.out, "sass_gluon_best.txt"))
        save()
    del q, k, v

    for H2 in (56, 7):
        q, k, v = _case("normal", (1, N_ROWS, H2, D), seed=1)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ms_c = _bench(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt), 300)
        del qt, kt, vt
        tab.append(("cudnn", H2, ms_c))
        tab.append(("triton", H2, _bench(lambda: sage8_dense(q, k, v, impl="triton"), 300)))
        if best_g:
            tab.append((best_g, H2, _bench(lambda: sage8_dense(q, k, v, impl="gluon", config=best_cfg), 300)))
        del q, k, v
        print(f"{H2} heads done ({time.time() - t_start:.0f} s)", flush=True)

    # accuracy: 8192 rows x 4 heads, the input families, vs float64; with and without balancing
    acc = []
    for case in ACC_CASES:
        q, k, v = _case(case, (1, 8192, 4, D), seed=7)
        o64, _ = _f64(q[0], k[0], v[0])
        runs = {"triton": dict(impl="triton"), "triton+balance": dict(impl="triton", quant_config=QuantConfig(balance=True))}
        if best_g:
            runs["gluon"] = dict(impl="gluon", config=best_cfg)
            runs["gluon+balance"] = dict(impl="gluon", config=best_cfg, quant_config=QuantConfig(balance=True))
        for label, kw in runs.items():
            acc.append((case, label, *_err(sage8_dense(q, k, v, **kw)[0], o64)))
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            acc.append((case, "cudnn", *_err(torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
                                               .transpose(1, 2)[0], o64)))
    rec["accuracy"] = [dict(case=c, kernel=n, rel_l2=r, cos=cs) for c, n, r, cs in acc]
    rec["table"] = [dict(kernel=n, heads=h, ms=ms, tflops=_tflops(N_ROWS, h, ms)) for n, h, ms in tab]
    save()

    cud = {h: ms for n, h, ms in tab if n == "cudnn"}
    print("\nkernel               heads     ms   TFLOP/s  x cuDNN")
    for n, h, ms in tab:
        print(f"{n:<20} {h:>6} {ms:>7.2f} {_tflops(N_ROWS, h, ms):>8.0f} {cud.get(h, float('nan')) / ms:>8.3f}")
    print("\ncase         kernel            rel-L2    cosine   (8192 rows x 4 heads x 128, bf16, vs float64)")
    for c, n, r, cs in acc:
        print(f"{c:<12} {n:<16} {r:>8.4f} {cs:>9.6f}")
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
