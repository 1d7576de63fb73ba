# SPDX-License-Identifier: Apache-2.0
"""The README's headline: one table of current numbers from ONE GPU's result files, and one plot.

    python -m benchmarks.headline [--hardware h100] [--date 2026-12-07] [--out benchmarks/results]

Reads the newest result files named in :data:`SOURCES` for that hardware (nothing is timed here)
and writes ``headline_<hardware>_<date>.{json,md,png}``: every number's source file beside it,
the GPU name each source recorded, and the plot (the kernel against cuDNN, SageAttention 2 and
FA3 FP8; the H3 block against diffusers'). Exits 2, naming the file, when a source is missing or
ran on another GPU than the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.harness import DEFAULT_OUT_DIR

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


def _kernel_ms(rows: list, kernel: str, heads: int) -> float:
    return next(r["median_ms"] for r in rows if r.get("kernel") == kernel and r.get("heads") == heads
                and r.get("status") == "ok")


def collect(folder: str, hardware: str, date: str) -> dict:
    """Every headline number with its source file; raises SystemExit on a missing source or a
    source from another GPU."""
    src = {t: _load(folder, t, hardware, date) for t in SOURCES}
    gpus = {name: d.get("gpu") for name, d in src.values()}
    if len(set(gpus.values())) != 1:
        raise SystemExit(f"headline: the sources ran on different GPUs: {gpus}")
    k = src["kernels"][1]["rows"]
    kernels = {h: {key: _kernel_ms(k, key, h) for key, _ in KERNELS} for h in (14, 56, 7)}
    acc = {(r["case"], r["kernel"]): r["rel_l2"] for r in src["accuracy"][1]["rows"] if "rel_l2" in r}
    tg = src["block"][1]["targets"]
    job = {r["phase"]: r["s"] for r in src["job"][1]["summary"]}
    dec = {r["decode"]: r["s"] for r in src["decode"][1]["rows"]}
    mem = {(r["world"], r["precision"]): max(p["peak_gb"] for p in r["phases"].values())
           for r in src["memory"][1]["rows"]}
    return {"gpu": next(iter(gpus.values())), "hardware": hardware, "date": date,
            "sources": {t: name for t, (name, _) in src.items()},
            "kernels_ms": kernels,
            "rel_l2_h3_first_block": {"sage8": acc[("h3_real", "sage8")], "sdpa": acc[("h3_real", "sdpa")]},
            "block_ms": {"fp8fast_sage8": tg["block_w1_fp8fast_sage8_compiled_ms"],
                         "native": tg["block_w1_native_compiled_ms"]},
            "modeled_w4_step_s": tg["w4_best_step_s"],
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
    rows.append(("real H3 block, W = 1, compiled, FP8 linears with fast accumulation (not the default) + sage8",
                 f"{b['fp8fast_sage8']:.2f} ms vs diffusers native compiled {b['native']:.2f} "
                 f"({b['native'] / b['fp8fast_sage8']:.2f}x); MODELED 4-GPU step {h['modeled_w4_step_s']:.3f} s",
                 s["block"]))
    rows.append(("served job, 8 of 50 blocks x 3 steps, W = 1, bf16, compiled decode",
                 f"{h['job_s']:.2f} s (against diffusers: not measured on this GPU)", s["job"]))
    rows.append(("H3 video decode at h3-ref, fp16, W = 1",
                 f"compiled {h['decode_s']['compiled']:.2f} s vs eager {h['decode_s']['eager']:.2f} s", s["decode"]))
    rows.append(("full-size H3, peak of rank 0 (fake process group)",
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
    blk = [h["block_ms"]["native"], h["block_ms"]["fp8fast_sage8"]]
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
