# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics of the server (``/metrics``), through prometheus_client.

Each server owns its own registry, so several servers (tests) never share counters.
"""

from __future__ import annotations

import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["Metrics", "CONTENT_TYPE"]

#: The Content-Type of :meth:`Metrics.render`.
CONTENT_TYPE = CONTENT_TYPE_LATEST

# A tiny CPU request takes ~20 ms, one h3-ref step on 4 H200s ~1 s and a 50-step request ~1 min.
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
            600.0)


class Metrics:
    """Counters and gauges of one server; thread-safe (prometheus_client locks each metric)."""

    def __init__(self, queue_depth: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self._requests = Counter("dist_attn_requests", "Generate requests served successfully.",
                                 registry=r)
        self._errors = Counter("dist_attn_request_errors",
                               "Generate requests rejected or failed, by HTTP status.", ["code"],
                               registry=r)
        self._cancelled = Counter("dist_attn_requests_cancelled",
                                  "Requests dropped from the queue or aborted between denoise "
                                  "steps, by reason (not counted as served).", ["reason"],
                                  registry=r)
        self._latency = Histogram("dist_attn_request_latency_seconds",
                                  "Server-side latency of served requests, receipt to result.",
                                  buckets=_BUCKETS, registry=r)
        self._tokens = Counter("dist_attn_tokens",
                               "Packed token-steps denoised (used rows x steps).", registry=r)
        self._tps = Gauge("dist_attn_tokens_per_second",
                          "Token-steps per second of denoising, over all requests.", registry=r)
        self._last_tps = Gauge("dist_attn_last_request_tokens_per_second",
                               "Token-steps per second of the last request.", registry=r)
        queue = Gauge("dist_attn_queue_depth", "Requests waiting for the rank-0 loop.",
                      registry=r)
        queue.set_function(queue_depth)
        self._ready = Gauge("dist_attn_ready",
                            "1 when every rank answered within runtime.health_timeout_s.",
                            registry=r)
        self._step = Histogram("dist_attn_denoise_step_seconds",
                               "Seconds per denoise step, by kind of job (generate, video).",
                               ["kind"], buckets=_BUCKETS, registry=r)
        self._videos_submitted = Counter("dist_attn_video_jobs_submitted",
                                         "Video jobs accepted (202).", registry=r)
        self._videos_finished = Counter("dist_attn_video_jobs_finished",
                                        "Video jobs that reached a final status, by status.",
                                        ["status"], registry=r)
        self._video_phase = Histogram("dist_attn_video_phase_seconds",
                                      "Seconds per phase of a succeeded video job (text_encode, "
                                      "denoise, decode_video, decode_audio, mux, queue, total).",
                                      ["phase"], buckets=_BUCKETS, registry=r)
        self._lock = threading.Lock()
        self._tokens_total = 0
        self._denoise_s_total = 0.0

    def observe(self, latency_s: float, tokens: int, denoise_s: float) -> None:
        """Records one served request: end-to-end latency and the token-steps it denoised."""
        self._requests.inc()
        self._latency.observe(latency_s)
        self._tokens.inc(tokens)
        with self._lock:
            self._tokens_total += tokens
            self._denoise_s_total += denoise_s
            if self._denoise_s_total > 0:
                self._tps.set(self._tokens_total / self._denoise_s_total)
        self._last_tps.set(tokens / denoise_s if denoise_s > 0 else 0.0)

    def error(self, status: int) -> None:
        """Records one rejected or failed request by HTTP status."""
        self._errors.labels(code=str(status)).inc()

    def cancelled(self, reason: str) -> None:
        """Records one request dropped or aborted (``reason``: an Abort label)."""
        self._cancelled.labels(reason=reason).inc()

    def observe_step(self, kind: str, seconds: float) -> None:
        """One denoise step of a ``kind`` job took ``seconds``."""
        self._step.labels(kind=kind).observe(seconds)

    def video_submitted(self) -> None:
        self._videos_submitted.inc()

    def video_finished(self, status: str, phases: dict[str, float] | None = None) -> None:
        """A video job reached ``status``; ``phases`` (seconds) of a succeeded one."""
        self._videos_finished.labels(status=status).inc()
        for phase, seconds in (phases or {}).items():
            self._video_phase.labels(phase=phase).observe(seconds)

    def watch_jobs(self, counts: Callable[[], dict[str, int]]) -> None:
        """Publishes ``dist_attn_video_jobs{status}`` and ``dist_attn_video_queue_depth`` from
        ``counts()`` (the job store's counts per status) at every scrape."""
        self.registry.register(_JobsCollector(counts))

    def set_ready(self, ready: bool) -> None:
        """Publishes the health verdict."""
        self._ready.set(1 if ready else 0)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _JobsCollector:
    """Reads the job store at scrape time (the store, not a counter, knows what survived a
    restart)."""

    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def describe(self) -> list:
        return []  # registered unchecked: collect() reads the store at scrape time

    def collect(self):
        counts = self._counts()
        jobs = GaugeMetricFamily("dist_attn_video_jobs", "Video jobs in the store, by status.",
                                 labels=["status"])
        for status, n in counts.items():
            jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily("dist_attn_video_queue_depth", "Video jobs waiting to run.",
                                value=counts.get("queued", 0))
