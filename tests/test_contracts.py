# SPDX-License-Identifier: Apache-2.0
"""Repository-wide rules for source files: every Python file carries the project's SPDX license
line."""

from __future__ import annotations

import os

from tests.conftest import ROOT

SPDX = "# SPDX-License-Identifier: Apache-2.0"


def _python_files(*tops: str) -> list[str]:
    """The .py files below ``tops`` (relative to the repository root), caches and hidden folders
    skipped; paths relative to the root."""
    found = []
    for top in tops:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            found += [os.path.relpath(os.path.join(dirpath, f), ROOT)
                      for f in sorted(filenames) if f.endswith(".py")]
    return found


def test_every_python_file_carries_the_spdx_line():
    """The first line (the second after a shebang) is the Apache-2.0 SPDX identifier."""
    files = _python_files("dist_attn", "launch", "tests", "benchmarks")
    assert len(files) > 100
    missing = []
    for path in files:
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            lines = f.read().splitlines()[:2]
        if lines and lines[0].startswith("#!"):
            lines = lines[1:]
        if not lines or lines[0] != SPDX:
            missing.append(path)
    assert not missing, "no SPDX line first: " + ", ".join(missing)
