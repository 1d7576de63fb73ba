# SPDX-License-Identifier: Apache-2.0
"""Runs a script under Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before
triton decorates a kernel, so never in the test process itself)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(*argv: str, min_triton: tuple[int, int] = (3, 9), why: str = "") -> list[str]:
    """``python -W ignore *argv`` under the interpreter, no GPU; skips (with the reason) without
    triton or below ``min_triton`` (``why`` says what needs it); the script must exit 0 and print
    OK last. Returns its stdout lines."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable: the interpreter tests need it (pip install triton)")
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < min_triton:
        want = ".".join(map(str, min_triton))
        pytest.skip(f"{why or 'the interpreter run'} needs triton >= {want}, found {triton.__version__}")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-W", "ignore", *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines and lines[-1] == "OK", proc.stdout
    return lines
