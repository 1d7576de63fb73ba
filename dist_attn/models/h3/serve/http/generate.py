# SPDX-License-Identifier: Apache-2.0
"""``POST /v1/generate``: a JSON request validated on rank 0, queued, run on every rank by the
rank-0 loop, answered with its JSON result; dropped from the queue or aborted between denoise
steps when its client leaves or its deadline passes (the transformer-only benchmark path)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from starlette.requests import Request as HttpRequest
from starlette.responses import Response
from starlette.routing import Route

from dist_attn.models.h3.serve.http.gate import Gate, error_response
from dist_attn.models.h3.serve.http.state import ServerState
from dist_attn.models.h3.serve.jobs.queue import Job, JobError, QueueFull, StepTimes
from dist_attn.models.h3.serve.jobs.requests import parse_request
from dist_attn.models.h3.serve.wire.abort import Abort

__all__ = ["generate_routes"]

log = logging.getLogger(__name__)

# A waiting handler checks for a vanished client this often; a dropped request then stops
# within one poll plus one denoise step.
_POLL_S = 0.25


def _consume(future: asyncio.Future) -> None:
    """Marks a future's outcome as seen (its answer went nowhere: the client left)."""
    if not future.cancelled():
        future.exception()


def generate_routes(state: ServerState, gate: Gate) -> list[Route]:
    """The route of /v1/generate over ``state``."""
    cfg, limits = state.cfg, state.cfg.serve
    fail = gate.fail

    async def generate(request: HttpRequest) -> Response:
        received = time.perf_counter()
        req = await gate.admit(request, lambda payload: parse_request(payload, cfg))
        if isinstance(req, Response):
            return req
        job = Job(request=req, received=received, rows=req.layout(cfg).used,
                  deadline=received + (req.timeout_s or limits.request_timeout_s))
        try:
            state.jobs.put(job)
        except QueueFull:
            # When a slot opens, from measured step times (the whole backlog was 9x that).
            retry = StepTimes.retry_after(state.slot_s())
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
            return error_response(504, f"{rid} not done within its deadline")
        try:
            result = future.result()
        except JobError as e:
            return error_response(e.status, e.message)
        try:
            body = json.dumps(result.to_json(), allow_nan=False).encode() + b"\n"
        except (TypeError, ValueError):
            log.exception("%s: result could not be encoded", job.request.request_id)
            return fail(500, f"{job.request.request_id}: the result could not be encoded")
        return Response(body, media_type="application/json")

    return [Route("/v1/generate", generate, methods=["POST"])]
