"""HTTP on rank 0: a Starlette app served by uvicorn in a thread of its own.

Endpoints: ``GET /health`` (200 ok, 503 not ready or shutting down; never needs a token),
``POST /v1/generate`` (JSON request -> JSON result, the transformer-only benchmark path),
``/v1/videos`` (the jobs API, :mod:`dist_attn.serve.api_videos`), ``GET /metrics`` (Prometheus
text). Every
error is a JSON body ``{"error": {"code", "message"}}``; no server banner; messages never carry
server paths or library internals (those go to the log).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dist_attn.serve.api_videos import VideoJobs, video_routes
from dist_attn.serve.config import Config
from dist_attn.serve.http_protocol import GuardedH11Protocol
from dist_attn.serve.jobs.queue import Job, JobError, JobQueue, Liveness, QueueFull, StepTimes
from dist_attn.serve.metrics import CONTENT_TYPE, Metrics
from dist_attn.serve.jobs.requests import RequestError, decode_json, parse_request
from dist_attn.serve.jobs.store import StoreError
from dist_attn.serve.wire.abort import Abort

__all__ = ["ServerState", "build_app", "HttpServer"]

log = logging.getLogger(__name__)

# A waiting handler checks for a vanished client this often; a dropped request then stops
# within one poll plus one denoise step.
_POLL_S = 0.25


@dataclass(kw_only=True)
class ServerState:
    """What the HTTP thread shares with the rank-0 loop."""

    cfg: Config
    jobs: JobQueue
    metrics: Metrics
    liveness: Liveness
    info: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    step_times: StepTimes = field(default_factory=StepTimes)
    """Measured step and overhead times (fed by the rank-0 loop): Retry-After and estimates."""
    running: Job | None = None
    """The /v1/generate job the rank-0 loop is running (None when idle or running a video)."""
    videos: VideoJobs | None = None
    """The video jobs (store, rules, the running one); None serves /v1/generate alone."""

    def __post_init__(self) -> None:
        if self.api_key == "":  # would refuse every request (process.resolve_api_key says why)
            raise ValueError("api_key='' is not a key: pass None for no key")

    def generate_backlog_s(self) -> float:
        """Expected seconds of work ahead of a new /v1/generate request: what is left of the
        running one and every queued one, from measured step times."""
        times, ahead = self.step_times, 0.0
        running = self.running
        if running is not None:
            ahead += times.job_s(running.rows, running.request.steps, "generate",
                                 steps_done=running.steps_done)
        for job in self.jobs.snapshot():
            ahead += times.job_s(job.rows, job.request.steps, "generate")
        return ahead


def _error(status: int, message: str, *, close: bool = False,
           headers: dict[str, str] | None = None) -> JSONResponse:
    hdrs = dict(headers or {})
    if close:  # the body was left unread: the connection cannot carry another request
        hdrs["connection"] = "close"
    return JSONResponse({"error": {"code": status, "message": message}}, status_code=status,
                        headers=hdrs)


def _consume(future: asyncio.Future) -> None:
    """Marks a future's outcome as seen (its answer went nowhere: the client left)."""
    if not future.cancelled():
        future.exception()


def build_app(state: ServerState) -> Starlette:
    """The ASGI app over ``state``."""
    cfg, limits = state.cfg, state.cfg.serve

    def fail(status: int, message: str, **kw: Any) -> JSONResponse:
        state.metrics.error(status)
        return _error(status, message, **kw)

    def refused(request: HttpRequest) -> JSONResponse | None:
        if state.api_key is None:
            return None
        # The scheme is case-insensitive (RFC 9110 11.1: curl users send "bearer"); the token
        # is compared exactly, in constant time.
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              state.api_key.encode()):
            return None
        return fail(401, "missing or wrong bearer token", headers={"www-authenticate": "Bearer"})

    async def health(_request: HttpRequest) -> JSONResponse:
        silent = state.liveness.silent_s()
        if state.liveness.stopping:
            status, code = "shutting_down", 503
        elif silent > cfg.runtime.health_timeout_s:
            status, code = "not_ready", 503
        else:
            status, code = "ok", 200
        state.metrics.set_ready(code == 200)
        return JSONResponse({"status": status, **state.info, "queue_depth": len(state.jobs),
                             "ranks_silent_s": round(silent, 3)}, status_code=code)

    async def metrics(request: HttpRequest) -> Response:
        return refused(request) or Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def read_body(request: HttpRequest, length: int) -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > length:
                break
            chunks.append(chunk)
        return b"".join(chunks)

    async def read_json(request: HttpRequest) -> Any:
        """The decoded JSON body within the limits, or the error Response to send."""
        if "transfer-encoding" in request.headers or "content-length" not in request.headers:
            return fail(411, "Content-Length required (chunked bodies are not accepted)",
                        close=True)
        length = int(request.headers["content-length"])  # one, digits only (h11 + GuardedH11Protocol)
        if length > limits.max_body_bytes:
            return fail(413, f"body of {length} bytes exceeds serve.max_body_bytes="
                             f"{limits.max_body_bytes}", close=True)
        try:
            body = await asyncio.wait_for(read_body(request, length), limits.idle_timeout_s)
        except ClientDisconnect:  # a truncated body is never executed
            return Response(status_code=400)
        except asyncio.TimeoutError:
            return fail(408, f"body not received within serve.idle_timeout_s="
                             f"{limits.idle_timeout_s}", close=True)
        try:
            return decode_json(body, limits)
        except RequestError as e:
            return fail(e.status, str(e))

    async def generate(request: HttpRequest) -> Response:
        received = time.perf_counter()
        denied = refused(request)
        if denied:
            return denied
        payload = await read_json(request)
        if isinstance(payload, Response):
            return payload
        try:
            req = parse_request(payload, cfg)
        except RequestError as e:
            return fail(e.status, str(e))
        if state.liveness.stopping:
            return fail(503, "server is shutting down")
        job = Job(request=req, received=received, rows=req.layout(cfg).used,
                  deadline=received + (req.timeout_s or limits.request_timeout_s))
        try:
            state.jobs.put(job)
        except QueueFull:
            # When the work ahead is done, from measured step times (it said 41-76 s, from a
            # mean of whole runs times the queue length, where the queue drained in ~30 s).
            retry = StepTimes.retry_after(state.generate_backlog_s())
            return fail(429, f"queue full ({limits.queue_size} waiting)",
                        headers={"retry-after": str(retry)})
        return await wait_for_job(request, job)

    async def wait_for_job(request: HttpRequest, job: Job) -> Response:
        future = asyncio.wrap_future(job.future)
        while not future.done():
            await asyncio.wait({future}, timeout=_POLL_S)
            if future.done():
                break
            reason = Abort.CLIENT_GONE if await request.is_disconnected() else job.abort_reason()
            if reason is Abort.NONE:
                continue
            job.cancel(reason)  # a running job is aborted (and counted) by the rank-0 loop
            # Nobody awaits the future from here on; the loop still fails the job, and asyncio
            # would log that unretrieved failure as an ERROR with a traceback.
            future.add_done_callback(_consume)
            if state.jobs.remove(job):
                state.metrics.cancelled(reason.label)
                job.fail(499, "cancelled while queued")
            rid = job.request.request_id
            if reason is Abort.CLIENT_GONE:
                log.info("%s: client disconnected; the request is cancelled", rid)
                return Response(status_code=499)
            log.info("%s: deadline passed; the request is cancelled", rid)
            return _error(504, f"{rid} not done within its deadline")
        try:
            result = future.result()
        except JobError as e:
            return _error(e.status, e.message)
        try:
            body = json.dumps(result.to_json(), allow_nan=False).encode() + b"\n"
        except (TypeError, ValueError):
            log.exception("%s: result could not be encoded", job.request.request_id)
            return fail(500, f"{job.request.request_id}: the result could not be encoded")
        return Response(body, media_type="application/json")

    async def http_error(_request: HttpRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # 404 and 405 from the router
        return fail(exc.status_code, str(exc.detail), headers=exc.headers)

    async def store_error(_request: HttpRequest, exc: Exception) -> JSONResponse:
        # A full disk or an I/O error is the operator's to fix: a clear answer naming the job
        # store (it was a generic 500: issue 24) and one log line, without a traceback.
        assert isinstance(exc, StoreError)
        log.error("job store %s: %s", exc.path, exc)
        return fail(exc.status, str(exc))

    async def internal_error(_request: HttpRequest, _exc: Exception) -> JSONResponse:
        # Counted like every other error answer (500s were missing from the metric: issue 24);
        # uvicorn logs the traceback.
        return fail(500, "internal error (details in the server log)")

    routes = [Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              Route("/v1/generate", generate, methods=["POST"])]
    if state.videos is not None:
        routes += video_routes(state, refused=refused, fail=fail, read_json=read_json)
    app = Starlette(routes=routes,
                    exception_handlers={HTTPException: http_error, StoreError: store_error,
                                        Exception: internal_error})
    # Starlette answers /health/ with a 307 whose Location it builds from the client's Host
    # header (an empty body; a client chooses where the server points): a path is exact here.
    app.router.redirect_slashes = False
    return app


class HttpServer:
    """uvicorn serving :func:`build_app` on an already listening socket, in a daemon thread."""

    def __init__(self, state: ServerState, sock: Any) -> None:
        limits = state.cfg.serve
        # A subclass per server, so that the protocol's own rejections reach this server's
        # metrics (uvicorn builds protocols from a class and its own keyword arguments).
        protocol = type("_ServerProtocol", (GuardedH11Protocol,), {"metrics": state.metrics})
        config = uvicorn.Config(build_app(state), http=protocol, lifespan="off",
                                log_config=None, access_log=False, server_header=False,
                                timeout_keep_alive=limits.idle_timeout_s,
                                h11_max_incomplete_event_size=limits.max_header_bytes,
                                backlog=limits.backlog, timeout_graceful_shutdown=2)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=asyncio.run, args=(self._server.serve([sock]),),
                                        name="http", daemon=True)

    def start(self) -> None:
        """Starts serving."""
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, closes connections and waits for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
