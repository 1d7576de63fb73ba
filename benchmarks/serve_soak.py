# SPDX-License-Identifier: Apache-2.0
"""Load and soak of the jobs API on loopback: N concurrent video-job submissions, then status polls
at a fixed rate for a fixed time while the jobs run, with the server's memory sampled throughout.

    python -m benchmarks.serve_soak                  # CPU, 4 ranks, 3 + 50 jobs, 200 polls/s, 60 s
    python -m benchmarks.serve_soak --smoke          # CI: 2 ranks, 3 + 4 jobs, 50 polls/s, 3 s

Starts ``launch/serve.py --nproc-per-node N`` (torchrun under the supervisor; the tiny H3
pipeline unless ``--video-runner`` says otherwise) on a free loopback port with a fresh output directory, and measures:

- submissions: all ``--jobs`` POSTs released at once from their own threads; each must be 202
  (``jobs.max_queued`` is raised above ``--jobs``); latency p50/p99/max;
- polls: ``--poll-rate`` GET /v1/videos/{id} per second over ``--poll-threads`` persistent
  connections, each paced to its share, for ``--seconds``; any answer but 200 and any connection
  error is an error, by kind; achieved rate; latency p50/p99/max;
- RSS: every ``--rss-every-s`` the resident set of every server process (agent and ranks, from
  /proc), for the plot; and the verdict "flat", which compares rank 0 at rest twice: after
  ``--warmup-jobs`` jobs have run (the first jobs pay the one-time costs: codec, allocators,
  buffers), and after the soak's jobs have all finished. Each "at rest" is the median of
  five samples 0.2 s apart with no job queued or running. A leak raises the second; a job's
  transient peak (a decode, an MP4 being written) or the first job's start-up raises neither.
  Comparing samples taken while jobs ran failed the 3 s smoke on start-up alone: 79-84 MB of
  "growth" in 2 of 4 runs on a 2-core machine (one CI run, one of 3 runs here), with only four
  samples in it. At rest, on the tiny
  pipeline (2 ranks, 2-step jobs), rank 0 steps up once by about 22 MB between its first and its
  third job, or later under load (1 of 6 smokes run two at a time), then stays within 2 MB: +22
  MB after 4 jobs and +23 MB after 12 with one warm-up job; +1.6 MB after 12 with three. The
  bound, 64 MB, sits above that one step. When the jobs do not all finish within ``--drain-s``,
  memory is not judged and the run fails;
- jobs: how many reached each status by the end (the warm-up jobs are not counted).

Every request goes to 127.0.0.1. The run stops itself: the warm-up, ``--seconds`` of polling, then
at most ``--drain-s`` waiting for the jobs, then SIGTERM to the server.

Writes ``benchmarks/results/serve-soak_<hardware>_<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import atexit
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from benchmarks.harness import (ResultWriter, add_common_args, int_at_least, markdown_table,
                                refuse_unhonoured, smoke_values)
from dist_attn.models.h3.serve.launch.process import set_parent_death_signal
from dist_attn.models.h3.serve.launch.supervise import rank_pids

THEME = "serve-soak"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    """Stops the server on every way out of the driver (an error, a SystemExit): SIGTERM, then
    SIGKILL to its process group after 60 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _at_rest_mb(pid: int, samples: int = 5, every_s: float = 0.2) -> float | None:
    """The median of a few RSS samples of ``pid`` (MB), taken while no job runs."""
    got = []
    for _ in range(samples):
        mb = _rss_mb(pid)
        if mb is not None:
            got.append(mb)
        time.sleep(every_s)
    return _pct(got, 0.5)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class _Conn:
    """One persistent HTTP/1.1 connection (reopened after an error)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        try:
            self.c.request(method, path, body=body,
                           headers={"Content-Type": "application/json"} if body else {})
            r = self.c.getresponse()
            return r.status, r.read()
        except Exception:
            self.c.close()
            self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            raise


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--jobs", type=int, default=50, help="concurrent job submissions")
    p.add_argument("--steps", type=int, default=4, help="denoise steps per job")
    p.add_argument("--poll-rate", type=float, default=200.0, help="status polls per second")
    p.add_argument("--poll-threads", type=int, default=8)
    p.add_argument("--seconds", type=float, default=60.0, help="polling time")
    p.add_argument("--rss-every-s", type=float, default=1.0)
    p.add_argument("--drain-s", type=float, default=300.0,
                   help="after polling, wait up to this long for the jobs to finish (memory is "
                        "judged only once they have)")
    p.add_argument("--warmup-jobs", type=int_at_least(1), default=3,
                   help="jobs run to completion before the soak; rank 0's RSS at rest after them "
                        "is the baseline of 'flat' (at least 1: without one the baseline would "
                        "include the first job's start-up)")
    p.add_argument("--video-runner", default="h3", choices=("h3", "synthetic"))
    p.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                   help="'flat': rank 0's RSS at rest rises less than this from after the warm-up "
                        "to after the soak")
    add_common_args(p, iters=1, warmup=0, budget_s=0)
    args = p.parse_args()
    refuse_unhonoured(p, args, device_unused=True, no_budget=True)
    smoke_values(p, args, nproc=2, jobs=4, poll_rate=50.0, seconds=3.0, poll_threads=4, steps=2)
    out_dir = tempfile.mkdtemp(prefix="dist_attn_soak_")
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # Under the supervisor (launch/serve.py --nproc-per-node): a SIGTERM at the end drains and
    # the job exits 0, which the result records (torchrun alone would exit 1).
    cmd = [sys.executable, os.path.join(_ROOT, "launch", "serve.py"), "--nproc-per-node",
           str(args.nproc), "--port", str(port),
           "--output-dir", out_dir, "--video-runner", args.video_runner,
           "--set", f"jobs.max_queued={max(256, 2 * args.jobs)}"]
    log_path = os.path.join(out_dir, "server.log")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=set_parent_death_signal)
    # The server goes down with this driver on every way out: atexit on an error or SystemExit
    # here, the parent-death SIGTERM (a drain) when the driver itself is killed.
    atexit.register(_stop, proc)
    base = _Conn(port)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}; see {log_path}")
        try:
            if base.call("GET", "/health")[0] == 200:
                break
        except Exception:  # noqa: BLE001 - not listening yet
            pass
        if time.monotonic() > deadline:
            raise SystemExit("server did not become healthy in 300 s")
        time.sleep(0.3)
    agent = _children(proc.pid)[0]
    ranks = rank_pids(agent)
    pids = [agent, *(ranks[r] for r in sorted(ranks))]  # the torchrun agent, then ranks 0, 1, ...
    rss: list[dict[str, Any]] = []
    stop_rss = threading.Event()
    t_start = time.monotonic()

    def sample_rss() -> None:
        while not stop_rss.is_set():
            rss.append({"t": round(time.monotonic() - t_start, 2),
                        "mb": {str(pid): _rss_mb(pid) for pid in pids}})
            stop_rss.wait(args.rss_every_s)

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    rank0 = ranks[0]

    def job_body(i: int) -> bytes:
        return json.dumps({"prompt": f"soak job {i}: a lighthouse at dusk", "steps": args.steps,
                           "seed": i}).encode()

    def at_rest(limit_s: float) -> bool:
        """Waits up to ``limit_s`` until no job is queued or running."""
        stop_at = time.monotonic() + limit_s
        while True:
            queued = json.loads(base.call("GET", "/v1/videos?status=queued&limit=1")[1])
            running = json.loads(base.call("GET", "/v1/videos?status=running&limit=1")[1])
            if not queued["data"] and not running["data"]:
                return True
            if time.monotonic() >= stop_at:
                return False
            time.sleep(0.5)

    # 0. warm-up: the first jobs pay the one-time costs
    warm_ids = []
    for i in range(args.warmup_jobs):
        status, data = base.call("POST", "/v1/videos", job_body(args.jobs + i))
        if status != 202:
            raise SystemExit(f"the warm-up job was answered {status}: {data[:300]!r}; see {log_path}")
        warm_ids.append(json.loads(data)["id"])
    if not at_rest(max(args.drain_s, 60.0)):
        raise SystemExit(f"the warm-up jobs did not finish; see {log_path}")
    for job in warm_ids:
        status = json.loads(base.call("GET", f"/v1/videos/{job}")[1])["status"]
        if status != "succeeded":
            raise SystemExit(f"warm-up job {job} ended {status!r}; see {log_path}")
    rest_before = _at_rest_mb(rank0)
    t_soak = round(time.monotonic() - t_start, 2)

    # 1. concurrent submissions
    ids: list[str] = []
    sub_ms: list[float] = []
    sub_errors: dict[str, int] = {}
    lock = threading.Lock()
    gate = threading.Barrier(args.jobs)

    def submit(i: int) -> None:
        conn = _Conn(port)
        body = job_body(i)
        gate.wait()
        t0 = time.perf_counter()
        try:
            status, data = conn.call("POST", "/v1/videos", body)
            kind = None if status == 202 else f"http {status}"
        except Exception as e:  # noqa: BLE001 - counted
            kind, data = type(e).__name__, b""
        ms = (time.perf_counter() - t0) * 1e3
        with lock:
            sub_ms.append(ms)
            if kind is None:
                ids.append(json.loads(data)["id"])
            else:
                sub_errors[kind] = sub_errors.get(kind, 0) + 1

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(args.jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)

    # 2. polls at a fixed rate
    poll_ms: list[float] = []
    poll_errors: dict[str, int] = {}
    polls = [0]
    end = time.monotonic() + args.seconds
    per_thread = args.poll_rate / args.poll_threads

    def poll(seed: int) -> None:
        conn, rng = _Conn(port), random.Random(seed)
        period, nxt = 1.0 / per_thread, time.monotonic()
        while True:
            now = time.monotonic()
            if now >= end:
                return
            if now < nxt:
                time.sleep(nxt - now)
            nxt += period
            job = rng.choice(ids) if ids else "none"
            t0 = time.perf_counter()
            try:
                status, _ = conn.call("GET", f"/v1/videos/{job}")
                kind = None if status == 200 else f"http {status}"
            except Exception as e:  # noqa: BLE001 - counted
                kind = type(e).__name__
            ms = (time.perf_counter() - t0) * 1e3
            with lock:
                polls[0] += 1
                poll_ms.append(ms)
                if kind is not None:
                    poll_errors[kind] = poll_errors.get(kind, 0) + 1

    t_poll = time.monotonic()
    pollers = [threading.Thread(target=poll, args=(i,)) for i in range(args.poll_threads)]
    for t in pollers:
        t.start()
    for t in pollers:
        t.join(args.seconds + 60)
    poll_s = time.monotonic() - t_poll
    base = _Conn(port)  # the first one sat idle past serve.idle_timeout_s and was closed
    drained = at_rest(args.drain_s)
    rest_after = _at_rest_mb(rank0) if drained else None
    stop_rss.set()
    sampler.join(5)
    statuses: dict[str, int] = {}
    step_s: list[float] = []
    totals: list[float] = []
    for job in ids:
        rec = json.loads(base.call("GET", f"/v1/videos/{job}")[1])
        statuses[rec["status"]] = statuses.get(rec["status"], 0) + 1
        if rec["status"] == "succeeded":
            step_s += rec["timings"]["step_s"]
            totals.append(rec["timings"]["total"])
    metrics = base.call("GET", "/metrics")[1].decode()
    _stop(proc)
    log.close()

    series = [s["mb"][str(rank0)] for s in rss if s["mb"].get(str(rank0)) is not None]
    growth = (rest_after - rest_before
              if rest_after is not None and rest_before is not None else None)
    summary = {
        "submissions": args.jobs, "accepted": len(ids), "submit_errors": sub_errors,
        "submit_p50_ms": _pct(sub_ms, 0.5), "submit_p99_ms": _pct(sub_ms, 0.99),
        "submit_max_ms": max(sub_ms) if sub_ms else None,
        "polls": polls[0], "poll_rate_achieved": polls[0] / poll_s if poll_s else 0.0,
        "poll_errors": poll_errors, "poll_p50_ms": _pct(poll_ms, 0.5),
        "poll_p99_ms": _pct(poll_ms, 0.99), "poll_max_ms": max(poll_ms) if poll_ms else None,
        "jobs_by_status": statuses, "median_step_s": _pct(step_s, 0.5),
        "median_job_s": _pct(totals, 0.5),
        "drained": drained,
        "rss_rank0_start_mb": series[0] if series else None,
        "rss_rank0_peak_mb": max(series) if series else None,
        "rss_rank0_at_rest_after_warmup_mb": rest_before,
        "rss_rank0_at_rest_after_soak_mb": rest_after,
        "rss_rank0_growth_at_rest_mb": growth,
        "rss_flat": growth is not None and growth < args.max_rss_growth_mb,
        "errors": sum(sub_errors.values()) + sum(poll_errors.values()),
        "server_exit": proc.returncode,
    }
    config = {k: getattr(args, k) for k in ("nproc", "jobs", "steps", "poll_rate", "poll_threads",
                                            "seconds", "rss_every_s", "drain_s", "warmup_jobs",
                                            "video_runner",
                                            "max_rss_growth_mb", "smoke")}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=torch.device("cpu"),
                          title="Jobs API load and soak (loopback)")
    writer.payload["rows"] = [{"status": "ok", "total_ms": poll_s * 1e3, **summary}]
    writer.payload["summary"] = summary
    writer.payload["rss"] = rss
    writer.payload["pids"] = {"agent": pids[0], "ranks": pids[1:]}
    writer.payload["warmup_done_t"] = t_soak
    writer.payload["metrics_tail"] = [ln for ln in metrics.splitlines()
                                      if ln.startswith("dist_attn_video_jobs")]
    rows = [{"what": k, "value": json.dumps(v) if isinstance(v, dict) else v}
            for k, v in summary.items()]
    table = markdown_table(rows, [("what", "measure", ""), ("value", "value", ".4g")])

    def plot(plt):
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8))
        for pid in map(str, pids):
            pts = [(s["t"], s["mb"].get(pid)) for s in rss if s["mb"].get(pid) is not None]
            label = "agent" if pid == str(pids[0]) else f"rank {pids.index(int(pid)) - 1}"
            a.plot([t for t, _ in pts], [m for _, m in pts], label=label)
        a.set_xlabel("s since healthy")
        a.set_ylabel("RSS (MB)")
        a.axvline(t_soak, color="grey", linestyle=":", label="warm-up done")
        a.legend(fontsize=7)
        a.set_title("server memory")
        b.hist(poll_ms, bins=50)
        b.set_xlabel("status poll latency (ms)")
        b.set_title(f"{polls[0]} polls, {summary['poll_rate_achieved']:.0f}/s")

    paths = writer.finish(plot, [("Summary", table)])
    print(table)
    print(f"wrote {paths['md']}")
    return 0 if summary["errors"] == 0 and summary["rss_flat"] else 1


if __name__ == "__main__":
    sys.exit(main())
