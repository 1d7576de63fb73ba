# SPDX-License-Identifier: Apache-2.0
"""One rank from its validated config to the end of its serve loop: the process group, rank 0's
port and job store, the memory preflight and the launch checks from gathered facts, the model and
the video jobs, warm-up, then the loop. A failure before the model prints one message on rank 0
and returns 1 on every rank; what the rank opened is closed on its way out. The CLI imports this
module once the serve extra was found: it imports torch, the model and the HTTP stack."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch

from dist_attn.distributed import init_distributed
from dist_attn.models.h3.serve.h3.engine import Engine
from dist_attn.models.h3.serve.h3.pipeline import H3Runner
from dist_attn.models.h3.serve.http.state import VideoJobs
from dist_attn.models.h3.serve.jobs.store import StoreError
from dist_attn.models.h3.serve.jobs.store_open import open_job_store
from dist_attn.models.h3.serve.jobs.synthetic import SyntheticRunner
from dist_attn.models.h3.serve.jobs.videos import VideoRules
from dist_attn.models.h3.serve.launch.build import block_linears, build_model
from dist_attn.models.h3.serve.launch.checks import run_launch_checks
from dist_attn.models.h3.serve.launch.keeper import announce_serving, rank0_listener
from dist_attn.models.h3.serve.launch.logs import rank0_error
from dist_attn.models.h3.serve.launch.preflight import Preflight, log_measured, memory_preflight
from dist_attn.models.h3.serve.launch.process import exposure_warnings
from dist_attn.models.h3.serve.launch.warmup import warm_up
from dist_attn.models.h3.serve.ranks.loop import serve

__all__ = ["serve_rank"]

# the launch's log lines under one logger name, the CLI's
log = logging.getLogger("dist_attn.models.h3.serve.launch.cli")


def serve_rank(args: argparse.Namespace, cfg: Any, rank: int, *, api_key: str | None,
               once: Any) -> int:
    """This rank, from ``cfg`` (validated, world-size rules included) and the parsed flags
    ``args`` to the end of its serve loop (``once``: the one ``--once`` request); returns the
    exit status. The process group, rank 0's socket and job store are closed on the way out."""
    env = init_distributed(backend=args.dist_backend, timeout_s=cfg.runtime.pg_timeout_s)
    dtype = _dtype(cfg.runtime.dtype, env.device)
    listener, store, local_failures = None, None, []
    if rank == 0 and not (args.once or args.check_only):
        listener, store = _rank0_front(cfg, api_key, local_failures)
    # before any weight is loaded; its one message joins the launch checks' failures
    pre = memory_preflight(cfg, env, dtype, args.checkpoint)
    local_failures += [pre.failure] if pre.failure else []
    try:
        backend = _launch_checks(args, cfg, env, dtype, rank, local_failures)
        if isinstance(backend, int):
            return backend
        built = _build(args, cfg, env, dtype, backend, rank, pre, store)
        if built is None:
            return 1
        engine, runner, videos = built
        if cfg.runtime.warmup_shapes:  # every rank, before HTTP answers /health
            warm_up(engine, cfg, pipeline=getattr(runner, "pipe", None))
            log_measured(pre, env.device)
        info = _serve_info(cfg, env, dtype, backend)
        if listener is not None:
            announce_serving()  # the supervisor stops answering the port for us
        return serve(cfg, env, engine, listener=listener, once=once, info=info,
                     api_key=api_key, runner=runner, videos=videos)
    finally:
        _close(listener, store, env)


def _dtype(name: str, device: torch.device) -> torch.dtype:
    """``runtime.dtype`` as a torch dtype; ``auto``: bfloat16 on CUDA, float32 elsewhere."""
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
            "auto": torch.bfloat16 if device.type == "cuda" else torch.float32}[name]


def _rank0_front(cfg: Any, api_key: str | None, failures: list[str]) -> tuple[Any, Any]:
    """Rank 0's ``(listener, store)``, before the launch checks: the HTTP port and the job
    store; either one that cannot be had is None, its reason appended to ``failures``. Warns of
    an exposed port."""
    listener = None
    host, port = cfg.serve.host, cfg.serve.port
    try:
        # the supervisor's held socket after a restart; else bound here (and given to it)
        listener = rank0_listener(host, port, cfg.serve.backlog)
    except OSError as e:
        failures.append(f"port: cannot listen on {host}:{port} ({e.strerror or e}); "
                        "choose another with --port")
    for warning in exposure_warnings(host, api_key):
        log.warning("%s", warning)
    return listener, _open_store(cfg, failures)


def _launch_checks(args: argparse.Namespace, cfg: Any, env: Any, dtype: torch.dtype, rank: int,
                   local_failures: list[str]) -> str | int:
    """The attention backend once every rank's launch checks passed; else the exit status: 1
    after rank 0 listed the failed conditions, 0 after ``--check-only``'s one line."""
    backend, failures = run_launch_checks(cfg, env, dtype, local_failures)
    if failures:
        tier = cfg.runtime.quality or "none"
        rank0_error(rank, f"launch checks failed (quality={tier}, world size "
                          f"{env.world_size}); {len(failures)} condition(s):\n  - "
                    + "\n  - ".join(failures))
        return 1
    if args.check_only:
        if rank == 0:
            print(f"check-only: OK (config {cfg.model.name}, world {env.world_size}, "
                  f"quality={cfg.runtime.quality or 'none'}, backend {backend}, device "
                  f"{env.device})", flush=True)
        return 0
    return backend


def _build(args: argparse.Namespace, cfg: Any, env: Any, dtype: torch.dtype, backend: str,
           rank: int, pre: Preflight, store: Any) -> tuple[Engine, Any, Any] | None:
    """``(engine, runner, videos)``: the served DiT's /v1/generate engine and, without
    ``--once``, the video jobs (:func:`_build_jobs`); None once rank 0 said why not."""
    model, timer = build_model(cfg, env, dtype, backend, _transformer_dir(args.checkpoint),
                               shard=pre.shard, report=lambda message: rank0_error(rank, message))
    if model is None:
        return None
    engine = Engine(cfg, env, model, timer, backend=backend, output_dir=args.output_dir)
    runner = videos = None
    if not args.once:  # --once runs one /v1/generate request: no jobs
        try:
            runner, videos = _build_jobs(cfg, env, dtype, backend, args.checkpoint, rank,
                                         model, store, shard_text=pre.shard)
        except (ValueError, FileNotFoundError) as e:  # every rank reads the same files
            rank0_error(rank, f"video pipeline: {e}")
            return None
    return engine, runner, videos


def _serve_info(cfg: Any, env: Any, dtype: torch.dtype, backend: str) -> dict[str, Any]:
    """What the server says of itself (``/health``, the startup log): model, parallelism,
    numerics, device."""
    return {"model": cfg.model.name, "layers": cfg.model.num_layers,
            "world_size": env.world_size, "backend": backend,
            "quality": cfg.runtime.quality, "dtype": str(dtype).removeprefix("torch."),
            "linear_precision": cfg.model.linear_precision,
            "block_linears": block_linears(cfg, dtype),
            "fp8_fast_accum": cfg.model.fp8_fast_accum,
            "fp8_fused_kernels": (cfg.model.linear_precision == "fp8"
                                  and cfg.model.fp8_fused_kernels),
            "overlap_chunks": cfg.parallel.overlap_chunks,
            "sequence_bucket": cfg.runtime.bucket(env.device.type),
            "compiled": cfg.runtime.compiled(env.device.type),
            "device": (torch.cuda.get_device_name(env.device)
                       if env.device.type == "cuda" else "cpu")}


def _close(listener: Any, store: Any, env: Any) -> None:
    """What the rank opened, closed: rank 0's socket and job store, then the process group."""
    if listener is not None:
        listener.close()
    if store is not None:
        store.close()
    if env.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _transformer_dir(checkpoint: str | None) -> str | None:
    """The transformer's directory inside a pipeline checkpoint (or the bare checkpoint)."""
    if checkpoint is None:
        return None
    sub = os.path.join(checkpoint, "transformer")
    return sub if os.path.isdir(sub) else checkpoint


def _open_store(cfg: Any, failures: list[str]) -> Any:
    """Rank 0: the job store after its restart recovery (None with ``jobs.runner = "off"``).
    Opened before the launch checks, so that a store that cannot be opened (a corrupt file, a
    directory that cannot be made) is one failed launch condition naming the file, appended to
    ``failures``, never a traceback."""
    if cfg.jobs.runner == "off":
        return None
    try:
        return open_job_store(cfg.jobs.output_dir)
    except StoreError as e:
        failures.append(f"job store: {e}")
    except OSError as e:
        failures.append(f"job store: cannot use jobs.output_dir={cfg.jobs.output_dir!r} "
                        f"({e.strerror or e}); choose another with --output-dir")
    return None


def _build_jobs(cfg: Any, env: Any, dtype: Any, backend: str, checkpoint: str | None,
                rank: int, transformer: Any, store: Any, *, shard_text: bool) -> tuple[Any, Any]:
    """The video runner on every rank (around the served DiT ``transformer``: one H3 in memory)
    and, on rank 0, what HTTP shares about the jobs over ``store`` (opened by
    :func:`_open_store`); ``(None, None)`` with ``jobs.runner = "off"``."""
    jobs = cfg.jobs
    if jobs.runner == "off":
        return None, None
    if jobs.runner == "synthetic":
        rules = VideoRules(default_height=64, default_width=64, default_steps=cfg.request.steps,
                           max_steps=cfg.serve.max_steps, max_rows=cfg.serve.max_tokens)
        runner: Any = SyntheticRunner(env, step_s=jobs.synthetic_step_s, rules=rules)
    else:
        if checkpoint is not None and _transformer_dir(checkpoint) == checkpoint:
            raise ValueError(f"--checkpoint {checkpoint} is a bare transformer checkpoint; the "
                             "video pipeline needs a full one (transformer/, vae/, audio_vae/, "
                             "text_encoder/, tokenizer/, scheduler/, audio_scheduler/), or pass "
                             "--video-runner off")
        runner = H3Runner.build(cfg, env, dtype=dtype, backend=backend, checkpoint=checkpoint,
                                transformer=transformer, shard_text=shard_text)
    if rank != 0:
        return runner, None
    return runner, VideoJobs(store=store, rules=runner.rules, max_queued=jobs.max_queued,
                             output_dir=jobs.output_dir, thumbnail=jobs.thumbnail)
