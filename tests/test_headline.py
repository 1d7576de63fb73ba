# SPDX-License-Identifier: Apache-2.0
"""The README's headline table is generated from result files of one GPU (benchmarks/headline.py)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from benchmarks import headline
from benchmarks.harness import DEFAULT_OUT_DIR
from tests.conftest import ROOT


def _source(name):
    with open(os.path.join(DEFAULT_OUT_DIR, name), encoding="utf-8") as f:
        return json.load(f)


def test_readme_table_is_the_generated_one():
    h = headline.collect(DEFAULT_OUT_DIR, "h100", "2026-12-07")
    assert h["gpu"] == "NVIDIA H100 80GB HBM3"
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert headline.table(h) in f.read(), "README's table differs from `python -m benchmarks.headline`"


def test_each_number_is_its_sources_row():
    h = headline.collect(DEFAULT_OUT_DIR, "h100", "2026-12-07")
    block = _source(h["sources"]["block"])["rows"]
    # the block row is the library's default AdaLN path (with fast accumulation, which the label says)
    ours = [r for r in block if r.get("section") == "block" and r.get("path") == "fp8fastadaln:sage8"]
    assert h["block_ms"]["ours"] == ours[0]["median_ms"]
    assert h["modeled_w4_step_s"] == min(r["step_s"] for r in block
                                         if r.get("section") == "w4" and r.get("path") == "fp8fastadaln:sage8")
    mem = _source(h["sources"]["memory"])["rows"]
    assert h["memory_rank0_gb"] == {f"W={r['world']} {r['precision']}": round(r["peak_gb"], 1) for r in mem}
    kernels = _source(h["sources"]["kernels"])["rows"]
    cudnn = [r for r in kernels if r.get("kernel") == "sdpa_cudnn" and r.get("heads") == 14]
    assert h["kernels_ms"][14]["sdpa_cudnn"] == cudnn[0]["median_ms"]


def test_a_missing_source_or_row_is_named(tmp_path):
    with pytest.raises(SystemExit, match="kernels-side_h100_2026-12-07.json is missing"):
        headline.collect(str(tmp_path), "h100", "2026-12-07")
    for theme in headline.SOURCES:
        shutil.copy(os.path.join(DEFAULT_OUT_DIR, f"{headline.SOURCES[theme]}_h100_2026-12-07.json"), tmp_path)
    path = tmp_path / "kernels-side_h100_2026-12-07.json"
    d = json.loads(path.read_text())
    d["rows"] = [r for r in d["rows"] if r.get("kernel") != "sage2_direct"]
    path.write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="kernels-side_h100_2026-12-07.json has no speed row with .*sage2_direct"):
        headline.collect(str(tmp_path), "h100", "2026-12-07")
    d = json.loads((tmp_path / "h3-memory_h100_2026-12-07.json").read_text())
    d["gpu"] = "NVIDIA H200"
    (tmp_path / "h3-memory_h100_2026-12-07.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit, match="different GPUs"):
        headline.collect(str(tmp_path), "h100", "2026-12-07")
