# SPDX-License-Identifier: Apache-2.0
"""Every benchmark's --smoke runs on CPU and leaves a complete, self-describing result.

The single-process ones (kernels, scaling --modeled, h3_model, vae_decode, h3_fp8) run in-process,
sharing one interpreter's torch and diffusers imports; alltoall.py and the measured scaling.py run
under ``python -m torch.distributed.run --standalone --nproc-per-node 2`` (a free port per launch,
so pytest-xdist workers never collide), as a user would launch them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

import pytest

from tests._torch_caps import cpu_rowwise_scaled_mm_refusal
from tests.conftest import ROOT as REPO, subprocess_env

# A hung collective must fail the test, not the CI job.
TIMEOUT_S = 120


def _env() -> dict[str, str]:
    return subprocess_env(CUDA_VISIBLE_DEVICES="")  # smoke is the CPU path, also on a GPU machine


def _run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def _torchrun(script: str, out, *extra: str) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
          "-m", f"benchmarks.{script.removesuffix('.py')}", "--smoke", "--out", str(out), *extra])


def _check_result(out, theme: str) -> dict:
    """The JSON/MD/PNG triple exists and the JSON records what ran; returns the JSON."""
    jsons = glob.glob(os.path.join(str(out), f"{theme}_cpu_*.json"))
    assert len(jsons) == 1, os.listdir(out)
    stem = jsons[0][: -len(".json")]
    date = stem.rsplit("_", 1)[1]
    assert len(date) == 10 and date[4] == date[7] == "-", stem  # <theme>_<hardware>_<YYYY-MM-DD>
    for ext in ("md", "png"):
        assert os.path.getsize(f"{stem}.{ext}") > 0, ext
    with open(f"{stem}.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with open(jsons[0]) as f:
        data = json.load(f)
    assert data["gpu"] == "cpu" and data["date"] == date and data["theme"] == theme
    assert isinstance(data["config"], dict) and data["config"]
    versions = data["versions"]
    for key in ("torch", "triton", "sageattention", "dist_attn", "python", "cuda"):
        assert key in versions, key
    assert versions["torch"] and versions["python"] and versions["dist_attn"]
    rows = data["rows"]
    assert rows, "no rows"
    timed = [r for r in rows if r.get("status") == "ok" and ("median_ms" in r or "total_ms" in r)]
    assert timed, "no timed row"
    for r in rows:
        if r.get("status") == "ok":
            t = r.get("median_ms", r.get("total_ms"))
            if t is not None:
                assert t > 0, r
        else:
            # a kernel or configuration that cannot run is a row that says why
            assert r.get("status") in ("unavailable", "skipped", "error") and r.get("reason"), r
    with open(f"{stem}.md") as f:
        md = f.read()
    assert "| " in md and data["versions"]["torch"] in md
    return data


def test_kernels_smoke(tmp_path):
    from benchmarks import kernels
    kernels.main(["--smoke", "--out", str(tmp_path), "--device", "cpu"])
    data = _check_result(tmp_path, "kernels")
    ok = {(r["section"], r.get("kernel")) for r in data["rows"] if r.get("status") == "ok"}
    # the sdpa backend runs everywhere: speed, error and the bridge overhead all have a row
    assert ("speed", "bridge:sdpa") in ok and ("speed", "dense_used:sdpa") in ok
    acc = [r for r in data["rows"] if r["section"] == "accuracy" and r["kernel"] == "bridge:sdpa"]
    assert acc and all(r["cosine"] > 0.999 and r["pad_rows_max_abs"] == 0.0 and not r["caller_k_changed"]
                       for r in acc)
    assert any(r["section"] == "overhead" and r["backend"] == "sdpa" for r in data["rows"])
    # CUDA-only kernels are rows with a reason, not crashes
    cudnn = [r for r in data["rows"] if r.get("kernel") == "sdpa_cudnn"]
    assert cudnn and all(r["status"] == "unavailable" and "CUDA" in r["reason"] for r in cudnn)


def test_alltoall_smoke_two_ranks(tmp_path):
    _torchrun("alltoall.py", tmp_path, "--backend", "gloo")
    data = _check_result(tmp_path, "alltoall-gloo2")
    assert data["config"]["world"] == 2
    ops = {r["op"]: r for r in data["rows"]}
    for op in ("copy_in", "pack_qkv", "unpack_output", "raw_a2a_in", "packed_in", "separate_in", "packed_out"):
        assert ops[op]["status"] == "ok" and ops[op]["median_ms"] > 0, ops[op]
    assert ops["packed_in"]["gb_per_s"] > 0
    assert "not representative of NVLink" in data["config"]["comm_label"]
    assert data["parity_packed_vs_separate"] == {"0": True, "1": True}


def test_pipeline_placement_smoke_two_ranks(tmp_path):
    """It crashed on every run after the decode moved to dist_attn.models.h3.serve.h3.decode (dec2a07)
    and no test ran it: it still called H3Pipeline.run_decode."""
    _torchrun("pipeline_placement.py", tmp_path)
    data = _check_result(tmp_path, "pipeline-placement")
    parts = {(r["part"], r["where"]) for r in data["rows"]}
    assert {("text encode", "rank 0"), ("text encode", "every rank"),
            ("decode video (served: over every rank)", "every rank")} <= parts, parts
    assert data["config"]["world"] == 2


def test_scaling_smoke_two_ranks_measured(tmp_path):
    _torchrun("scaling.py", tmp_path, "--backends", "sdpa", "--overlap", "1,2")
    data = _check_result(tmp_path, "scaling-gloo2")
    rows = [r for r in data["rows"] if r.get("status") == "ok"]
    assert {r["mode"] for r in data["rows"]} == {"measured"}
    got = {(r["what"], r["N"], r["overlap_chunks"]) for r in rows}
    assert {("attention", 1, 1), ("attention", 2, 1), ("attention", 2, 2), ("block", 2, 2)} <= got
    two = [r for r in rows if r["N"] == 2]
    assert all(r["efficiency"] > 0 and set(r["phases_ms"]) >= {"pack", "a2a_in", "kernel", "a2a_out", "unpack"}
               for r in two)


@pytest.mark.parametrize("ranks", ["1,2,4"])
def test_scaling_smoke_modeled(tmp_path, ranks, capsys):
    from benchmarks import scaling

    # in-process (one process, no process group): spares a second interpreter importing diffusers
    scaling.main(["--smoke", "--modeled", "--out", str(tmp_path), "--device", "cpu", "--ranks", ranks,
                  "--backends", "sdpa", "--overlap", "1,2", "--bandwidth-gbs", "0.001"])
    data = _check_result(tmp_path, "scaling-modeled")
    # progress as it goes, one line a row (a full run took minutes on a CPU without a word)
    progress = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[scaling] row ")]
    assert len(progress) == len(data["rows"]), progress
    modeled = [r for r in data["rows"] if r["mode"] == "modeled" and r.get("status") == "ok"]
    assert modeled and data["config"]["formula"]
    # at 1 MB/s the all-to-all dominates: the plain path hides nothing, two chunks hide the kernels
    # and the second pack call (it runs while the first chunk's input is in flight)
    by = {(r["what"], r["N"], r["overlap_chunks"]): r for r in modeled}
    plain, piped = by[("attention", 2, 1)], by[("attention", 2, 2)]
    assert plain["phases_ms"]["a2a_in"] > 100  # 3 * 160 rows * 2 heads * 64 * 2 B / 1 MB/s = 123 ms
    assert abs(plain["hidden_ms"]) < 1e-6 and plain["formula"] == "plain"
    assert piped["formula"] == "pipelined"
    assert [n for n, _ in piped["pack_runs"]] == [1, 1]
    assert piped["hidden_ms"] == pytest.approx(sum(piped["kernel_chunk_ms"]) + piped["pack_runs"][1][1]
                                               + piped["unpack_chunk_ms"][0], rel=1e-6)
    # the real N = 1 layer is reported separately, never as a modeled row
    assert any(r["mode"] == "measured" and r["N"] == 1 for r in data["rows"])


def test_h3_model_smoke(tmp_path):
    """The real-H3 benchmark: every section has a row, unavailable kernels say why."""
    from benchmarks import h3_model

    h3_model.main(["--smoke", "--out", str(tmp_path), "--device", "cpu",
                   "--paths", "ulysses:sdpa,ulysses:fa3,diffusers:native",
                   "--modes", "eager", "--overhead-backends", "sdpa", "--serve-backends", "sdpa"])
    # (the compiled rows cost ~40 s of inductor C++ builds on CI's 2 cores; they ran on the H200:
    # benchmarks/results/h3-model_h200_2026-12-03.md)
    data = _check_result(tmp_path, "h3-model")
    ok = {(r["section"], r["path"], r["mode"]) for r in data["rows"] if r.get("status") == "ok"}
    for want in [("block", "none", "eager"), ("block", "ulysses:sdpa", "eager"),
                 ("model", "ulysses:sdpa", "eager"), ("model", "diffusers:native", "eager"),
                 ("refiner", "diffusers:native", "eager"), ("serve", "ulysses:sdpa", "eager"),
                 ("overhead", "ulysses:sdpa vs direct:sdpa", "eager")]:
        assert want in ok, want
    fa3 = [r for r in data["rows"] if r["path"] == "ulysses:fa3"]
    assert fa3 and all(r["status"] == "unavailable" and "fa3" in r["reason"] for r in fa3)
    overhead = next(r for r in data["rows"] if r["section"] == "overhead")
    assert overhead["direct_ms"] > 0 and "overhead" in overhead
    assert data["config"]["used"] == 274 and data["config"]["model"]["num_layers"] == 2


def test_vae_decode_smoke(tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("av")
    from benchmarks import vae_decode

    vae_decode.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--tiles-per-call", "2", "4"])
    data = _check_result(tmp_path, "vae-decode")
    rows = data["rows"]
    precision = [r for r in rows if r["section"] == "precision"]
    assert {(r["init"], r["dtype"]) for r in precision} == {
        (i, d) for i in ("class init", "scales drawn") for d in ("float16", "bfloat16")}
    assert all(0 < r["rel_l2"] < 0.05 and r["share_off_1_255"] <= 0.01 for r in precision)
    times = [r for r in rows if r["section"] == "time"]
    assert [r["tiles_per_call"] for r in times] == [1, 2, 4]
    modeled = [r for r in rows if r["section"] == "W=4 modeled"]
    assert [r["tiles_per_call"] for r in modeled] == [2, 4]
    assert all(r["modeled_s"] >= r["rank_decoder_s"] > 0 for r in modeled)
    mux = [r for r in rows if r["section"] == "mux"]
    assert {(r["threading"], r["clips"]) for r in mux} == {(t, c) for t in ("frame", "slice")
                                                          for c in (1, 7)}
    assert all(0 < r["tail_s"] <= r["s"] for r in mux)


def test_h3_memory_smoke(tmp_path):
    """The tiny served model as ranks 0, 3 and the last of W = 2 and 4 over a fake process group
    (rank 3 only where W > 3, each case once): every phase runs through the served code, each row holds the measured
    phases (no device memory on CPU), the pre-flight's estimate for the same plan and the gather
    model from the blocks' times."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from benchmarks import h3_memory

    h3_memory.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--ranks", "0", "3", "-1"])
    rows = _check_result(tmp_path, "h3-memory")["rows"]
    assert [(r["world"], r["precision"], r["rank"]) for r in rows] == [
        (2, "bf16", 0), (2, "bf16", 1), (4, "bf16", 0), (4, "bf16", 3)], rows
    assert all(r["status"] == "ok" for r in rows), rows
    for r in rows:
        assert set(r["phases"]) == set(h3_memory.PHASES) and r["estimate_gb"] > 0, r
        assert r["weights_rank_gb"] <= r["weights_total_gb"] / r["world"] * 1.05, r
        assert r["blocks"] == 4 and len(r["gather"]) == 4, r  # 2 bandwidths x 2 block bases
        assert all(g["gather_ms"] > 0 and g["slowdown"] >= 0 for g in r["gather"]), r


def test_vae_decode_compiled_smoke(tmp_path):
    pytest.importorskip("diffusers")
    from benchmarks import vae_decode_compiled

    vae_decode_compiled.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--rounds", "1"])
    data = _check_result(tmp_path, "vae-decode-compiled")
    assert [r["decode"] for r in data["rows"]] == ["eager", "compiled"]
    assert data["pixels"]["share_off_1_255"] <= 1e-4 and data["config"]["compile_backend"] == "aot_eager"


def test_h3_fp8_smoke(tmp_path):
    """The FP8 benchmark on CPU (the float32 emulation): every section has rows, FP8 GEMMs show
    an FP8-sized error and bf16 a bf16-sized one, the W = 4 model adds up, the served latents of
    fp8:sdpa differ from bf16:sdpa, CUDA-only kernels are rows that say why."""
    from benchmarks import h3_fp8

    h3_fp8.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--modes", "eager",
                 "--profile", "fp8:sdpa"])
    # (compiled rows: fullgraph inductor on CPU costs ~30 s a row here; run by hand with
    # --modes compiled, and on the H200 by default)
    data = _check_result(tmp_path, "h3-fp8")
    rows = data["rows"]
    ok = {(r["section"], r["path"]) for r in rows if r.get("status") == "ok"}
    gemm = {(r["shape"], r["rows"], r["path"]): r for r in rows if r["section"] == "gemm"}
    assert {s for s, _, _ in gemm} == {"qkv", "out", "ff_in", "ff_out"} and len(gemm) == 4 * 2 * 9
    refusal = cpu_rowwise_scaled_mm_refusal()  # torch 2.11's CPU kernel takes per-tensor scales only
    for (shape, n, path), r in gemm.items():
        if refusal and path.startswith("scaled_mm") and "tensor" not in path:
            assert r["status"] == "unavailable" and refusal[:80] in r["reason"], r
            continue
        assert r["status"] == "ok", r
        if path == "bf16":
            assert r["rel_l2"] < 4e-3, r
        elif not path.startswith("quant"):
            assert 1.5e-2 < r["rel_l2"] < 6e-2 and r["x_bf16"] > 0, r
    for want in [("block", "fp8:sdpa"), ("block", "bf16:sdpa"), ("block", "fp8:native"), ("block", "bf16:none"),
                 ("w4-rest", "fp8:none@w4"), ("w4", "fp8:sdpa"), ("w4", "bf16:sdpa"),
                 ("accuracy", "bf16:sdpa"), ("accuracy", "fp8:sdpa")]:
        assert want in ok, want
    w4 = next(r for r in rows if r["section"] == "w4" and r["path"] == "fp8:sdpa")
    assert w4["overlap_chunks"] == 1  # 4 tiny heads over 4 ranks: one head a rank, one chunk
    assert w4["median_ms"] == pytest.approx(w4["rest_ms"] + w4["kernel_ms"] + w4["comm_ms"])
    # each all-to-all counted once: q, k, v in (3 tensors), the output back (1)
    assert w4["a2a_in_ms"] == pytest.approx(3 * w4["a2a_out_ms"]) and w4["comm_ms"] == pytest.approx(
        w4["pack_ms"] + w4["a2a_in_ms"] + w4["a2a_out_ms"] + w4["unpack_ms"])
    assert w4["step_s"] == pytest.approx(50 * w4["median_ms"] / 1e3) and w4["rows"] == 80
    # the w4 parts are timed in interleaved rounds (--rounds, 2 under --smoke), the medians used
    rounds = data["w4_rounds_ms"]
    assert {"pack 1 0", "unpack 1 0", "kernel sdpa 1"} <= set(rounds) and all(len(t) == 2 for t in rounds.values())
    assert w4["kernel_ms"] == pytest.approx(statistics.median(rounds["kernel sdpa 1"]))
    acc = {r["path"]: r for r in rows if r["section"] == "accuracy"}
    assert acc["bf16:sdpa"]["video_rel_l2"] == 0.0 and 1e-4 < acc["fp8:sdpa"]["video_rel_l2"] < 5e-2
    # the first block's own output: FP8 linears alone move it by an FP8-sized amount
    assert acc["bf16:sdpa"]["block0_rel_l2"] == 0.0 and 1e-4 < acc["fp8:sdpa"]["block0_rel_l2"] < 5e-2
    sage = [r for r in rows if r["path"].endswith(":sage8")]
    assert sage and all(r["status"] == "unavailable" and "sage8" in r["reason"] for r in sage)
    prof = next(r for r in rows if r["section"] == "block" and r["path"] == "fp8:sdpa")["kernels"]
    assert prof and all(k["ms"] > 0 and k["calls"] > 0 for k in prof)  # --profile: its kernels
    assert 0 < sum(k["share"] for k in prof) <= 1.0 + 1e-9
    assert not any("kernels" in r for r in rows if r["path"] != "fp8:sdpa")
    (md,) = glob.glob(str(tmp_path / "h3-fp8_cpu_*.md"))
    assert "where the block's time goes" in open(md).read()
    assert data["config"]["fp8"] == "emulated (float32)" and "torchao" in data["versions"]
    assert data["targets"]["block_w1_target_ms"] == 80.0 and data["targets"]["w4_best_step_s"] > 0


def test_h3_fp8_fused_adaln_precision_and_mk_variant_rows(tmp_path):
    """fp8fastadaln runs the fused AdaLN forward (emulated on CPU: fuse_adaln=True, never a silent
    plain fp8fast) beside fp8fast, in the eager accuracy rows only when named; a '+mk' row is its
    own row and keeps its name in w4-seq, and never stands in for the W = 4 model's rest."""
    from benchmarks import h3_fp8

    h3_fp8.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--modes", "compiled",
                 "--sections", "block,w4,accuracy", "--compiled",
                 "fp8fastadaln:none@w4,fp8fast:none@w4,fp8fast:none+mk@w4", "--acc-compiled", "",
                 "--overlap", "1", "--rounds", "1"])
    rows = _check_result(tmp_path, "h3-fp8")["rows"]
    ok = {(r["section"], r["path"]) for r in rows if r.get("status") == "ok"}
    assert {("w4-rest", "fp8fastadaln:none@w4"), ("w4-rest", "fp8fast:none+mk@w4"),
            ("accuracy", "fp8:sdpa"), ("w4-seq", "fp8fast:sdpa+mk")} <= ok, ok
    acc = {r["path"]: r for r in rows if r["section"] == "accuracy"}
    assert "fp8fastadaln:sage8" in acc  # named in --compiled: its eager accuracy row exists (sage8: CPU says why)
    w4 = {r["path"] for r in rows if r["section"] == "w4"}
    assert not any("+" in p for p in w4), w4


def test_h3_fp8_accuracy_runs_the_compiled_paths_on_their_own_compiled_model(tmp_path, monkeypatch):
    """--acc-compiled: after the eager paths, each listed path builds its own model, compiles its
    blocks as the server does (aot_eager here: inductor on CPU costs ~30 s) and is compared with
    bf16:sdpa and with its own eager run."""
    from benchmarks import h3_fp8
    from dist_attn.models.h3.serve.h3 import model as h3_model

    compiled, built = [], []
    real, real_build = h3_model.compile_blocks, h3_model.build_h3

    def compile_blocks(model, **kwargs):
        compiled.append(model)
        real(model, backend="aot_eager")

    def build_h3(*args, **kwargs):
        built.append(real_build(*args, **kwargs))
        return built[-1]
    monkeypatch.setattr(h3_model, "compile_blocks", compile_blocks)
    monkeypatch.setattr(h3_model, "build_h3", build_h3)
    h3_fp8.main(["--smoke", "--out", str(tmp_path), "--device", "cpu", "--modes", "eager",
                 "--sections", "accuracy", "--acc-compiled", "fp8:sdpa,bf16:sage8"])
    rows = _check_result(tmp_path, "h3-fp8")["rows"]
    acc = {(r["path"], r["mode"]): r for r in rows if r["section"] == "accuracy"}
    eager, comp = acc["fp8:sdpa", "eager"], acc["fp8:sdpa", "compiled"]
    assert comp["status"] == "ok" and len(compiled) == 1  # sage8 has no CPU kernel: its row says why
    # built: the block sections' model, the eager paths' one (quantized in place for fp8), and the
    # compiled path's own
    assert len(built) == 3 and compiled[0] is built[2]
    assert acc["bf16:sage8", "compiled"]["status"] == "unavailable"
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in compiled[0].transformer_blocks)
    # the compiled model computes what the eager one does (aot_eager: the same kernels, regrouped)
    assert comp["video_vs_eager_rel_l2"] < 1e-5 and comp["audio_vs_eager_rel_l2"] < 1e-5
    assert comp["video_rel_l2"] == pytest.approx(eager["video_rel_l2"], rel=1e-2, abs=1e-6)
    assert "block0_rel_l2" not in comp  # no hook inside a fullgraph block
    assert comp["median_ms"] == comp["steps_ms"][-1] and len(comp["steps_ms"]) == 2  # the steady step


def test_h3_fp8_w4_model_counts_each_all_to_all_once_and_pipelines_chunks():
    """The W = 4 block model: plain = rest + pack + A_in + kernel + A_out + unpack (a run before
    2026-12-05 added the all-to-alls twice); C chunks pipelined hide part of the all-to-alls and
    never beat the kernel plus the rest; the kernels queue behind every pack call."""
    from benchmarks import h3_fp8

    parts = {"s_local": 9504, "heads": 14, "a_in_ms": 0.85, "a_out_ms": 0.28, "chunks": {
        ("sage8", 1, "even"): {"widths": [14], "pack_ms": 0.2, "pack_runs": [[1, 0.2]], "unpack_ms": 0.1,
                               "unpack_chunk_ms": [0.1], "kernel_ms": [12.6]},
        ("sage8", 4, "even"): {"widths": [4, 4, 3, 3], "pack_ms": 0.4,
                               "pack_runs": [[1, 0.1], [1, 0.1], [2, 0.2]], "unpack_ms": 0.13,
                               "unpack_chunk_ms": [0.04, 0.04, 0.03, 0.02], "kernel_ms": [3.7, 3.7, 2.8, 2.8]},
        ("sage8", 4, "waves"): {"widths": [2, 4, 4, 4], "pack_ms": 0.4, "pack_runs": [[1, 0.05], [3, 0.35]],
                                "unpack_ms": 0.13, "unpack_chunk_ms": [0.01, 0.04, 0.04, 0.04],
                                "kernel_ms": [1.8, 3.6, 3.6, 3.6]},
        ("fa3", 1, "even"): {"widths": [14], "pack_ms": 0.2, "pack_runs": [[1, 0.2]], "unpack_ms": 0.1,
                             "unpack_chunk_ms": [0.1], "kernel_ms": "fa3: needs a CUDA GPU"}}}
    rows: list[dict] = []
    h3_fp8.w4_rows(argparse.Namespace(step_blocks=50), parts, {("fp8", "compiled"): 6.7}, rows)
    by = {(r["path"], r["overlap_chunks"], r["chunking"]): r for r in rows}
    plain, chunked, waves = by["fp8:sage8", 1, "even"], by["fp8:sage8", 4, "even"], by["fp8:sage8", 4, "waves"]
    assert plain["median_ms"] == pytest.approx(6.7 + 0.2 + 0.85 + 12.6 + 0.28 + 0.1)
    assert plain["hidden_ms"] == pytest.approx(0.0, abs=1e-9)
    assert plain["step_s"] == pytest.approx(50 * plain["median_ms"] / 1e3)
    # pipelined: the first chunk's input arrives (0.1 + 0.85 * 4 / 14) before the last pack ends
    # (0.4), so the 4 kernels start at 0.4; then the first three unpacks (0.11) run while the last
    # chunk's output travels (0.28 * 3 / 14 = 0.06), and its unpack after them
    assert chunked["median_ms"] == pytest.approx(6.7 + 0.4 + 13.0 + 0.11 + 0.02)
    assert 0 < chunked["hidden_ms"] < chunked["comm_ms"] and chunked["median_ms"] < plain["median_ms"]
    assert chunked["pack_runs"] == [[1, 0.1], [1, 0.1], [2, 0.2]]
    assert waves["widths"] == [2, 4, 4, 4] and waves["kernel_chunk_ms"] == [1.8, 3.6, 3.6, 3.6]
    # the first three unpacks (0.09) take longer than the last output's 0.28 * 4 / 14 = 0.08
    assert waves["median_ms"] == pytest.approx(6.7 + 0.4 + 12.6 + 0.09 + 0.04)
    assert by["fp8:fa3", 1, "even"]["status"] == "unavailable"


def test_overlapped_model_starts_the_first_all_to_all_after_the_first_pack_call():
    """Where the all-to-alls are the bottleneck: chunk 0's input goes as soon as its own pack call
    ends (0.1), not after every pack (0.2), and each later chunk waits for its own call."""
    from benchmarks.scaling import overlapped_ms

    # in_end = [0.1 + 1, max(1.1, 0.2) + 1]; kernels [max(0.2, 1.1) + 0.5, max(1.6, 2.1) + 0.5]
    assert overlapped_ms([(1, 0.1), (1, 0.1)], [0.0, 0.0], 2.0, 0.0, [0.5, 0.5], [1, 1]) == pytest.approx(2.6)
    # a slow second pack call holds back chunk 1's input
    assert overlapped_ms([(1, 0.1), (1, 3.0)], [0.0, 0.0], 2.0, 0.0, [0.5, 0.5], [1, 1]) == pytest.approx(4.6)
    # ... and chunk 0's kernel too, though its input is there at 0.1: the kernels queue behind
    # every pack call on the compute stream (3.1 + 1.0 + 0.1, not max(0.1 + 1.0, 3.1) + 0.1)
    assert overlapped_ms([(1, 0.1), (1, 3.0)], [0.0, 0.0], 0.0, 0.0, [1.0, 0.1], [1, 1]) == pytest.approx(4.2)
    with pytest.raises(ValueError, match="cover 1 chunks"):
        overlapped_ms([(1, 0.1)], [0.0, 0.0], 2.0, 0.0, [0.5, 0.5], [1, 1])


def test_overlapped_model_unpacks_each_chunk_once_its_output_is_back():
    """The unpacks queue behind the last kernel; chunk 0's runs while chunk 1's output travels."""
    from benchmarks.scaling import overlapped_ms

    # in_end [1.0, 2.0]; kernels end 2.0, 3.0; the outputs (from in_end[1] = 2.0) end
    # [max(2.0, 2.0) + 1.0, max(3.0, 3.0) + 1.0] = [3.0, 4.0]
    # unpacks: max(3.0, 3.0) + 0.5 = 3.5, then max(3.5, 4.0) + 0.5 = 4.5
    assert overlapped_ms([(1, 0.0), (1, 0.0)], [0.5, 0.5], 2.0, 2.0, [1.0, 1.0], [1, 1]) == pytest.approx(4.5)
    # a slow first unpack delays the second past its output's arrival
    assert overlapped_ms([(1, 0.0), (1, 0.0)], [2.0, 0.5], 2.0, 2.0, [1.0, 1.0], [1, 1]) == pytest.approx(5.5)


def test_h3_fp8_w4_sequence_times_the_block_in_one_piece_and_adds_the_all_to_alls_from_bytes():
    """w4-seq: for each compiled rest at 9,504 rows, rest + pack + the 14-head kernel + unpack run
    back to back (in that order, once per timed call), timed in --rounds passes, plus A_in + A_out;
    then profiled: the kernels' own time beside the wall time (the GPU's waiting)."""
    import torch

    from benchmarks import h3_fp8
    from benchmarks.harness import Budget

    calls: list[str] = []
    timers = {("pack", (14,), 0): lambda: calls.append("pack"), ("unpack", (14,), 0): lambda: calls.append("unpack"),
              ("kernel", "sage8", 14): lambda: calls.append("sage8")}
    live = [({"section": "w4-rest", "path": "fp8fast:none@w4", "mode": "compiled", "status": "ok"},
             lambda *a: calls.append("rest"), ()),
            ({"section": "w4-rest", "path": "bf16:none@w4", "mode": "compiled", "status": "error"},
             lambda *a: calls.append("failed rest"), ()),
            ({"section": "block", "path": "fp8fast:sage8", "mode": "compiled", "status": "ok"},
             lambda *a: calls.append("w1"), ())]
    parts = {"timers": timers, "heads": 14, "s_local": 9504, "a_in_ms": 0.85, "a_out_ms": 0.28}
    args = argparse.Namespace(rounds=2, iters=3, warmup=1, step_blocks=50, compile_reserve_s=0.0)
    rows: list[dict] = []
    h3_fp8.run_w4_sequence(args, parts, live, torch.device("cpu"), Budget(None), rows)
    (row,) = rows  # no sdpa kernel measured, no W = 1 block, no failed rest: one row
    assert row["section"] == "w4-seq" and row["path"] == "fp8fast:sage8" and len(row["rounds_ms"]) == 2
    # 2 rounds of warm-up + iters, then 3 calls under the profiler (the kernels' own time)
    assert calls == ["rest", "pack", "sage8", "unpack"] * (2 * (3 + 1) + 3)
    assert row["busy_ms"] >= 0 and row["idle_ms"] is None  # CPU: no device timeline
    assert row["a2a_ms"] == pytest.approx(0.85 + 0.28)
    assert row["median_ms"] == pytest.approx(row["compute_ms"] + 1.13)
    assert row["step_s"] == pytest.approx(50 * row["median_ms"] / 1e3)
    assert row["compute_ms"] == pytest.approx(statistics.median(row["rounds_ms"]))


def test_h3_fp8_time_rounds_interleaves_and_keeps_a_failing_path_as_an_error_row():
    """--rounds passes, each over every path in turn; a path that raises in a later round is an
    error row (its reason kept) and is not called again; the others get their medians."""
    import torch

    from benchmarks import h3_fp8
    from benchmarks.harness import Budget

    order: list[str] = []
    n = {"b": 0}

    def b():
        n["b"] += 1
        order.append("b")
        if n["b"] > 2:  # 1 warm-up + 1 timed call in round 1, then it fails
            raise RuntimeError("out of memory")

    a, bb, c = {}, {}, {}
    args = argparse.Namespace(rounds=3, iters=1, warmup=1)
    h3_fp8._time_rounds([(a, lambda: order.append("a")), (bb, b), (c, lambda: order.append("c"))], args,
                        torch.device("cpu"), Budget(None), 0.0)
    assert order == ["a", "a", "b", "b", "c", "c", "a", "a", "b", "c", "c", "a", "a", "c", "c"]
    assert len(a["rounds_ms"]) == len(c["rounds_ms"]) == 3 and a["median_ms"] == statistics.median(a["rounds_ms"])
    assert a["rounds"].count(" / ") == 2 and a["min_ms"] <= a["median_ms"]
    assert bb["status"] == "error" and "out of memory" in bb["reason"] and len(bb["rounds_ms"]) == 1


def test_job_model_takes_the_double_counted_all_to_all_off_rows_written_before_the_fix():
    """h3-fp8 w4 rows of 2026-12-04 (no ``a2a_in_ms``) counted q/k/v-in + out twice; the job
    model takes one count off, computed from the run's own config; newer rows are read as they are."""
    from benchmarks.job_model import w4_block_ms

    config = {"model": {"num_attention_heads": 56, "attention_head_dim": 128}, "bandwidth_gbs": 360.0}
    old = {"median_ms": 21.89, "rows": 9504, "heads": 14}
    once = 4 * 9504 * 42 * 128 * 2 / 360e9 * 1e3  # 1.135 ms
    assert w4_block_ms(old, config) == pytest.approx(21.89 - once) and once == pytest.approx(1.1354, abs=1e-3)
    new = {**old, "a2a_in_ms": 0.85, "median_ms": 20.75}
    assert w4_block_ms(new, config) == 20.75


def test_job_model_reads_the_measured_step_outside_the_blocks_when_there_is_one(tmp_path,
                                                                               monkeypatch):
    """benchmarks.job_model's term outside the blocks: the newest serve-h3-job-outside file of an
    identity-blocks run with the real configs and the mode's compile setting, its median step
    (warm-up job left out); else the W = 1 step less its blocks; the text names which."""
    import json

    import benchmarks.job_model as jm

    monkeypatch.setattr(jm, "RESULTS", str(tmp_path))
    s, how, name = jm.outside_blocks(5.0, 50, 0.096, compiled=True)
    assert s == pytest.approx(0.2) and "less 50 W = 1 blocks of 96.00 ms" in how and name is None
    rows = [{"warmup": True, "step_s": [9.0, 9.0]}, {"warmup": False, "step_s": [0.31, 0.12, 0.13]}]
    runs = (("2026-12-01", 10.0, "identity", True), ("2026-12-06", 1.0, "identity", True),
            ("2026-12-07", 3.0, "real", True), ("2026-12-08", 5.0, "identity", False))
    for date, scale, blocks, compile_ in runs:
        with open(tmp_path / f"serve-h3-job-outside_h200_{date}.json", "w") as f:
            json.dump({"config": {"blocks": blocks, "real_configs": True, "compile": compile_},
                       "rows": [{**r, "step_s": [x * scale for x in r["step_s"]]} for r in rows]}, f)
    s, how, name = jm.outside_blocks(5.0, 50, 0.096, compiled=True)  # newest identity + compiled
    assert s == pytest.approx(0.13) and name == "serve-h3-job-outside_h200_2026-12-06.json"
    assert how.endswith(name)
    s, _, name = jm.outside_blocks(5.0, 50, 0.096, compiled=False)
    assert s == pytest.approx(0.65) and name == "serve-h3-job-outside_h200_2026-12-08.json"


def test_common_flags_refuse_what_they_cannot_honour(capsys):
    """--iters 0 was recorded while max(1, iters) calls were timed; --device cuda on a machine
    without CUDA raised an AssertionError deep in a benchmark (or, in vae_decode, quietly ran on
    the CPU); --hardware a/b failed writing the file. Each is refused at parsing, by name."""
    import torch

    from benchmarks.harness import add_common_args

    p = argparse.ArgumentParser(prog="bench")
    add_common_args(p, iters=3, warmup=1, budget_s=0)
    bad = [(["--iters", "0"], "argument --iters: 0 must be >= 1"),
           (["--warmup", "-1"], "argument --warmup: -1 must be >= 0"),
           (["--budget-s", "-5"], "argument --budget-s: -5 must be >= 0"),
           (["--hardware", "a/b"], "argument --hardware: 'a/b' must be a non-empty file-name part")]
    if not torch.cuda.is_available():
        bad.append((["--device", "cuda"], "argument --device: 'cuda' asked for, but "
                                          "torch.cuda.is_available() is False"))
    for argv, needle in bad:
        with pytest.raises(SystemExit):
            p.parse_args(argv)
        assert needle in capsys.readouterr().err, argv
    assert p.parse_args(["--iters", "1", "--device", "cpu"]).iters == 1


def test_device_timeline_ms_on_cpu_sums_the_ops_and_has_no_idle():
    """On CPU the profiler's time per call of fn's ops: some for a matmul, none for a call with no
    ops; no device timeline, so no idle time (the GPU case runs in tests/core/test_gpu_core.py)."""
    import torch

    from benchmarks.harness import device_timeline_ms

    a = torch.randn(256, 256)
    busy, idle = device_timeline_ms(lambda: a @ a, torch.device("cpu"))
    assert busy > 0 and idle is None
    assert device_timeline_ms(lambda: None, torch.device("cpu")) == (0, None)


def test_smoke_keeps_the_options_the_caller_gave():
    """--smoke used to overwrite --iters (and other options) silently in five benchmarks: a
    caller asking for --smoke --iters 5 got 2. Options the command line did not set still shrink;
    one it set keeps its value even when that value is the default."""
    from benchmarks.harness import add_common_args, smoke_values

    p = argparse.ArgumentParser(prog="bench")
    p.add_argument("--rounds", type=int, default=3)
    add_common_args(p, iters=10, warmup=2, budget_s=0)
    for argv, want in ((["--smoke", "--iters", "5"], (5, 1, 1)),
                       (["--smoke", "--iters=10", "--rounds", "3"], (10, 1, 3)),  # the defaults, given
                       (["--smoke"], (2, 1, 1)),
                       (["--iters", "5"], (5, 2, 3))):  # no --smoke: nothing changes
        args = p.parse_args(argv)
        smoke_values(p, args, argv, iters=2, warmup=1, rounds=1)
        assert (args.iters, args.warmup, args.rounds) == want, argv
    assert p.get_default("iters") == 10  # the parser's defaults are restored
    p.set_defaults(rounds=4)  # a parser-level default is not a given option either
    args = p.parse_args(["--smoke"])
    smoke_values(p, args, ["--smoke"], rounds=1)
    assert args.rounds == 1 and p.get_default("rounds") == 4
    args = p.parse_args(["--smoke"])
    args.later = 1  # set after parsing: not an option
    with pytest.raises(AttributeError, match="'later' is not an option"):
        smoke_values(p, args, ["--smoke"], later=2)


@pytest.mark.parametrize("argv,needle", [
    (["kernels", "--smoke", "--kernels", "nosuch"], "--kernels 'nosuch': 'nosuch' matches no kernel"),
    (["kernels", "--smoke", "--kernels", "dense:sdpa*,sage8_glun"], "'sage8_glun' matches no kernel"),
    (["h3_fp8", "--smoke", "--compiled", "fp8tfst:sage8"], "--compiled entry 'fp8tfst:sage8' must be"),
    (["h3_fp8", "--smoke", "--compiled", "fp8:sage8@w4"], "--compiled entry 'fp8:sage8@w4' must be"),
    (["h3_fp8", "--smoke", "--acc-compiled", "fp8fast:native"], "--acc-compiled entry 'fp8fast:native' must be"),
    (["h3_fp8", "--smoke", "--compiled", "fp8fast:none@w4+mk"], "'@w4' comes last"),
    (["h3_fp8", "--smoke", "--compiled", "fp8fast:sage8+mkk"], "'+mkk' is not one of +mk"),
    (["job_model", "--budget-s", "5"], "--budget-s 5 would not be honoured"),
    (["job_model", "--steps", "-3"], "--steps=-3 must be >= 2"),
    (["job_model", "--paths", "foo"], "--paths entry 'foo' must be <linears>:<attention>:<mode>"),
    (["scaling", "--smoke", "--modeled", "--ranks", "0"],
     "argument --ranks: '0' must be comma-separated ints >= 1"),
    # it timed h3-ref on the CPU for minutes, silently
    (["scaling", "--modeled"], "--modeled times each rank's work on one GPU, and CUDA is not available"),
], ids=["kernels_none", "kernels_typo", "h3_fp8_compiled_typo", "h3_fp8_compiled_w4_attention",
        "h3_fp8_acc_compiled_attention", "h3_fp8_variant_before_w4", "h3_fp8_variant_typo", "job_model_budget", "job_model_steps", "job_model_paths",
        "scaling_ranks", "scaling_modeled_needs_a_gpu"])
def test_benchmark_specific_flags_are_checked(argv, needle, tmp_path):
    """Each wrote rows of nonsense (negative forwards, zero rows with exit 0) or crashed with a
    raw traceback (ZeroDivisionError, 'not enough values to unpack')."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{argv[0]}", *argv[1:], "--out",
                           str(tmp_path)], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_a_run_into_the_tracked_results_says_so(tmp_path, monkeypatch, capsys):
    """benchmarks.job_model (a model computed on the CPU) wrote job-modeled_h200_<date> into the
    tracked benchmarks/results/ without a word. A run whose files go to the default folder now
    says so first, and how to write elsewhere."""
    import benchmarks.harness as harness
    import benchmarks.job_model as job_model

    monkeypatch.setattr(harness, "DEFAULT_OUT_DIR", str(tmp_path))  # the tracked folder's stand-in
    monkeypatch.setattr(sys, "argv", ["job_model"])
    job_model.main()
    out = capsys.readouterr().out
    first = out.splitlines()[0]
    assert first.startswith("[job-modeled] writing job-modeled_h200_") and "git tracks" in first, out[:500]
    assert "pass --out DIR" in first and "cpu" in first, first
    monkeypatch.setattr(sys, "argv", ["job_model", "--out", str(tmp_path / "elsewhere")])
    job_model.main()
    assert "git tracks" not in capsys.readouterr().out


def test_h3_fp8_takes_the_cute_loop_in_compiled_rows_only(capsys):
    """sage8_cute (an opt-in extra) is a --compiled attention name, and the refusal of an unknown
    one lists it; the eager pass never runs it."""
    from benchmarks import h3_fp8

    with pytest.raises(SystemExit):
        h3_fp8.main(["--smoke", "--compiled", "fp8:sage8_cutex"])
    assert "sage8_cute" in capsys.readouterr().err
    assert h3_fp8._split_key("fp8:sage8_cute")[:2] == ("fp8", "sage8_cute")
    assert "sage8_cute" not in h3_fp8._ATTN
