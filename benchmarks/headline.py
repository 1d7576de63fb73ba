# SPDX-License-Identifier: Apache-2.0
"""The README's headline: one table of current numbers from ONE GPU's result files, and one plot.

    python -m benchmarks.headline [--hardware h100] [--date 2026-12-07] [--out benchmarks/results]

Reads the result files named in :data:`SOURCES` for that hardware and date (nothing is timed
here) and writes ``headline_<hardware>_<date>.{json,md,png}``: every number's source file beside
it, the GPU name the sources recorded, and the plot (the kernel against cuDNN, SageAttention 2
and FA3 FP8; the H3 block against diffusers'). Exits with a message naming the file and what is
missing when a source or one of its rows is absent, or when the sources ran on different GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.harness import DEFAULT_OUT_DIR

#: the block path of the library's defaults on CUDA (fused AdaLN) with FP8 fast accumulation
BLOCK_PATH = "fp8fastadaln:sage8"
#: theme -> the result file (without ``_<hardware>_<date>.json``) the row reads
SOURCES = {
    "kernels": "kernels-side",
    "accuracy": "accuracy-cute",
    "block": "h3-fp8-adaln2",
    "job": "serve-h3-job-8x3",
    "decode": "vae-decode-compiled",
    "memory": "h3-memory",
}
KERNELS = (("sdpa_cudnn", "cuDNN SDPA"), ("sage2_direct", "SageAttention 2"),
           ("dense:sage8", "sage8 (Triton loop, default)"), ("dense:sage8_cute", "sage8_cute (CuTe DSL, opt-in)"),
           ("fa3_fp8_prequant", "FA3 FP8, pre-quantized"))


def _load(folder: str, theme: str, hardware: str, date: str) -> tuple[str, dict]:
    name = f"{SOURCES[theme]}_{hardware}_{date}.json"
    path = os.path.join(folder, name)
    if not os.path.exists(path):
        raise SystemExit(f"headline: {name} is missing from {folder} (theme {theme!r})")
    with open(path, encoding="utf-8") as f:
        return name, json.load(f)


def _row(name: str, rows: list, what: str, **match):
    """The one row of ``rows`` whose fields equal ``match``; SystemExit naming ``name`` if none."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if not found:
        raise SystemExit(f"headline: {name} has no {what} row with {match}")
    return found[0]


def collect(folder: str, hardware: str, date: str) -> dict:
    """Every headline number with its source file; raises SystemExit on a missing source or a
    source from another GPU."""
    src = {t: _load(folder, t, hardware, date) for t in SOURCES}
    gpus = {name: d.get("gpu") for name, d in src.values()}
    if len(set(gpus.values())) != 1:
        raise SystemExit(f"headline: the sources ran on different GPUs: {gpus}")
    (kn, k), (an, a), (bn, b) = src["kernels"], src["accuracy"], src["block"]
    kernels = {h: {key: _row(kn, k["rows"], "speed", kernel=key, heads=h, status="ok")["median_ms"]
                   for key, _ in KERNELS} for h in (14, 56, 7)}
    acc = {kernel: _row(an, a["rows"], "accuracy", case="h3_real", kernel=kernel)["rel_l2"]
           for kernel in ("sage8", "sdpa")}
    block = _row(bn, b["rows"], "block", section="block", mode="compiled", path=BLOCK_PATH)["median_ms"]
    native = _row(bn, b["rows"], "block", section="block", mode="compiled", path="bf16:native")["median_ms"]
    step = min(r["step_s"] for r in b["rows"] if r.get("section") == "w4" and r.get("path") == BLOCK_PATH)
    job = {r["phase"]: r["s"] for r in src["job"][1]["summary"]}
    dec = {r["decode"]: r["s"] for r in src["decode"][1]["rows"]}
    mem = {(r["world"], r["precision"]): r["peak_gb"] for r in src["memory"][1]["rows"]}
    return {"gpu": next(iter(gpus.values())), "hardware": hardware, "date": date,
            "sources": {t: name for t, (name, _) in src.items()},
            "kernels_ms": kernels,
            "rel_l2_h3_first_block": acc,
            "block_ms": {"path": BLOCK_PATH, "ours": block, "native": native},
            "modeled_w4_step_s": step,
            "job_s": job["total (one job)"], "decode_s": dec,
            "memory_rank0_gb": {f"W={w} {p}": round(gb, 1) for (w, p), gb in sorted(mem.items())}}


def table(h: dict) -> str:
    """The README's markdown table of ``h`` (:func:`collect`)."""
    km, s = h["kernels_ms"], h["sources"]

    def kx(key, heads):
        return f"{km[heads][key]:.2f} ms ({km[heads]['sdpa_cudnn'] / km[heads][key]:.2f}x)"

    rows = [("what", "result", "source"), ("---", "---", "---")]
    for heads, w in ((14, 4), (56, 1)):
        rows.append((f"attention per rank, {heads} heads (W = {w}), 38,016 rows, quantization included",
                     "; ".join(f"{label} {kx(key, heads)}" for key, label in KERNELS[1:]) +
                     f"; cuDNN {km[heads]['sdpa_cudnn']:.2f} ms", s["kernels"]))
    acc = h["rel_l2_h3_first_block"]
    rows.append(("error vs float64, real H3 first block (rel-L2)", f"sage8 {acc['sage8']:.4f}; sdpa {acc['sdpa']:.4f}",
                 s["accuracy"]))
    b = h["block_ms"]
    rows.append(("real H3 block, W = 1, compiled, FP8 linears with fast accumulation (not the default; "
                 "AdaLN fused, the default) + sage8",
                 f"{b['ours']:.2f} ms vs diffusers native compiled {b['native']:.2f} "
                 f"({b['native'] / b['ours']:.2f}x); MODELED 4-GPU step {h['modeled_w4_step_s']:.3f} s",
                 s["block"]))
    rows.append(("served job, 8 of 50 blocks x 3 steps, W = 1, bf16, compiled decode",
                 f"{h['job_s']:.2f} s (against diffusers: not measured on this GPU)", s["job"]))
    rows.append(("H3 video decode at h3-ref, fp16, W = 1",
                 f"compiled {h['decode_s']['compiled']:.2f} s vs eager {h['decode_s']['eager']:.2f} s", s["decode"]))
    rows.append(("full-size H3, peak of rank 0 in a job (fake process group)",
                 "; ".join(f"{k} {v} GB" for k, v in h["memory_rank0_gb"].items()), s["memory"]))
    return "\n".join("| " + " | ".join(r) + " |" for r in rows) + "\n"


def plot(h: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [3, 1.2]})
    labels = [label for _, label in KERNELS]
    ms = [h["kernels_ms"][14][key] for key, _ in KERNELS]
    a.barh(labels[::-1], ms[::-1], color=["#4c72b0", "#dd8452", "#55a868", "#55a868", "#8c8c8c"][::-1])
    for y, v in enumerate(ms[::-1]):
        a.text(v, y, f" {v:.2f} ms ({ms[0] / v:.2f}x)", va="center", fontsize=8)
    a.set_xlabel("ms, 14 heads x 38,016 rows x 128 (W = 4), quantization included")
    a.set_xlim(0, max(ms) * 1.35)
    blk = [h["block_ms"]["native"], h["block_ms"]["ours"]]
    b.bar(["diffusers\nnative", "dist_attn\nFP8 fast + sage8"], blk, color=["#8c8c8c", "#55a868"])
    for x, v in enumerate(blk):
        b.text(x, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    b.set_ylabel("ms, one H3 block, W = 1, compiled")
    fig.suptitle(f"{h['gpu']}, {h['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hardware", default="h100")
    p.add_argument("--date", default="2026-12-07")
    p.add_argument("--out", default=None, help="the results folder (read and written)")
    a = p.parse_args(argv)
    folder = a.out or DEFAULT_OUT_DIR
    h = collect(folder, a.hardware, a.date)
    stem = os.path.join(folder, f"headline_{a.hardware}_{a.date}")
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(h, f, indent=1)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(f"# Headline: {h['gpu']}, {h['date']}\n\n{table(h)}")
    plot(h, stem + ".png")
    print(f"[headline] wrote {stem}.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
