# SPDX-License-Identifier: Apache-2.0
"""launch/serve.py end to end under torchrun on CPU gloo ranks (tiny config)."""

from __future__ import annotations

import json
import re
import signal
import socket
import sys
import time

import pytest

from dist_attn.models.h3.serve.h3.engine import latent_checksum
from dist_attn.models.h3.serve.h3.weights import load_output

from tests.serve._server import SERVE, STARTUP_S, http, metric_samples, run, server, torchrun

# Every float op of the sharded H3 is row-wise or per-head, so 4 ranks match 1 rank to
# reduction-order noise (observed: bit-identical on CPU float32, 274 rows padded to 276 on 4 ranks);
# 1e-5 is the float32 allowance.
RTOL_F32 = 1e-5


def _last_json(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout  # exactly one JSON result line, from rank 0 only
    return json.loads(lines[0])


# --------------------------------------------------------------------------- --once


def test_once_on_3_ranks_matches_a_single_rank(tmp_path):
    # 3 ranks: the 274 rows are padded (to 276) and the tiny config's heads split unevenly, as
    # at 4; a 4-rank server runs in test_server_under_torchrun (each rank imports diffusers:
    # ~8 s of CI's 2 cores)
    args = ["--once", "--steps", "2", "--seed", "5"]
    dist_run = run(torchrun(3, *args, "--output-dir", str(tmp_path / "w4")), STARTUP_S)
    assert dist_run.returncode == 0, dist_run.stderr[-3000:]
    single = run([sys.executable, SERVE, *args, "--output-dir", str(tmp_path / "w1")],
                  STARTUP_S)
    assert single.returncode == 0, single.stderr[-3000:]
    r4, r1 = _last_json(dist_run.stdout), _last_json(single.stdout)
    assert r4["world_size"] == 3 and r1["world_size"] == 1
    # H3's packing of the tiny default (22 frames at 128 x 192): 32 text + 74 audio + 168 video
    rows = {"used": 274, "text": 32, "audio": 74, "video": 168, "frames": 22, "latent_shape": [7, 8, 12]}
    assert r4["tokens"] == {**rows, "total": 276} and r1["tokens"] == {**rows, "total": 274}
    assert r4["backend"] == r1["backend"] == "sdpa"
    assert len(r4["step_latency_ms"]) == 2 and r4["total_latency_ms"] > 0
    assert 0 < r4["all_to_all_share"] < r4["attention_share"] <= 1
    assert r1["all_to_all_share"] == 0  # world 1: no all-to-all
    # the file's name, relative to --output-dir (no server paths in results)
    assert r4["output"] == r1["output"] == "once-5.safetensors"
    a = load_output(str(tmp_path / "w4" / r4["output"]))
    b = load_output(str(tmp_path / "w1" / r1["output"]))
    assert a["video"].shape == (168, 16) and a["audio"].shape == (74, 8)
    for name in ("video", "audio"):
        err = (a[name] - b[name]).norm() / b[name].norm()
        assert err < RTOL_F32, (name, err)
    assert abs(r4["checksum"]["sum"] - r1["checksum"]["sum"]) <= 1e-4 * r1["checksum"]["abs_sum"]
    assert latent_checksum(a["video"], a["audio"]).bits64 == r4["checksum"]["bits64"]
    # per-step progress logged on rank 0 only, with the rank in every line
    assert "[rank 0] INFO dist_attn.models.h3.serve.h3.engine: once-5 step 2/2" in dist_run.stderr
    assert "[rank 1] INFO" not in dist_run.stderr


# --------------------------------------------------------------------------- HTTP server


# 4 ranks only: every other serving test runs 2 (a rank imports diffusers, ~8 s of CI's 2 cores)
@pytest.mark.parametrize("world", [4])
def test_server_under_torchrun(tmp_path, world):
    with server(tmp_path, world, "--log-all-ranks") as srv:
        base = srv.base
        status, body, _ = http("GET", base + "/health")
        health = json.loads(body)
        assert status == 200 and health["status"] == "ok" and health["world_size"] == world

        good = json.dumps({"frames": 5, "height": 128, "width": 128, "steps": 2, "seed": 1}).encode()
        status, body, _ = http("POST", base + "/v1/generate", good)
        assert status == 200, body
        first = json.loads(body)
        assert first["tokens"] == {"used": 80, "total": 80, "text": 32, "audio": 16, "video": 32,
                                   "frames": 5, "latent_shape": [2, 8, 8]}
        assert len(first["step_latency_ms"]) == 2 and first["world_size"] == world
        assert len(first["checksum"]["bits64"]) == 16

        status, body, _ = http("POST", base + "/v1/generate", b'{"steps": "many"}')
        assert status == 400 and "steps='many' must be an integer" in json.loads(body)["error"][
            "message"]
        status, body, _ = http("POST", base + "/v1/generate",
                               b'{"frames": 300, "height": 2048, "width": 2048}')
        assert status == 413 and "max_tokens" in body
        status, body, _ = http("POST", base + "/v1/generate", b"x" * 70_000)
        assert status == 413 and "max_body_bytes" in body

        # workers keep serving after rejected requests; same request -> same latent
        status, body, _ = http("POST", base + "/v1/generate", good)
        assert status == 200, body
        second = json.loads(body)
        assert second["request_id"] != first["request_id"]
        assert second["checksum"] == first["checksum"]

        status, metrics, _ = http("GET", base + "/metrics")
        assert status == 200
        samples = metric_samples(metrics)
        assert samples["dist_attn_requests_total"] == 2
        assert samples['dist_attn_request_errors_total{code="400"}'] == 1
        assert samples['dist_attn_request_errors_total{code="413"}'] == 2
        assert samples['dist_attn_request_latency_seconds_bucket{le="+Inf"}'] == 2
        assert samples["dist_attn_request_latency_seconds_count"] == 2
        assert samples["dist_attn_tokens_per_second"] > 0
        assert http("GET", base + "/nope")[0] == 404

        pids = list(srv.rank_pids().values())
        assert len(pids) == world
        srv.proc.send_signal(signal.SIGTERM)
        srv.wait_gone([srv.proc.pid, *pids], timeout=60)
        # every rank left through the shutdown message
        log = srv.log()
        for rank in range(world):
            assert f"[rank {rank}] INFO dist_attn.models.h3.serve.ranks.loop: shut down cleanly" in log, log[-3000:]
        # the launch log reads at a glance: the backend choice in one short INFO line (it was
        # ~1,200 characters of reasons and TRITON_INTERPRET advice), the tiny model's size in a
        # unit that fits (it was "0.00B parameters")
        chose = [ln for ln in log.splitlines() if "backend='auto' chose" in ln]
        assert chose and all(len(ln) < 220 and "TRITON_INTERPRET" not in ln for ln in chose), chose
        assert "0.00B" not in log and re.search(r"built tiny .*, \d+\.\d+M parameters", log), log[-3000:]


# --------------------------------------------------------------------------- launch checks


def test_quality_high_on_cpu_fails_fast_naming_conditions():
    t0 = time.monotonic()
    res = run(torchrun(4, "--quality", "high"), STARTUP_S)
    elapsed = time.monotonic() - t0
    assert res.returncode != 0
    assert elapsed < STARTUP_S
    msg = res.stderr
    assert msg.count("launch checks failed") == 1  # ONE message, from rank 0
    assert "GPU model: every GPU name must contain H200" in msg
    assert "GPU per rank: every rank must run on a CUDA GPU" in msg
    assert "compute capability: every GPU must be 9.0" in msg
    assert "shut down" not in msg  # no model was built, nothing was served


def test_port_in_use_fails_before_the_model_with_one_message():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = run(torchrun(2, "--port", str(port)), STARTUP_S)
    assert res.returncode != 0
    assert res.stderr.count("launch checks failed") == 1, res.stderr[-3000:]
    assert f"port: cannot listen on 127.0.0.1:{port} (Address already in use)" in res.stderr
    assert "Traceback" not in res.stderr.split("launch checks failed")[0]
    assert "built tiny" not in res.stderr  # caught before the model was built


def test_single_process_check_only_ok():
    ok = run([sys.executable, SERVE, "--check-only"], STARTUP_S)
    assert ok.returncode == 0 and "check-only: OK" in ok.stdout, ok.stderr


def test_launch_rejects_bad_tier_backend_and_checkpoint(launcher, tmp_path, capsys):
    assert launcher.main(["--check-only", "--quality", "lossless", "--backend", "sage"]) == 1
    err = capsys.readouterr().err
    assert "backend='sage' is an 8-bit backend, not allowed under quality='lossless'" in err
    assert launcher.main(["--check-only", "--quality", "best"]) == 1
    assert "valid values: 'lossless', 'high' (absent: no constraint)" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(
        {"_class_name": "MiniMaxH3Transformer3DModel", "num_layers": 50, "num_attention_heads": 56}))
    assert launcher.main(["--once", "--checkpoint", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"--checkpoint {tmp_path} does not match the serving config's [model]" in err
    assert "num_layers: checkpoint 50 vs config 2" in err and "num_attention_heads: checkpoint 56" in err
    assert launcher.main(["--once", "--layers", "0"]) == 1
    assert "model.num_layers=0 must be a positive integer" in capsys.readouterr().err


def test_once_with_compile_compiles_the_served_blocks(launcher, monkeypatch, capsys):
    """--compile reaches compile_blocks (diffusers' compile_repeated_blocks, fullgraph) of the
    served MiniMaxH3Transformer3DModel; aot_eager here, inductor in the 2-rank integration test."""
    from dist_attn.models.h3.serve.h3 import model as served

    calls, real = [], served.compile_blocks

    def spy(model, **kwargs):
        calls.append(type(model).__name__)
        real(model, backend="aot_eager")

    monkeypatch.setattr(served, "compile_blocks", spy)
    assert launcher.main(["--once", "--compile", "--steps", "1", "--backend", "sdpa"]) == 0
    result = _last_json(capsys.readouterr().out)
    assert calls == ["MiniMaxH3Transformer3DModel"]
    assert len(result["step_latency_ms"]) == 1 and result["checksum"]["bits64"]


def test_max_restarts_is_the_supervisors_and_must_be_non_negative(capsys):
    """--max-restarts bounds the supervisor's restarts (a killed rank ended the server for good:
    issue 24); it names its value and rule, and is refused where no supervisor runs."""
    from dist_attn.models.h3.serve.launch import cli

    assert cli.main(["--nproc-per-node", "2", "--max-restarts", "-1"]) == 1
    assert ("--max-restarts=-1 must be a non-negative integer (restarts within 600 s; 0: never "
            "restart)") in capsys.readouterr().err
    assert cli.main(["--max-restarts", "2"]) == 1
    assert "--max-restarts=2 is the supervisor's (with --nproc-per-node)" in capsys.readouterr().err


def test_parameter_counts_are_logged_in_a_unit_that_fits():
    """The tiny model was logged as "0.00B parameters"."""
    from dist_attn.models.h3.serve.launch.logs import count_in_units

    assert [count_in_units(n) for n in (999, 12_345, 4_567_890, 15_400_000_000)] == [
        "999", "12.35K", "4.57M", "15.40B"]
