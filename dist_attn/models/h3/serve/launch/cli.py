# SPDX-License-Identifier: Apache-2.0
"""Serve MiniMax H3 (diffusers' MiniMaxH3Transformer3DModel) on the ranks of one host: the
project's main job.

    torchrun --nproc-per-node 4 launch/serve.py                       # tiny H3, CPU gloo, :8000
    torchrun --nproc-per-node 4 launch/serve.py --config configs/h3.toml --quality high
    torchrun --nproc-per-node 4 launch/serve.py --once --steps 2      # one request, JSON line
    torchrun --nproc-per-node 4 launch/serve.py --check-only --quality high
    python launch/serve.py --once                                      # single rank, local

Order on every rank: parse flags -> parent-death signal -> config (validated, world-size rules
included) -> process group -> rank 0 binds the HTTP port -> quality tier, backend and port
checks from gathered facts -> model -> serve. A failure before the model prints one message on
rank 0 and exits 1 on every rank.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any, NoReturn

__all__ = ["build_parser", "config_from_args", "main", "run"]

log = logging.getLogger(__name__)
#: a SIGINT that came before ranks.lifecycle's handler was in place (its import is the slow part
#: of a rank's start: the ranks package imports the HTTP stack)
_EARLY_STOPS: list[signal.Signals] = []


def _early_interrupt(signum: int, _frame: Any) -> None:
    _EARLY_STOPS.append(signal.Signals(signum))
    raise KeyboardInterrupt

# flag dest -> config field it overrides
_FLAG_FIELDS = {
    "backend": "runtime.backend",
    "dtype": "runtime.dtype",
    "layers": "model.num_layers",
    "ulysses_degree": "parallel.ulysses_degree",
    "ring_degree": "parallel.ring_degree",
    "pg_timeout": "runtime.pg_timeout_s",
    "heartbeat": "runtime.heartbeat_s",
    "compile": "runtime.compile",
    "host": "serve.host",
    "port": "serve.port",
    "frames": "request.frames",
    "height": "request.height",
    "width": "request.width",
    "steps": "request.steps",
    "seed": "request.seed",
    "output_dir": "jobs.output_dir",
    "video_runner": "jobs.runner",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="TOML config: a path, or a shipped config by name: tiny (the "
                                    "default, CPU) or h3 (the real model; configs/h3.toml)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override any config field; VALUE is a TOML value (repeatable)")
    p.add_argument("--quality", default=None,
                   help="quality tier: 'lossless' or 'high' (absent: no constraint)")
    p.add_argument("--backend", help="attention backend: auto, sage, sdpa, ...")
    p.add_argument("--dtype", help="auto, bfloat16, float16 or float32")
    p.add_argument("--layers", type=int, help="number of H3 blocks (model.num_layers)")
    p.add_argument("--ulysses-degree", type=int, help="Ulysses degree (0 = world size / ring degree)")
    p.add_argument("--ring-degree", type=int, help="ring degree R (the ring crosses hosts; "
                                                   "Ulysses runs inside each)")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="diffusers-format MiniMax-H3 directory: the served DiT loads DIR/"
                        "transformer (or DIR itself when it is a bare MiniMaxH3Transformer3DModel "
                        "checkpoint: config.json + safetensors) with from_pretrained, the video "
                        "pipeline the rest (vae/, audio_vae/, text_encoder/, tokenizer/, "
                        "scheduler/, audio_scheduler/). Default: the DiT's own random "
                        "initialisation (model.weight_seed) inside a tiny random pipeline built "
                        "once into a cache directory")
    p.add_argument("--compile", action="store_const", const=True, default=None,
                   help="torch.compile every H3 transformer block, fullgraph (attention stays one "
                        "opaque op; the default on CUDA); the first job of each padded length "
                        "(runtime.sequence_bucket) compiles unless runtime.warmup_shapes covers it")
    p.add_argument("--host", help="HTTP bind address (rank 0; default loopback, others warn)")
    p.add_argument("--api-key", default=None,
                   help="bearer token required on every endpoint but /health (default: "
                        "$DIST_ATTN_API_KEY; empty means no key)")
    p.add_argument("--port", type=int, help="HTTP port (0: pick a free one)")
    p.add_argument("--frames", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--output-dir", help="where the video jobs' store and MP4s live (default "
                                        "jobs.output_dir, ./outputs); given, /v1/generate also "
                                        "saves each output latent there as "
                                        "<request_id>.safetensors")
    p.add_argument("--video-runner", help="what runs /v1/videos jobs: h3 (the pipeline), "
                                          "synthetic (no model, for load tests) or off")
    p.add_argument("--once", action="store_true",
                   help="run one request from the flags, print its JSON result, exit")
    p.add_argument("--check-only", action="store_true",
                   help="validate config and topology, then exit 0 or 1")
    p.add_argument("--dist-backend", default="auto", choices=("auto", "nccl", "gloo"),
                   help="process-group backend (auto: nccl on CUDA, gloo on CPU)")
    p.add_argument("--pg-timeout", type=float, help="process-group timeout in seconds")
    p.add_argument("--heartbeat", type=float, help="idle heartbeat period in seconds")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="N",
                   help="run torchrun on N local ranks under a supervisor that turns SIGTERM/"
                        "SIGINT into rank 0's drain, so a clean stop exits 0 (torchrun alone "
                        "exits 1 after a SIGTERM although every rank drained); not under "
                        "torchrun")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="with --nproc-per-node: restart the job when it fails after it served "
                        "(a rank killed or crashed), at most N times within 10 minutes "
                        "(default 3; 0: never). The running video job is re-queued")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-all-ranks", action="store_true",
                   help="log INFO on every rank, not only rank 0")
    return p


def config_from_args(args: argparse.Namespace) -> Any:
    """The validated config: file (or embedded default), then --set, then dedicated flags."""
    from dist_attn.models.h3.serve.config import apply_overrides, load_config
    from dist_attn.models.h3.serve.config.load import parse_override

    cfg = load_config(args.config)
    overrides: dict[str, Any] = dict(parse_override(item) for item in args.set)
    for dest, key in _FLAG_FIELDS.items():
        value = getattr(args, dest)
        if value is not None:
            overrides[key] = value
    if args.quality is not None:
        overrides["runtime.quality"] = args.quality
    return apply_overrides(cfg, overrides) if overrides else cfg


def _rank0_error(rank: int, message: str) -> None:
    if rank == 0:
        print(f"launch/serve.py: error: {message}", file=sys.stderr, flush=True)


def run() -> NoReturn:
    """The process entry point: :func:`main`, then the exit. A torchrun rank leaves through
    ``os._exit`` once :func:`main` has closed what it opened (the job store, HTTP, the process
    group): at interpreter teardown gloo's worker threads can still be destroyed joinable, and
    ``std::terminate`` then turns a clean shutdown into SIGABRT (exit -6, seen on 1 in ~6 supervised
    SIGTERM drains on 2 CPU ranks; torch 2.13). The supervisor and single processes exit as
    usual."""
    from dist_attn.models.h3.serve.launch.supervise import under_torchrun

    try:
        code = main()
    except (Exception, KeyboardInterrupt) as exc:
        code = _stopped(exc)  # re-raises unless a stop signal came first
    if under_torchrun():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _stopped(exc: BaseException) -> int:
    """The exit status of a rank that ``exc`` ended after a SIGINT/SIGTERM reached it (Ctrl-C
    reaches every rank: one stops in its start-up, a peer then finds it gone), with one line on
    rank 0 instead of a traceback per rank; without such a signal, ``exc`` is a fault: raised."""
    # torchrun forwards a second SIGINT to a rank the terminal's already reached: the exit path
    # (which may still import the ranks package) must not be interrupted in its turn
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sig = _EARLY_STOPS[0] if _EARLY_STOPS else None
    if sig is None:
        from dist_attn.models.h3.serve.ranks.lifecycle import stop_signal

        sig = stop_signal()
    if sig is None:
        raise exc
    why = "" if isinstance(exc, KeyboardInterrupt) else f" ({type(exc).__name__} as the ranks stopped)"
    _rank0_error(int(os.environ.get("RANK", 0)), f"stopped by {sig.name}{why}")
    return 128 + int(sig)


def main(argv: list[str] | None = None) -> int:
    from dist_attn.extras import install_hint, missing_modules
    from dist_attn.models.h3.serve.launch.supervise import (restore_default_signals, strip_flag,
                                                            supervise, under_torchrun)

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    missing = missing_modules("serve")  # before anything imports them (the HTTP app: uvicorn)
    if missing:
        _rank0_error(int(os.environ.get("RANK", 0)), f"the server needs the 'serve' extra, and "
                     f"{', '.join(missing)} cannot be imported: {install_hint('serve')}")
        return 1
    if args.nproc_per_node is not None:
        if under_torchrun():
            print("launch/serve.py: error: --nproc-per-node starts torchrun itself; under "
                  "torchrun leave it out", file=sys.stderr, flush=True)
            return 1
        restarts = {} if args.max_restarts is None else {"max_restarts": args.max_restarts}
        try:
            return supervise(args.nproc_per_node, strip_flag(strip_flag(
                argv, "--nproc-per-node"), "--max-restarts"), **restarts)
        except (ValueError, RuntimeError) as e:
            print(f"launch/serve.py: error: {e}", file=sys.stderr, flush=True)
            return 1
    if args.max_restarts is not None:
        print(f"launch/serve.py: error: --max-restarts={args.max_restarts} is the supervisor's "
              "(with --nproc-per-node); under torchrun use torchrun's own --max-restarts",
              file=sys.stderr, flush=True)
        return 1
    restore_default_signals()  # a rank under the supervisor inherits them ignored
    signal.signal(signal.SIGINT, _early_interrupt)  # until interrupt_start_up's, below
    from dist_attn.models.h3.serve.ranks.lifecycle import interrupt_start_up

    interrupt_start_up()  # Ctrl-C before the rank serves: one line, not a traceback (run)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))

    import torch

    from dist_attn.distributed import init_distributed
    from dist_attn.models.h3.serve.launch.checks import run_launch_checks
    from dist_attn.models.h3.serve.launch.keeper import announce_serving, rank0_listener
    from dist_attn.models.h3.serve.launch.logs import setup_logging
    from dist_attn.models.h3.serve.launch.process import (exposure_warnings, resolve_api_key,
                                                          set_parent_death_signal)
    from dist_attn.models.h3.serve.jobs.requests import RequestError, parse_request

    setup_logging(rank, level=args.log_level, all_ranks=args.log_all_ranks)
    set_parent_death_signal()
    # Config errors need no collective: every rank computes the same verdict and exits.
    try:
        cfg = config_from_args(args)
        cfg.check_world(world)
    except ValueError as e:
        _rank0_error(rank, f"invalid config: {e}")
        return 1
    try:
        api_key = resolve_api_key(args.api_key, os.environ)
    except ValueError as e:
        _rank0_error(rank, str(e))
        return 1
    once_req = None
    if args.once:
        try:
            once_req = parse_request({}, cfg, request_id=f"once-{cfg.request.seed}")
        except RequestError as e:
            _rank0_error(rank, f"invalid request: {e}")
            return 1

    env = init_distributed(backend=args.dist_backend, timeout_s=cfg.runtime.pg_timeout_s)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
             "auto": torch.bfloat16 if env.device.type == "cuda" else torch.float32
             }[cfg.runtime.dtype]
    listener, store, local_failures = None, None, []
    if rank == 0 and not (args.once or args.check_only):
        host, port = cfg.serve.host, cfg.serve.port
        try:
            # the supervisor's held socket after a restart; else bound here (and given to it)
            listener = rank0_listener(host, port, cfg.serve.backlog)
        except OSError as e:
            local_failures.append(f"port: cannot listen on {host}:{port} ({e.strerror or e}); "
                                  "choose another with --port")
        for warning in exposure_warnings(host, api_key):
            log.warning("%s", warning)
        store = _open_store(cfg, local_failures)
    from dist_attn.models.h3.serve.launch.preflight import log_measured, memory_preflight

    # before any weight is loaded; its one message joins the launch checks' failures
    pre = memory_preflight(cfg, env, dtype, args.checkpoint)
    local_failures += [pre.failure] if pre.failure else []
    try:
        backend, failures = run_launch_checks(cfg, env, dtype, local_failures)
        if failures:
            tier = cfg.runtime.quality or "none"
            _rank0_error(rank, f"launch checks failed (quality={tier}, world size "
                               f"{env.world_size}); {len(failures)} condition(s):\n  - "
                         + "\n  - ".join(failures))
            return 1
        if args.check_only:
            if rank == 0:
                print(f"check-only: OK (config {cfg.model.name}, world {env.world_size}, "
                      f"quality={cfg.runtime.quality or 'none'}, backend {backend}, device "
                      f"{env.device})", flush=True)
            return 0
        from dist_attn.models.h3.serve.h3.engine import Engine
        from dist_attn.models.h3.serve.ranks.loop import serve

        from dist_attn.models.h3.serve.launch.build import block_linears, build_model

        model, timer = build_model(cfg, env, dtype, backend, _transformer_dir(args.checkpoint),
                                   shard=pre.shard, report=lambda message: _rank0_error(rank, message))
        if model is None:
            return 1
        engine = Engine(cfg, env, model, timer, backend=backend, output_dir=args.output_dir)
        runner = videos = None
        if not args.once:  # --once runs one /v1/generate request: no jobs
            try:
                runner, videos = _build_jobs(cfg, env, dtype, backend, args.checkpoint, rank,
                                             model, store, shard_text=pre.shard)
            except (ValueError, FileNotFoundError) as e:  # every rank reads the same files
                _rank0_error(rank, f"video pipeline: {e}")
                return 1
        if cfg.runtime.warmup_shapes:  # every rank, before HTTP answers /health
            from dist_attn.models.h3.serve.launch.warmup import warm_up

            warm_up(engine, cfg, pipeline=getattr(runner, "pipe", None))
            log_measured(pre, env.device)
        info = {"model": cfg.model.name, "layers": cfg.model.num_layers,
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
        if listener is not None:
            announce_serving()  # the supervisor stops answering the port for us
        return serve(cfg, env, engine, listener=listener, once=once_req, info=info,
                     api_key=api_key, runner=runner, videos=videos)
    finally:
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
    from dist_attn.models.h3.serve.jobs.store import StoreError
    from dist_attn.models.h3.serve.jobs.store_open import open_job_store

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
    from dist_attn.models.h3.serve.http.state import VideoJobs
    from dist_attn.models.h3.serve.jobs.synthetic import SyntheticRunner
    from dist_attn.models.h3.serve.jobs.videos import VideoRules

    jobs = cfg.jobs
    if jobs.runner == "off":
        return None, None
    if jobs.runner == "synthetic":
        rules = VideoRules(default_height=64, default_width=64, default_steps=cfg.request.steps,
                           max_steps=cfg.serve.max_steps, max_rows=cfg.serve.max_tokens)
        runner: Any = SyntheticRunner(env, step_s=jobs.synthetic_step_s, rules=rules)
    else:
        from dist_attn.models.h3.serve.h3.pipeline import H3Runner

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
