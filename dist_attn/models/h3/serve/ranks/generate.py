# SPDX-License-Identifier: Apache-2.0
"""One /v1/generate job on every rank, driven by rank 0: the RUN message, the denoise loop with
rank 0's abort vote before every step, and the answer (the result, or why it stopped)."""

from __future__ import annotations

import logging
import time

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.h3.engine import Engine, RunResult
from dist_attn.models.h3.serve.jobs.queue import Job
from dist_attn.models.h3.serve.ranks.front import Front
from dist_attn.models.h3.serve.ranks.lifecycle import Shutdown
from dist_attn.models.h3.serve.wire.abort import Abort
from dist_attn.models.h3.serve.wire.control import Control, Op, exchange

__all__ = ["GenerateDrive"]

log = logging.getLogger(__name__)

# How the answer to an aborted job reads (CLIENT_GONE is never read: nobody is waiting).
_ABORT_ANSWER = {Abort.CLIENT_GONE: (499, "client disconnected"),
                Abort.DEADLINE: (504, "not done within its deadline"),
                Abort.SHUTDOWN: (503, "server shut down")}


class GenerateDrive:
    """Runs /v1/generate jobs on every rank from rank 0 and answers them."""

    def __init__(self, cfg: Config, env: DistEnv, engine: Engine, front: Front,
                 shutdown: Shutdown) -> None:
        self.cfg, self.env, self.engine = cfg, env, engine
        self.front, self.shutdown = front, shutdown

    def vote(self, job: Job) -> Abort:
        """Rank 0's abort vote before a denoise step. The previous step's all-to-alls needed
        every rank, so reaching this point is also proof of life."""
        self.front.liveness.contact()
        job.steps_done += 1  # the vote comes before every step after the first
        reason = job.abort_reason()
        if reason is Abort.NONE and self.shutdown.older_than(self.cfg.serve.drain_timeout_s):
            reason = Abort.SHUTDOWN
        return reason

    def run(self, job: Job) -> RunResult | None:
        """Runs ``job`` on every rank and resolves it; the result, or None when it failed."""
        front, metrics = self.front, self.front.metrics
        state = front.state
        req = job.request
        reason = job.abort_reason()
        if reason is not Abort.NONE:  # dropped before it started: no collective spent on it
            metrics.cancelled(reason.label)
            job.fail(*_ABORT_ANSWER[reason])
            return None
        started = job.started = time.perf_counter()
        exchange(Control(Op.RUN, req.wire()), self.env)
        state.running = job
        try:
            result = self.engine.run(req, abort=lambda: self.vote(job))
        except Exception:
            # Peers may be stuck in a collective of this request: fail it, then leave non-zero;
            # the others exit on the process-group timeout.
            metrics.error(500)
            job.fail(500, f"{req.request_id} failed; the server is stopping")
            raise
        finally:
            state.running = None
        assert result is not None
        front.liveness.contact()
        for ms in result.step_latency_ms:
            state.step_times.observe_step(job.rows, ms / 1e3)
        if result.aborted is not Abort.NONE:
            status, message = _ABORT_ANSWER[result.aborted]
            metrics.cancelled(result.aborted.label)
            job.fail(status, f"{req.request_id} {message}; aborted after "
                             f"{len(result.step_latency_ms)} of {req.steps} steps")
            log.info("%s aborted (%s) after %d of %d steps", req.request_id,
                     result.aborted.label, len(result.step_latency_ms), req.steps)
            return None
        try:
            self.engine.save_output(result)
        except Exception:  # noqa: BLE001 - rank 0 alone: this request fails, the server serves on
            log.exception("%s: writing the output failed", req.request_id)
            metrics.error(500)
            job.fail(500, f"{req.request_id}: the output could not be written (details in the "
                          "server log)")
            return None
        now = time.perf_counter()
        result.queue_ms = round((started - job.received) * 1e3, 3)
        result.total_latency_ms = round((now - job.received) * 1e3, 3)
        state.step_times.observe_overhead("generate", max(0.0, now - started
                                                      - result.denoise_ms / 1e3))
        metrics.observe(now - job.received, result.tokens.used * req.steps,
                        result.denoise_ms / 1e3)
        job.finish(result)
        log.info("%s done: %d tokens x %d steps in %.1f ms", req.request_id, result.tokens.used,
                 req.steps, result.total_latency_ms)
        return result
