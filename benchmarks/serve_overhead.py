# SPDX-License-Identifier: Apache-2.0
"""Per-request serving overhead (HTTP, queue, broadcast, setup, finalize) vs one denoise step.

Starts ``launch/serve.py`` under torchrun (or talks to ``--url``), sends requests one at a time
and splits each request's client-side latency into:

    denoise     sum of the server's per-step latencies (the DiT forward passes)
    overhead    everything else = client end-to-end - denoise, itemised as
                http      client round trip outside the server's receipt->result window
                queue     receipt -> rank-0 loop picks the job
                broadcast request broadcast to all ranks (+ loop scheduling)
                setup     noise, cu_seqlens, RoPE tables, timer reset
                finalize  checksum all-gather (absorbs any rank skew at the end of the last
                          step: rank 0's step time ends when rank 0 finishes), phase totals

and reports median overhead as a share of one median denoise step (target <= 1%), plus the share
of a full-depth step (overhead / (per-layer step time x the config's full layer count)) when
``--layers`` cuts the model.

``--load 1,4,50`` then runs a bounded load (loopback only) at each number of concurrent clients,
each client on its own persistent connection: throughput, p50/p99 latency and errors (non-200
answers and connection errors, by kind).

    python -m benchmarks.serve_overhead --smoke                      # CPU, tiny, ~20 s
    python -m benchmarks.serve_overhead --load 1,4,50                # CPU, tiny, 4 ranks
    python -m benchmarks.serve_overhead --config configs/h3.toml --layers 1 --backend sage \\
        --nproc 4                                                    # H200 x4, one h3-ref layer

Writes ``benchmarks/results/serve_overhead_<config>_<hardware>_<date>.{json,md,png}`` with the
full config, versions, GPU name (or "cpu") and date.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import importlib.metadata
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from benchmarks.harness import collect_versions
from dist_attn.models.h3.serve.launch.process import is_loopback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = ["main"]

COMPONENTS = ("http", "queue", "broadcast", "setup", "finalize")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", help="TOML config (default: embedded tiny)")
    p.add_argument("--layers", type=int, help="H3 blocks to build (default: the config's)")
    p.add_argument("--backend", default=None, help="attention backend (auto, sage, sdpa, ...)")
    p.add_argument("--quality", default=None, help="quality tier passed to the server")
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks (default 4; 2 with --smoke); 1 runs without torchrun")
    p.add_argument("--steps", type=int, default=1, help="denoise steps per request")
    p.add_argument("--frames", type=int, default=None,
                   help="request frames (default: the config's default request)")
    p.add_argument("--height", type=int, default=None, help="request height in pixels")
    p.add_argument("--width", type=int, default=None, help="request width in pixels")
    p.add_argument("--requests", type=int, default=30, help="measured requests")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured requests first")
    p.add_argument("--url", help="measure an already running server instead of starting one")
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="output folder (default benchmarks/results; with --smoke a fresh temp "
                        "folder, as every benchmark's smoke)")
    p.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds to wait for the server (H3 weights init on 4 GPUs takes a while)")
    p.add_argument("--smoke", action="store_true",
                   help="quick CPU check: tiny config, 2 ranks, 5 requests, 1 warm-up")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument passed to launch/serve.py (repeatable)")
    p.add_argument("--load", default="",
                   help="comma-separated client counts for the load run (e.g. 1,4,50; empty: none)")
    p.add_argument("--load-requests", type=int, default=200,
                   help="requests per load level (all clients together)")
    p.add_argument("--load-seconds", type=float, default=30.0,
                   help="time bound of one load level")
    p.add_argument("--label", default="", help="tag in the result name (e.g. 'before')")
    args = p.parse_args()
    if args.smoke:
        args.config, args.requests, args.warmup = None, 5, 1
        args.nproc = args.nproc or 2
    args.nproc = args.nproc or 4
    if args.out_dir is None:
        args.out_dir = (tempfile.mkdtemp(prefix="dist_attn_bench_smoke_") if args.smoke
                        else os.path.join(ROOT, "benchmarks", "results"))
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 3600
          ) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    serve = [os.path.join(ROOT, "launch", "serve.py"), "--port", str(port),
             "--log-level", "WARNING"]
    for flag, value in (("--config", args.config), ("--layers", args.layers),
                        ("--backend", args.backend), ("--quality", args.quality)):
        if value is not None:
            serve += [flag, str(value)]
    serve += args.serve_arg
    if args.nproc == 1:
        cmd = [sys.executable, *serve]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), *serve]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    print("starting:", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)


def _wait_health(base: str, proc: subprocess.Popen | None, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before becoming healthy")
        try:
            status, body = _http("GET", base + "/health", timeout=5)
            if status == 200:
                return json.loads(body)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"server not healthy after {timeout} s")
        time.sleep(0.5)


class _Client:
    """One persistent HTTP/1.1 connection, as a production client keeps: connection set-up is
    not a per-request cost of the server."""

    def __init__(self, base: str) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.conn = http.client.HTTPConnection(host, int(port or 80), timeout=3600)

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        return resp.status, resp.read()


def _one(client: _Client, payload: dict[str, Any]) -> dict[str, Any]:
    body = json.dumps(payload).encode()
    t0 = time.perf_counter()
    status, raw = client.post("/v1/generate", body)
    e2e = (time.perf_counter() - t0) * 1e3
    if status != 200:
        raise SystemExit(f"request failed ({status}): {raw[:500]!r}")
    r = json.loads(raw)
    broadcast = r["total_latency_ms"] - r["queue_ms"] - r["run_ms"]
    return {
        "e2e_ms": e2e,
        "denoise_ms": r["denoise_ms"],
        "step_ms": r["step_latency_ms"],
        "overhead_ms": e2e - r["denoise_ms"],
        "http": e2e - r["total_latency_ms"],
        "queue": r["queue_ms"],
        "broadcast": broadcast,
        "setup": r["setup_ms"],
        "finalize": r["finalize_ms"],
        "attention_share": r["attention_share"],
        "all_to_all_share": r["all_to_all_share"],
        "tokens": r["tokens"],
        "backend": r["backend"],
        "world_size": r["world_size"],
    }


def _versions() -> dict[str, Any]:
    out = collect_versions()
    for pkg in ("starlette", "uvicorn", "prometheus-client"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def _load_level(base: str, payload: dict[str, Any], clients: int, requests: int,
                seconds: float) -> dict[str, Any]:
    """``clients`` threads, one persistent connection each, share ``requests`` requests within
    ``seconds``; returns throughput, latency percentiles and errors by kind."""
    lock = threading.Lock()
    left = [requests]
    latencies: list[float] = []
    errors: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    body = json.dumps(payload).encode()

    def client() -> None:
        conn = _Client(base)
        while time.monotonic() < deadline:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            t0 = time.perf_counter()
            try:
                status, _ = conn.post("/v1/generate", body)
                kind = None if status == 200 else f"http_{status}"
            except (OSError, http.client.HTTPException) as e:
                kind = type(e).__name__
                conn = _Client(base)
            with lock:
                if kind is None:
                    latencies.append((time.perf_counter() - t0) * 1e3)
                else:
                    errors[kind] = errors.get(kind, 0) + 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    wall = time.perf_counter() - t0
    lat = sorted(latencies)
    pct = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else None  # noqa: E731
    return {"clients": clients, "ok": len(lat), "errors": errors,
            "error_count": sum(errors.values()), "wall_s": wall,
            "throughput_rps": len(lat) / wall if wall else 0.0,
            "p50_ms": pct(0.50), "p99_ms": pct(0.99), "max_ms": lat[-1] if lat else None}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def main() -> int:
    args = _parse()
    from dist_attn.models.h3.serve.config import apply_overrides, load_config

    cfg = load_config(args.config)
    full_layers = cfg.model.num_layers
    overrides: dict[str, Any] = {}
    if args.layers is not None:
        overrides["model.num_layers"] = args.layers
    if args.backend is not None:
        overrides["runtime.backend"] = args.backend
    cfg = apply_overrides(cfg, overrides) if overrides else cfg

    proc = None
    if args.url:
        base = args.url.rstrip("/")
        host = base.removeprefix("http://").rsplit(":", 1)[0].strip("[]")
        if not is_loopback(host):
            raise SystemExit(f"--url {args.url}: this benchmark sends load to loopback "
                             "addresses only")
    else:
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        proc = _start_server(args, port)
    try:
        health = _wait_health(base, proc, args.startup_timeout)
        payload: dict[str, Any] = {"steps": args.steps, "seed": 0}
        payload.update({k: getattr(args, k) for k in ("frames", "height", "width")
                        if getattr(args, k) is not None})
        client = _Client(base)
        for _ in range(args.warmup):
            _one(client, payload)
        runs = [_one(client, {**payload, "seed": i}) for i in range(args.requests)]
        load = [_load_level(base, payload, int(c), args.load_requests, args.load_seconds)
                for c in args.load.split(",") if c.strip()]
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)

    med = lambda key: statistics.median(r[key] for r in runs)  # noqa: E731
    step_ms = statistics.median(s for r in runs for s in r["step_ms"])
    overhead_ms = med("overhead_ms")
    layers = cfg.model.num_layers
    summary = {
        "median_step_ms": step_ms,
        "median_overhead_ms": overhead_ms,
        "overhead_share_of_step": overhead_ms / step_ms,
        "overhead_share_of_request": overhead_ms / med("e2e_ms"),
        # a cut model (--layers) has a proportionally shorter step; scale to the full depth
        "full_depth_layers": full_layers,
        "overhead_share_of_full_depth_step": overhead_ms / (step_ms / layers * full_layers),
        "median_components_ms": {k: med(k) for k in COMPONENTS},
        "median_e2e_ms": med("e2e_ms"),
        "attention_share": med("attention_share"),
        "all_to_all_share": med("all_to_all_share"),
        "target_share": 0.01,
    }
    summary["meets_target"] = summary["overhead_share_of_step"] <= summary["target_share"]
    device = health.get("device", "cpu")
    world = runs[0]["world_size"]
    now = datetime.datetime.now(datetime.timezone.utc)
    hw = f"{_slug(device)}x{world}"
    label = f"-{_slug(args.label)}" if args.label else ""
    name = f"serve_overhead_{_slug(cfg.model.name)}-{layers}l{label}_{hw}_{now:%Y%m%d-%H%M%S}"
    result = {
        "benchmark": "serve_overhead",
        "date": now.isoformat(timespec="seconds"),
        "device": device,
        "world_size": world,
        "backend": runs[0]["backend"],
        "tokens": runs[0]["tokens"],
        "steps_per_request": args.steps,
        "requests": args.requests,
        "warmup": args.warmup,
        "smoke": args.smoke,
        "host": platform.node(),
        "versions": _versions(),
        "config": cfg.to_dict(),
        "server_info": health,
        "label": args.label,
        "summary": summary,
        "load": load,
        "runs": runs,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, name)
    with open(stem + ".json", "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    md = _markdown(result)
    with open(stem + ".md", "w", encoding="utf-8") as f:
        f.write(md)
    _plot(result, stem + ".png")
    print(md)
    print(f"wrote {stem}.json/.md/.png")
    return 0


def _markdown(res: dict[str, Any]) -> str:
    s = res["summary"]
    c = s["median_components_ms"]
    tok = res["tokens"]
    lines = [
        f"# Serving overhead: {res['config']['model']['name']}, "
        f"{res['config']['model']['num_layers']} layer(s), {res['device']} x{res['world_size']}",
        "",
        f"{res['date']}; backend {res['backend']}; {tok['used']} used / {tok['total']} packed "
        f"rows; {res['steps_per_request']} step(s) per request; median of {res['requests']} "
        f"requests after {res['warmup']} warm-up, one persistent HTTP/1.1 connection; torch {res['versions'].get('torch')}; "
        f"commit {res['versions'].get('dist_attn_commit')}.",
        "",
        "| quantity | median |",
        "|---|---|",
        f"| one denoise step | {s['median_step_ms']:.3f} ms |",
        f"| request end to end (client) | {s['median_e2e_ms']:.3f} ms |",
        f"| **serving overhead per request** | **{s['median_overhead_ms']:.3f} ms** |",
        *(f"| &nbsp; {k} | {c[k]:.3f} ms |" for k in COMPONENTS),
        "| &nbsp; (medians of the parts need not add up to the median of the whole) | |",
        f"| overhead / one step (target <= 1%) | **{100 * s['overhead_share_of_step']:.2f}%** "
        f"({'meets' if s['meets_target'] else 'misses'} target) |",
        f"| overhead / one full-depth step ({s['full_depth_layers']} layers, scaled) | "
        f"{100 * s['overhead_share_of_full_depth_step']:.3f}% |",
        f"| overhead / whole request | {100 * s['overhead_share_of_request']:.2f}% |",
        f"| attention share of a step | {100 * s['attention_share']:.1f}% |",
        f"| all-to-all share of a step | {100 * s['all_to_all_share']:.1f}% |",
        "",
    ]
    if res["load"]:
        lines += ["## Load (one persistent connection per client, loopback)", "",
                  "| clients | served | errors | throughput | p50 | p99 | max |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {x['clients']} | {x['ok']} | {x['error_count']} {x['errors'] or ''} | "
                  f"{x['throughput_rps']:.1f} req/s | {x['p50_ms'] or 0:.1f} ms | "
                  f"{x['p99_ms'] or 0:.1f} ms | {x['max_ms'] or 0:.1f} ms |" for x in res["load"]]
        lines.append("")
    return "\n".join(lines)


def _plot(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = res["summary"]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4))
    comps = s["median_components_ms"]
    left = 0.0
    for k in COMPONENTS:
        ax1.barh(["overhead"], [comps[k]], left=left, label=k)
        left += comps[k]
    ax1.barh(["one step"], [s["median_step_ms"]], color="grey", label="denoise step")
    ax1.set_xlabel("ms (median)")
    ax1.set_title("serving overhead per request vs one step")
    ax1.legend(fontsize=8, loc="lower right")
    shares = [100 * r["overhead_ms"] / statistics.median(r["step_ms"]) for r in res["runs"]]
    ax2.plot(range(len(shares)), shares, "o-", ms=3)
    ax2.axhline(100 * s["target_share"], color="red", ls="--", label="target 1%")
    ax2.set_xlabel("request")
    ax2.set_ylabel("overhead / step (%)")
    ax2.set_title("per request")
    ax2.legend(fontsize=8)
    if res["load"]:
        clients = [x["clients"] for x in res["load"]]
        ax3.plot(clients, [x["p50_ms"] or 0 for x in res["load"]], "o-", label="p50")
        ax3.plot(clients, [x["p99_ms"] or 0 for x in res["load"]], "s-", label="p99")
        ax3.set_xscale("log")
        ax3.set_xlabel("concurrent clients")
        ax3.set_ylabel("latency (ms)")
        for x in res["load"]:
            ax3.annotate(f"{x['throughput_rps']:.0f} req/s, {x['error_count']} err",
                         (x["clients"], x["p99_ms"] or 0), fontsize=7)
        ax3.legend(fontsize=8)
    ax3.set_title("load")
    fig.suptitle(f"{res['config']['model']['name']} x{res['config']['model']['num_layers']} "
                 f"layers, {res['device']} x{res['world_size']}, {res['backend']}, "
                 f"{res['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
