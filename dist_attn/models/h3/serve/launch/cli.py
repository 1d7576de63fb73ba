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

# At the top only modules that import the standard library alone (the supervisor, logging, the
# OS): --help and argument errors import no more. What imports the HTTP stack (the ranks package)
# or the model comes later, in the step it serves, once the serve extra was found.
from dist_attn.extras import install_hint, missing_modules
from dist_attn.models.h3.serve.launch.logs import rank0_error, setup_logging
from dist_attn.models.h3.serve.launch.process import resolve_api_key, set_parent_death_signal
from dist_attn.models.h3.serve.launch.supervise import (restore_default_signals, strip_flag,
                                                        supervise, under_torchrun)

__all__ = ["build_parser", "config_from_args", "main", "run"]

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
    """The flags of ``launch/serve.py``, in ``--help``'s order: the config and the model, the
    HTTP server and the default request, then the process."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_model_flags(p)
    _add_serving_flags(p)
    _add_process_flags(p)
    return p


def _add_model_flags(p: argparse.ArgumentParser) -> None:
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


def _add_serving_flags(p: argparse.ArgumentParser) -> None:
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


def _add_process_flags(p: argparse.ArgumentParser) -> None:
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


def run() -> NoReturn:
    """The process entry point: :func:`main`, then the exit. A torchrun rank leaves through
    ``os._exit`` once :func:`main` has closed what it opened (the job store, HTTP, the process
    group): at interpreter teardown gloo's worker threads can still be destroyed joinable, and
    ``std::terminate`` then turns a clean shutdown into SIGABRT (exit -6, seen on 1 in ~6 supervised
    SIGTERM drains on 2 CPU ranks; torch 2.13). The supervisor and single processes exit as
    usual."""
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
    rank0_error(int(os.environ.get("RANK", 0)), f"stopped by {sig.name}{why}")
    return 128 + int(sig)


def main(argv: list[str] | None = None) -> int:
    """The launch of this process (module docstring); returns its exit status. The flags send it
    to the supervisor (``--nproc-per-node``) or make it a rank: its signals, then its config,
    then :func:`dist_attn.models.h3.serve.launch.start.serve_rank`. A failure before the model
    prints one message on rank 0 and returns 1 on every rank."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    routed = _route(args, argv)
    if routed is not None:
        return routed
    rank, world = _rank_signals()
    # torch, the model and the HTTP app: the slow part of a rank's start, after the serve extra
    # was found and with Ctrl-C handled
    from dist_attn.models.h3.serve.launch.start import serve_rank

    setup_logging(rank, level=args.log_level, all_ranks=args.log_all_ranks)
    set_parent_death_signal()
    try:
        cfg, api_key, once = _settle(args, world)
    except _Refused as e:
        rank0_error(rank, str(e))
        return 1
    return serve_rank(args, cfg, rank, api_key=api_key, once=once)


class _Refused(Exception):
    """A launch refused before any collective: every rank reaches it alike; rank 0 prints it."""


def _route(args: argparse.Namespace, argv: list[str]) -> int | None:
    """The exit status when this process is no rank: the serve extra is missing, or the
    supervisor ran (``--nproc-per-node``), or ``--max-restarts`` came without it; else None."""
    missing = missing_modules("serve")  # before anything imports them (the HTTP app: uvicorn)
    if missing:
        rank0_error(int(os.environ.get("RANK", 0)), f"the server needs the 'serve' extra, and "
                    f"{', '.join(missing)} cannot be imported: {install_hint('serve')}")
        return 1
    if args.nproc_per_node is not None:
        return _supervised(args, argv)
    if args.max_restarts is not None:
        print(f"launch/serve.py: error: --max-restarts={args.max_restarts} is the supervisor's "
              "(with --nproc-per-node); under torchrun use torchrun's own --max-restarts",
              file=sys.stderr, flush=True)
        return 1
    return None


def _supervised(args: argparse.Namespace, argv: list[str]) -> int:
    """``--nproc-per-node``: torchrun under :func:`supervise`, given ``argv`` without the
    supervisor's own flags; its exit status (1 under torchrun, or for a refused value)."""
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


def _rank_signals() -> tuple[int, int]:
    """This rank's SIGTERM and SIGINT back to their defaults (a rank under the supervisor
    inherits them ignored), and a Ctrl-C before it serves one line, not a traceback
    (:func:`run`); returns ``(rank, world size)`` from the launcher's environment."""
    restore_default_signals()
    signal.signal(signal.SIGINT, _early_interrupt)  # until interrupt_start_up's, below
    from dist_attn.models.h3.serve.ranks.lifecycle import interrupt_start_up

    interrupt_start_up()  # Ctrl-C before the rank serves: one line, not a traceback (run)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _settle(args: argparse.Namespace, world: int) -> tuple[Any, str | None, Any]:
    """``(config, API key, --once's request or None)``, decided by every rank alone: config
    errors need no collective, every rank computes the same verdict. Raises :class:`_Refused`
    with rank 0's message."""
    from dist_attn.models.h3.serve.jobs.requests import RequestError, parse_request

    try:
        cfg = config_from_args(args)
        cfg.check_world(world)
    except ValueError as e:
        raise _Refused(f"invalid config: {e}") from None
    try:
        api_key = resolve_api_key(args.api_key, os.environ)
    except ValueError as e:
        raise _Refused(str(e)) from None
    once = None
    if args.once:
        try:
            once = parse_request({}, cfg, request_id=f"once-{cfg.request.seed}")
        except RequestError as e:
            raise _Refused(f"invalid request: {e}") from None
    return cfg, api_key, once
