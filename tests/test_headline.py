# SPDX-License-Identifier: Apache-2.0
"""The README's headline table is generated from result files of one GPU (benchmarks/headline.py)."""

from __future__ import annotations

import os

import pytest

from benchmarks import headline
from benchmarks.harness import DEFAULT_OUT_DIR
from tests.conftest import ROOT


def test_readme_table_is_the_generated_one():
    h = headline.collect(DEFAULT_OUT_DIR, "h100", "2026-12-07")
    assert h["gpu"] == "NVIDIA H100 80GB HBM3"
    assert 0 < h["kernels_ms"][14]["fa3_fp8_prequant"] < h["kernels_ms"][14]["sdpa_cudnn"]
    text = headline.table(h)
    assert "fast accumulation (not the default)" in text and "MODELED" in text
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert text in f.read(), "README's headline table differs from `python -m benchmarks.headline`"


def test_a_missing_source_is_named(tmp_path):
    with pytest.raises(SystemExit, match="kernels-side_h100_2026-12-07.json is missing"):
        headline.collect(str(tmp_path), "h100", "2026-12-07")
