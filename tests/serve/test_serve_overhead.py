# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_overhead.py end to end on 2 CPU gloo ranks (--smoke), with a small load run."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

from tests.conftest import ROOT, subprocess_env
from tests.serve._server import STARTUP_S


def test_serve_overhead_smoke_writes_results_with_a_load_run(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_overhead", "--smoke",
                          "--load", "1,3", "--load-requests", "6", "--load-seconds", "60",
                          "--out-dir", str(tmp_path)], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=STARTUP_S + 120)
    assert res.returncode == 0, res.stderr[-3000:]
    [path] = glob.glob(str(tmp_path / "serve_overhead_tiny-2l_cpux2_*.json"))
    with open(path) as f:
        result = json.load(f)
    s = result["summary"]
    assert s["median_step_ms"] > 0 and s["median_overhead_ms"] > 0
    assert result["world_size"] == 2 and len(result["runs"]) == 5
    assert [x["clients"] for x in result["load"]] == [1, 3]
    for level in result["load"]:
        assert level["ok"] == 6 and level["error_count"] == 0, level
        assert 0 < level["p50_ms"] <= level["p99_ms"] <= level["max_ms"]
    assert result["versions"]["uvicorn"] and result["versions"]["starlette"]
    for ext in (".md", ".png"):
        assert os.path.getsize(path.removesuffix(".json") + ext) > 0
