# SPDX-License-Identifier: Apache-2.0
"""benchmarks/serve_h3_gpu.py --smoke on CPU: the script that goes to the (scarce) H200 runs the
server's own job path end to end and writes a complete result, so it cannot fail there for a
reason a CPU run would have shown."""

from __future__ import annotations

import glob
import json
import subprocess
import sys

import pytest

pytest.importorskip("av")

from tests.conftest import ROOT, subprocess_env  # noqa: E402


def test_h3_job_benchmark_smoke(tmp_path):
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_h3_gpu", "--smoke", "--out",
                          str(tmp_path)], cwd=ROOT, env=subprocess_env(CUDA_VISIBLE_DEVICES=""),
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    [path] = glob.glob(str(tmp_path / "serve-h3-job_cpu_*.json"))
    with open(path) as f:
        data = json.load(f)
    phases = {r["phase"]: r for r in data["summary"]}
    parts = ("text_encode", "denoise", "decode_audio", "decode_video", "mux")
    for name in (*parts, "after_denoise", "one denoise step (median)"):
        assert phases[name]["s"] > 0, name
    total = phases["total (one job)"]["s"]
    assert 0 < phases["outside the transformer's steps"]["share"] < 1
    assert sum(phases[n]["s"] for n in parts) <= total * 1.01
    # everything after the last step: the audio, the video decode, the MP4's tail
    after = sum(phases[n]["s"] for n in ("decode_audio", "decode_video", "mux"))
    assert after <= phases["after_denoise"]["s"] * 1.01
    assert [len(r["step_s"]) for r in data["rows"]] == [3, 3]  # warm-up + 1 job, 3 steps
    # the same seeded request twice: the same MP4, byte for byte (its digest is what two trees'
    # runs compare)
    digests = [r["mp4_sha256"] for r in data["rows"]]
    assert len(set(digests)) == 1 and len(digests[0]) == 64, digests
    assert data["config"]["backend"] == "sdpa" and data["config"]["diffusers_t2va"] is None
    # bf16 linears on CPU: nothing fused (the counts come from the model's modules)
    assert data["config"]["fused_swiglu_ffns"] == data["config"]["fused_adaln_blocks"] == 0


def test_h3_job_benchmark_identity_blocks_measure_the_step_outside_them(tmp_path):
    """--blocks identity (what benchmarks.job_model reads as the step outside the blocks): the
    same job runs with every block's forward returning its input, once per block per transformer
    call, and the real run calls none. (Until 2026-12-07 this compared the two runs' step times,
    which two busy CPU workers inverted: a timed test.)"""
    calls = {}
    for blocks in ("real", "identity"):
        out = tmp_path / blocks
        res = subprocess.run([sys.executable, "-m", "benchmarks.serve_h3_gpu", "--smoke",
                              "--blocks", blocks, "--out", str(out)], cwd=ROOT,
                             env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                             text=True, timeout=240)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        [path] = glob.glob(str(out / "serve-h3-job_cpu_*.json"))
        with open(path) as f:
            data = json.load(f)
        assert data["config"]["blocks"] == blocks and data["config"]["compile"] is False  # CPU
        steps = sum(len(r["step_s"]) for r in data["rows"])
        calls[blocks] = (data["config"]["identity_block_calls"], data["config"]["transformer_blocks"], steps)
    assert calls["real"][0] == 0, calls
    n, layers, steps = calls["identity"]
    assert n > 0 and n % (layers * steps) == 0, calls  # every block of every step's forward(s)
    res = subprocess.run([sys.executable, "-m", "benchmarks.serve_h3_gpu", "--smoke", "--blocks",
                          "identity", "--diffusers", "on", "--out", str(tmp_path / "x")], cwd=ROOT,
                         env=subprocess_env(CUDA_VISIBLE_DEVICES=""), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "not with --diffusers on" in res.stderr, res.stderr[-2000:]
