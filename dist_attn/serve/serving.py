"""Serving the DiT across the ranks of one host: launch checks, the rank loops, HTTP on rank 0.

Control flow (one direction)::

    HTTP thread (rank 0) --validate--> queue --> rank-0 loop --broadcast_object_list--> all ranks
                                                                   |
                           all ranks: Engine.run (denoise loop, sequence-sharded DiT)
                                                                   |
    HTTP response <-- Job.done <-- rank 0 (gathered latent: checksum, optional save)

Rank 0 is the only rank that decides anything. Idle, it broadcasts a heartbeat every
``runtime.heartbeat_s``; the other ranks always wait inside a broadcast, bounded by the process
group timeout ``runtime.pg_timeout_s`` (> 2 heartbeats), so if any rank dies the rest leave with a
non-zero status within that bound instead of hanging. SIGINT/SIGTERM set a flag; rank 0 then
broadcasts "shutdown" and every rank exits 0.
"""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

from dist_attn.serve.config import Config, PackedLayout, request_layout
from dist_attn.serve.quality import (Topology, gather_device_facts, local_device_facts,
                               quality_failures)

__all__ = [
    "RequestError",
    "Request",
    "Job",
    "Metrics",
    "DistContext",
    "Engine",
    "setup_logging",
    "init_distributed",
    "parse_request",
    "run_launch_checks",
    "resolve_backend_name",
    "make_http_server",
    "serve",
]

log = logging.getLogger("dist_attn.serve")


# --------------------------------------------------------------------------- logging


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, *, level: str = "INFO", all_ranks: bool = False) -> None:
    """Root logging to stderr with the rank in every line; ranks other than 0 log WARNING and
    above unless ``all_ranks``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s [rank %(rank)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if rank == 0 or all_ranks else logging.WARNING)


# --------------------------------------------------------------------------- requests


class RequestError(ValueError):
    """A request rejected on rank 0 before anything is broadcast; ``status`` is the HTTP code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True, frozen=True)
class Request:
    """A validated generation request (what is broadcast to every rank)."""

    request_id: str
    frames: int
    height: int
    width: int
    num_tokens: int
    steps: int
    seed: int

    def layout(self, cfg: Config) -> PackedLayout:
        """The packed rows of this request under ``cfg``."""
        return request_layout(cfg, frames=self.frames, height=self.height, width=self.width,
                              num_tokens=self.num_tokens)

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_ids = itertools.count(1)
_REQUEST_FIELDS = ("frames", "height", "width", "num_tokens", "steps", "seed")


def _new_request_id() -> str:
    return f"req-{next(_ids):06d}-{uuid.uuid4().hex[:8]}"


def parse_request(payload: Any, cfg: Config, *, request_id: str | None = None) -> Request:
    """Validates a decoded JSON request; raises :class:`RequestError` (400 malformed, 413 too
    large) naming the field. Geometry (frames/height/width) and num_tokens are exclusive; absent
    fields take the config's [request] defaults, except that giving num_tokens drops the
    geometry and vice versa."""
    if not isinstance(payload, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(_REQUEST_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid: {list(_REQUEST_FIELDS)}")
    for name, value in payload.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(400, f"{name}={value!r} must be an integer")
    geometry = {"frames", "height", "width"} & set(payload)
    if geometry and payload.get("num_tokens"):
        raise RequestError(400, f"give either num_tokens or frames/height/width, not both "
                                f"(got num_tokens and {sorted(geometry)})")
    d = cfg.request
    num_tokens = payload.get("num_tokens", 0 if geometry else d.num_tokens)
    fields = {"frames": payload.get("frames", d.frames),
              "height": payload.get("height", d.height),
              "width": payload.get("width", d.width),
              "num_tokens": num_tokens,
              "steps": payload.get("steps", d.steps),
              "seed": payload.get("seed", d.seed)}
    for name in ("frames", "height", "width", "steps"):
        if fields[name] <= 0:
            raise RequestError(400, f"{name}={fields[name]} must be a positive integer")
    if fields["num_tokens"] < 0:
        raise RequestError(400, f"num_tokens={fields['num_tokens']} must be >= 0")
    if not 0 <= fields["seed"] < 2**63:
        raise RequestError(400, f"seed={fields['seed']} must be in [0, 2**63)")
    if fields["steps"] > cfg.serve.max_steps:
        raise RequestError(413, f"steps={fields['steps']} exceeds serve.max_steps="
                                f"{cfg.serve.max_steps}")
    # Bound the geometry before multiplying it out, so a huge number cannot cost time here.
    for name in ("frames", "height", "width"):
        if fields[name] > 1_000_000:
            raise RequestError(413, f"{name}={fields[name]} is too large")
    try:
        layout = request_layout(cfg, **{k: fields[k] for k in
                                        ("frames", "height", "width", "num_tokens")})
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    if layout.used > cfg.serve.max_tokens:
        raise RequestError(413, f"request has {layout.used} tokens, above serve.max_tokens="
                                f"{cfg.serve.max_tokens}")
    return Request(request_id=request_id or _new_request_id(), **fields)


@dataclass(kw_only=True)
class Job:
    """A request waiting in rank 0's queue, and the slot its HTTP handler waits on."""

    request: Request
    enqueued: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None
    error: tuple[int, str] | None = None

    def finish(self, result: dict[str, Any] | None = None,
               error: tuple[int, str] | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


# --------------------------------------------------------------------------- metrics


class Metrics:
    """Thread-safe counters rendered in the Prometheus text exposition format."""

    BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
               600.0)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.errors: dict[str, int] = {}
        self.bucket_counts = [0] * len(self.BUCKETS)
        self.latency_sum = 0.0
        self.tokens_total = 0
        self.denoise_s_total = 0.0
        self.last_tokens_per_s = 0.0

    def observe(self, latency_s: float, tokens: int, denoise_s: float) -> None:
        """Records one served request: end-to-end latency and the token-steps it denoised."""
        with self._lock:
            self.requests += 1
            self.latency_sum += latency_s
            for i, bound in enumerate(self.BUCKETS):
                if latency_s <= bound:
                    self.bucket_counts[i] += 1
            self.tokens_total += tokens
            self.denoise_s_total += denoise_s
            self.last_tokens_per_s = tokens / denoise_s if denoise_s > 0 else 0.0

    def error(self, status: int) -> None:
        """Records one rejected or failed request by HTTP status."""
        with self._lock:
            self.errors[str(status)] = self.errors.get(str(status), 0) + 1

    def render(self, queue_depth: int) -> str:
        """Prometheus text format (version 0.0.4)."""
        with self._lock:
            lines = [
                "# HELP dist_attn_requests_total Generate requests served successfully.",
                "# TYPE dist_attn_requests_total counter",
                f"dist_attn_requests_total {self.requests}",
                "# HELP dist_attn_request_errors_total Generate requests rejected or failed, by "
                "HTTP status.",
                "# TYPE dist_attn_request_errors_total counter",
            ]
            lines += [f'dist_attn_request_errors_total{{code="{c}"}} {n}'
                      for c, n in sorted(self.errors.items())] or [
                'dist_attn_request_errors_total{code="none"} 0']
            lines += [
                "# HELP dist_attn_request_latency_seconds Server-side latency of served "
                "requests, receipt to result.",
                "# TYPE dist_attn_request_latency_seconds histogram",
            ]
            lines += [f'dist_attn_request_latency_seconds_bucket{{le="{b}"}} {n}'
                      for b, n in zip(self.BUCKETS, self.bucket_counts)]
            lines += [
                f'dist_attn_request_latency_seconds_bucket{{le="+Inf"}} {self.requests}',
                f"dist_attn_request_latency_seconds_sum {self.latency_sum:.6f}",
                f"dist_attn_request_latency_seconds_count {self.requests}",
                "# HELP dist_attn_tokens_total Packed token-steps denoised (used rows x steps).",
                "# TYPE dist_attn_tokens_total counter",
                f"dist_attn_tokens_total {self.tokens_total}",
                "# HELP dist_attn_tokens_per_second Token-steps per second of denoising, "
                "over all requests.",
                "# TYPE dist_attn_tokens_per_second gauge",
                "dist_attn_tokens_per_second "
                f"{self.tokens_total / self.denoise_s_total if self.denoise_s_total else 0.0:.3f}",
                "# HELP dist_attn_last_request_tokens_per_second Token-steps per second of the "
                "last request.",
                "# TYPE dist_attn_last_request_tokens_per_second gauge",
                f"dist_attn_last_request_tokens_per_second {self.last_tokens_per_s:.3f}",
                "# HELP dist_attn_queue_depth Requests waiting for the rank-0 loop.",
                "# TYPE dist_attn_queue_depth gauge",
                f"dist_attn_queue_depth {queue_depth}",
            ]
        return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- distributed setup


@dataclass(kw_only=True)
class DistContext:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    group: Any = None
    """None: the default group (or no group at all when world_size == 1)."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(cfg: Config, *, dist_backend: str = "auto") -> DistContext:
    """Reads torchrun's environment, picks the device and initialises the process group.

    CPU: gloo. CUDA: NCCL with one GPU per rank (LOCAL_RANK), or gloo if asked (several ranks
    may then share one GPU). World size 1 (plain ``python``) creates no process group.
    """
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        backend = dist_backend if dist_backend != "auto" else (
            "nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            # NVLink SHARP multicast is off on the lent H200 hosts (shared KINDS notes); NCCL and
            # symmetric memory otherwise try it and fail at init.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(backend=backend,
                                timeout=datetime.timedelta(seconds=cfg.runtime.pg_timeout_s),
                                **kwargs)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, device=device)


def resolve_backend_name(cfg: Config, ctx: DistContext, dtype: torch.dtype) -> tuple[str, Any]:
    """The attention backend that will run, as (name, object or None).

    Under quality="lossless", "auto" means "sdpa": auto may pick Sage, which is 8-bit. The core's
    ``dist_attn.backends.resolve_backend`` is asked when available, with a probe tensor of this
    rank's per-head shape; an unavailable backend (e.g. Sage on CPU) raises here, before the
    model is built.
    """
    name = cfg.runtime.backend
    if cfg.runtime.quality == "lossless" and name == "auto":
        name = "sdpa"
    try:
        from dist_attn.backends import resolve_backend
    except ImportError:  # the core's registry is not importable: trust the name
        return name, None
    heads = cfg.model.num_heads // cfg.parallel.resolved_ulysses(ctx.world_size)
    probe = torch.zeros(cfg.tokens.alignment, heads, cfg.model.head_dim, dtype=dtype,
                        device=ctx.device)
    obj = resolve_backend(name, probe)
    return str(getattr(obj, "name", name)), obj


def run_launch_checks(cfg: Config, ctx: DistContext, dtype: torch.dtype) -> tuple[str, list[str]]:
    """Quality tier and backend checks on every rank, from gathered device facts.

    Returns (resolved backend name, failures). Every rank gets the same failures (the decision
    is a pure function of the gathered facts), so all ranks can exit together.
    """
    failures: list[str] = []
    try:
        backend, obj = resolve_backend_name(cfg, ctx, dtype)
    except Exception as e:  # noqa: BLE001 - reported as a failed launch condition
        backend, obj = cfg.runtime.backend, None
        failures.append(f"backend: {cfg.runtime.backend!r} cannot run here ({e})")
    facts = gather_device_facts(local_device_facts(ctx.rank, ctx.device), ctx.group)
    topo = Topology(world_size=ctx.world_size,
                    ulysses_degree=cfg.parallel.resolved_ulysses(ctx.world_size),
                    ring_degree=cfg.parallel.ring_degree,
                    tensor_parallel=cfg.parallel.tensor_parallel)
    failures += quality_failures(cfg.runtime.quality, facts, topo, backend=backend,
                                 backend_obj=obj)
    try:
        cfg.check_backend(backend)
    except ValueError as e:
        failures.append(str(e))
    # Backend availability can differ per rank (it is probed locally); agree on the union so
    # every rank takes the same exit.
    if ctx.distributed:
        everyone: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(everyone, failures, group=ctx.group)
        merged: list[str] = []
        for rank_failures in everyone:
            merged += [f for f in rank_failures if f not in merged]
        failures = merged
    return backend, failures


# --------------------------------------------------------------------------- the engine


class Engine:
    """The denoise loop over the sequence-sharded DiT; ``run`` is called on every rank."""

    def __init__(self, cfg: Config, ctx: DistContext, model: torch.nn.Module, timer: Any,
                 *, output_dir: str | None = None) -> None:
        self.cfg, self.ctx, self.model, self.timer = cfg, ctx, model, timer
        self.output_dir = output_dir
        self.dtype = next(model.parameters()).dtype

    def _sync(self) -> None:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)

    @torch.no_grad()
    def run(self, req: Request) -> dict[str, Any] | None:
        """Denoises one request; returns the result on rank 0 (None elsewhere).

        Initial noise is drawn for ALL packed rows from one generator seeded with the request's
        seed, then sliced: the result does not depend on the world size. Flow-matching Euler from
        t = 1 to 0: z <- z + (t_next - t) * v(z, t).
        """
        cfg, ctx = self.cfg, self.ctx
        t_start = time.perf_counter()
        layout = req.layout(cfg)
        s_local = layout.total // ctx.world_size
        offset = ctx.rank * s_local
        bounds = layout.cu_seqlens()
        cu = torch.tensor(bounds, dtype=torch.int32, device=ctx.device)
        gen = torch.Generator(device=ctx.device).manual_seed(req.seed)
        noise = torch.randn(layout.total, cfg.model.latent_channels, generator=gen,
                            device=ctx.device, dtype=torch.float32)
        z = noise[offset:offset + s_local].clone()  # [S_local, C] float32 state
        from dist_attn.serve.model import rope_tables
        positions = torch.arange(offset, offset + s_local, device=ctx.device)
        rope = rope_tables(positions, cfg.model.rope_dims, cfg.model.rope_theta)
        self.timer.reset()
        self._sync()
        t_loop = time.perf_counter()
        step_ms: list[float] = []
        log_steps = ctx.rank == 0
        for i in range(req.steps):
            t0 = time.perf_counter()
            t, t_next = 1.0 - i / req.steps, 1.0 - (i + 1) / req.steps
            v = self.model(z.to(self.dtype), torch.tensor(t, device=ctx.device), cu, layout.used,
                           row_offset=offset, cu_seqlens_host=bounds, rope=rope)
            z = z + (t_next - t) * v.float()
            self._sync()  # per-step latency and progress; one sync per ~layers x 25 ms at h3-ref
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if log_steps:
                log.info("%s step %d/%d %.1f ms", req.request_id, i + 1, req.steps, step_ms[-1])
        t_denoised = time.perf_counter()
        # The checksum is reduced from per-rank partials (a few scalars in one all-reduce), so a
        # request costs no gather of the latent (9.7 MB fp32 at h3-ref, plus a ~6 ms host
        # sha256) unless --output-dir asks for the latent itself.
        csum = _latent_checksum(z, offset, layout.used, ctx)
        latent = None
        if self.output_dir:
            if ctx.distributed:
                parts = [torch.empty_like(z) for _ in range(ctx.world_size)]
                dist.all_gather(parts, z.contiguous(), group=ctx.group)
                full = torch.cat(parts)  # [W * S_local, C] = [total, C]
            else:
                full = z
            latent = full[: layout.used].float().cpu()  # [used, C]; padding rows dropped
        if ctx.rank != 0:
            return None
        phases = self.timer.totals_ms()
        denoise_ms = sum(step_ms)
        attn_ms = sum(phases.values())
        a2a_ms = sum(v for k, v in phases.items() if k.startswith("a2a"))
        output = None
        if latent is not None:
            from dist_attn.serve.weights import save_safetensors
            os.makedirs(self.output_dir, exist_ok=True)
            output = os.path.join(self.output_dir, f"{req.request_id}.safetensors")
            save_safetensors({"latent": latent}, output,
                             metadata={"request": json.dumps(req.to_wire()),
                                       "checksum": json.dumps(csum)})
        t_end = time.perf_counter()
        return {
            "request_id": req.request_id,
            "request": req.to_wire(),
            "tokens": {"used": layout.used, "total": layout.total,
                       "latent_shape": list(layout.latent_shape) if layout.latent_shape else None},
            "world_size": ctx.world_size,
            "backend": getattr(self.model, "backend_name", "unknown"),
            "step_latency_ms": [round(x, 3) for x in step_ms],
            "denoise_ms": round(denoise_ms, 3),
            "run_ms": round((t_end - t_start) * 1e3, 3),
            "setup_ms": round((t_loop - t_start) * 1e3, 3),
            "finalize_ms": round((t_end - t_denoised) * 1e3, 3),
            "phase_ms": {k: round(v, 3) for k, v in sorted(phases.items())},
            "attention_share": attn_ms / denoise_ms if denoise_ms else 0.0,
            "all_to_all_share": a2a_ms / denoise_ms if denoise_ms else 0.0,
            "checksum": csum,
            "output": output,
        }


def _latent_checksum(z: torch.Tensor, offset: int, used: int, ctx: DistContext
                     ) -> dict[str, Any]:
    """Checksum of the used rows of the sharded latent, identical for any world size.

    Args:
        z: [S_local, C] float32, this rank's rows [offset, offset + S_local).
    Returns:
        {"bits64": hex of sum over elements of bits(x_i) * (2 i + 1) mod 2**64 (i = global flat
        index; exact, order-free, changes with any bit of any element), "sum", "abs_sum", "l2"}.
    """
    rows = max(0, min(z.shape[0], used - offset))
    x = z[:rows].float()  # [rows, C]; padding rows excluded
    idx = torch.arange(offset * z.shape[1], (offset + rows) * z.shape[1], device=z.device,
                       dtype=torch.int64).view(rows, z.shape[1])
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    # int64 products and sums wrap mod 2**64, and integer addition is associative, so partial
    # sums over any sharding add up to the same value.
    h = (bits * (2 * idx + 1)).sum()
    xd = x.double()
    # [4] float64 per rank: the int64 hash bit-cast into a float64 slot, then the float sums.
    part = torch.stack([h.view(torch.float64), xd.sum(), xd.abs().sum(), xd.pow(2).sum()])
    if ctx.distributed:
        # One gather-to-all of 4 numbers per rank (a single collective per request).
        parts = [torch.empty_like(part) for _ in range(ctx.world_size)]
        dist.all_gather(parts, part, group=ctx.group)
        part_all = torch.stack(parts)  # [W, 4]
    else:
        part_all = part[None]  # [1, 4]
    h = part_all[:, 0].contiguous().view(torch.int64).sum()  # wraps mod 2**64
    total, abs_sum, sq = part_all[:, 1:].sum(0).tolist()
    return {"bits64": f"{int(h.item()) & 0xFFFFFFFFFFFFFFFF:016x}", "sum": total,
            "abs_sum": abs_sum, "l2": sq ** 0.5}


# --------------------------------------------------------------------------- HTTP (rank 0)


class _Handler(BaseHTTPRequestHandler):
    server_version = "dist_attn"
    protocol_version = "HTTP/1.1"
    # Headers and body leave in two writes; on a kept-alive connection Nagle + delayed ACK then
    # hold the body ~40 ms (measured 48 ms of a 53 ms per-request overhead before this).
    disable_nagle_algorithm = True
    state: "_ServerState"  # set on the subclass made by make_http_server

    def log_message(self, fmt: str, *args: Any) -> None:  # route access logs through logging
        log.debug("%s %s", self.address_string(), fmt % args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, (json.dumps(obj) + "\n").encode(), "application/json")

    def _error(self, status: int, message: str, *, count: bool = True) -> None:
        if count:
            self.state.metrics.error(status)
        self._json(status, {"error": {"code": status, "message": message}})

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        st = self.state
        if self.path == "/health":
            self._json(200, {"status": "shutting_down" if st.stopping.is_set() else "ok",
                             **st.info, "queue_depth": st.queue.qsize()})
        elif self.path == "/metrics":
            self._send(200, st.metrics.render(st.queue.qsize()).encode(),
                       "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._error(404, f"no route GET {self.path}", count=False)

    def do_POST(self) -> None:  # noqa: N802
        st = self.state
        if self.path != "/v1/generate":
            self.close_connection = True
            return self._error(404, f"no route POST {self.path}", count=False)
        received = time.perf_counter()
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True
            return self._error(411, "Content-Length required")
        if length > st.cfg.serve.max_body_bytes or length < 0:
            self.close_connection = True  # the body is left unread
            return self._error(413, f"body of {length} bytes exceeds serve.max_body_bytes="
                                    f"{st.cfg.serve.max_body_bytes}")
        body = self.rfile.read(length)
        try:
            payload = json.loads(body.decode("utf-8"))
            req = parse_request(payload, st.cfg)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return self._error(400, f"body is not valid JSON: {e}")
        except RequestError as e:
            return self._error(e.status, str(e))
        if st.stopping.is_set():
            return self._error(503, "server is shutting down")
        job = Job(request=req, enqueued=received)
        try:
            st.queue.put_nowait(job)
        except queue.Full:
            return self._error(503, f"queue full ({st.cfg.serve.queue_size} waiting)")
        if not job.done.wait(st.cfg.serve.request_timeout_s):
            return self._error(504, f"{req.request_id} not done after "
                                    f"{st.cfg.serve.request_timeout_s} s")
        if job.error is not None:
            return self._error(*job.error)
        self._json(200, job.result)


@dataclass(kw_only=True)
class _ServerState:
    cfg: Config
    queue: "queue.Queue[Job]"
    metrics: Metrics
    stopping: threading.Event
    info: dict[str, Any]


def make_http_server(state: _ServerState) -> ThreadingHTTPServer:
    """A ThreadingHTTPServer bound to serve.host:serve.port (port 0: a free one)."""
    handler = type("Handler", (_Handler,), {"state": state})
    server = ThreadingHTTPServer((state.cfg.serve.host, state.cfg.serve.port), handler)
    server.daemon_threads = True
    return server


# --------------------------------------------------------------------------- the rank loops


# Control messages travel as ONE int64 tensor broadcast: [op, frames, height, width, num_tokens,
# steps, seed]. broadcast_object_list costs two broadcasts plus pickling (measured 2.4 ms on
# loaded CPU gloo vs ~1 ms for one small tensor); every field of a request is an integer anyway.
_OPS = ("heartbeat", "run", "shutdown")
_WIRE_FIELDS = ("frames", "height", "width", "num_tokens", "steps", "seed")


def _broadcast(msg: dict[str, Any] | None, ctx: DistContext) -> dict[str, Any]:
    """Rank 0 sends ``msg``; other ranks receive it (blocking up to the process-group timeout).

    ``msg``: {"op": "heartbeat" | "shutdown"} or {"op": "run", "request": Request.to_wire()}.
    Receivers get the request without its id (ids are rank 0's bookkeeping).
    """
    if not ctx.distributed:
        assert msg is not None
        return msg
    wire = torch.zeros(1 + len(_WIRE_FIELDS), dtype=torch.int64)
    if msg is not None:
        wire[0] = _OPS.index(msg["op"])
        if msg["op"] == "run":
            wire[1:] = torch.tensor([msg["request"][k] for k in _WIRE_FIELDS])
    # NCCL only moves device tensors; gloo takes either.
    wire = wire.to(ctx.device)
    dist.broadcast(wire, src=0, group=ctx.group)
    if msg is not None:
        return msg
    values = wire.tolist()
    out: dict[str, Any] = {"op": _OPS[values[0]]}
    if out["op"] == "run":
        out["request"] = {"request_id": "-", **dict(zip(_WIRE_FIELDS, values[1:]))}
    return out


def _install_signal_handlers(stop: threading.Event) -> None:
    def handler(signum: int, _frame: Any) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def serve(cfg: Config, ctx: DistContext, engine: Engine, *, once: Request | None = None,
          info: dict[str, Any] | None = None) -> int:
    """Runs the rank loops until shutdown. Rank 0 serves HTTP (or runs ``once`` and stops);
    returns the process exit code. ``--once`` prints the result as one JSON line on stdout."""
    stop = threading.Event()
    _install_signal_handlers(stop)
    if ctx.rank != 0:
        return _worker_loop(ctx, engine)

    jobs: queue.Queue[Job] = queue.Queue(maxsize=cfg.serve.queue_size)
    metrics = Metrics()
    server = None
    if once is None:
        state = _ServerState(cfg=cfg, queue=jobs, metrics=metrics, stopping=stop,
                             info=dict(info or {}))
        server = make_http_server(state)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                         name="http", daemon=True).start()
        host, port = server.server_address[:2]
        log.info("serving on http://%s:%d (world %d, backend %s)", host, port, ctx.world_size,
                 (info or {}).get("backend"))
    else:
        jobs.put(Job(request=once))

    once_result: dict[str, Any] | None = None
    try:
        last_broadcast = time.monotonic()
        while not stop.is_set():
            try:
                # Short polls so a signal (which only sets a flag) is noticed within 0.2 s.
                job = jobs.get(timeout=min(0.2, cfg.runtime.heartbeat_s))
            except queue.Empty:
                if once is not None:
                    break
                if time.monotonic() - last_broadcast >= cfg.runtime.heartbeat_s:
                    _broadcast({"op": "heartbeat"}, ctx)
                    last_broadcast = time.monotonic()
                continue
            last_broadcast = time.monotonic()
            started = time.perf_counter()
            _broadcast({"op": "run", "request": job.request.to_wire()}, ctx)
            try:
                result = engine.run(job.request)
            except Exception as e:
                # Peers may be stuck in a collective of this request: fail the request, then leave
                # non-zero; the others exit on the process-group timeout.
                job.finish(error=(500, f"{job.request.request_id} failed: {e}"))
                metrics.error(500)
                raise
            assert result is not None
            result["queue_ms"] = round((started - job.enqueued) * 1e3, 3)
            now = time.perf_counter()
            result["total_latency_ms"] = round((now - job.enqueued) * 1e3, 3)
            metrics.observe(now - job.enqueued, result["tokens"]["used"] * job.request.steps,
                            result["denoise_ms"] / 1e3)
            job.finish(result)
            log.info("%s done: %d tokens x %d steps in %.1f ms", job.request.request_id,
                     result["tokens"]["used"], job.request.steps, result["total_latency_ms"])
            if once is not None:
                once_result = result
                break
    finally:
        # Whatever ended the loop, release waiting HTTP clients and tell the ranks to leave.
        stop.set()
        while True:
            try:
                jobs.get_nowait().finish(error=(503, "server shut down"))
            except queue.Empty:
                break
        if server is not None:
            server.shutdown()
            server.server_close()
        if sys.exc_info()[0] is None:
            _broadcast({"op": "shutdown"}, ctx)
            log.info("shut down cleanly")
    if once is not None:
        if once_result is None:
            return 1
        print(json.dumps(once_result), flush=True)
    return 0


def _worker_loop(ctx: DistContext, engine: Engine) -> int:
    while True:
        msg = _broadcast(None, ctx)
        op = msg.get("op")
        if op == "heartbeat":
            continue
        if op == "shutdown":
            log.info("shut down cleanly")
            return 0
        if op == "run":
            engine.run(Request(**msg["request"]))
            continue
        raise RuntimeError(f"unknown control message {msg!r}")
