# SPDX-License-Identifier: Apache-2.0
"""Report of :mod:`benchmarks.h3_fp8`: the targets it is read against, its markdown tables, its plot."""

from __future__ import annotations

from benchmarks.harness import markdown_table

__all__ = ["plot", "report", "targets"]


def targets(rows) -> dict:
    ok = [r for r in rows if r.get("status") == "ok"]
    compiled = {r["path"]: r["median_ms"] for r in ok if r["section"] == "block" and r["mode"] == "compiled"}
    block = compiled.get("fp8:sage8")
    native = compiled.get("bf16:native")
    w4 = sorted((r for r in ok if r["section"] == "w4"), key=lambda r: r["step_s"])
    seq = sorted((r for r in ok if r["section"] == "w4-seq"), key=lambda r: r["step_s"])
    rounds = {r["path"]: r.get("rounds_ms") for r in ok if r["section"] == "block" and r["mode"] == "compiled"}

    def per_round(path):  # native / path, round by round (the rounds are interleaved)
        a, b = rounds.get("bf16:native"), rounds.get(path)
        return [x / y for x, y in zip(a, b)] if a and b and len(a) == len(b) else None
    return {"block_w1_fp8_sage8_compiled_ms": block, "block_w1_target_ms": 80.0,
            "block_w1_fp8fast_sage8_compiled_ms": compiled.get("fp8fast:sage8"),
            "block_w1_native_compiled_ms": native,
            "x_native_compiled": native / block if native and block else None,
            "x_native_target": 1.45,
            "x_native_compiled_fp8fast": (native / compiled["fp8fast:sage8"]
                                          if native and compiled.get("fp8fast:sage8") else None),
            "x_native_rounds": per_round("fp8:sage8"), "x_native_rounds_fp8fast": per_round("fp8fast:sage8"),
            "w4_best_step_s": w4[0]["step_s"] if w4 else None,
            "w4_best": (f"{w4[0]['path']} {w4[0]['mode']} C={w4[0].get('overlap_chunks', 1)}"
                        f" {w4[0].get('chunking', 'even')} {w4[0].get('widths', '')}" if w4 else None), "w4_step_target_s": 1.0,
            "w4_seq_best_step_s": seq[0]["step_s"] if seq else None,
            "w4_seq_best": f"{seq[0]['path']} {seq[0]['mode']}" if seq else None}


def _fmt(ratios) -> str:
    return ", ".join(f"{x:.3f}" for x in ratios) if ratios else "-"


def report(rows) -> list[tuple[str, str]]:
    t = targets(rows)
    cols = {"gemm": [("shape", "GEMM", ""), ("rows", "rows", ""), ("path", "path", ""), ("status", "status", ""),
                     ("median_ms", "ms", ".3f"), ("tflops", "TFLOP/s", ".0f"), ("x_bf16", "x bf16", ".2f"),
                     ("rel_l2", "rel-L2 vs fp64", ".2e"), ("reason", "reason", "")],
            "block": [("path", "linears:attention", ""), ("mode", "mode", ""), ("rows", "rows", ""),
                      ("status", "status", ""), ("median_ms", "ms", ".2f"), ("rounds", "rounds ms", ""),
                      ("wall_s", "wall s", ".1f"), ("reason", "reason", "")],
            "w4": [("path", "linears:attention", ""), ("mode", "rest mode", ""),
                   ("overlap_chunks", "C", ""), ("chunking", "chunks", ""), ("widths", "heads a chunk", ""),
                   ("status", "status", ""),
                   ("rest_ms", "rest ms", ".2f"), ("kernel_ms", "attention ms", ".2f"),
                   ("comm_ms", "pack+a2a+unpack ms", ".2f"), ("hidden_ms", "hidden ms", ".2f"),
                   ("median_ms", "block ms", ".2f"),
                   ("step_s", "50-block step s", ".3f"), ("reason", "reason", "")],
            "w4-seq": [("path", "linears:attention", ""), ("mode", "rest mode", ""), ("status", "status", ""),
                       ("compute_ms", "rest + pack + attention + unpack ms", ".2f"), ("rounds", "rounds ms", ""),
                       ("busy_ms", "its kernels ms (profiled)", ".2f"),
                       ("idle_ms", "GPU idle between them ms (profiled)", ".2f"),
                       ("a2a_ms", "all-to-alls ms (bytes)", ".2f"), ("median_ms", "block ms", ".2f"),
                       ("step_s", "50-block step s", ".3f")],
            "accuracy": [("path", "linears:attention", ""), ("mode", "blocks", ""), ("status", "status", ""),
                         ("median_ms", "step ms (eager: median; compiled: the last)", ".1f"),
                         ("video_rel_l2", "video rel-L2 vs bf16:sdpa", ".3e"),
                         ("audio_rel_l2", "audio rel-L2", ".3e"),
                         ("block0_rel_l2", "first block's output rel-L2 (step 1)", ".3e"),
                         ("video_vs_eager_rel_l2", "video rel-L2 vs its eager run", ".3e"),
                         ("audio_vs_eager_rel_l2", "audio rel-L2 vs its eager run", ".3e"),
                         ("reason", "reason", "")]}
    pick = {"block": ("block", "w4-rest")}
    out = [("Targets", f"- real block W=1, fp8:sage8 compiled: {t['block_w1_fp8_sage8_compiled_ms']} ms "
                       f"(target <= 80), {t['x_native_compiled']} x diffusers native compiled (target "
                       f">= 1.45); fp8fast:sage8: {t['block_w1_fp8fast_sage8_compiled_ms']} ms, "
                       f"{t['x_native_compiled_fp8fast']} x; round by round (fp8 / fp8fast): "
                       f"{_fmt(t['x_native_rounds'])} / {_fmt(t['x_native_rounds_fp8fast'])}\n- modeled W = 4 50-block step (its parts timed on the GPU above), best ({t['w4_best']}): "
                       f"{t['w4_best_step_s']} s (target <= 1.0); the block computed in one piece (w4-seq), best "
                       f"({t['w4_seq_best']}): {t['w4_seq_best_step_s']} s")]
    for name, columns in cols.items():
        sel = [r for r in rows if r["section"] in pick.get(name, (name,))]
        if sel:
            out.append((name, markdown_table(sel, columns)))
    kernels = [{"path": f"{r['path']} {r['mode']}", **k} for r in rows if r.get("kernels")
               for k in r["kernels"]]
    if kernels:  # --profile
        out.append(("where the block's time goes (torch.profiler, per call)",
                    markdown_table(kernels, [("path", "block", ""), ("kernel", "kernel", ""),
                                             ("calls", "calls", ".0f"), ("ms", "ms", ".3f"),
                                             ("share", "share", ".1%")])))
    return out


def plot(writer):
    def draw(plt):
        ok = [r for r in writer.rows if r.get("status") == "ok"]
        fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
        for ax, section, key, label in ((axes[0], "block", "median_ms", "block ms (W = 1)"),
                                        (axes[1], "w4", "step_s", "modeled 50-block step s (W = 4)")):
            sel = [r for r in ok if r["section"] == section]
            ax.bar(range(len(sel)), [r[key] for r in sel],
                   color=["tab:orange" if r["mode"] == "compiled" else "tab:blue" for r in sel])
            ax.set_xticks(range(len(sel)))
            ax.set_xticklabels([r["path"] for r in sel], rotation=70, fontsize=7)
            ax.set_title(f"{label}; blue eager, orange compiled", fontsize=9)
        sel = [r for r in ok if r["section"] == "gemm" and r["path"] in ("fp8", "scaled_mm") and r.get("x_bf16")]
        axes[2].bar(range(len(sel)), [r["x_bf16"] for r in sel])
        axes[2].set_xticks(range(len(sel)))
        axes[2].set_xticklabels([f"{r['shape']} {r['rows']} {r['path']}" for r in sel], rotation=70, fontsize=7)
        axes[2].axhline(1.0, color="grey", lw=0.8)
        axes[2].set_title(f"GEMM speed x bf16 ({writer.gpu})", fontsize=9)
        fig.tight_layout()
    return draw


if __name__ == "__main__":
    raise SystemExit("benchmarks.h3_fp8_report is a module of other benchmarks, with nothing to run by itself; "
                     "run python -m benchmarks.h3_fp8")
