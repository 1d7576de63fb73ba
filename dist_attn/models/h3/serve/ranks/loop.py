# SPDX-License-Identifier: Apache-2.0
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
import socket
import time
from typing import Any

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.h3.engine import Engine, RunResult
from dist_attn.models.h3.serve.http.app import HttpServer
from dist_attn.models.h3.serve.http.state import VideoJobs
from dist_attn.models.h3.serve.jobs.queue import Job
from dist_attn.models.h3.serve.jobs.requests import Request, request_from_wire
from dist_attn.models.h3.serve.jobs.runner import VideoRunner, video_from_wire
from dist_attn.models.h3.serve.ranks.front import Front
from dist_attn.models.h3.serve.ranks.generate import GenerateDrive
from dist_attn.models.h3.serve.ranks.lifecycle import Shutdown, mark_ready
from dist_attn.models.h3.serve.ranks.video import VideoDrive
from dist_attn.models.h3.serve.wire.control import Control, Op, exchange

__all__ = ["Rank0", "serve"]

log = logging.getLogger(__name__)

# Shutdown steps after the drain (telling the ranks, stopping HTTP) get this long.
_EXIT_GRACE_S = 5.0


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
    return Rank0(cfg, env, engine, info or {}, api_key, runner, videos).run(listener, once)


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


class Rank0:
    """Rank 0's loop: serves HTTP through its :class:`~dist_attn.models.h3.serve.ranks.front.Front`,
    picks the next job (/v1/generate first, then the oldest stored video job), has every rank run it
    (:class:`~dist_attn.models.h3.serve.ranks.generate.GenerateDrive`,
    :class:`~dist_attn.models.h3.serve.ranks.video.VideoDrive`), keeps idle ranks awake with
    heartbeats, and on a signal drains and tells every rank to leave."""

    def __init__(self, cfg: Config, env: DistEnv, engine: Engine, info: dict[str, Any],
                 api_key: str | None, runner: VideoRunner | None = None,
                 videos: VideoJobs | None = None) -> None:
        self.cfg, self.env = cfg, env
        assert (runner is None) == (videos is None), "video jobs need a runner and a store"
        self.front = Front(cfg, info, api_key, videos)
        self.shutdown = Shutdown(hard_exit_after_s=cfg.serve.drain_timeout_s + _EXIT_GRACE_S,
                                 on_request=self.front.refuse_queued)
        self.generate = GenerateDrive(cfg, env, engine, self.front, self.shutdown)
        self.video = (VideoDrive(cfg, env, runner, videos, self.front, self.shutdown)
                      if runner is not None and videos is not None else None)

    def run(self, listener: socket.socket | None, once: Request | None) -> int:
        self.shutdown.install()
        http = None
        if once is None:
            assert listener is not None, "rank 0 serves HTTP on a bound listener"
            http = HttpServer(self.front.state, listener)
            http.start()
            host, port = listener.getsockname()[:2]
            log.info("serving on http://%s:%d (world %d, backend %s)", host, port,
                     self.env.world_size, self.front.state.info.get("backend"))
            mark_ready()  # a supervisor restarts a job that served, never a failed launch
        else:
            self.front.jobs.put(Job(request=once))
        result = None
        clean = False
        try:
            result = self._loop(once is not None)
            clean = True
        finally:
            self.front.refuse_queued()
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
        jobs = self.front.jobs
        last = time.monotonic()
        while not self.shutdown.requested.is_set():
            # /v1/generate first (short benchmark requests), then the oldest stored video job;
            # short waits so that a signal (which only sets a flag) is seen within 0.2 s. A new
            # video job wakes the wait.
            job = jobs.get(timeout=0)
            if job is None and self.video is not None and not once:
                record = self.video.start_next()
                if record is not None:
                    self.video.run(record)
                    last = time.monotonic()
                    continue
            if job is None:
                job = jobs.get(timeout=min(0.2, heartbeat))
            if job is None:
                if once:
                    return None
                if time.monotonic() - last >= heartbeat:
                    exchange(Control(Op.HEARTBEAT), self.env)
                    self.front.liveness.contact()
                    last = time.monotonic()
                continue
            result = self.generate.run(job)
            last = time.monotonic()
            if once:
                return result
        return None
