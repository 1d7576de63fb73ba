# SPDX-License-Identifier: Apache-2.0
"""Where the H3 pipeline's text encoder should run: on every rank alike, or on rank 0 with a
broadcast; and the served VAE decode beside it. Run under torchrun (every rank loads the tiny pipeline):

    torchrun --nproc-per-node 4 -m benchmarks.pipeline_placement            # CPU gloo, ~1 min
    torchrun --nproc-per-node 2 -m benchmarks.pipeline_placement --smoke    # CI-sized

Measured, per part, median of ``--iters``:

- ``text encode, rank 0``: rank 0 encodes alone (the others wait, as they do when serving);
- ``text encode, every rank``: all ranks encode at once; the wall time of the slowest;
- ``broadcast``: :func:`dist_attn.models.h3.serve.wire.broadcast_prompt` of the tiny embedding and of an
  H3-sized one ([1, 512, 5120]: 512 prompt tokens of the 5,120-wide Qwen3-VL state);
- ``decode video``: the served decode of one job, the video over every rank (since dec2a07 the
  server decodes there; rank 0 alone against every rank is ``benchmarks/vae_decode.py``'s
  comparison).

And the weights each placement puts on every rank, from the real configs built on the meta device
(no memory): the H3 transformer (diffusers' default config), the two VAEs (their defaults) and a
Qwen3-VL text encoder of H3's conditioning width (hidden 5,120; 64 layers, 25,600 FFN, 64 heads,
8 KV heads: Qwen3-VL-32B's shape, an assumption: the checkpoint's own config decides).

On CPU the ranks share the machine's cores, so "every rank" is slower than "rank 0" here for a
reason that GPUs do not have (each rank has its own GPU): read the CPU times as the cost of the
work itself, and the memory table as what decides on GPUs.

Writes ``benchmarks/results/pipeline-placement_<hardware>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.harness import (ResultWriter, add_common_args, init_distributed, markdown_table,
                                refuse_unhonoured, smoke_values)

THEME = "pipeline-placement"


def _param_bytes(model: torch.nn.Module, dtype_bytes: int) -> int:
    return sum(p.numel() for p in model.parameters()) * dtype_bytes


def _real_weights() -> list[dict]:
    """Weights of the real configs, built on the meta device."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio,
                           MiniMaxH3Transformer3DModel)
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        te_cfg = Qwen3VLConfig(text_config=dict(hidden_size=5120, intermediate_size=25600,
                                                num_hidden_layers=64, num_attention_heads=64,
                                                num_key_value_heads=8, head_dim=128),
                               vision_config=dict(out_hidden_size=5120))
        cut_cfg = Qwen3VLConfig(text_config=dict(hidden_size=5120, intermediate_size=25600,
                                                 num_hidden_layers=51, num_attention_heads=64,
                                                 num_key_value_heads=8, head_dim=128),
                                vision_config=dict(out_hidden_size=5120))
        parts = [("transformer (50 blocks)", MiniMaxH3Transformer3DModel(), 2),
                 ("text encoder (Qwen3-VL, 5120 wide, 64 layers)",
                  Qwen3VLForConditionalGeneration(te_cfg), 2),
                 ("text encoder as loaded (51 layers: H3 reads hidden_states[50])",
                  Qwen3VLForConditionalGeneration(cut_cfg), 2),
                 ("video VAE", AutoencoderKLMiniMaxH3(), 2),
                 ("audio VAE (fp32: its class keeps it)", AutoencoderKLMiniMaxH3Audio(), 4)]
        return [{"part": name, "gb": _param_bytes(m, b) / 1e9} for name, m, b in parts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=96,
                   help="prompt length in tokens (the tiny tokenizer: one per byte)")
    add_common_args(p, iters=5, warmup=1, budget_s=0)
    args = p.parse_args()
    refuse_unhonoured(p, args, cpu_only=True, no_budget=True)
    smoke_values(p, args, iters=2, prompt_tokens=16)
    ctx = init_distributed(backend="gloo", device="cpu")
    env = ctx.env
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.pipeline import H3Runner
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request
    from dist_attn.models.h3.serve.wire import broadcast_prompt

    runner = H3Runner.build(load_config(None), env, dtype=torch.float32, backend="sdpa",
                            checkpoint=None)
    pipe = runner.pipe
    # Every rank gets a text pipeline for the "every rank" variant (the server builds it on rank 0)
    if env.rank != 0:
        from dist_attn.models.h3.serve.h3.components import load_components

        from dist_attn.models.h3.serve.h3.tiny import tiny_checkpoint_path
        full = load_components(tiny_checkpoint_path(), device=env.device, dtype=torch.float32,
                               rank0=True, transformer=pipe.comps.transformer)
        from dist_attn.models.h3.serve.h3.pipeline import H3Pipeline
        local = H3Pipeline(full, env.__class__(rank=0, world_size=1, local_rank=0,
                                               device=env.device, backend=None), torch.float32)
    else:
        local = pipe
    prompt = "x" * args.prompt_tokens
    req_json = {"prompt": prompt, "steps": 2, "seed": 0}
    req = parse_video_request(req_json, runner.rules) if env.rank == 0 else None
    box = [req]
    dist.broadcast_object_list(box, src=0)
    req = box[0]

    def timed(fn, *, everyone: bool) -> float:
        """Median wall ms of ``fn`` (on rank 0, or on every rank at once: the slowest)."""
        out = []
        for i in range(args.warmup + args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            if everyone or env.rank == 0:
                fn()
            dist.barrier()
            ms = (time.perf_counter() - t0) * 1e3
            if i >= args.warmup:
                out.append(ms)
        return statistics.median(out)

    def encode_local() -> None:
        local.text(prompt=prompt, output=["prompt_embeds", "text_token_tags"])

    rows = [{"part": "text encode", "where": "rank 0", "median_ms": timed(encode_local, everyone=False)},
            {"part": "text encode", "where": "every rank", "median_ms": timed(encode_local,
                                                                       everyone=True)}]
    embeds, tags, _ = pipe.encode(prompt if env.rank == 0 else None)
    for label, (t, d) in (("tiny", tuple(embeds.shape[1:])), ("H3-sized", (512, 5120))):
        e = torch.randn(1, t, d) if env.rank == 0 else None
        g = torch.ones(t, dtype=torch.int64) if env.rank == 0 else None
        rows.append({"part": f"broadcast {label} [1, {t}, {d}]", "where": "rank 0 -> all",
                     "median_ms": timed(lambda: broadcast_prompt(e, g, env, dtype=torch.float32,
                                                          device=env.device), everyone=True)})
    out = pipe.run_denoise(req, embeds, tags, runner._hook(None))
    lat, alat = out["latents"], out["audio_latents"]
    # The served decode (dist_attn.models.h3.serve.h3.decode.JobDecoder, since dec2a07): the video over
    # every rank, no MP4 here. Rank 0 alone against every rank, tile batches and dtypes, is
    # benchmarks/vae_decode.py's subject; this row keeps the whole job's parts side by side.
    rows.append({"part": "decode video (served: over every rank)", "where": "every rank",
                 "median_ms": timed(lambda: pipe.decoder.decode(lat, alat), everyone=True)})
    if env.rank != 0:
        dist.barrier()
        dist.destroy_process_group()
        return
    for r in rows:
        r["status"] = "ok"
    weights = _real_weights()
    writer = ResultWriter(theme=THEME, args=args, device=env.device,
                          config={"world": env.world_size, "prompt_tokens": args.prompt_tokens,
                                  "request": req.to_json(), "iters": args.iters},
                          title="H3 pipeline: text encoder and VAE decode, rank 0 vs every rank")
    writer.payload["rows"] = rows
    writer.payload["weights_gb"] = weights
    te_gb = next(w["gb"] for w in weights if w["part"].startswith("text encoder as loaded"))
    vae_gb = sum(w["gb"] for w in weights if "VAE" in w["part"])
    writer.note(f"every rank alike would hold the text encoder ({te_gb:.1f} GB) and the VAEs "
                f"({vae_gb:.2f} GB) on each of the {env.world_size} ranks: "
                f"{(env.world_size - 1) * (te_gb + vae_gb):.1f} GB more over the job")
    table = markdown_table(rows, [("part", "part", ""), ("where", "where", ""),
                                  ("median_ms", "ms (median)", ".1f")])
    wtable = markdown_table(weights, [("part", "real config", ""), ("gb", "GB of weights", ".2f")])

    def plot(plt):
        labels = [f"{r['part']}\n{r['where']}" for r in rows]
        plt.figure(figsize=(9, 4))
        plt.barh(labels, [r["median_ms"] for r in rows])
        plt.xlabel("ms (median)")
        plt.title(f"H3 pipeline placement, {env.world_size} CPU gloo ranks (tiny checkpoint)")

    paths = writer.finish(plot, [("Times (tiny checkpoint)", table),
                                 ("Weights per rank (real configs, meta device)", wtable)])
    print(table + "\n\n" + wtable)
    print(f"wrote {paths['md']}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
