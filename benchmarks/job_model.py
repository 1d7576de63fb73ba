# SPDX-License-Identifier: Apache-2.0
"""The served H3 job on 4 x H200 at 50 steps (49 forwards, SGLang's setting), MODELED from
pieces measured on one H200: no multi-GPU machine ran it.

    python -m benchmarks.job_model            # reads the newest result files named below

Terms, each read from a result file (the file and the row are recorded):

- text encode: the served full-size job at W = 1 (``serve-h3-job-full_*``): rank 0 encodes
  and broadcasts at any W;
- denoise: 49 x (50 x the real block per rank at the W = 4 shapes, eager sage8, with its
  all-to-alls from bytes; ``scaling-modeled_*``) + the step's part outside the blocks (the
  refiner, embeddings, heads and the engine's loop; kept whole: it is not split over the ranks
  in this model): measured where a ``serve-h3-job-outside_*`` file exists (the served step with
  every block the identity: ``bash benchmarks/h200.sh job-outside``), else the full-size W = 1
  step minus 50 of its W = 1 blocks (a difference of two runs, often of two days: it swung from
  0.05 to 0.195 s between files, so the measured term is preferred; the term's text says which);
- audio decode: the served job (rank 0, before the video decode);
- video decode at W = 4: ``vae-decode_*``'s model (a rank's 49 calls + stitching +
  all-gathers from bytes);
- mux: the tail from the last clip to the MP4 committed, streamed at the W = 4 decode's pace
  (``vae-decode_*``'s mux rows).

Writes ``benchmarks/results/job-modeled_<hw>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import torch

from benchmarks.harness import ResultWriter, add_common_args, markdown_table, refuse_unhonoured

THEME = "job-modeled"
RESULTS = os.path.join(os.path.dirname(__file__), "results")


def _newest(pattern: str) -> tuple[str, dict]:
    paths = sorted(glob.glob(os.path.join(RESULTS, pattern)))
    if not paths:
        raise SystemExit(f"no result file {pattern} in {RESULTS}: run the H200 benchmarks first")
    with open(paths[-1]) as f:
        return os.path.basename(paths[-1]), json.load(f)


def _median_step(job: dict) -> float:
    """The median step of a ``serve_h3_gpu`` file's timed jobs (the warm-up job left out)."""
    timed = [r for r in job["rows"] if not r["warmup"]] or job["rows"]
    steps = sorted(x for r in timed for x in r["step_s"])
    return steps[len(steps) // 2]


def outside_blocks(w1_step: float, layers: int, block_w1: float,
                   compiled: bool) -> tuple[float, str, str | None]:
    """Seconds of a step outside its blocks, how they were found, and the file read: the newest
    ``serve-h3-job-outside_h200_*`` file whose run had every block the identity, the real
    component configs and the refiner compiled as ``compiled`` says; else ``w1_step - layers *
    block_w1`` (no file)."""
    for path in sorted(glob.glob(os.path.join(RESULTS, "serve-h3-job-outside_h200_*.json")),
                       reverse=True):
        with open(path) as f:
            run = json.load(f)
        cfg = run.get("config", {})
        if (cfg.get("blocks") == "identity" and cfg.get("real_configs")
                and bool(cfg.get("compile")) == compiled):
            name = os.path.basename(path)
            return _median_step(run), f"measured, blocks as the identity: {name}", name
    how = f"the W = 1 step {w1_step:.3f} s less {layers} W = 1 blocks of {block_w1 * 1e3:.2f} ms"
    return max(0.0, w1_step - layers * block_w1), how, None


def w4_block_ms(row: dict, config: dict) -> float:
    """An h3_fp8 ``w4`` row's block time. Rows written before the fix of 2026-12-05 (no
    ``a2a_in_ms``) added the all-to-alls twice: the second count is taken off here, computed as
    the run computed it (the bytes rank 0 sends to the 3 others: q, k, v in and the output back,
    over the run's ``bandwidth_gbs``)."""
    if "a2a_in_ms" in row:
        return row["median_ms"]
    m = config["model"]
    once = (4 * row["rows"] * (m["num_attention_heads"] - row["heads"]) * m["attention_head_dim"] * 2
            / (config["bandwidth_gbs"] * 1e9) * 1e3)
    return row["median_ms"] - once


#: (linears, mode) -> the theme of the measured served job it is modeled from.
_JOB_THEMES = {("bf16", "eager"): "serve-h3-job-full", ("bf16", "compiled"):
               "serve-h3-job-full-compiled", ("fp8", "compiled"): "serve-h3-job-full-fp8",
               ("fp8fast", "compiled"): "serve-h3-job-full-fp8fast"}


def model(steps: int, path: str, mode: str, threading: str,
          overlap_chunks: int = 1) -> tuple[list[dict], dict]:
    """The job's terms for one ``path`` (``"<linears>:<attention>"``) in ``mode``."""
    linears, backend = path.split(":")
    job_name, job = _newest(f"{_JOB_THEMES[(linears, mode)]}_h200_*.json")
    dec_name, dec = _newest("vae-decode_h200_*.json")
    timed = [r for r in job["rows"] if not r["warmup"]] or job["rows"]
    j = timed[-1]
    layers = job["config"]["layers"]
    w1_step = _median_step(job)
    if (linears, mode) == ("bf16", "eager"):  # the scaling run's real block, eager
        blocks_name, sc = _newest("scaling-modeled_h200_*.json")

        def block(n: int) -> float:
            rows = [r for r in sc["rows"] if r.get("what") == "block"
                    and r.get("backend") == backend and r.get("N") == n
                    and r.get("mode") == "modeled" and r.get("status") == "ok"
                    and r.get("overlap_chunks", 1) == 1]
            return min(r["total_ms"] for r in rows) / 1e3
        block_w1, block_w4 = block(1), block(4)
    else:  # h3_fp8's block rows: compiled, W = 1 measured and W = 4 modeled
        blocks_name, fp = _newest("h3-fp8_h200_*.json")
        w1 = [r for r in fp["rows"] if r.get("section") == "block" and r.get("path") == path
              and r.get("mode") == mode and r.get("status") == "ok"]
        w4 = [r for r in fp["rows"] if r.get("section") == "w4" and r.get("path") == path
              and r.get("mode") == mode and r.get("status") == "ok"
              and r.get("overlap_chunks", 1) == overlap_chunks]
        if not w4:
            raise SystemExit(f"{blocks_name} has no w4 row of {path} {mode} with overlap_chunks="
                             f"{overlap_chunks}")
        block_w1, block_w4 = w1[0]["median_ms"] / 1e3, w4_block_ms(w4[0], fp["config"]) / 1e3
        if "a2a_in_ms" not in w4[0]:
            blocks_name += (f" (w4 row {w4[0]['median_ms']:.2f} ms less its second count of the "
                            f"all-to-alls)")
    outside_s, outside_how, outside_name = outside_blocks(w1_step, layers, block_w1,
                                                          compiled=mode == "compiled")
    step_w4 = layers * block_w4 + outside_s
    w4rows = [r for r in dec["rows"]
              if r.get("section") == "W=4 modeled" and r.get("status", "ok") == "ok"]
    decode = min(w4rows, key=lambda r: r["modeled_s"])
    try:
        mux_name, mux_file = _newest("vae-decode-mux_h200_*.json")
    except SystemExit:
        mux_name, mux_file = dec_name, dec
    mux = [r for r in mux_file["rows"] if r.get("section") == "mux" and r.get("clips", 1) > 1
           and r.get("threading", "frame") == threading and r.get("status", "ok") == "ok"]
    tail = mux[0]["tail_s"] if mux else j["mux"]
    terms = [
        {"term": "text encode (rank 0, broadcast)", "s": j["text_encode"], "source": job_name},
        {"term": f"denoise: {steps - 1} forwards x {step_w4:.3f} s (50 blocks x "
                 f"{block_w4 * 1e3:.2f} ms at W = 4 + {outside_s:.3f} s outside the blocks: "
                 f"{outside_how})",
         "s": (steps - 1) * step_w4,
         "source": " + ".join(x for x in (blocks_name, job_name, outside_name) if x)},
        {"term": "audio decode (rank 0)", "s": j["decode_audio"], "source": job_name},
        {"term": f"video decode at W = 4 ({decode['rank_calls']} calls a rank, "
                 f"{decode['tiles_per_call']} a call)", "s": decode["modeled_s"],
         "source": dec_name},
        {"term": f"MP4 tail after the last clip (x264 {threading} threads, streamed at the W = 4 "
                 "decode's pace)" if mux else "MP4 tail after the last clip (measured at W = 1)",
         "s": tail, "source": mux_name if mux else job_name},
    ]
    after = sum(t["s"] for t in terms[2:])
    total = sum(t["s"] for t in terms)
    terms.append({"term": "after the last denoise step (audio + decode + MP4 tail)", "s": after,
                  "source": "sum"})
    terms.append({"term": "job, end to end", "s": total, "source": "sum"})
    info = {"steps": steps, "path": path, "mode": mode, "overlap_chunks": overlap_chunks,
            "step_w4_s": step_w4,
            "w1_step_s": w1_step, "block_w1_s": block_w1, "block_w4_s": block_w4,
            "outside_blocks_s": outside_s, "outside_blocks_how": outside_how,
            "sources": [x for x in (job_name, dec_name, blocks_name, outside_name) if x],
            "after_denoise_s": after, "total_s": total, "sglang_s": 74.38,
            "sglang_decode_s": 1.32}
    return terms, info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="grid points; forwards = steps - 1")
    p.add_argument("--paths", default="bf16:sage8:eager,bf16:sage8:compiled,fp8:sage8:compiled,fp8fast:sage8:compiled",
                   help="<linears>:<attention>:<mode>[:C], comma-separated: one table each; C = "
                        "overlap_chunks of the compiled paths' W = 4 block (default 1)")
    p.add_argument("--threading", default="frame", choices=("frame", "slice"))
    add_common_args(p, iters=1, warmup=0, budget_s=0)
    args = p.parse_args()
    refuse_unhonoured(p, args, cpu_only=True, no_budget=True)
    if args.steps < 2:
        p.error(f"--steps={args.steps} must be >= 2 (grid points: forwards = steps - 1)")
    runs = []
    for spec in args.paths.split(","):
        parts = spec.split(":")
        if len(parts) not in (3, 4) or (parts[0], parts[2]) not in _JOB_THEMES \
                or (len(parts) == 4 and not (parts[3].isdigit() and int(parts[3]) >= 1)):
            p.error(f"--paths entry {spec!r} must be <linears>:<attention>:<mode>[:C] with "
                    f"(linears, mode) one of {sorted(_JOB_THEMES)} and C an int >= 1")
        linears, attention, mode, *chunks = parts
        c = int(chunks[0]) if chunks else 1
        try:
            terms_info = model(args.steps, f"{linears}:{attention}", mode, args.threading, c)
        except (KeyError, IndexError, ValueError, StopIteration) as exc:
            p.error(f"--paths entry {spec!r}: the measured results have no rows for it "
                    f"({type(exc).__name__}: {exc})")
        runs.append((f"{linears}:{attention}" + (f" C={c}" if c > 1 else ""), mode, *terms_info))
    writer = ResultWriter(theme=THEME, args=args, config={"paths": args.paths, "steps": args.steps,
                                                          "runs": [r[3] for r in runs]},
                          device=torch.device("cpu"),
                          title="The served H3 job on 4 x H200, MODELED from one-H200 pieces")
    # the pieces are one H200's: the files say so unless --hardware / --theme say otherwise
    writer.hardware = writer.payload["hardware"] = args.hardware or "h200"
    writer.stem = os.path.join(writer.out_dir,
                               f"{args.theme or THEME}_{writer.hardware}_{writer.date}")
    writer.note("MODELED: every term was measured on one H200 or computed from bytes; no "
                "4-GPU machine ran this job. SGLang's measured 4 x H200 job: 74.38 s, its "
                "decode 1.32 s (sglang PR #33398).")
    sections = []
    for path, mode, terms, info in runs:
        for t in terms:
            writer.rows.append({"status": "ok", "total_ms": t["s"] * 1e3, "path": path,
                                "mode": mode, **t})
        sections.append((f"{path}, {mode}", markdown_table(
            terms, [("term", "term", ""), ("s", "seconds", ".3f"), ("source", "from", "")])))
    terms = runs[-1][2]

    def plot(plt):
        parts = terms[:-2]
        plt.figure(figsize=(7, 3))
        left = 0.0
        for t in parts:
            plt.barh([0], [t["s"]], left=left, label=t["term"][:40])
            left += t["s"]
        plt.yticks([])
        plt.xlabel("seconds")
        plt.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.3))
        plt.title(f"H3 job on 4 x H200 (modeled), {runs[-1][0]} {runs[-1][1]}")

    paths = writer.finish(plot, sections)
    for head, table in sections:
        print(f"## {head}\n{table}")
    print(f"wrote {paths['md']}")


if __name__ == "__main__":
    main()
