# SPDX-License-Identifier: Apache-2.0
"""Repository-wide rules for source files: every Python file carries the project's SPDX license
line, and the package's docstrings and comments state contracts, not history."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

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


_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
#: What a docstring or comment of the package must not carry: history (dates, this project's
#: issues and pull requests) and pointers to dated result files. Legitimate text stays clear:
#: ``sm_90``, ``2.11``, ``0x4B400000``, "issues S = Q K^T", ``owner/repo#123`` (an upstream bug).
_HISTORY = {
    "a date": re.compile(rf"(?<![\d.-])20\d\d-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?(?!\d)"
                         rf"|(?<!\d)20\d\d(?:0[1-9]|1[0-2])(?:0[1-9]|[12]\d|3[01])-\d{{6}}(?!\d)"
                         rf"|\b{_MONTH} \d{{1,2}},? 20\d\d\b|\b\d{{1,2}} {_MONTH} 20\d\d\b"),
    "an issue reference": re.compile(r"\b(?:tracker\s+)?issues?\s+#?\d+\b|\bPRs?\s+#?\d+\b"
                                     r"|(?<![\w/.-])#\d+\b", re.I),
    "a result file": re.compile(r"benchmarks/results\b|\bresults/[\w*-]|\b[a-z0-9]+(?:-[a-z0-9]+)+_\*"
                                r"|_(?:[a-z]{1,2}\d{2,3}|cpu)(?:x\d+)?_(?:20\d\d|\*)"
                                r"|KERNEL_NOTES\.md,?\s+(?:v\d|section)", re.I),
    "a path outside the repository": re.compile(r"(?<![\w.])/(?:work|home)/"),
}


def _history_in(text: str) -> str | None:
    """What of :data:`_HISTORY` ``text`` carries (the rule's name and the match), or None."""
    for rule, pattern in _HISTORY.items():
        m = pattern.search(text)
        if m:
            return f"{rule} ({m.group(0)!r})"
    return None


def _docs_and_comments(path: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment (tokenize) and every docstring (ast: a bare string
    statement, the docstrings of modules, classes and functions and those under a dataclass field)
    of the Python file ``path``. String literals that run (error messages) are not among them."""
    with open(path, encoding="utf-8") as f:
        src = f.read()
    tokens = tokenize.generate_tokens(io.StringIO(src).readline)
    found = [(t.start[0], t.string.lstrip("#:")) for t in tokens if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(src, path)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            found += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return found


def test_package_docstrings_and_comments_state_contracts_not_history():
    """dist_attn/'s docstrings and comments carry no date, no issue or pull-request number of this
    project and no result file name: measurements and history live in docs/ and
    benchmarks/KERNEL_NOTES.md, and a comment names the benchmark that measures its number."""
    for history in ("since 2026-12-04", "(issue 24)", "tracker issue 10", "PR #33398", "see #33",
                    "``kernels-side_h100_2026-12-07``", "benchmarks/results/x.json", "vae-decode_*",
                    "KERNEL_NOTES.md v3", "/work/shared/h3.md", "on Dec 4, 2026",
                    "overhead_nvidia-h200x1_20261203-091523", "h3-fp8_a100_*"):
        assert _history_in(history), history
    for fine in ("sm_90 SASS", "torch 2.11, triton 3.6", "0x4B400000", "ptxas issues S = Q K^T",
                 "huggingface/diffusers#14754", "# 28 a call", "see benchmarks/KERNEL_NOTES.md",
                 "run_on_cpu_only", "2048-1024 rows", "1.12x cuDNN"):
        assert _history_in(fine) is None, fine
    bad = []
    for path in _python_files("dist_attn"):
        for line, text in _docs_and_comments(os.path.join(ROOT, path)):
            what = _history_in(text)
            if what:
                bad.append(f"{path}:{line}: {what}: {text.strip()}")
    assert not bad, "history in docstrings or comments (move it to docs/*.md):\n" + "\n".join(bad)
