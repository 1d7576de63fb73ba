"""Seconds per served H3 job on one GPU, and the share of it outside the transformer.

    python -m benchmarks.serve_h3_gpu                      # one H200: real configs, random weights
    python -m benchmarks.serve_h3_gpu --smoke              # CPU: the tiny checkpoint, seconds

One process, W = 1, the same code the server runs for a job (:class:`dist_attn.serve.pipeline.
H3Runner.lead`: text encoding, diffusers' denoise blocks with our per-step loop, the video and audio
VAE decode blocks, the MP4 with PyAV). On the GPU every component is its real diffusers /
transformers class at its real config with its own random initialisation, built directly on the
GPU (no checkpoint, no download), bf16 with the fp32 modules each class declares:

- the transformer at ``--layers`` of its 50 blocks (default 8) + the 2 refiner blocks;
- the text encoder as the server loads it: Qwen3-VL 5,120 wide with the 51 decoder layers H3
  reads (54 GB);
- ``AutoencoderKLMiniMaxH3()`` and ``AutoencoderKLMiniMaxH3Audio()`` at their defaults;
- the request is h3-ref: 1344 x 768, 124 frames (37 x 42 x 24 = 37,296 video rows), 2 x 207
  audio rows, a 512-token prompt (byte tokenizer: 512 bytes), ``--steps`` forwards (default 3).

One warm-up job, then ``--jobs`` timed ones (or fewer when ``--budget-s`` runs out). Reports per
phase seconds (median), seconds per job, and the share of the job outside the transformer's
steps (text encoder, decode, muxing). Writes ``benchmarks/results/serve-h3-job_<hw>_<date>.*``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.harness import ResultWriter, add_common_args, markdown_table

THEME = "serve-h3-job"
PHASES = ("text_encode", "denoise", "decode_video", "decode_audio", "mux")


def _cast_like_from_pretrained(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``dtype`` everywhere but the modules the class keeps in float32 (diffusers matches
    ``_keep_in_fp32_modules`` as substrings of parameter names, as ``from_pretrained`` does)."""
    keep = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if any(k in name for k in keep) else dtype)
    for name, buf in model.named_buffers():
        if buf.is_floating_point() and not any(k in name for k in keep):
            buf.data = buf.data.to(dtype)
    return model


def _real_components(layers: int, device: torch.device, dtype: torch.dtype):
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio,
                           MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from dist_attn.serve.pipeline import H3Components, TextOnlyQwen3VLProcessor
    from dist_attn.serve.tiny_h3 import _tokenizer

    tok = _tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in ("<|image_pad|>", "<|video_pad|>",
                                                      "<|vision_start|>", "<|vision_end|>")}
    te_cfg = Qwen3VLConfig(
        text_config=dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=51,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936),
        vision_config=dict(out_hidden_size=5120, depth=1),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    t0 = time.perf_counter()
    with torch.device(device):
        torch.manual_seed(0)
        transformer = _cast_like_from_pretrained(MiniMaxH3Transformer3DModel(num_layers=layers),
                                                 dtype)
        # fp32 like the audio VAE: in bf16 its decoder got fp32 activations at proj_in (H200, 2026-12-03)
        vae = AutoencoderKLMiniMaxH3().float()
        # the class default has no latents statistics (the release ships 32 per-channel floats each)
        audio_vae = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32).float()
        text_encoder = Qwen3VLForConditionalGeneration._from_config(te_cfg, dtype=dtype)
    built_s = time.perf_counter() - t0
    comps = H3Components(transformer=transformer.eval().requires_grad_(False),
                         scheduler=MiniMaxH3Scheduler(shift=12.0),
                         audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
                         vae=vae.eval().requires_grad_(False),
                         audio_vae=audio_vae.eval().requires_grad_(False),
                         text_encoder=text_encoder.eval().requires_grad_(False), tokenizer=tok,
                         processor=TextOnlyQwen3VLProcessor(tok))
    return comps, built_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--jobs", type=int, default=2, help="timed jobs after the warm-up job")
    p.add_argument("--prompt-tokens", type=int, default=512)
    add_common_args(p, iters=1, warmup=1, budget_s=150)
    args = p.parse_args()
    from dist_attn.distributed import DistEnv
    from dist_attn.serve.jobs import Abort
    from dist_attn.serve.pipeline import H3Pipeline, H3Runner, load_components
    from dist_attn.serve.videos import parse_video_request

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    if cuda:
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
        comps, built_s = _real_components(args.layers, device, dtype)
        geometry = {"height": 768, "width": 1344, "frames": 124}
    else:
        from dist_attn.serve.tiny_h3 import ensure_tiny_checkpoint

        dtype = torch.float32
        t0 = time.perf_counter()
        comps = load_components(ensure_tiny_checkpoint(None), device=device, dtype=dtype,
                                rank0=True)
        built_s = time.perf_counter() - t0
        geometry = {"height": 64, "width": 64, "frames": 124}
        args.prompt_tokens = min(args.prompt_tokens, 32)
    pipe = H3Pipeline(comps, env, dtype)
    rules = pipe.rules(max_steps=100, max_rows=65536, default_steps=args.steps)
    runner = H3Runner(pipe, rules)
    req = parse_video_request({"prompt": "a" * args.prompt_tokens, "steps": args.steps,
                               "seed": 0, **geometry}, rules)
    out_dir = tempfile.mkdtemp(prefix="dist_attn_h3job_")
    jobs = []
    for i in range(1 + args.jobs):
        if i > 1 and args.budget_s and time.perf_counter() - t_start > args.budget_s:
            break
        t0 = time.perf_counter()
        outcome = runner.lead(req, mp4_path=os.path.join(out_dir, f"{i}.mp4"), png_path=None,
                              on_step=lambda k, s: Abort.NONE)
        total = time.perf_counter() - t0
        assert outcome.error is None and outcome.file is not None, outcome.error
        jobs.append({"job": i, "warmup": i == 0, "total_s": total, "step_s": outcome.step_s,
                     **{k: outcome.timings.get(k) for k in PHASES},
                     "mp4_bytes": outcome.file.size_bytes})
        print(f"job {i}: {total:.2f} s " + " ".join(f"{k}={outcome.timings.get(k, 0):.3f}"
                                                   for k in PHASES), flush=True)
    timed = [j for j in jobs if not j["warmup"]] or jobs
    med = {k: statistics.median(j[k] for j in timed) for k in (*PHASES, "total_s")}
    outside = med["total_s"] - med["denoise"]
    rows = [{"phase": k, "s": med[k], "share": med[k] / med["total_s"]} for k in PHASES]
    rows.append({"phase": "total (one job)", "s": med["total_s"], "share": 1.0})
    rows.append({"phase": "outside the transformer's steps", "s": outside,
                 "share": outside / med["total_s"]})
    config = {"layers": args.layers, "steps": args.steps, "request": req.to_json(),
              "dtype": str(dtype), "device": str(device), "jobs_timed": len(timed),
              "built_s": built_s, "real_configs": cuda}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="One served H3 job: seconds and the share outside the "
                                "transformer")
    writer.payload["rows"] = [{"status": "ok", "total_ms": j["total_s"] * 1e3, **j} for j in jobs]
    writer.payload["summary"] = rows
    table = markdown_table(rows, [("phase", "phase", ""), ("s", "seconds (median)", ".3f"),
                                  ("share", "share of the job", ".1%")])

    def plot(plt):
        plt.figure(figsize=(7, 3.5))
        plt.barh([r["phase"] for r in rows[:-2]], [r["s"] for r in rows[:-2]])
        plt.xlabel("seconds (median)")
        plt.title(f"one H3 job, {args.layers} layers x {args.steps} steps, {writer.gpu}")

    paths = writer.finish(plot, [("Phases", table)])
    print(table)
    print(f"wrote {paths['md']} ({time.perf_counter() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
