# SPDX-License-Identifier: Apache-2.0
"""The jobs API over HTTP: ``/v1/videos``.

- ``POST /v1/videos`` validates the request
  (:func:`dist_attn.models.h3.serve.jobs.videos.parse_video_request`), stores the job (committed
  before the answer) and answers **202** with the job and a ``Location``; 429 with Retry-After when
  ``jobs.max_queued`` jobs wait; 507 when the output directory's free space cannot hold its files
  and those of the jobs before it; 503 while shutting down.
- ``GET /v1/videos/{id}``: the job: status (queued, running, succeeded, failed, cancelled),
  progress (step k of n, elapsed, estimated remaining, queue position), timings, errors.
- ``GET /v1/videos/{id}/content`` streams the MP4 (``?variant=thumbnail``: the first frame's PNG);
  409 until the job succeeded, 410 when its file is gone.
- ``DELETE /v1/videos/{id}`` cancels a queued job at once, or a running one between denoise
  steps (on every rank); 409 for a finished job.
- ``GET /v1/videos?limit=&status=&before=`` lists recent jobs, newest first.

Store calls run in Starlette's thread pool: a submit waits for its fsync, which must not stall
the event loop that answers everyone else.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from dist_attn.models.h3.serve.http.gate import Gate
from dist_attn.models.h3.serve.http.state import ServerState, VideoJobs
from dist_attn.models.h3.serve.jobs.queue import StepTimes
from dist_attn.models.h3.serve.jobs.records import JobRecord, JobStatus
from dist_attn.models.h3.serve.jobs.videos import parse_video_request

__all__ = ["job_json", "video_routes"]

_MAX_LIST = 100


class _FileResponse(FileResponse):
    """Starlette's FileResponse, whose own answers to a Range header it cannot serve (a 416 with
    an empty body, a text/plain 400) become JSON errors like every other answer, counted through
    ``refuse``. Starlette's answer is caught at ``send`` rather than by re-parsing the
    Range header, so the verdict stays Starlette's (If-Range included)."""

    def __init__(self, path: str, *, refuse: Callable[..., JSONResponse], what: str,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._refuse, self._what = refuse, what

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        refused: dict[str, Any] = {}

        async def keep_refusal(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and message["status"] in (400, 416):
                refused.update(status=message["status"], text=b"",
                               headers={k.decode("latin-1"): v.decode("latin-1")
                                        for k, v in message.get("headers", [])})
            elif refused:  # the body of that answer
                refused["text"] += message.get("body", b"")
            else:
                await send(message)

        await super().__call__(scope, receive, keep_refusal)
        if not refused:
            return
        asked = dict(scope["headers"]).get(b"range", b"").decode("latin-1")
        if refused["status"] == 416:
            span = refused["headers"].get("content-range")  # "bytes */SIZE"
            size = span.rpartition("/")[2] if span else "?"
            answer = self._refuse(416, f"Range={asked!r} starts past the end of {self._what} "
                                       f"({size} bytes)",
                                  headers={"content-range": span} if span else None)
        else:
            answer = self._refuse(400, f"Range={asked!r}: "
                                       f"{refused['text'].decode('utf-8', 'replace')}")
        await answer(scope, receive, send)


def _bounded_int(raw: str, lo: int, hi: int) -> int | None:
    """``raw`` as an integer in [lo, hi] (0 <= lo), or None. ASCII digits only: str.isdigit()
    accepts '\u00b2', which int() refuses; and no int() of more digits than ``hi`` has, which
    Python refuses past 4300 digits (both answered 500)."""
    if not (raw.isascii() and raw.isdigit()):
        return None
    digits = raw.lstrip("0") or "0"
    if len(digits) > len(str(hi)):
        return None
    value = int(digits)
    return value if lo <= value <= hi else None


def job_json(job: JobRecord, jobs: VideoJobs, times: StepTimes) -> dict[str, Any]:
    """The client's view of a job."""
    now = time.time()
    req = job.request
    progress: dict[str, Any] = {"step": 0, "steps": req.steps}
    out: dict[str, Any] = {"id": job.id, "object": "video", "status": job.status.value,
                           "created_at": job.created_at, "started_at": job.started_at,
                           "finished_at": job.finished_at, "request": req.to_json(),
                           "attempts": job.attempts, "cancel_requested": job.cancel_requested,
                           "error": job.error, "history": job.history}
    if job.status is JobStatus.QUEUED:
        queued = jobs.store.queued()
        ahead = [j for j in queued if j.seq < job.seq]
        wait = jobs.backlog_s(times, ahead)
        own = times.job_s(req.rows, req.steps, "video")
        out["queue_position"] = len(ahead)
        progress.update(elapsed_s=0.0, remaining_s=round(wait + own, 3),
                        waited_s=round(now - job.created_at, 3))
    elif job.status is JobStatus.RUNNING:
        run = jobs.running
        step = run.step if run is not None and run.job_id == job.id else 0
        elapsed = now - (job.started_at or now)
        progress.update(step=step, elapsed_s=round(elapsed, 3),
                        remaining_s=round(times.running_s(req.rows, req.steps, "video",
                                                          steps_done=step, elapsed_s=elapsed), 3))
    else:
        done = len(job.timings.get("step_s", [])) if job.timings else 0
        progress.update(step=req.steps if job.status is JobStatus.SUCCEEDED else done,
                        elapsed_s=round((job.finished_at or now) - (job.started_at or now), 3)
                        if job.started_at else 0.0, remaining_s=0.0)
    progress["fraction"] = round(progress["step"] / req.steps, 4)
    out["progress"] = progress
    if job.timings:
        out["timings"] = job.timings
    if job.status is JobStatus.SUCCEEDED and job.output is not None:  # None: deleted
        out["content_url"] = f"/v1/videos/{job.id}/content"
        if job.thumbnail:
            out["thumbnail_url"] = f"/v1/videos/{job.id}/content?variant=thumbnail"
    return out


def video_routes(state: ServerState, gate: Gate) -> list[Route]:
    """The routes of :mod:`this module <dist_attn.models.h3.serve.http.videos>` over
    ``state.videos``, through ``gate`` (the token and the body limits of ``/v1/generate`` apply
    alike)."""
    api = _VideoApi(state, gate)
    return [Route("/v1/videos", api.submit, methods=["POST"]),
            Route("/v1/videos", api.listing, methods=["GET"]),
            Route("/v1/videos/{job_id}", api.status, methods=["GET"]),
            Route("/v1/videos/{job_id}", api.cancel, methods=["DELETE"]),
            Route("/v1/videos/{job_id}/content", api.content, methods=["GET"])]


class _VideoApi:
    """The endpoints of :func:`video_routes`: one method each, over ``state.videos``; store calls
    run in the thread pool."""

    def __init__(self, state: ServerState, gate: Gate) -> None:
        self.state, self.gate = state, gate
        self.jobs: VideoJobs = state.videos
        self.times = state.step_times
        self.fail = gate.fail

    async def _view(self, job: JobRecord) -> JSONResponse:
        """200 with the client's view of ``job``."""
        return JSONResponse(await run_in_threadpool(job_json, job, self.jobs, self.times))

    async def submit(self, request: HttpRequest) -> Response:
        jobs, fail = self.jobs, self.fail
        req = await self.gate.admit(request,
                                    lambda payload: parse_video_request(payload, jobs.rules))
        if isinstance(req, Response):
            return req
        short = await run_in_threadpool(jobs.space_refusal, req)
        if short is not None:
            return fail(507, short)
        job = await run_in_threadpool(jobs.store.submit, req, max_queued=jobs.max_queued)
        if job is None:
            # when a slot opens (the running job ends), not when the whole backlog is done
            retry = StepTimes.retry_after(self.state.slot_s())
            return fail(429, f"{jobs.max_queued} video jobs are waiting (jobs.max_queued)",
                        headers={"retry-after": str(retry)})
        self.state.jobs.wake()  # the rank-0 loop may be waiting for /v1/generate work
        self.state.metrics.video_submitted()
        body = await run_in_threadpool(job_json, job, jobs, self.times)
        return JSONResponse(body, status_code=202, headers={"location": f"/v1/videos/{job.id}"})

    async def _lookup(self, request: HttpRequest) -> JobRecord | Response:
        """The job the path names, after the gate's token check; else the refusal (404)."""
        denied = self.gate.refused(request)
        if denied:
            return denied
        job_id = request.path_params["job_id"]
        job = await run_in_threadpool(self.jobs.store.get, job_id)
        if job is None:
            return self.fail(404, f"no video job {job_id!r}")
        return job

    async def status(self, request: HttpRequest) -> Response:
        job = await self._lookup(request)
        if isinstance(job, Response):
            return job
        return await self._view(job)

    async def content(self, request: HttpRequest) -> Response:
        job = await self._lookup(request)
        if isinstance(job, Response):
            return job
        variant = request.query_params.get("variant", "video")
        if variant not in ("video", "thumbnail"):
            return self.fail(400, f"variant={variant!r} must be 'video' or 'thumbnail'")
        path = self._content_path(job, variant)
        if isinstance(path, Response):
            return path
        media = "video/mp4" if variant == "video" else "image/png"
        return _FileResponse(path, media_type=media, refuse=self.fail, what=f"the {variant}",
                             filename=f"{job.id}.{'mp4' if variant == 'video' else 'png'}")

    def _content_path(self, job: JobRecord, variant: str) -> str | Response:
        """The file of ``job``'s ``variant``; else why there is none (409, 410, 404)."""
        fail = self.fail
        if job.status is not JobStatus.SUCCEEDED:
            why = f": {job.error}" if job.error else ""
            return fail(409, f"video job {job.id} is {job.status.value}{why}; its content exists "
                             "once it succeeded")
        if job.output is None:  # only the retention takes a succeeded job's files
            kept = self.state.cfg.jobs
            return fail(410, f"the files of video job {job.id} were deleted by the server's "
                             f"retention (jobs.videos_kept={kept.videos_kept} newest, "
                             f"jobs.videos_max_age_s={kept.videos_max_age_s})")
        name = job.output if variant == "video" else job.thumbnail
        if name is None:
            return fail(404, f"video job {job.id} has no {variant}")
        path = os.path.join(self.jobs.output_dir, name)
        if not os.path.isfile(path):
            return fail(410, f"the {variant} of video job {job.id} is no longer in the output "
                             "directory")
        return path

    async def cancel(self, request: HttpRequest) -> Response:
        job = await self._lookup(request)
        if isinstance(job, Response):
            return job
        if job.status.final:
            return self.fail(409, f"video job {job.id} already {job.status.value}; nothing to "
                                  "cancel")
        after = await run_in_threadpool(self.jobs.store.request_cancel, job.id)
        assert after is not None
        if after.status is JobStatus.RUNNING:
            self.jobs.cancels.add(after.id)  # the loop stops it between denoise steps
        elif after.status is JobStatus.CANCELLED:
            self.state.metrics.video_finished(JobStatus.CANCELLED.value)
        return await self._view(after)

    async def listing(self, request: HttpRequest) -> Response:
        denied = self.gate.refused(request)
        if denied:
            return denied
        query = await self._list_query(request)
        if isinstance(query, Response):
            return query
        limit, wanted, before_seq = query
        found = await run_in_threadpool(self.jobs.store.list, limit=limit + 1, status=wanted,
                                        before_seq=before_seq)

        def render() -> list[dict[str, Any]]:
            return [job_json(j, self.jobs, self.times) for j in found[:limit]]

        return JSONResponse({"object": "list", "data": await run_in_threadpool(render),
                             "has_more": len(found) > limit})

    async def _list_query(self, request: HttpRequest
                          ) -> tuple[int, JobStatus | None, int | None] | Response:
        """``(limit, status, before_seq)`` of ``GET /v1/videos``; else the 400 naming the
        parameter."""
        q, fail = request.query_params, self.fail
        raw = q.get("limit", "20")
        limit = _bounded_int(raw, 1, _MAX_LIST)
        if limit is None:
            return fail(400, f"limit={raw!r} must be an integer in [1, {_MAX_LIST}] (ASCII "
                             "digits)")
        which = q.get("status")
        try:
            wanted = JobStatus(which) if which is not None else None
        except ValueError:
            return fail(400, f"status={which!r} must be one of "
                             f"{[s.value for s in JobStatus]}")
        before = q.get("before")
        if before is None:
            return limit, wanted, None
        anchor = await run_in_threadpool(self.jobs.store.get, before)
        if anchor is None:
            return fail(400, f"before={before!r} is not a video job id")
        return limit, wanted, anchor.seq
