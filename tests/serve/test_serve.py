"""launch/serve.py end to end under torchrun on CPU gloo ranks (tiny config)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

from dist_attn.serve.config import load_config
from dist_attn.serve.serving import (DistContext, Metrics, RequestError, _latent_checksum,
                               parse_request)
from dist_attn.serve.weights import load_safetensors, save_safetensors

from tests.conftest import ROOT, free_port, subprocess_env

SERVE = os.path.join(ROOT, "launch", "serve.py")
# Start-up of 4 ranks importing torch on a loaded 2-core CI box takes ~15 s; allow 8x.
STARTUP_S = 120
# Every float op of the sharded DiT is row-wise or per-head, so 4 ranks match 1 rank to
# reduction-order noise (observed: bit-identical on CPU float32); 1e-5 is the float32 allowance.
RTOL_F32 = 1e-5


def _torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(n), SERVE, *args]


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=timeout)


def _last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout  # exactly one JSON result line, from rank 0 only
    return json.loads(lines[0])


# --------------------------------------------------------------------------- --once


def test_once_on_4_ranks_matches_a_single_rank(tmp_path):
    args = ["--once", "--steps", "2", "--seed", "5"]
    dist_run = _run(_torchrun(4, *args, "--output-dir", str(tmp_path / "w4")), STARTUP_S)
    assert dist_run.returncode == 0, dist_run.stderr[-3000:]
    single = _run([sys.executable, SERVE, *args, "--output-dir", str(tmp_path / "w1")],
                  STARTUP_S)
    assert single.returncode == 0, single.stderr[-3000:]
    r4, r1 = _last_json(dist_run.stdout), _last_json(single.stdout)
    assert r4["world_size"] == 4 and r1["world_size"] == 1
    assert r4["tokens"] == r1["tokens"] == {"used": 276, "total": 320,
                                            "latent_shape": [3, 8, 8]}
    assert len(r4["step_latency_ms"]) == 2 and r4["total_latency_ms"] > 0
    assert 0 < r4["all_to_all_share"] < r4["attention_share"] <= 1
    assert r1["all_to_all_share"] == 0  # world 1: no all-to-all
    a = load_safetensors(r4["output"])["latent"]
    b = load_safetensors(r1["output"])["latent"]
    assert a.shape == (276, 16)
    err = (a - b).norm() / b.norm()
    assert err < RTOL_F32, err
    assert abs(r4["checksum"]["sum"] - r1["checksum"]["sum"]) <= 1e-4 * r1["checksum"]["abs_sum"]
    # the checksum reduced from 4 shards is the checksum of the saved (gathered) latent
    ctx1 = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert _latent_checksum(a, 0, 276, ctx1)["bits64"] == r4["checksum"]["bits64"]
    # per-step progress logged on rank 0 only, with the rank in every line
    assert "[rank 0] INFO dist_attn.serve: once-5 step 2/2" in dist_run.stderr
    assert "[rank 1] INFO" not in dist_run.stderr


# --------------------------------------------------------------------------- HTTP server


def _http(method: str, url: str, body: bytes | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("world", [2, 4])
def test_server_under_torchrun(tmp_path, world):
    port = free_port()
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err, open(tmp_path / "stdout.txt", "w") as out:
        proc = subprocess.Popen(_torchrun(world, "--port", str(port), "--log-all-ranks"),
                                cwd=ROOT, env=subprocess_env(), stdout=out, stderr=err,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:
            assert proc.poll() is None, err_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                status, body = _http("GET", base + "/health")
                break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.3)
        health = json.loads(body)
        assert status == 200 and health["status"] == "ok" and health["world_size"] == world

        good = json.dumps({"num_tokens": 200, "steps": 2, "seed": 1}).encode()
        status, body = _http("POST", base + "/v1/generate", good)
        assert status == 200, body
        first = json.loads(body)
        assert first["tokens"] == {"used": 200, "total": 256, "latent_shape": None}
        assert len(first["step_latency_ms"]) == 2 and first["world_size"] == world
        assert len(first["checksum"]["bits64"]) == 16

        status, body = _http("POST", base + "/v1/generate", b'{"steps": "many"}')
        assert status == 400 and "steps='many' must be an integer" in json.loads(body)["error"][
            "message"]
        status, body = _http("POST", base + "/v1/generate", b'{"num_tokens": 10000000}')
        assert status == 413 and "max_tokens" in body
        status, body = _http("POST", base + "/v1/generate", b"x" * 70_000)
        assert status == 413 and "max_body_bytes" in body

        # workers keep serving after rejected requests; same request -> same latent
        status, body = _http("POST", base + "/v1/generate", good)
        assert status == 200, body
        second = json.loads(body)
        assert second["request_id"] != first["request_id"]
        assert second["checksum"] == first["checksum"]

        status, metrics = _http("GET", base + "/metrics")
        assert status == 200
        assert "dist_attn_requests_total 2\n" in metrics
        assert 'dist_attn_request_errors_total{code="400"} 1\n' in metrics
        assert 'dist_attn_request_errors_total{code="413"} 2\n' in metrics
        assert 'dist_attn_request_latency_seconds_bucket{le="+Inf"} 2\n' in metrics
        assert "dist_attn_request_latency_seconds_count 2\n" in metrics
        tps = [ln for ln in metrics.splitlines() if ln.startswith("dist_attn_tokens_per_second ")]
        assert float(tps[0].split()[1]) > 0
        assert _http("GET", base + "/nope")[0] == 404
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    # every process of the job is gone, and each rank left through the shutdown broadcast
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "ranks still alive after SIGTERM"
        time.sleep(0.2)
    log = err_path.read_text()
    for rank in range(world):
        assert f"[rank {rank}] INFO dist_attn.serve: shut down cleanly" in log, log[-3000:]


# --------------------------------------------------------------------------- launch checks


def test_quality_high_on_cpu_fails_fast_naming_conditions():
    t0 = time.monotonic()
    run = _run(_torchrun(4, "--quality", "high"), STARTUP_S)
    elapsed = time.monotonic() - t0
    assert run.returncode != 0
    assert elapsed < STARTUP_S
    msg = run.stderr
    assert msg.count("launch checks failed") == 1  # ONE message, from rank 0
    assert "GPU model: every GPU name must contain H200" in msg
    assert "GPU per rank: every rank must run on a CUDA GPU" in msg
    assert "compute capability: every GPU must be 9.0" in msg
    assert "shut down" not in msg  # no model was built, nothing was served


def test_single_process_check_only_ok():
    ok = _run([sys.executable, SERVE, "--check-only"], STARTUP_S)
    assert ok.returncode == 0 and "check-only: OK" in ok.stdout, ok.stderr


@pytest.fixture
def launcher(monkeypatch):
    """launch/serve.py's main() in this process as world 1 (no torchrun env), logging restored."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from dist_attn.serve import cli as serve

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield serve
    root.handlers[:], root.level = handlers, level


def test_launch_rejects_bad_tier_backend_and_weights(launcher, tmp_path, capsys):
    assert launcher.main(["--check-only", "--quality", "lossless", "--backend", "sage"]) == 1
    err = capsys.readouterr().err
    assert "backend='sage' is an 8-bit backend, not allowed under quality='lossless'" in err
    assert launcher.main(["--check-only", "--quality", "best"]) == 1
    assert "valid values: absent (no constraint), 'lossless', 'high'" in capsys.readouterr().err
    weights = tmp_path / "w.safetensors"
    save_safetensors({"patch_in.weight": torch.zeros(3, 3)}, weights)
    assert launcher.main(["--once", "--weights", str(weights)]) == 1
    err = capsys.readouterr().err
    assert "mis-shaped keys (1): patch_in.weight: file [3, 3] vs model [256, 16]" in err
    assert "missing keys" in err and "blocks.1.qkv.weight" in err
    assert launcher.main(["--once", "--layers", "0"]) == 1
    assert "ModelConfig.num_layers=0 must be a positive integer" in capsys.readouterr().err


# --------------------------------------------------------------------------- in-process units


def test_parse_request_rules():
    cfg = load_config(None)
    req = parse_request({"frames": 5, "height": 64, "width": 96, "steps": 3, "seed": 2}, cfg)
    assert req.layout(cfg).latent_shape == (2, 2, 3)
    assert parse_request({"num_tokens": 50}, cfg).layout(cfg).total == 64
    for payload, status, match in [
        ([], 400, "JSON object"),
        ({"frame": 3}, 400, r"unknown field\(s\) \['frame'\]"),
        ({"steps": True}, 400, "must be an integer"),
        ({"steps": 0}, 400, "steps=0 must be a positive integer"),
        ({"steps": 51}, 413, "max_steps=50"),
        ({"num_tokens": 10, "frames": 3}, 400, "either num_tokens or frames"),
        ({"height": 100}, 400, "multiple of tokens.spatial_compression=32"),
        ({"frames": 10**12}, 413, "too large"),
        ({"seed": -1}, 400, "seed=-1"),
    ]:
        with pytest.raises(RequestError, match=match) as info:
            parse_request(payload, cfg)
        assert info.value.status == status, payload


def test_metrics_histogram_is_cumulative():
    m = Metrics()
    m.observe(0.02, 100, 0.01)
    m.observe(3.0, 100, 1.0)
    m.error(400)
    text = m.render(queue_depth=1)
    assert 'dist_attn_request_latency_seconds_bucket{le="0.025"} 1\n' in text
    assert 'dist_attn_request_latency_seconds_bucket{le="5.0"} 2\n' in text
    assert 'dist_attn_request_errors_total{code="400"} 1\n' in text
    assert "dist_attn_tokens_total 200\n" in text and "dist_attn_queue_depth 1\n" in text


def test_checksum_is_independent_of_sharding():
    ctx1 = DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    z = torch.randn(128, 16)
    full = _latent_checksum(z, 0, 100, ctx1)
    parts = [_latent_checksum(z[r * 32:(r + 1) * 32], r * 32, 100, ctx1) for r in range(4)]
    assert sum(int(p["bits64"], 16) for p in parts) % 2**64 == int(full["bits64"], 16)
    assert abs(sum(p["sum"] for p in parts) - full["sum"]) < 1e-9
    z2 = z.clone()
    z2[100:] = 7.0  # padding rows do not count
    assert _latent_checksum(z2, 0, 100, ctx1) == full
    z2[99, 15] = torch.nextafter(z[99, 15], torch.tensor(1e9))  # one ulp of one element does
    assert _latent_checksum(z2, 0, 100, ctx1)["bits64"] != full["bits64"]
