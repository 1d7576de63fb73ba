# SPDX-License-Identifier: Apache-2.0
"""docs/serving.md says what the server does: its video-jobs session runs as pasted, its metrics
list names every exported series, and its list of counted error codes every code the routes
answer with."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT
from tests.serve._server import server

SERVING = os.path.join(ROOT, "docs", "serving.md")


def _doc() -> str:
    with open(SERVING, encoding="utf-8") as f:
        return f.read()


def _section(title: str) -> str:
    text = _doc()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_metrics_list_names_every_exported_series():
    """Seven of the fifteen series /metrics exports were missing from the list."""
    from prometheus_client.parser import text_string_to_metric_families

    from dist_attn.models.h3.serve.http.metrics import Metrics

    metrics = Metrics(lambda: 0)
    metrics.watch_jobs(lambda: {"queued": 0})
    listed = _section("Metrics")
    for family in text_string_to_metric_families(metrics.render().decode()):
        if family.name.endswith("_created"):  # prometheus_client's own timestamps of counters
            continue
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}" in listed, f"{name} is exported but not in docs/serving.md#metrics"


def test_every_error_code_the_routes_count_is_listed():
    """409 (content before the job succeeded, a cancel of a finished job) and 410 were counted in
    dist_attn_request_errors_total{code} but missing from the docs' list of counted codes."""
    codes = set()
    http = os.path.join(ROOT, "dist_attn", "models", "h3", "serve", "http")
    for name in os.listdir(http):
        if name.endswith(".py"):
            with open(os.path.join(http, name), encoding="utf-8") as f:
                codes |= set(re.findall(r"(?<!\.)\bfail\((\d{3})\b", f.read()))  # not job.fail
    listed = re.search(r"Every rejection \(([^)]*)\) is counted", _doc().replace("\n  ", " "))
    assert listed, "docs/serving.md lost its list of counted codes"
    missing = {c for c in codes if c != "400" and c not in listed.group(1)}
    assert {"409", "410"} <= codes and not missing, missing


def _session_block() -> str:
    text = _section("Video jobs (/v1/videos)")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    assert blocks, "no ```bash block in docs/serving.md#video-jobs-v1videos"
    return blocks[0]


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")),
                    reason="the session needs curl and jq, as the docs say")
def test_the_video_jobs_session_runs_as_pasted(tmp_path):
    """The block wrote a 409 JSON body into fox.mp4 when pasted whole (no wait, curl without -f)
    and then cancelled the job it had just asked for. Run here against 2 ranks with the synthetic
    runner (the same jobs API and MP4 writer, no pipeline to build): it waits for the job, saves a
    real MP4 and thumbnail, and cancels a second job."""
    with server(tmp_path, 2, "--output-dir", str(tmp_path / "out"), "--video-runner",
                "synthetic") as srv:
        block = _session_block().replace("localhost:8000", f"127.0.0.1:{srv.port}")
        work = tmp_path / "session"
        work.mkdir()
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, capture_output=True,
                             text=True, timeout=120)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert (work / "fox.mp4").read_bytes()[4:8] == b"ftyp", (work / "fox.mp4").read_bytes()[:200]
    assert (work / "fox.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = res.stdout.splitlines()
    assert re.fullmatch(r"vid_\S+: succeeded", next(ln for ln in out if ": succeeded" in ln))
    cancel = out[-1]
    assert '"cancel_requested":true' in cancel or '"status":"cancelled"' in cancel, res.stdout
