# SPDX-License-Identifier: Apache-2.0
"""HTTP on rank 0: a Starlette app served by uvicorn in a thread of its own.

Endpoints: ``GET /health`` (200 ok, 503 not ready or shutting down; never needs a token),
``POST /v1/generate`` (:mod:`dist_attn.models.h3.serve.http.generate`), ``/v1/videos`` (the jobs
API, :mod:`dist_attn.models.h3.serve.http.videos`), ``GET /metrics`` (Prometheus text). Every error
is a JSON body ``{"error": {"code", "message"}}`` (:mod:`dist_attn.models.h3.serve.http.gate`); no
server banner; messages never carry server paths or library internals (those go to the log).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from dist_attn.models.h3.serve.http.gate import Gate
from dist_attn.models.h3.serve.http.generate import generate_routes
from dist_attn.models.h3.serve.http.guard import GuardedH11Protocol
from dist_attn.models.h3.serve.http.metrics import CONTENT_TYPE
from dist_attn.models.h3.serve.http.state import ServerState
from dist_attn.models.h3.serve.http.videos import video_routes
from dist_attn.models.h3.serve.jobs.records import StoreError

__all__ = ["build_app", "HttpServer"]

log = logging.getLogger(__name__)


def build_app(state: ServerState) -> Starlette:
    """The ASGI app over ``state``."""
    cfg = state.cfg
    gate = Gate(state)
    fail = gate.fail

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
        return gate.refused(request) or Response(state.metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(_request: HttpRequest, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)  # 404 and 405 from the router
        return fail(exc.status_code, str(exc.detail), headers=exc.headers)

    async def store_error(_request: HttpRequest, exc: Exception) -> JSONResponse:
        # A full disk or an I/O error is the operator's to fix: a clear answer naming the job
        # store (never a generic 500) and one log line, without a traceback.
        assert isinstance(exc, StoreError)
        log.error("job store %s: %s", exc.path, exc)
        return fail(exc.status, str(exc))

    async def internal_error(_request: HttpRequest, _exc: Exception) -> JSONResponse:
        # Counted like every other error answer (a 500 is in the metric too); uvicorn logs the
        # traceback.
        return fail(500, "internal error (details in the server log)")

    routes = [Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"]),
              *generate_routes(state, gate)]
    if state.videos is not None:
        routes += video_routes(state, gate)
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
