"""The rank loops: rank 0 decides, every rank follows.

Control flow (one direction)::

    HTTP thread (rank 0) --validate--> JobQueue --> rank-0 loop --exchange(RUN)--> all ranks
                                                                   |
                  all ranks: Engine.run (denoise loop; an abort vote before every step)
                                                                   |
    HTTP response <-- Job.future <-- rank 0 (checksum, optional save: rank-0-only, local faults)

Idle, rank 0 exchanges a heartbeat every ``runtime.heartbeat_s``; the other ranks always wait
inside an exchange, bounded by the process-group timeout ``runtime.pg_timeout_s``, so if a rank
dies or hangs the rest leave non-zero within that bound. On SIGTERM/SIGINT rank 0 answers every
queued request 503 at once, lets the running one finish for up to ``serve.drain_timeout_s``,
aborts it between steps otherwise, and sends SHUTDOWN: every rank exits 0.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

from dist_attn.distributed import DistEnv
from dist_attn.serve.config import Config
from dist_attn.serve.h3.engine import Engine, RunResult
from dist_attn.serve.http.app import HttpServer
from dist_attn.serve.http.state import ServerState, VideoJobs, VideoProgress
from dist_attn.serve.jobs.queue import Job, JobQueue, Liveness
from dist_attn.serve.http.metrics import Metrics
from dist_attn.serve.process import Shutdown
from dist_attn.serve.jobs.requests import Request, request_from_wire
from dist_attn.serve.wire.abort import Abort
from dist_attn.serve.wire.control import Control, Op, exchange
from dist_attn.serve.jobs.runner import VideoRunner, video_from_wire, video_wire
from dist_attn.serve.jobs.store import JobRecord, JobStatus, StoreError
from dist_attn.serve.supervise import mark_ready

__all__ = ["serve"]

log = logging.getLogger(__name__)

# How the answer to an aborted job reads (CLIENT_GONE is never read: nobody is waiting).
_ABORT_ANSWER = {Abort.CLIENT_GONE: (499, "client disconnected"),
                 Abort.DEADLINE: (504, "not done within its deadline"),
                 Abort.SHUTDOWN: (503, "server shut down")}
# Shutdown steps after the drain (telling the ranks, stopping HTTP) get this long.
_EXIT_GRACE_S = 5.0
# A job store that cannot start the next job (a full disk) is logged at most this often.
_STORE_ERROR_LOG_S = 60.0


def serve(cfg: Config, env: DistEnv, engine: Engine, *, listener: socket.socket | None = None,
          once: Request | None = None, info: dict[str, Any] | None = None,
          api_key: str | None = None, runner: VideoRunner | None = None,
          videos: VideoJobs | None = None) -> int:
    """Runs this rank's loop until shutdown; returns the process exit code. Rank 0 serves HTTP
    on ``listener`` (or runs ``once``, prints its JSON result on stdout and stops).

    ``runner`` (every rank) and ``videos`` (rank 0: the store and what HTTP shares) enable the
    video jobs; without them only /v1/generate is served."""
    hard_exit = cfg.serve.drain_timeout_s + _EXIT_GRACE_S
    if env.rank != 0:
        Shutdown(hard_exit_after_s=hard_exit).install()  # rank 0 tells us when to leave
        return _worker_loop(env, engine, runner)
    return _Rank0(cfg, env, engine, info or {}, api_key, runner, videos).run(listener, once)


def _worker_loop(env: DistEnv, engine: Engine, runner: VideoRunner | None) -> int:
    while True:
        msg = exchange(None, env)
        if msg.op is Op.SHUTDOWN:
            log.info("shut down cleanly")
            return 0
        if msg.op is Op.RUN:
            engine.run(request_from_wire(msg.request))
        elif msg.op is Op.VIDEO:
            assert runner is not None, "rank 0 sent a video job to a rank without a runner"
            runner.follow(video_from_wire(msg.request))


class _Rank0:
    def __init__(self, cfg: Config, env: DistEnv, engine: Engine, info: dict[str, Any],
                 api_key: str | None, runner: VideoRunner | None = None,
                 videos: VideoJobs | None = None) -> None:
        self.cfg, self.env, self.engine = cfg, env, engine
        assert (runner is None) == (videos is None), "video jobs need a runner and a store"
        self.runner, self.videos = runner, videos
        self.jobs = JobQueue(cfg.serve.queue_size)
        self.metrics = Metrics(lambda: len(self.jobs))
        if videos is not None:
            store = videos.store
            self.metrics.watch_jobs(lambda: {k.value: n for k, n in store.counts().items()})
        self.liveness = Liveness()
        self.state = ServerState(cfg=cfg, jobs=self.jobs, metrics=self.metrics,
                                 liveness=self.liveness, info=info, api_key=api_key,
                                 videos=videos)
        self.shutdown = Shutdown(hard_exit_after_s=cfg.serve.drain_timeout_s + _EXIT_GRACE_S,
                                 on_request=self._refuse_queued)
        self._store_error_logged = -_STORE_ERROR_LOG_S

    def _refuse_queued(self) -> None:
        """Answers every waiting request 503 at once (runs on its own thread at a signal)."""
        self.liveness.stopping = True
        for job in self.jobs.drain():
            self.metrics.cancelled(Abort.SHUTDOWN.label)
            job.fail(503, "server is shutting down")

    def _vote(self, job: Job) -> Abort:
        """Rank 0's abort vote before a denoise step. The previous step's all-to-alls needed
        every rank, so reaching this point is also proof of life."""
        self.liveness.contact()
        job.steps_done += 1  # the vote comes before every step after the first
        reason = job.abort_reason()
        since = self.shutdown.since
        if reason is Abort.NONE and since is not None and (
                time.perf_counter() - since > self.cfg.serve.drain_timeout_s):
            reason = Abort.SHUTDOWN
        return reason

    def run(self, listener: socket.socket | None, once: Request | None) -> int:
        self.shutdown.install()
        http = None
        if once is None:
            assert listener is not None, "rank 0 serves HTTP on a bound listener"
            http = HttpServer(self.state, listener)
            http.start()
            host, port = listener.getsockname()[:2]
            log.info("serving on http://%s:%d (world %d, backend %s)", host, port,
                     self.env.world_size, self.state.info.get("backend"))
            mark_ready()  # a supervisor restarts a job that served, never a failed launch
        else:
            self.jobs.put(Job(request=once))
        result = None
        clean = False
        try:
            result = self._loop(once is not None)
            clean = True
        finally:
            self._refuse_queued()
            if clean:
                exchange(Control(Op.SHUTDOWN), self.env)
            if http is not None:
                http.stop()
            if clean:
                log.info("shut down cleanly")
        if once is not None:
            if result is None:
                return 1
            print(json.dumps(result.to_json()), flush=True)
        return 0

    def _loop(self, once: bool) -> RunResult | None:
        heartbeat = self.cfg.runtime.heartbeat_s
        last = time.monotonic()
        while not self.shutdown.requested.is_set():
            # /v1/generate first (short benchmark requests), then the oldest stored video job;
            # short waits so that a signal (which only sets a flag) is seen within 0.2 s. A new
            # video job wakes the wait.
            job = self.jobs.get(timeout=0)
            if job is None and self.videos is not None and not once:
                record = self._start_next_video()
                if record is not None:
                    self._run_video(record)
                    last = time.monotonic()
                    continue
            if job is None:
                job = self.jobs.get(timeout=min(0.2, heartbeat))
            if job is None:
                if once:
                    return None
                if time.monotonic() - last >= heartbeat:
                    exchange(Control(Op.HEARTBEAT), self.env)
                    self.liveness.contact()
                    last = time.monotonic()
                continue
            result = self._run(job)
            last = time.monotonic()
            if once:
                return result
        return None

    def _start_next_video(self) -> JobRecord | None:
        """The oldest queued video job, now running; None when there is none or when the store
        cannot commit (a full disk). That error ended the server; the job now stays queued
        (the transaction rolled back), the error is logged at most once a minute, and
        /v1/generate is served on (issue 24)."""
        assert self.videos is not None
        try:
            return self.videos.store.start_next()
        except StoreError as e:
            now = time.monotonic()
            if now - self._store_error_logged >= _STORE_ERROR_LOG_S:
                self._store_error_logged = now
                log.error("job store %s: the next video job cannot start: %s (retried until it "
                          "can; logged once a minute)", e.path, e)
            return None

    def _run(self, job: Job) -> RunResult | None:
        req = job.request
        reason = job.abort_reason()
        if reason is not Abort.NONE:  # dropped before it started: no collective spent on it
            self.metrics.cancelled(reason.label)
            job.fail(*_ABORT_ANSWER[reason])
            return None
        started = time.perf_counter()
        exchange(Control(Op.RUN, req.wire()), self.env)
        self.state.running = job
        try:
            result = self.engine.run(req, abort=lambda: self._vote(job))
        except Exception:
            # Peers may be stuck in a collective of this request: fail it, then leave non-zero;
            # the others exit on the process-group timeout.
            self.metrics.error(500)
            job.fail(500, f"{req.request_id} failed; the server is stopping")
            raise
        finally:
            self.state.running = None
        assert result is not None
        self.liveness.contact()
        for ms in result.step_latency_ms:
            self.state.step_times.observe_step(job.rows, ms / 1e3)
        if result.aborted is not Abort.NONE:
            status, message = _ABORT_ANSWER[result.aborted]
            self.metrics.cancelled(result.aborted.label)
            job.fail(status, f"{req.request_id} {message}; aborted after "
                             f"{len(result.step_latency_ms)} of {req.steps} steps")
            log.info("%s aborted (%s) after %d of %d steps", req.request_id,
                     result.aborted.label, len(result.step_latency_ms), req.steps)
            return None
        try:
            self.engine.save_output(result)
        except Exception:  # noqa: BLE001 - rank 0 alone: this request fails, the server serves on
            log.exception("%s: writing the output failed", req.request_id)
            self.metrics.error(500)
            job.fail(500, f"{req.request_id}: the output could not be written (details in the "
                          "server log)")
            return None
        now = time.perf_counter()
        result.queue_ms = round((started - job.received) * 1e3, 3)
        result.total_latency_ms = round((now - job.received) * 1e3, 3)
        self.state.step_times.observe_overhead("generate", max(0.0, now - started
                                                           - result.denoise_ms / 1e3))
        self.metrics.observe(now - job.received, result.tokens.used * req.steps,
                             result.denoise_ms / 1e3)
        job.finish(result)
        log.info("%s done: %d tokens x %d steps in %.1f ms", req.request_id, result.tokens.used,
                 req.steps, result.total_latency_ms)
        return result

    def _run_video(self, record: JobRecord) -> None:
        """Runs one stored video job on every rank and records how it ended. A failure on rank 0
        alone (decode, muxing, disk) fails the job and the server serves on; a failure in the
        collective path leaves the job 'running' in the store (the restart re-queues it once) and
        ends the server."""
        videos, runner = self.videos, self.runner
        assert videos is not None and runner is not None
        req, job_id = record.request, record.id
        progress = VideoProgress(job_id=job_id, rows=req.rows, steps=req.steps,
                                 started=record.started_at or time.time())
        mp4_rel, png_rel = f"videos/{job_id}.mp4", f"videos/{job_id}.png"
        try:
            os.makedirs(os.path.join(videos.output_dir, "videos"), exist_ok=True)
        except OSError as e:  # rank 0 alone, before any collective: this job fails
            log.exception("%s: the videos directory cannot be made", job_id)
            videos.store.fail(job_id, f"the output directory is not writable "
                                      f"({e.strerror or type(e).__name__})")
            self.metrics.video_finished(JobStatus.FAILED.value)
            return
        videos.running = progress
        log.info("%s started (attempt %d): %d frames %dx%d, %d steps, %d rows", job_id,
                 record.attempts, req.frames, req.width, req.height, req.steps, req.rows)

        def on_step(k: int, seconds: float) -> Abort:
            progress.step = k
            self.liveness.contact()  # the step's all-to-alls needed every rank
            self.state.step_times.observe_step(req.rows, seconds)
            self.metrics.observe_step("video", seconds)
            if job_id in videos.cancels:
                return Abort.CANCELLED
            since = self.shutdown.since
            if since is not None and time.perf_counter() - since > self.cfg.serve.drain_timeout_s:
                return Abort.SHUTDOWN
            return Abort.NONE

        t0 = time.perf_counter()
        try:
            exchange(Control(Op.VIDEO, video_wire(req)), self.env)
            outcome = runner.lead(req, mp4_path=os.path.join(videos.output_dir, mp4_rel),
                                  png_path=(os.path.join(videos.output_dir, png_rel)
                                            if videos.thumbnail else None),
                                  on_step=on_step)
        except Exception:
            log.exception("%s failed in the collective path; the server stops (the job is "
                          "re-queued once at the next start)", job_id)
            raise
        finally:
            videos.running = None
            videos.cancels.discard(job_id)
        self.liveness.contact()
        total = time.perf_counter() - t0
        done = len(outcome.step_s)
        timings = {k: round(v, 4) for k, v in outcome.timings.items()}
        timings.update(queue=round((record.started_at or 0) - record.created_at, 4),
                       total=round(total, 4), step_s=[round(x, 4) for x in outcome.step_s])
        store = videos.store
        try:
            if outcome.aborted is Abort.CANCELLED:
                store.cancelled(job_id, f"cancelled by the client after {done} of {req.steps} "
                                        "steps", timings=timings)
                self.metrics.video_finished(JobStatus.CANCELLED.value)
            elif outcome.aborted is Abort.SHUTDOWN:
                store.requeue(job_id, f"re-queued: the server was stopped after {done} of "
                                      f"{req.steps} steps")
            elif outcome.error is not None or outcome.file is None:
                store.fail(job_id, outcome.error or "no video was written", timings=timings)
                self.metrics.video_finished(JobStatus.FAILED.value)
            else:
                thumb = png_rel if outcome.file.png_path else None
                store.succeed(job_id, output=mp4_rel, thumbnail=thumb, timings=timings)
                self.state.step_times.observe_overhead("video", max(0.0, total
                                                                    - sum(outcome.step_s)))
                phases = {k: v for k, v in timings.items() if isinstance(v, float)}
                self.metrics.video_finished(JobStatus.SUCCEEDED.value, phases)
        except Exception:  # noqa: BLE001 - rank 0 alone: the store stays as it was (running)
            log.exception("%s: recording its end in the job store failed", job_id)
            return
        log.info("%s %s after %d of %d steps in %.2f s", job_id,
                 outcome.aborted.label if outcome.aborted is not Abort.NONE
                 else ("failed" if outcome.error else "succeeded"), done, req.steps, total)
