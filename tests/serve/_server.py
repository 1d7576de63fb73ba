# SPDX-License-Identifier: Apache-2.0
"""Helpers of the serve tests: launching the server under torchrun on loopback, talking to it,
and reading what it left behind. Every wait is bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Iterator

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import ROOT, free_port, subprocess_env

SERVE = os.path.join(ROOT, "launch", "serve.py")
# Start-up of 4 ranks importing torch on a loaded 2-core CI box takes ~15 s; allow 8x.
STARTUP_S = 120


def torchrun(n: int, *args: str) -> list[str]:
    """The command line of ``launch/serve.py`` on ``n`` ranks of one host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), SERVE, *args]


def run(cmd: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def http(method: str, url: str, body: bytes | None = None, *, timeout: float = 60,
         headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    """(status, body, headers) of one request; HTTP errors are answers, not exceptions."""
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(), dict(e.headers)


def metric_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v"}': value} (labels in their exposition order)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


class Server:
    """A running ``torchrun ... launch/serve.py`` (its own session: ``pgid`` holds every rank)."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: str) -> None:
        self.proc, self.port, self.log_path = proc, port, log_path
        self.base = f"http://127.0.0.1:{port}"
        self._seen: set[int] = set()  # rank pids ever found: killed at the end even if orphaned

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def wait_healthy(self, timeout: float = STARTUP_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                status, body, _ = http("GET", self.base + "/health", timeout=5)
                if status == 200:
                    return json.loads(body)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.3)

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the rank processes (children of the torchrun agent)."""
        pids = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                if ppid != self.proc.pid:
                    continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            except (OSError, IndexError, ValueError):
                continue
            if b"RANK" in env:
                pids[int(env[b"RANK"])] = int(entry)
        self._seen.update(pids.values())
        return pids

    def wait_gone(self, pids: list[int], timeout: float) -> float:
        """Seconds until none of ``pids`` is alive; fails the test past ``timeout``."""
        t0 = time.monotonic()
        while any(_alive(p) for p in pids):
            assert time.monotonic() - t0 < timeout, (
                f"ranks {[p for p in pids if _alive(p)]} still alive after {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - t0

    def kill(self) -> None:
        """Ends every process of the job (the agent's session)."""
        self.rank_pids()
        for pid in [*self._seen, self.proc.pid]:
            try:
                os.kill(pid, signal.SIGCONT)  # a stopped rank cannot die of SIGTERM
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def server(tmp_path, world: int, *args: str, **env: str) -> Iterator[Server]:
    """Starts the server on a free loopback port and yields it once healthy; kills whatever is
    left of it afterwards."""
    port = free_port()
    log_path = str(tmp_path / f"server-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(torchrun(world, "--port", str(port), *args), cwd=ROOT,
                                env=subprocess_env(**env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server(proc, port, log_path)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.kill()
