# SPDX-License-Identifier: Apache-2.0
"""Dev probe: the served engine compiled as a CUDA launch runs it, at h3-ref, on one GPU.

H3 at its real config but ``--layers`` of its 50 blocks, bf16 (or ``--linear-precision fp8``
with fast accumulation), ``enable_ulysses(backend=sage8, sequence_bucket=512)``, the transformer
blocks under ``compile_blocks`` with a frame counter around inductor. Then, in order:

1. the launch's warm-up of ``--geometry`` (each sequence bucket its prompts of 1 to 512 tokens
   reach), timed;
2. 3-step jobs at several prompt lengths: Dynamo frames compiled after the warm-up (expected 0)
   and the steady step;
3. the same weights eager, unpadded (``sequence_bucket=1``), the job at one of those prompt
   lengths: the compiled, padded latents' rel-L2 from it (compiling alone moved the latents by
   ~0.29% on 2026-12-06; padding rows wrongly attended would move them further).

    python3 -m benchmarks.dev.compiled_serve_probe --out $OUT     # one GPU, ~3 min
    python3 -m benchmarks.dev.compiled_serve_probe --out $OUT --layers 50 --no-eager  # full size
    python3 -m benchmarks.dev.compiled_serve_probe --out /tmp/p --smoke   # CPU: the code path
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.dev import write_probe_json

__all__ = ["main"]


def _engine(cfg, env, *, bucket: int, compiled: bool, counter=None, backend: str = "sage8"):
    from dist_attn import PhaseTimer
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, parallelize

    dtype = torch.bfloat16 if env.device.type == "cuda" else torch.float32
    model = build_h3(cfg.model, device=env.device, dtype=dtype)
    timer = PhaseTimer(env.device)
    parallelize(model, backend=backend, timer=timer, sequence_bucket=bucket)
    if compiled:
        compile_blocks(model, backend=counter)
    return Engine(cfg, env, model, timer, backend=backend, output_dir="unused")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--geometry", type=int, nargs=3, default=(124, 768, 1344))
    p.add_argument("--prompts", type=int, nargs="+", default=(37, 300, 512))
    p.add_argument("--linear-precision", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--no-eager", action="store_true",
                   help="skip step 3 (a second model: H3's 50 blocks twice do not fit one H100)")
    p.add_argument("--smoke", action="store_true",
                   help="CPU, the tiny config, sdpa, aot_eager: the probe's own code path only")
    args = p.parse_args(argv)
    smoke = args.smoke

    from torch._dynamo.testing import CompileCounterWithBackend

    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.config import apply_overrides, load_config
    from dist_attn.models.h3.serve.jobs.requests import parse_request
    from dist_attn.models.h3.serve.launch.warmup import warm_up

    overrides = {"model.num_layers": args.layers, "runtime.compile": True,
                 "runtime.warmup_shapes": [list(args.geometry)]}
    if args.linear_precision == "fp8" and not smoke:
        overrides.update({"model.linear_precision": "fp8", "model.fp8_fast_accum": True})
    if smoke:
        overrides.update({"runtime.warmup_shapes": [[17, 64, 128]], "runtime.sequence_bucket": 64,
                          "runtime.warmup_prompt_tokens": 100})
        args.prompts = (7, 40, 90)
    cfg = apply_overrides(load_config(None if smoke else "configs/h3.toml"), overrides)
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend=None, shared_gpu=False)
    counter = CompileCounterWithBackend("aot_eager" if smoke else "inductor")
    backend = "sdpa" if smoke else "sage8"
    res: dict = {"gpu": torch.cuda.get_device_name(0) if not smoke else "cpu", "layers": args.layers,
                 "linear_precision": args.linear_precision, "bucket": cfg.runtime.bucket(device.type),
                 "geometry": list(cfg.runtime.warmup_shapes[0])}
    engine = _engine(cfg, env, bucket=cfg.runtime.bucket(device.type), compiled=True,
                     counter=counter, backend=backend)
    t0 = time.perf_counter()
    runs = warm_up(engine, cfg)
    res["warm_up"] = {"seconds": time.perf_counter() - t0, "frames": counter.frame_count,
                      "runs": [{"text_rows": r.text_rows, "rows": r.rows, "padded_rows": r.padded_rows,
                                "seconds": round(r.seconds, 2)} for r in runs]}
    print("warm-up", res["warm_up"], flush=True)
    frames = counter.frame_count
    geometry = dict(zip(("frames", "height", "width"), cfg.runtime.warmup_shapes[0]))
    req = parse_request({**geometry, "steps": 3, "seed": 2}, cfg)
    jobs, latents = [], {}
    for text in args.prompts:
        out = engine.run(req, text_rows=text)
        latents[text] = out.latent
        jobs.append({"text_rows": text, "padded_rows": out.tokens.total,
                     "step_ms": out.step_latency_ms, "new_frames": counter.frame_count - frames})
        print("job", jobs[-1], flush=True)
    res["jobs"] = jobs
    del engine
    if not smoke:
        res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.empty_cache()
    if args.no_eager:
        write_probe_json(args.out, "compiled-serve-probe.json", res)
        return 0
    text = args.prompts[len(args.prompts) // 2]
    eager = _engine(cfg, env, bucket=1, compiled=False, backend=backend)
    ref = eager.run(req, text_rows=text).latent
    res["compiled_padded_vs_eager_unpadded"] = {
        "text_rows": text, "video_rel_l2": _rel(latents[text]["video"], ref["video"]),
        "audio_rel_l2": _rel(latents[text]["audio"], ref["audio"])}
    print("accuracy", res["compiled_padded_vs_eager_unpadded"], flush=True)
    write_probe_json(args.out, "compiled-serve-probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
