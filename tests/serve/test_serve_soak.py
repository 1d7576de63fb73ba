"""benchmarks/serve_soak.py --smoke: the bounded version of the 60 s soak (2 CPU ranks, one
warm-up job, then 4 concurrent job submissions and 50 status polls/s for 3 s, loopback): no error,
every job accepted and finished, the poll rate held, rank 0's memory at rest flat from after the
warm-up to after the soak, the job exits 0 under the supervisor."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("av")

from tests.conftest import ROOT, subprocess_env  # noqa: E402
from tests.serve._server import STARTUP_S  # noqa: E402


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
