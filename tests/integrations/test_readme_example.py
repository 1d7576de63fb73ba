# SPDX-License-Identifier: Apache-2.0
"""The complete diffusers script of docs/diffusers.md runs as written under torchrun on 2 CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install -e '.[diffusers]')")

from tests.conftest import ROOT, free_port, subprocess_env  # noqa: E402

# The script is the python block of docs/diffusers.md (what users read; the README links it) that
# opens with this line.
MARKER = "# wan_ulysses.py"
SOURCES = ("docs/diffusers.md",)


def _example() -> tuple[str, str]:
    for rel in SOURCES:
        path = os.path.join(ROOT, rel)
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
            if block.startswith(MARKER):
                return rel, block
    raise AssertionError(f"no ```python block starting with {MARKER!r} in {SOURCES}")


def test_readme_diffusers_example_runs_on_two_gloo_ranks(tmp_path):
    source, code = _example()
    script = tmp_path / "wan_ulysses.py"
    script.write_text(code, encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(),
                         timeout=180)
    assert res.returncode == 0, f"the example of {source} failed:\n{res.stdout}\n{res.stderr[-4000:]}"
    assert re.search(r"^2 ranks: output \(2, 4, 3, 6, 10\), max \|difference\| to one device",
                     res.stdout, flags=re.M), res.stdout
