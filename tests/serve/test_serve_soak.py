# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_soak.py --smoke: the bounded version of the 60 s soak (2 CPU ranks, three
warm-up jobs, then 4 concurrent job submissions and 50 status polls/s for 3 s, loopback): no error,
every job accepted and finished, the poll rate held, rank 0's memory at rest flat from after the
warm-up to after the soak, the job exits 0 under the supervisor. And the driver leaves no server
behind when it fails or is killed."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("av")

from tests.conftest import ROOT, subprocess_env  # noqa: E402
from tests.serve._server import STARTUP_S, _alive  # noqa: E402


def test_soak_smoke(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_soak", "--smoke", "--drain-s",
                          "30", "--out", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=STARTUP_S + 120)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    [path] = glob.glob(str(tmp_path / "serve-soak_cpu_*.json"))
    with open(path) as f:
        s = json.load(f)["summary"]
    assert s["errors"] == 0 and s["submit_errors"] == {} and s["poll_errors"] == {}, s
    assert s["accepted"] == s["submissions"] == 4
    assert s["jobs_by_status"] == {"succeeded": 4}, s
    assert s["poll_rate_achieved"] > 0.8 * 50 and s["polls"] > 0.8 * 50 * 3
    assert s["drained"] and s["rss_rank0_at_rest_after_soak_mb"] is not None, s
    assert s["rss_flat"] and s["server_exit"] == 0, s
    for ext in (".md", ".png"):
        assert os.path.getsize(path.removesuffix(".json") + ext) > 0


def _servers_of(marker: str) -> list[int]:
    """Pids of live processes whose command line contains ``marker`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _still_alive(pids: list[int], timeout_s: float) -> list[int]:
    """Those of ``pids`` still alive (not zombies) after waiting up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def test_a_failed_or_killed_driver_leaves_no_server(tmp_path):
    """Soak runs that failed in their warm-up left live servers (six were found on one machine);
    a driver killed by a timeout would too. Refused warm-up (steps above the tiny config's
    serve.max_steps): the driver exits 1 and its server is gone. Driver killed with SIGKILL once
    its server serves: the server drains and exits on the parent-death signal."""
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_soak", "--nproc", "2",
                          "--jobs", "1", "--seconds", "1", "--steps", "100000", "--out",
                          str(tmp_path)], cwd=ROOT, env=subprocess_env(), capture_output=True,
                         text=True, timeout=STARTUP_S + 120)
    assert res.returncode == 1 and "the warm-up job was answered 413" in res.stderr, res.stderr[-2000:]
    out_dir = re.search(r"see (/\S+)/server\.log", res.stderr).group(1)
    assert _still_alive(_servers_of(out_dir), 5) == []

    driver = subprocess.Popen([sys.executable, "-m", "benchmarks.serve_soak", "--smoke",
                               "--out", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = "dist_attn_soak_"
    try:
        deadline = time.monotonic() + STARTUP_S + 60
        # the supervisor, the agent and 2 ranks, all carrying the driver's output directory
        while len(servers := [p for p in _servers_of(marker) if _descends_from(p, driver.pid)]) < 4:
            assert time.monotonic() < deadline and driver.poll() is None, "no server tree started"
            time.sleep(0.5)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
    alive = _still_alive(servers, 60)
    assert alive == [], f"server processes {alive} outlived their killed driver"


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid and pid > 1:
        pid = _ppid(pid)
        if pid == ancestor:
            return True
    return False
