# SPDX-License-Identifier: Apache-2.0
"""The full-size served H3 as rank r of W (default 0) on ONE GPU: peak memory per phase with the weights
sharded (FSDP2), beside the launch pre-flight's estimate, and the modeled cost of the per-block
gathers.

    python -m benchmarks.h3_memory                      # one H100/H200: W = 4 and 8, bf16 and FP8
    python -m benchmarks.h3_memory --ranks 0 -1         # ... as rank 0, then as the last rank
    python -m benchmarks.h3_memory --smoke              # CPU: the tiny config, seconds

A fake process group (``torch.testing._internal.distributed.fake_pg``, backend "fake": the way
torchtitan estimates memory) makes this one process rank r of W: every allocation and kernel is
real (rank r's shards, its 1/W of the rows, its share of the decode), no byte crosses a wire (an
all-gather copies this rank's shard W times, an all-to-all copies its input). Per (W, linear
precision), everything as the server builds it with ``parallel.shard_weights = true``:

- the transformer (50 blocks + the 2 refiner blocks, its own init on the GPU, materialised block by
  block: ``meta_h3`` + ``enable_ulysses`` + ``shard_h3``, FP8 linears quantized per block);
- the text encoder: Qwen3-VL 5,120 wide, the 51 decoder layers H3 reads, sharded per layer
  (``shard_text_encoder``), random N(0, 0.02) weights;
- ``AutoencoderKLMiniMaxH3()`` in float16 (from_pretrained's dtypes) and the audio VAE in float32;
- the h3-ref request (124 frames at 768 x 1344, a 512-token prompt) through the served pipeline's
  own code: the text encode, ONE denoise step, the video decode (the rank's share of the tiles).
  As rank r > 0 the text encode runs as rank 0's (a fake group cannot deliver rank 0's broadcast).

Reported per phase: ``torch.cuda.max_memory_allocated`` (peak stats reset between phases) beside
:func:`dist_attn.models.h3.serve.h3.memory.estimate_peak` for the same plan. The gather model: each block's
compute time measured here (CUDA events around every block, FSDP2's waits outside them), a block's
all-gather = (W - 1)/W of its bytes at ``--bandwidth-gbs`` (300 and 360 GB/s), hidden under the
block before it when shorter (FSDP2 prefetches one block ahead); the step's slowdown counts the
first gather (the root and block 0) and every excess. MODELED: NCCL's SM use is not counted.
Writes ``benchmarks/results/h3-memory_<hw>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness import (Budget, ResultWriter, add_common_args, markdown_table,
                                refuse_unhonoured, smoke_values)

THEME = "h3-memory"
PHASES = ("build", "text encode", "denoise", "decode")
#: h3.md: the real block at W = 1, compiled, FP8 linears + sage8 with fast accumulation (H100):
#: the fastest block measured, the one that hides a gather least
FASTEST_BLOCK_W1_MS = 79.7


def _text_config(smoke: bool, tok, width: int) -> Any:
    """Qwen3-VL's text tower as H3 reads it (51 decoder layers; H3: 5,120 wide, as
    benchmarks/serve_h3_gpu.py builds it), ``width`` wide in the smoke run."""
    from transformers import Qwen3VLConfig

    layers, heads, kv, head = (51, width // 16, 1, 16) if smoke else (51, 64, 8, 128)
    rope = {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [4, 2, 2],
                                "mrope_interleaved": True}} if smoke else {}
    ids = {s: tok.convert_tokens_to_ids(s) for s in ("<|image_pad|>", "<|video_pad|>",
                                                      "<|vision_start|>", "<|vision_end|>")}
    return Qwen3VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=5 * width, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head,
                         vocab_size=151936 if not smoke else len(tok), **rope),
        vision_config=dict(out_hidden_size=width, depth=1, hidden_size=16 if smoke else 1152,
                           intermediate_size=32 if smoke else 4304, num_heads=2 if smoke else 16),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


def _random_fill(name: str, module: torch.nn.Module) -> None:
    for pname, p in module.named_parameters(recurse=False):
        p.fill_(1.0) if p.dim() == 1 and "bias" not in pname else p.normal_(0.0, 0.02)


def _vaes(smoke: bool, device: torch.device, latent: int, audio_latent: int):
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio

    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained, video_vae_dtype

    previous = torch.get_default_dtype()
    try:  # drawn in the served dtype at once: a float32 H3 VAE would hold 10.4 GB for a moment
        torch.set_default_dtype(video_vae_dtype(device))
        with torch.device(device):
            torch.manual_seed(0)
            vae = AutoencoderKLMiniMaxH3(
                latent_channels=latent, block_out_channels=[8] * 6, layers_per_block=1,
                norm_num_groups=4, decoder_num_layers=1, decoder_num_attention_heads=2,
                decoder_attention_head_dim=8, decoder_num_register_tokens=1,
                latents_mean=(0.0,) * latent, latents_std=(1.0,) * latent) if smoke else \
                AutoencoderKLMiniMaxH3()
    finally:
        torch.set_default_dtype(previous)
    with torch.device(device):
        audio = AutoencoderKLMiniMaxH3Audio(
            encoder_dim=2, latent_dim=16, latent_channels=audio_latent, num_attention_heads=2,
            decoder_dim=16, decoder_rates=(8, 10, 10), decoder_kernel_sizes=(16, 20, 20),
            resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),),
            latents_mean=[0.0] * audio_latent, latents_std=[1.0] * audio_latent) if smoke else \
            AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
    vae = cast_like_from_pretrained(vae, video_vae_dtype(device))
    return (vae.eval().requires_grad_(False), audio.float().eval().requires_grad_(False),
            dict(vae.config), dict(audio.config))


def _block_timer(blocks, device):
    """CUDA events around each block's forward (after FSDP2's pre-forward, which waits for its
    gather): returns a function giving each block's milliseconds of the last forward."""
    pairs: list[list[Any]] = []
    handles = []
    cuda = device.type == "cuda"

    def stamp() -> Any:
        if not cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    for block in blocks:
        handles += [block.register_forward_pre_hook(lambda m, a: pairs.append([stamp(), None])),
                    block.register_forward_hook(lambda m, a, o: pairs[-1].__setitem__(1, stamp()))]

    def read() -> list[float]:
        if cuda:
            torch.cuda.synchronize(device)
        ms = [(s.elapsed_time(e) if cuda else (e - s) * 1e3) for s, e in pairs if e is not None]
        pairs.clear()
        return ms

    return read, handles


def _phase(name, fn, device, out):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    out[name] = {"s": time.perf_counter() - t0,
                 "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0,
                 "after_gb": torch.cuda.memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0}
    return result


def _replicating_all_gather(device: torch.device) -> str:
    """The fake group's list all-gather must hand back the input in every slot: enable_ulysses'
    input check and the decode's agreement compare what it gathers (torch 2.13's FakeProcessGroup
    copies; a build whose fake all-gather leaves the outputs untouched gets a Python wrapper that
    copies, and the result says so). Run with the fake group initialised."""
    x = torch.arange(3.0, device=device)
    out = [torch.full_like(x, -7.0) for _ in range(dist.get_world_size())]
    dist.all_gather(out, x)
    if all(torch.equal(o, x) for o in out):
        return "the fake group's all_gather replicates its input"
    real = dist.all_gather

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        work = real(tensor_list, tensor, group=group, async_op=async_op)
        for t in tensor_list:
            t.copy_(tensor)
        return work

    dist.all_gather = all_gather
    return "the fake group's all_gather left its outputs untouched: wrapped to copy its input"


def run_one(world: int, precision: str, *, smoke: bool, device: torch.device, backend: str,
            bandwidths: list[float], rank: int = 0) -> dict:
    """One (W, precision) as ``rank`` of W: build, the three phases, the estimate, the gather
    model."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from transformers import Qwen3VLForConditionalGeneration

    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.config import apply_overrides, load_config
    from dist_attn.models.h3.serve.h3.components import H3Components
    from dist_attn.models.h3.serve.h3.memory import Plan, estimate_peak, model_sizes
    from dist_attn.models.h3.serve.h3.model import meta_h3, parallelize, shard_h3
    from dist_attn.models.h3.serve.h3.pipeline import H3Pipeline
    from dist_attn.models.h3.serve.h3.text import TextOnlyQwen3VLProcessor, shard_text_encoder
    from dist_attn.models.h3.serve.h3.tiny import _tokenizer
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request
    from dist_attn.models.h3.serve.launch.preflight import largest_geometry
    from dist_attn.models.h3.serve.wire import Abort

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    real_all_gather = dist.all_gather
    try:
        fake_note = _replicating_all_gather(device)
        cfg = load_config(None if smoke else os.path.join("configs", "h3.toml"))
        cfg = apply_overrides(cfg, {"model.linear_precision": precision,
                                    "parallel.shard_weights": True, "runtime.compile": False})
        env = DistEnv(rank=rank, world_size=world, local_rank=0, device=device, backend="fake")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        tok = _tokenizer()
        text_cfg = _text_config(smoke, tok, cfg.model.text_dim)
        phases: dict[str, dict] = {}

        def build():
            model = meta_h3(cfg.model, device=device, dtype=dtype)
            parallelize(model, backend=backend)
            summary = shard_h3(model, cfg.model, device=device, dtype=dtype)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(1)
                te = shard_text_encoder(Qwen3VLForConditionalGeneration, text_cfg, dtype=dtype,
                                        device=device, materialize=_random_fill)
            vae, audio, vae_cfg, audio_cfg = _vaes(smoke, device, cfg.model.in_channels,
                                                   cfg.model.audio_in_channels)
            from diffusers import MiniMaxH3Scheduler

            comps = H3Components(transformer=model, scheduler=MiniMaxH3Scheduler(shift=12.0),
                                 audio_scheduler=MiniMaxH3Scheduler(shift=3.0), vae=vae,
                                 audio_vae=audio, text_encoder=te, tokenizer=tok,
                                 processor=TextOnlyQwen3VLProcessor(tok))
            return comps, summary, vae_cfg, audio_cfg

        comps, summary, vae_cfg, audio_cfg = _phase("build", build, device, phases)
        pipe = H3Pipeline(comps, env, dtype)
        rules = pipe.rules(max_steps=100, max_rows=200_000, default_steps=1,
                           default_height=64 if smoke else None, default_width=64 if smoke else None)
        geo_req = {"frames": 124, "height": 64 if smoke else 768, "width": 64 if smoke else 1344}
        prompt = "a" * (32 if smoke else 512)
        req = parse_video_request({"prompt": prompt, "steps": 1, "seed": 0, **geo_req}, rules)
        embeds, tags, _ = _phase("text encode", lambda: _encode_as_rank0(pipe, prompt), device, phases)
        blocks = list(comps.transformer.token_refiner.refiner_blocks) + list(comps.transformer.transformer_blocks)
        read, handles = _block_timer(blocks, device)
        out = _phase("denoise", lambda: pipe.run_denoise(req, embeds, tags,
                                                         lambda k, n: Abort.NONE), device, phases)
        block_ms = read()
        for h in handles:
            h.remove()
        _phase("decode", lambda: pipe.decoder.decode(out["latents"], out["audio_latents"]),
               device, phases)
        # the pre-flight's estimate of this very plan
        sizes = model_sizes(cfg.model, dtype=dtype, vae_dtype=comps.vae.dtype, text_config=text_cfg,
                            vae_config=vae_cfg, audio_vae_config=audio_cfg)
        cfg_geo = apply_overrides(cfg, {"request.frames": req.frames, "request.height": req.height,
                                        "request.width": req.width, "runtime.warmup_prompt_tokens": len(prompt)})
        geo = largest_geometry(cfg_geo, world, device.type)
        tiles = pipe.decoder.handle.last.tiles_per_call
        est = estimate_peak(sizes, geo, Plan(world=world, rank=rank, shard=True, fp8=precision == "fp8",
                                             tiles_per_call=tiles, elt=torch.finfo(dtype).bits // 8))
        res = {"world": world, "rank": rank, "precision": precision, "backend": backend, "phases": phases,
               # the job's peak: the build's transients (materialising a block, a VAE) are the
               # launch's, once
               "peak_gb": max(p["peak_gb"] for k, p in phases.items() if k != "build"),
               "estimate_gb": est.peak / 1e9, "estimate_phase": est.peak_phase,
               "estimate": {"resident": est.resident, "phases": est.phases, "reserve": est.reserve,
                            "slack": est.slack},
               "weights_total_gb": summary.bytes_total / 1e9,
               "weights_rank_gb": summary.bytes_per_rank / 1e9,
               "largest_unit_gb": summary.largest_unit_bytes / 1e9, "root_gb": summary.root_bytes / 1e9,
               "blocks": len(blocks), "block_ms_median": statistics.median(block_ms) if block_ms else None,
               "step_s": phases["denoise"]["s"], "decode_tiles_per_call": tiles}
        res["gather"] = _gather_model(summary, world, block_ms, bandwidths)
        res["fake_group"] = fake_note
        return res
    finally:
        dist.all_gather = real_all_gather
        dist.destroy_process_group()


def _gather_model(summary, world: int, block_ms: list[float], bandwidths: list[float]) -> list[dict]:
    """Per bandwidth: a block's gather ms, whether the block before it hides it, and the step's
    modeled slowdown (first gather + every excess) against the measured blocks and against the
    fastest block measured on an H100 (h3.md, scaled by 1/W)."""
    rows = []
    if not block_ms:
        return rows
    n = len(block_ms)
    for bw in bandwidths:
        gather_ms = (world - 1) / world * summary.largest_unit_bytes / (bw * 1e9) * 1e3
        first_ms = (world - 1) / world * (summary.root_bytes + summary.largest_unit_bytes) / (bw * 1e9) * 1e3
        for basis, blocks in (("measured here (eager)", block_ms),
                              ("fastest H100 block / W", [FASTEST_BLOCK_W1_MS / world] * n)):
            excess = sum(max(0.0, gather_ms - c) for c in blocks[:-1])
            rows.append({"bandwidth_gbs": bw, "block_basis": basis, "gather_ms": gather_ms,
                         "block_ms": statistics.median(blocks), "hidden": gather_ms <= min(blocks),
                         "first_gather_ms": first_ms, "slowdown": (first_ms + excess) / sum(blocks)})
    return rows


def _encode_as_rank0(pipe, prompt: str):
    """``pipe.encode`` as rank 0 runs it. Every rank runs the sharded encoder alike, then takes
    rank 0's output from a broadcast, which a fake group cannot deliver (a receiver's buffer stays
    unwritten); as rank 0 this rank keeps its own output, a buffer of the same size."""
    import dataclasses

    env = pipe.env
    pipe.env = dataclasses.replace(env, rank=0)
    try:
        return pipe.encode(prompt)
    finally:
        pipe.env = env


def _case(r: dict) -> str:
    """A result row's label: W, precision and, past rank 0, the rank."""
    rank = r.get("rank", 0)
    return f"W={r['world']} {r['precision']}" + (f" rank {rank}" if rank else "")


def _in_child(world: int, precision: str, rank: int, args) -> dict:
    """One (W, precision) in a fresh process: a case's leftovers (caches, the previous model
    until its last reference goes) never count in the next case's peaks, as they did when the
    four ran in one process (the FP8 builds after bf16 ones then showed ~15-20 GB more)."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "case.json")
        cmd = [sys.executable, "-m", "benchmarks.h3_memory", "--worlds", str(world), "--precisions",
               precision, "--ranks", str(rank), "--backend", args.backend,
               "--bandwidth-gbs", *map(str, args.bandwidth_gbs),
               "--case-json", path, "--out", tmp]
        r = subprocess.run(cmd)
        if r.returncode != 0 or not os.path.exists(path):
            return {"status": "error", "world": world, "rank": rank, "precision": precision,
                    "reason": f"child process exited {r.returncode}"}
        with open(path) as f:
            return json.load(f)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    p.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=("bf16", "fp8"))
    p.add_argument("--ranks", type=int, nargs="+", default=[0],
                   help="which rank of W each case runs as (-1: the last; one outside [-W, W) is left "
                        "out): the shards, rows and decode tiles are that rank's")
    p.add_argument("--backend", default="sdpa", help="attention backend (sdpa: cuDNN)")
    p.add_argument("--bandwidth-gbs", type=float, nargs="+", default=[300.0, 360.0])
    p.add_argument("--same-process", action="store_true",
                   help="run every (W, precision) in this process (default on a GPU: each in a child "
                        "process, so no case's leftovers count in the next one's peaks)")
    p.add_argument("--case-json", default="", help=argparse.SUPPRESS)  # a child's one result
    add_common_args(p, iters=1, warmup=0, budget_s=450)
    args = p.parse_args(argv)
    refuse_unhonoured(p, args, smoke_on_cpu=True)
    smoke_values(p, args, argv, worlds=[2, 4])  # the tiny model's 4 heads: at most W = 4
    budget = Budget(args.budget_s)
    cuda = torch.cuda.is_available() and args.device != "cpu" and not args.smoke
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if not cuda:
        args.precisions = [q for q in args.precisions if q == "bf16"]  # FP8 GEMMs need CUDA
    config = {"worlds": args.worlds, "precisions": args.precisions, "backend": args.backend,
              "bandwidth_gbs": args.bandwidth_gbs, "model": "tiny" if not cuda else "h3 (50 blocks)",
              "request": "124 frames at 768 x 1344, 512-token prompt, 1 step" if cuda else "tiny",
              "process_group": "fake (rank r of W)", "ranks": args.ranks}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=device,
                          title="Full-size H3 as rank r of W (fake process group): peak memory "
                                "by phase, the pre-flight's estimate, the gather model")
    results = []
    cases = list(dict.fromkeys((w, q, r % w) for w in args.worlds for q in args.precisions
                               for r in args.ranks if -w <= r < w))  # -1 may name a rank given too
    for world, precision, rank in cases:
        if budget.expired(reserve_s=90 if cuda else 0):
            writer.rows.append({"status": "skipped", "world": world, "rank": rank, "precision": precision,
                                "reason": "--budget-s spent"})
            continue
        t0 = time.perf_counter()
        try:
            if cuda and not args.same_process and not args.case_json:
                res = _in_child(world, precision, rank, args)
            else:
                res = run_one(world, precision, smoke=not cuda, device=device, backend=args.backend,
                              bandwidths=args.bandwidth_gbs, rank=rank)
                res.update(status="ok")
            res.update(total_ms=(time.perf_counter() - t0) * 1e3)
        except Exception as e:  # noqa: BLE001 - a row, not a crash
            import traceback

            traceback.print_exc()
            res = {"status": "error", "world": world, "rank": rank, "precision": precision,
                   "reason": f"{type(e).__name__}: {e}"[:500]}
        if args.case_json:
            with open(args.case_json, "w") as f:
                json.dump(res, f)
            return
        results.append(res)
        writer.rows.append(res)
        print({k: v for k, v in res.items() if k not in ("estimate", "gather")}, flush=True)
        writer.save()
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    ok = [r for r in results if r["status"] == "ok"]
    mem_rows = [{"case": _case(r), "weights_rank_gb": r["weights_rank_gb"],
                 **{f"{ph}_gb": r["phases"][ph]["peak_gb"] for ph in PHASES},
                 "peak_gb": r["peak_gb"], "estimate_gb": r["estimate_gb"],
                 "ratio": r["estimate_gb"] / r["peak_gb"] if r["peak_gb"] else None} for r in ok]
    gather_rows = [{"case": _case(r), **g} for r in ok for g in r["gather"]]
    tables = [("Peak memory of the rank by phase (GB, torch.cuda.max_memory_allocated)", markdown_table(
        mem_rows, [("case", "case", ""), ("weights_rank_gb", "weights kept", ".1f"),
                   ("build_gb", "build", ".1f"), ("text encode_gb", "text encode", ".1f"),
                   ("denoise_gb", "denoise step", ".1f"), ("decode_gb", "decode", ".1f"),
                   ("peak_gb", "peak", ".1f"), ("estimate_gb", "pre-flight estimate", ".1f"),
                   ("ratio", "estimate / peak", ".2f")])),
              ("Per-block gather, MODELED (prefetched one block ahead)", markdown_table(
                  gather_rows, [("case", "case", ""), ("bandwidth_gbs", "GB/s", ".0f"),
                                ("block_basis", "block compute", ""), ("block_ms", "block ms", ".1f"),
                                ("gather_ms", "gather ms", ".2f"), ("hidden", "hidden", ""),
                                ("first_gather_ms", "first gather ms", ".2f"),
                                ("slowdown", "step slowdown", ".2%")]))]

    def plot(plt):
        plt.figure(figsize=(7, 3.5))
        names = [r["case"] for r in mem_rows]
        x = range(len(names))
        plt.bar([i - 0.2 for i in x], [r["peak_gb"] for r in mem_rows], width=0.4, label="measured")
        plt.bar([i + 0.2 for i in x], [r["estimate_gb"] for r in mem_rows], width=0.4, label="estimate")
        plt.xticks(list(x), names)
        plt.ylabel("GB, peak of the rank")
        plt.legend()
        plt.title(f"H3 rank r of W, sharded weights, {writer.gpu}")

    paths = writer.finish(plot, tables)
    for _, t in tables:
        print(t)
    print(f"wrote {paths['md']}")


if __name__ == "__main__":
    main()
