# SPDX-License-Identifier: Apache-2.0
"""Accuracy of the attention kernels against float64: real MiniMax-H3 activations, V with channel
means at H3 length, several segments, and the input families of the earlier notes, in ONE run.

    PYTHONUNBUFFERED=1 python -m benchmarks.accuracy                 # one H200, ~2 minutes
    python -m benchmarks.accuracy --smoke                            # CPU, seconds (CI)

Cases (rows of the table):

* ``h3_real``: the q/k/v the FIRST block of diffusers' ``MiniMaxH3Transformer3DModel`` (default
  config, its own initialisation, bf16) hands to attention on the h3-ref layout built by the H3
  pipeline's own layout code (512 text + 172 audio + 37,296 video = 37,980 rows, 56 heads x 128):
  :mod:`dist_attn.models.h3.activations`;
* ``vmean``: q, k ~ N(0, 1), v ~ N(0, 1) + a per-channel mean drawn from U(0, m), 8 heads, at
  4,096 and 38,016 rows, m in {0, 0.5, 2};
* ``segments``: four documents of one packed axis (5,000 / 12,000 / 3,000 / 16,000 rows), each
  with its own V channel means U(0, 2);
* ``family``: the distributions of the earlier notes at 8,192 rows x 4 heads (N(0,1), key bias,
  x20 channel outliers in q / k / q,k,v, RMS-normed q/k with log-normal gains, sharp logits).

Every kernel's output is compared on ``--rows`` random query rows of each segment (all of its keys)
with attention computed in float64 on the same device from the same bf16 inputs. Metric: rel-L2 =
||out - ref|| / ||ref|| over those rows, all heads and channels.

Kernels: ``sdpa`` (dist_attn's torch SDPA backend), ``fa3`` (FA3 bf16), ``sage`` (sageattention:
1.0.6 from PyPI, or 2.x when built), ``sage2_direct`` (SageAttention 2's sm90 kernel,
``sageattn_qk_int8_pv_fp8_cuda_sm90``, per_warp, fp32+fp32, when importable), ``sage8`` (the Triton
loop) and ``sage8_gluon`` (the Gluon loop), what the backends run (each key block's P V added into
fp32 registers), their
``:v2-running`` variants (v2's kernel: the P V sum kept inside the FP8 MMA accumulator across the
whole row). Every dist_attn kernel runs through the varlen bridge (``dist_attn.sage_varlen``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Callable

import torch

import dist_attn
from benchmarks.harness import (Budget, ResultWriter, add_common_args, describe_exception,
                                markdown_table, refuse_unhonoured)

__all__ = ["family_case", "main"]

THEME = "accuracy"


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    rows: int
    heads: int
    build: Callable[[torch.device, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]]
    what: str


# ---------------------------------------------------------------------------------------------
# inputs: each returns q, k, v [T, H, D] bf16 and the segment bounds (host list)
# ---------------------------------------------------------------------------------------------
def _randn(shape, g, device):
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32)


def _vmean_case(rows: int, heads: int, mean_hi: float, d: int):
    def build(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (_randn((rows, heads, d), g, device) for _ in range(3))
        if mean_hi:
            v += torch.rand((heads, d), generator=g, device=device) * mean_hi
        return q.bfloat16(), k.bfloat16(), v.bfloat16(), [0, rows]
    return build


def _segments_case(lens: list[int], heads: int, d: int):
    def build(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        T = sum(lens)
        q, k, v = (_randn((T, heads, d), g, device) for _ in range(3))
        bounds = [0]
        for n in lens:
            a = bounds[-1]
            v[a:a + n] += torch.rand((heads, d), generator=g, device=device) * 2.0
            bounds.append(a + n)
        return q.bfloat16(), k.bfloat16(), v.bfloat16(), bounds
    return build


def family_case(kind: str, rows: int, heads: int, d: int):
    """The input families of the earlier notes: a builder (device, seed) -> q, k, v [T, H, D] bf16, bounds."""
    def build(device, seed):
        g = torch.Generator(device=device).manual_seed(seed)
        q, k, v = (_randn((rows, heads, d), g, device) for _ in range(3))
        ch = [3, 77 % d, 100 % d]
        if kind == "bias":
            k += 0.5
        elif kind == "outlier_q":
            q[..., ch] *= 20
        elif kind == "outlier_k":
            k[..., ch] *= 20
        elif kind == "outlier_qkv":
            for t in (q, k, v):
                t[..., ch] *= 20
        elif kind == "rms_gain":  # RMS-normed q/k with heavy-tailed per-channel gains (QK norm)
            gq, gk = (torch.exp(_randn((d,), g, device)) for _ in range(2))
            q = q / q.pow(2).mean(-1, keepdim=True).sqrt() * gq
            k = k / k.pow(2).mean(-1, keepdim=True).sqrt() * gk
        elif kind == "sharp":  # logits with std ~5: a few keys dominate each row
            q *= 5.0
        return q.bfloat16(), k.bfloat16(), v.bfloat16(), [0, rows]
    return build


def _h3_case(smoke: bool, small: bool = False):
    def build(device, seed):
        import dist_attn.models.h3.activations as h3

        layout, config = h3.H3_REF_LAYOUT, {}
        if small:  # the GPU test's layout (tests/core/test_kernel_accuracy.py): 4,176 rows
            layout = h3.H3Layout(text_rows=256, latent_frames=5, latent_height=64, latent_width=48, audio_latents=40)
        if smoke:  # the same class at a tiny config
            layout = h3.H3Layout(text_rows=32, latent_frames=2, latent_height=16, latent_width=16, audio_latents=16)
            config = dict(num_attention_heads=2, attention_head_dim=64, hidden_size=128, ffn_dim=256, text_dim=32,
                          time_embed_hidden_dim=64, time_embed_dim=32, num_refiner_layers=1,
                          rope_freq_dim=8)
        model = h3.build_h3_model(device=device, num_layers=1, seed=seed, **config)
        q, k, v = h3.first_block_qkv(model, h3.h3_inputs(model, layout, device=device, seed=seed))
        del model
        return q, k, v, [0, q.shape[0]]
    return build


def cases(smoke: bool) -> list[Case]:
    d = 64 if smoke else 128
    out = [Case("h3_real", "h3", 0, 0, _h3_case(smoke),
                "first-block q/k/v of MiniMaxH3Transformer3DModel (own init), h3-ref layout")]
    if not smoke:
        out.append(Case("h3_real_4176", "h3", 0, 0, _h3_case(False, small=True),
                        "the same on the GPU test's 4,176-row layout (256 text, 5 x 32 x 24 video, 80 audio)"))
    sizes = (256,) if smoke else (4096, 38016)
    for rows in sizes:
        for m in (0.0, 0.5, 2.0):
            out.append(Case(f"vmean{m:g}_{rows}", "vmean", rows, 2 if smoke else 8, _vmean_case(rows, 2 if smoke else 8, m, d),
                            f"v ~ N(0,1) + U(0,{m:g}) per channel" if m else "q, k, v ~ N(0,1)"))
    lens = [50, 130, 20, 100] if smoke else [5000, 12000, 3000, 16000]
    out.append(Case("segments4", "segments", sum(lens), 2 if smoke else 8, _segments_case(lens, 2 if smoke else 8, d),
                    f"4 documents {lens}, each with its own V means U(0,2)"))
    fam_rows, fam_heads = (256, 2) if smoke else (8192, 4)
    for kind in ("normal", "bias", "outlier_q", "outlier_k", "outlier_qkv", "rms_gain", "sharp"):
        out.append(Case(f"{kind}_{fam_rows}", "family", fam_rows, fam_heads, family_case(kind, fam_rows, fam_heads, d),
                        kind))
    return out


# ---------------------------------------------------------------------------------------------
# kernels: fn(q, k, v, bounds) -> out [T, H, D]
# ---------------------------------------------------------------------------------------------
def _bridge(backend: str):
    def run(q, k, v, bounds):
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        return dist_attn.sage_varlen(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])),
                                     cu_seqlens_host=bounds, valid_len=bounds[-1], backend=backend)
    return run


def _sage8_variant(impl: str, pv_accum: str):
    def run(q, k, v, bounds):
        from dist_attn.kernels.sage8 import launch, sage8_varlen

        cfg = dataclasses.replace(launch.default_config(impl), pv_accum=pv_accum)
        cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
        return sage8_varlen(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])), impl=impl, config=cfg)
    return run


def _sage2_direct(q, k, v, bounds):
    import sageattention

    fn = getattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda_sm90", None)
    if fn is None:
        raise RuntimeError("SageAttention 2 (sageattn_qk_int8_pv_fp8_cuda_sm90) is not importable: build it "
                           "from ../shared/third_party (see benchmarks/README.md)")
    out = torch.empty_like(q)
    for a, b in zip(bounds, bounds[1:]):
        out[a:b] = fn(q[None, a:b], k[None, a:b], v[None, a:b], tensor_layout="NHD", is_causal=False,
                      qk_quant_gran="per_warp", pv_accum_dtype="fp32+fp32")[0]
    return out


def kernels(smoke: bool) -> dict[str, Callable]:
    ks = {"sdpa": _bridge("sdpa")}
    if smoke:
        return ks
    ks.update({"fa3": _bridge("fa3"), "sage": _bridge("sage"), "sage2_direct": _sage2_direct,
               "sage8": _bridge("sage8"), "sage8_gluon": _bridge("sage8_gluon"),
               "sage8_cute": _bridge("sage8_cute")})  # the CuTe DSL loop (opt-in: DIST_ATTN_SAGE8_CUTE=1)
    for impl, name in (("triton", "sage8"), ("gluon", "sage8_gluon")):
        ks[f"{name}:v2-running"] = _sage8_variant(impl, "running")
    return ks


# ---------------------------------------------------------------------------------------------
# measurement
# ---------------------------------------------------------------------------------------------
def _sample_rows(bounds: list[int], n: int, device, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [a + torch.randperm(b - a, generator=g)[:n].sort().values.to(device) for a, b in zip(bounds, bounds[1:])]


def _reference(q, k, v, bounds, samples) -> list[torch.Tensor]:
    """float64 attention of the sampled rows of each segment over all of its keys: [r, H, D] each."""
    refs = []
    scale = 1.0 / math.sqrt(q.shape[-1])
    for (a, b), rows in zip(zip(bounds, bounds[1:]), samples):
        ref = torch.empty((rows.numel(), q.shape[1], q.shape[2]), dtype=torch.float64, device=q.device)
        for h in range(q.shape[1]):  # one head at a time: [r, T] float64 scores stay small
            s = q[rows, h].double() @ k[a:b, h].double().T * scale
            ref[:, h] = torch.softmax(s, dim=-1) @ v[a:b, h].double()
        refs.append(ref)
    return refs


def _rel(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[float, float]:
    """rel-L2 over all sampled rows, and the worst head's rel-L2."""
    num = sum(((o.double() - r) ** 2).sum() for o, r in zip(outs, refs))
    den = sum((r ** 2).sum() for r in refs)
    per_head = (sum(((o.double() - r) ** 2).sum(dim=(0, 2)) for o, r in zip(outs, refs))
                / sum((r ** 2).sum(dim=(0, 2)) for r in refs)).sqrt()
    return (num / den).sqrt().item(), per_head.max().item()


def run(args, device, writer: ResultWriter, budget: Budget) -> None:
    known = kernels(args.smoke)
    unknown = [k for k in args.kernels or () if k not in known]
    if unknown:
        raise SystemExit(f"accuracy: --kernels {','.join(unknown)}: not among "
                         f"{sorted(known)}{' (--smoke runs sdpa only)' if args.smoke else ''}")
    ks = {n: f for n, f in known.items() if not args.kernels or n in args.kernels}
    selected = [c for c in cases(args.smoke) if not args.cases or any(c.name.startswith(p) for p in args.cases)]
    for case in selected:
        try:
            q, k, v, bounds = case.build(device, args.seed)
        except Exception as exc:  # noqa: BLE001 - e.g. diffusers missing: the case becomes a row
            writer.rows.append({"case": case.name, "family": case.family, "kernel": "-", "status": "error",
                                "reason": describe_exception(exc)})
            continue
        samples = _sample_rows(bounds, args.rows, device, args.seed)
        refs = _reference(q, k, v, bounds, samples)
        keep = [t.clone() for t in (q, k, v)]
        for name, fn in ks.items():
            row = {"case": case.name, "family": case.family, "what": case.what, "kernel": name,
                   "rows": q.shape[0], "heads": q.shape[1], "head_dim": q.shape[2], "segments": len(bounds) - 1,
                   "compared_rows": sum(s.numel() for s in samples)}
            if budget.expired():
                row.update(status="skipped", reason="the --budget-s wall-time budget was spent")
                writer.rows.append(row)
                continue
            try:
                out = fn(q, k, v, bounds)
                rel, worst = _rel([out[s] for s in samples], refs)
                row.update(status="ok", rel_l2=rel, worst_head_rel_l2=worst,
                           inputs_unchanged=all(torch.equal(a, b) for a, b in zip((q, k, v), keep)))
            except Exception as exc:  # noqa: BLE001
                row.update(status="unavailable", reason=describe_exception(exc)[:300])
            writer.rows.append(row)
            print(f"  {case.name:<18} {name:<24} {row.get('rel_l2', float('nan')):.5f} "
                  f"{row.get('reason', '')[:80]}", flush=True)
        writer.save(sections(writer))
        del q, k, v, refs, keep
        if device.type == "cuda":
            torch.cuda.empty_cache()


def latent_drift(args, device, writer: ResultWriter, budget: Budget) -> None:
    """The served H3 DiT's end-to-end drift: ``--drift-layers`` blocks of the real class (+ its
    refiner), its own init, bf16, h3-ref, ``--drift-steps`` MiniMax-H3 scheduler steps, every
    attention call of the model routed through ``dist_attn.sage_varlen(backend=...)``; each
    backend's final video and audio latents vs the sdpa run's (rel-L2)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.models.transformers import transformer_minimax_h3 as h3mod

    import dist_attn.models.h3.activations as h3

    layout = h3.H3_REF_LAYOUT
    config = {}
    if args.smoke:
        layout = h3.H3Layout(text_rows=32, latent_frames=2, latent_height=16, latent_width=16, audio_latents=16)
        config = dict(num_attention_heads=2, attention_head_dim=64, hidden_size=128, ffn_dim=256, text_dim=32,
                      time_embed_hidden_dim=64, time_embed_dim=32, num_refiner_layers=1, rope_freq_dim=8)
    model = h3.build_h3_model(device=device, num_layers=args.drift_layers, seed=args.seed, **config)
    base = h3.h3_inputs(model, layout, device=device, seed=args.seed)
    original = h3mod.dispatch_attention_fn
    backend_box = {}

    def routed(query, key, value, *a, **kw):  # [B, S, H, D], no mask in H3
        outs = [dist_attn.sage_varlen(qb, kb, vb, [0, qb.shape[0]], qb.shape[0], cu_seqlens_host=[0, qb.shape[0]],
                                      backend=backend_box["name"]) for qb, kb, vb in zip(query, key, value)]
        return torch.stack(outs)

    results = {}
    h3mod.dispatch_attention_fn = routed
    try:
        for name in ["sdpa"] + [b for b in args.drift_backends if b != "sdpa"]:
            if budget.expired():
                writer.rows.append({"section": "drift", "kernel": name, "status": "skipped"})
                continue
            backend_box["name"] = name
            try:
                video_sched, audio_sched = MiniMaxH3Scheduler(shift=12.0), MiniMaxH3Scheduler(shift=3.0)
                video_sched.set_timesteps(args.drift_steps + 1, device=device)
                audio_sched.set_timesteps(args.drift_steps + 1, device=device)
                x, a = base["hidden_states"].clone(), base["audio_hidden_states"].clone()
                t0 = budget.elapsed()
                with torch.no_grad():
                    for tv, ta in zip(video_sched.timesteps, audio_sched.timesteps):
                        ts, ti = h3.row_timesteps(base["video_indices"], base["audio_indices"], layout.text_rows,
                                                  float(tv), float(ta))
                        out = model(**{**base, "hidden_states": x, "audio_hidden_states": a,
                                       "timestep": ts.to(device), "timestep_indices": ti.to(device)})
                        x = video_sched.step(out.sample, tv, x).prev_sample
                        a = audio_sched.step(out.audio_sample, ta, a).prev_sample
                if device.type == "cuda":
                    torch.cuda.synchronize()
                results[name] = (x.double(), a.double())
                row = {"section": "drift", "kernel": name, "status": "ok", "seconds": budget.elapsed() - t0,
                       "layers": args.drift_layers, "steps": args.drift_steps, "rows": layout.rows}
                if name != "sdpa" and "sdpa" in results:
                    rx, ra = results["sdpa"]
                    row["video_rel_l2_vs_sdpa"] = ((x.double() - rx).norm() / rx.norm()).item()
                    row["audio_rel_l2_vs_sdpa"] = ((a.double() - ra).norm() / ra.norm()).item()
            except Exception as exc:  # noqa: BLE001
                row = {"section": "drift", "kernel": name, "status": "unavailable",
                       "reason": describe_exception(exc)[:300]}
            writer.rows.append(row)
            print(f"  drift {name:<12} {row.get('video_rel_l2_vs_sdpa', 0):.5f} {row.get('audio_rel_l2_vs_sdpa', 0):.5f}"
                  f" {row.get('reason', '')[:80]}", flush=True)
    finally:
        h3mod.dispatch_attention_fn = original
        del model
    writer.save(sections(writer))


def sections(writer: ResultWriter) -> list[tuple[str, str]]:
    ok = [r for r in writer.rows if r.get("status") == "ok" and r.get("section") != "drift"]
    drift = [r for r in writer.rows if r.get("section") == "drift"]
    kernels_seen = list(dict.fromkeys(r["kernel"] for r in ok))
    cases_seen = list(dict.fromkeys(r["case"] for r in ok))
    by = {(r["case"], r["kernel"]): r for r in ok}
    grid = []
    for c in cases_seen:
        row = {"case": c}
        for kname in kernels_seen:
            r = by.get((c, kname))
            row[kname] = r["rel_l2"] if r else None
        grid.append(row)
    table = markdown_table(grid, [("case", "case", "")] + [(kname, kname, ".4f") for kname in kernels_seen])
    bad = [r for r in writer.rows if r.get("status") != "ok"]
    drift_text = ("The real H3 class (its own init, bf16) at h3-ref, every attention call through "
                  "`dist_attn.sage_varlen(backend=...)`, denoised with MiniMax-H3's scheduler (video shift 12, "
                  "audio 3); final latents vs the sdpa run's.\n\n" + markdown_table(drift, [
                      ("kernel", "kernel", ""), ("layers", "layers", "d"), ("steps", "steps", "d"),
                      ("status", "status", ""), ("video_rel_l2_vs_sdpa", "video latent rel-L2 vs sdpa", ".4f"),
                      ("audio_rel_l2_vs_sdpa", "audio latent rel-L2 vs sdpa", ".4f"), ("seconds", "s", ".1f"),
                      ("reason", "reason", "")]))
    return [
        ("rel-L2 vs float64", "Each cell: ||out - ref|| / ||ref|| over the sampled query rows (all heads, "
         "all channels) of every segment; reference = float64 attention of the same bf16 inputs on the same "
         "device.\n\n" + table),
        ("Served-DiT latent drift", drift_text),
        ("Rows not measured", markdown_table(bad, [("case", "case", ""), ("kernel", "kernel", ""),
                                                   ("status", "status", ""), ("reason", "reason", "")])),
    ]


def _plot(writer: ResultWriter):
    def draw(plt):
        ok = [r for r in writer.rows if r.get("status") == "ok" and r.get("section") != "drift"]
        kern = list(dict.fromkeys(r["kernel"] for r in ok))
        cs = list(dict.fromkeys(r["case"] for r in ok))
        fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(cs) * len(kern) / 3), 5.5))
        width = 0.8 / max(1, len(kern))
        for i, kname in enumerate(kern):
            vals = [next((r["rel_l2"] for r in ok if r["kernel"] == kname and r["case"] == c), float("nan"))
                    for c in cs]
            ax.bar([x + i * width for x in range(len(cs))], vals, width, label=kname)
        ax.set_yscale("log")
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cs))])
        ax.set_xticklabels(cs, rotation=40, ha="right", fontsize=8)
        ax.set_ylabel("rel-L2 vs float64")
        ax.set_title(f"attention accuracy, {writer.gpu}")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
    return draw


def main(argv: list[str] | None = None) -> dict[str, str]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=None, help="query rows sampled per segment (default 512)")
    p.add_argument("--cases", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated case-name prefixes (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernels", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="comma-separated kernel names (default all)")
    p.add_argument("--drift-layers", type=int, default=8, help="blocks of the latent-drift run (0 = skip it)")
    p.add_argument("--drift-steps", type=int, default=3, help="model evaluations of the latent-drift run")
    p.add_argument("--drift-backends", type=lambda s: [x for x in s.split(",") if x],
                   default=["fa3", "sage8", "sage8_gluon"], help="backends of the latent-drift run (+ sdpa)")
    add_common_args(p, iters=1, warmup=0, budget_s=0)
    args = p.parse_args(argv)
    refuse_unhonoured(p, args, smoke_on_cpu=True)
    if args.rows is None:
        args.rows = 32 if args.smoke else 512
    device = torch.device("cuda" if torch.cuda.is_available() and args.device != "cpu" and not args.smoke else "cpu")
    config = {"rows_sampled": args.rows, "seed": args.seed, "cases": [c.name for c in cases(args.smoke)],
              "kernels": list(kernels(args.smoke)), "smoke": args.smoke, "dtype": "bfloat16"}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="Attention accuracy vs float64 (real H3 activations, V channel means, segments)")
    writer.note("sage8 = the Triton loop, sage8_gluon = the Gluon loop, both adding each key block's P V "
                "into fp32 registers; ':v2-running' = the kernel before (P V summed inside the FP8 MMA "
                "accumulator across the whole row).")
    budget = Budget(args.budget_s)
    run(args, device, writer, budget)
    if args.drift_layers > 0:
        try:
            latent_drift(args, device, writer, budget)
        except Exception as exc:  # noqa: BLE001 - e.g. diffusers missing
            writer.rows.append({"section": "drift", "kernel": "-", "status": "error",
                                "reason": describe_exception(exc)[:300]})
    writer.payload["elapsed_s"] = budget.elapsed()
    paths = writer.finish(_plot(writer), sections(writer))
    print(f"[accuracy] wrote {paths['json']} (+ .md, .png) in {budget.elapsed():.1f}s", flush=True)
    return paths


if __name__ == "__main__":
    main()
