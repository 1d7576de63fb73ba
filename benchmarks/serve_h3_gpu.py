# SPDX-License-Identifier: Apache-2.0
"""Seconds per served H3 job on one GPU, the job as the server runs it, beside diffusers' own
modular ``t2va`` pipeline on the same components.

    python -m benchmarks.serve_h3_gpu --layers 50 --steps 2     # one H200: the full-size job
    python -m benchmarks.serve_h3_gpu                           # 8 of 50 blocks, 3 steps
    python -m benchmarks.serve_h3_gpu --smoke                   # CPU: the tiny checkpoint

One process, W = 1, the code the server runs for a job (:meth:`dist_attn.models.h3.serve.h3.pipeline.
H3Runner.lead`): text encoding, diffusers' denoise blocks with our per-step loop, the audio
decode, the video decode (:func:`enable_parallel_decode`, float16) with the MP4 encoded from
each clip's frames meanwhile. On the GPU every component is its real diffusers / transformers
class at its real config with its own random initialisation, built on the GPU as the server
builds it (no checkpoint, no download):

- the transformer through the server's builder (:func:`dist_attn.models.h3.serve.h3.model.build_h3`: bf16
  blocks, the class's float32 modules) at ``--layers`` of its 50 blocks + the 2 refiner blocks,
  made sequence-parallel by ``enable_ulysses(backend=--backend)`` (one rank: dist_attn's kernel,
  no collectives), its linears in ``--linear-precision``, compiled as the server compiles them
  (``--compile auto``: on CUDA, the served default);
- the text encoder as the server loads it: Qwen3-VL 5,120 wide with the 51 decoder layers H3
  reads (54 GB);
- ``AutoencoderKLMiniMaxH3()`` with the dtypes ``from_pretrained(torch_dtype=float16)`` gives
  (the server's), ``AutoencoderKLMiniMaxH3Audio()`` in float32;
- the request is h3-ref: 1344 x 768, 124 frames (37 x 42 x 24 = 37,296 video rows), 2 x 207
  audio rows, a 512-token prompt (byte tokenizer: 512 bytes), ``--steps`` forwards.

Before enabling dist_attn, with ``--diffusers`` (default on the GPU): diffusers 0.42.1's own
``MiniMaxH3Blocks`` pipeline (workflow t2va) on the same components, its native attention and its
decode, the same request and steps, its video written with the same MP4 writer.

One warm-up job, then ``--jobs`` timed ones (or fewer when ``--budget-s`` runs out). Reports per
phase seconds (median), seconds per step, everything after the last step (decode, mux, commit),
the GPU's peak memory and what it left free. Writes ``benchmarks/results/serve-h3-job_<hw>_<date>.*``
(``--theme`` to keep runs apart).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from benchmarks.harness import ResultWriter, add_common_args, markdown_table, refuse_unhonoured

THEME = "serve-h3-job"
PHASES = ("text_encode", "denoise", "decode_audio", "decode_video", "mux", "after_denoise")


def _real_components(layers: int, device: torch.device, dtype: torch.dtype,
                     linear_precision: str = "bf16", fp8_fast_accum: bool = False):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Scheduler
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from dist_attn.models.h3.serve.config import ModelConfig
    from dist_attn.models.h3.serve.h3.components import H3Components
    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained, video_vae_dtype
    from dist_attn.models.h3.serve.h3.model import build_h3
    from dist_attn.models.h3.serve.h3.text import TextOnlyQwen3VLProcessor
    from dist_attn.models.h3.serve.h3.tiny import _tokenizer

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
    transformer = build_h3(ModelConfig(num_layers=layers, linear_precision=linear_precision,
                                       fp8_fast_accum=fp8_fast_accum),
                           device=device, dtype=dtype)
    with torch.device(device):
        torch.manual_seed(0)
        vae = cast_like_from_pretrained(AutoencoderKLMiniMaxH3().float(), video_vae_dtype(device))
        # the class default has no latents statistics (the release ships 32 per-channel floats each)
        audio_vae = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32).float()
        text_encoder = Qwen3VLForConditionalGeneration._from_config(te_cfg, dtype=dtype)
    built_s = time.perf_counter() - t0
    comps = H3Components(transformer=transformer,
                         scheduler=MiniMaxH3Scheduler(shift=12.0),
                         audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
                         vae=vae.eval().requires_grad_(False),
                         audio_vae=audio_vae.eval().requires_grad_(False),
                         text_encoder=text_encoder.eval().requires_grad_(False), tokenizer=tok,
                         processor=TextOnlyQwen3VLProcessor(tok))
    return comps, built_s


#: calls of :func:`_identity_block` in this process (the result's config records them)
_IDENTITY_CALLS = [0]


def _identity_block(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A transformer block's forward that returns its input (``--blocks identity``)."""
    _IDENTITY_CALLS[0] += 1
    return hidden_states


def _diffusers_job(comps, req, device, mp4_path: str) -> dict:
    """diffusers' own t2va (``MiniMaxH3Blocks``) on the same components and request: its native
    attention, its decode (one tile a call, the VAE's dtype), then the MP4 with our writer."""
    from diffusers.modular_pipelines.minimax_h3 import MiniMaxH3Blocks

    from dist_attn.models.h3.serve.jobs.mp4 import write_mp4

    pipe = MiniMaxH3Blocks().init_pipeline()
    pipe.update_components(transformer=comps.transformer, scheduler=comps.scheduler,
                           audio_scheduler=comps.audio_scheduler, vae=comps.vae,
                           audio_vae=comps.audio_vae, text_encoder=comps.text_encoder,
                           tokenizer=comps.tokenizer, processor=comps.processor)
    _sync(device)
    t0 = time.perf_counter()
    out = pipe(prompt=req.prompt, height=req.height, width=req.width, num_frames=req.frames,
               num_inference_steps=req.steps + 1,
               generator=torch.Generator(device=device).manual_seed(req.seed),
               output_type="np", output=["videos", "audio", "sampling_rate"])
    _sync(device)
    t1 = time.perf_counter()
    import numpy as np

    video = np.asarray(out["videos"])[0]
    write_mp4(mp4_path, video, out["audio"][0].float().cpu().numpy(), fps=24,
              sample_rate=int(out["sampling_rate"]))
    t2 = time.perf_counter()
    return {"pipeline_s": t1 - t0, "mux_s": t2 - t1, "total_s": t2 - t0}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    peak = torch.cuda.max_memory_reserved(device)
    return {"peak_reserved_gb": peak / 1e9, "peak_allocated_gb":
            torch.cuda.max_memory_allocated(device) / 1e9, "total_gb": total / 1e9,
            "free_at_peak_gb": (total - peak) / 1e9}


def _sha256(path: str) -> str:
    """The file's SHA-256 (hex): two runs' MP4s compared byte for byte."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--jobs", type=int, default=1, help="timed jobs after the warm-up job")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--backend", default="sage8", help="enable_ulysses backend (the served one)")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="compile the blocks (auto: as the server's runtime.compile default, "
                        "on CUDA)")
    p.add_argument("--linear-precision", choices=("bf16", "fp8"), default="bf16",
                   help="the served model.linear_precision (fp8: the blocks' linears in FP8)")
    p.add_argument("--fp8-fast-accum", action="store_true",
                   help="the served model.fp8_fast_accum (with --linear-precision fp8)")
    p.add_argument("--diffusers", choices=("auto", "on", "off"), default="auto",
                   help="also run diffusers' own t2va pipeline first (auto: on the GPU)")
    p.add_argument("--decode-tiles-per-call", type=int, default=None)
    p.add_argument("--decode-compile", choices=("auto", "on", "off"), default="auto",
                   help="compile the video decoder's blocks (auto: as the server's decode.compile "
                        "default, on CUDA); the warm-up job compiles them")
    p.add_argument("--blocks", choices=("real", "identity"), default="real",
                   help="identity: every transformer block returns its input, so a step's seconds "
                        "are the part of the served step outside the blocks (the refiner, "
                        "embeddings, heads and the engine's loop; benchmarks.job_model reads it); "
                        "not with --diffusers on; the refiner runs eager, as served")
    add_common_args(p, iters=1, warmup=1, budget_s=400)
    args = p.parse_args()
    refuse_unhonoured(p, args, smoke_on_cpu=True)
    if args.blocks == "identity" and args.diffusers == "on":
        p.error("--blocks identity measures the served step outside the blocks: not with "
                "--diffusers on (diffusers' own pipeline would run the real blocks)")
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.fp8.linear import Fp8Linear, Fp8SwiGLUFeedForward
    from dist_attn.models.h3.serve.h3.components import load_components
    from dist_attn.models.h3.serve.config.sections import COMPILED_SEQUENCE_BUCKET
    from dist_attn.models.h3.serve.h3.model import compile_blocks, parallelize
    from dist_attn.models.h3.serve.h3.pipeline import H3Pipeline, H3Runner
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request
    from dist_attn.models.h3.serve.wire import Abort

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend=None)
    if cuda:
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
        comps, built_s = _real_components(args.layers, device, dtype, args.linear_precision,
                                          args.fp8_fast_accum)
        geometry = {"height": 768, "width": 1344, "frames": 124}
    else:
        from dist_attn.models.h3.serve.h3.tiny import ensure_tiny_checkpoint

        dtype = torch.float32
        t0 = time.perf_counter()
        comps = load_components(ensure_tiny_checkpoint(None), device=device, dtype=dtype,
                                rank0=True)
        built_s = time.perf_counter() - t0
        geometry = {"height": 64, "width": 64, "frames": 124}
        args.prompt_tokens = min(args.prompt_tokens, 32)
        args.backend = "sdpa"  # the 8-bit kernels need a GPU
    out_dir = tempfile.mkdtemp(prefix="dist_attn_h3job_")
    run_diffusers = args.blocks == "real" and (args.diffusers == "on"
                                               or (args.diffusers == "auto" and cuda))
    diffusers_row = None
    if run_diffusers:
        # before enable_ulysses: the transformer still has diffusers' own processors
        from types import SimpleNamespace

        probe = SimpleNamespace(prompt="a" * args.prompt_tokens, steps=args.steps, seed=0,
                                **geometry)
        diffusers_row = _diffusers_job(comps, probe, device, os.path.join(out_dir, "d.mp4"))
        print(f"diffusers t2va (native attention, its decode): {diffusers_row}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    compiled = args.compile == "on" or (args.compile == "auto" and cuda)
    # as served: compiled, the sequence is padded to the server's bucket
    parallelize(comps.transformer, backend=args.backend,
                sequence_bucket=COMPILED_SEQUENCE_BUCKET if compiled else 1)
    if args.blocks == "identity":  # before compile_blocks
        for block in comps.transformer.transformer_blocks:
            block.forward = _identity_block
    if compiled:
        compile_blocks(comps.transformer)
    decode_compiled = args.decode_compile == "on" or (args.decode_compile == "auto" and cuda)
    pipe = H3Pipeline(comps, env, dtype, decode_tiles_per_call=args.decode_tiles_per_call,
                      decode_compile=decode_compiled)
    rules = pipe.rules(max_steps=100, max_rows=65536, default_steps=args.steps)
    runner = H3Runner(pipe, rules)
    req = parse_video_request({"prompt": "a" * args.prompt_tokens, "steps": args.steps,
                               "seed": 0, **geometry}, rules)
    jobs = []
    for i in range(1 + args.jobs):
        if i > 1 and args.budget_s and time.perf_counter() - t_start > args.budget_s:
            break
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        mp4_path = os.path.join(out_dir, f"{i}.mp4")
        outcome = runner.lead(req, mp4_path=mp4_path, png_path=None,
                              on_step=lambda k, s: Abort.NONE)
        total = time.perf_counter() - t0
        assert outcome.error is None and outcome.file is not None, outcome.error
        stats = pipe.decoder.handle.last
        jobs.append({"job": i, "warmup": i == 0, "total_s": total, "step_s": outcome.step_s,
                     **{k: outcome.timings.get(k) for k in PHASES},
                     "mp4_bytes": outcome.file.size_bytes, "mp4_sha256": _sha256(mp4_path),
                     "decode_calls": stats.calls,
                     "decode_tiles_per_call": stats.tiles_per_call, **_memory(device)})
        print(f"job {i}: {total:.2f} s " + " ".join(f"{k}={outcome.timings.get(k, 0):.3f}"
                                                   for k in PHASES)
              + f" steps={[round(x, 3) for x in outcome.step_s]} {_memory(device)}", flush=True)
    timed = [j for j in jobs if not j["warmup"]] or jobs
    med = {k: statistics.median(j[k] for j in timed) for k in (*PHASES, "total_s")}
    step_s = statistics.median(x for j in timed for x in j["step_s"])
    outside = med["total_s"] - med["denoise"]
    rows = [{"phase": k, "s": med[k], "share": med[k] / med["total_s"]} for k in PHASES]
    rows.append({"phase": "total (one job)", "s": med["total_s"], "share": 1.0})
    rows.append({"phase": "outside the transformer's steps", "s": outside,
                 "share": outside / med["total_s"]})
    rows.append({"phase": "one denoise step (median)", "s": step_s, "share": step_s /
                 med["total_s"]})
    if diffusers_row is not None:
        rows.append({"phase": "diffusers t2va, same request (its pipeline + our MP4 writer)",
                     "s": diffusers_row["total_s"], "share": diffusers_row["total_s"] /
                     med["total_s"]})
    config = {"layers": args.layers, "steps": args.steps, "request": req.to_json(),
              "dtype": str(dtype), "device": str(device), "jobs_timed": len(timed),
              "built_s": built_s, "real_configs": cuda, "backend": args.backend,
              "compile": compiled, "decode_compile": decode_compiled,
              "linear_precision": args.linear_precision,
              "fp8_fast_accum": args.fp8_fast_accum, "blocks": args.blocks,
              "transformer_blocks": len(comps.transformer.transformer_blocks),
              # what quantize_linears fused in the served blocks (its defaults: on CUDA, both)
              "fused_swiglu_ffns": sum(isinstance(m, Fp8SwiGLUFeedForward)
                                       for m in comps.transformer.transformer_blocks.modules()),
              "fused_adaln_blocks": sum(isinstance(b.attn.to_q, Fp8Linear)
                                        for b in comps.transformer.transformer_blocks),
              "identity_block_calls": _IDENTITY_CALLS[0],
              "video_vae_dtype": str(comps.vae.dtype),
              "diffusers_t2va": diffusers_row}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="One served H3 job: seconds, the share outside the transformer, "
                                "diffusers' t2va beside it")
    writer.payload["rows"] = [{"status": "ok", "total_ms": j["total_s"] * 1e3, **j} for j in jobs]
    writer.payload["summary"] = rows
    if len(jobs) > 1:
        first, steady = jobs[0], timed[-1]
        writer.payload["warmup"] = {"first_job_s": first["total_s"],
                                    "first_step_s": first["step_s"][0],
                                    "steady_step_s": steady["step_s"][0],
                                    "cost_s": first["total_s"] - steady["total_s"]}
        writer.note(f"what the first job of the geometry pays (compilation, kernel JIT, "
                    f"autotuning): {first['total_s'] - steady['total_s']:.1f} s "
                    f"(first step {first['step_s'][0]:.2f} s vs {steady['step_s'][0]:.2f} s "
                    "steady); the server's runtime.warmup_shapes pays it before /health")
    if diffusers_row is not None:
        writer.note(f"diffusers 0.42.1 t2va on the same components and request: "
                    f"{diffusers_row['total_s']:.2f} s ({diffusers_row['pipeline_s']:.2f} s "
                    f"pipeline + {diffusers_row['mux_s']:.2f} s MP4); served job "
                    f"{med['total_s']:.2f} s: {diffusers_row['total_s'] / med['total_s']:.2f}x")
    table = markdown_table(rows, [("phase", "phase", ""), ("s", "seconds (median)", ".3f"),
                                  ("share", "share of the job", ".1%")])
    mem = _memory(device) and markdown_table(
        [{k: j.get(k) for k in ("job", "peak_reserved_gb", "peak_allocated_gb", "total_gb",
                                "free_at_peak_gb")} for j in jobs],
        [("job", "job", "d"), ("peak_reserved_gb", "peak reserved GB", ".1f"),
         ("peak_allocated_gb", "peak allocated GB", ".1f"), ("total_gb", "GPU GB", ".1f"),
         ("free_at_peak_gb", "free at peak GB", ".1f")])

    def plot(plt):
        plt.figure(figsize=(7, 3.5))
        bars = [r for r in rows if r["phase"] in PHASES]
        plt.barh([r["phase"] for r in bars], [r["s"] for r in bars])
        plt.xlabel("seconds (median)")
        plt.title(f"one H3 job, {args.layers} layers x {args.steps} steps, {writer.gpu}")

    sections = [("Phases", table)] + ([("GPU memory", mem)] if mem else [])
    paths = writer.finish(plot, sections)
    print(table)
    if mem:
        print(mem)
    print(f"wrote {paths['md']} ({time.perf_counter() - t_start:.0f} s in all)")


if __name__ == "__main__":
    main()
