# SPDX-License-Identifier: Apache-2.0
"""The README and docs/ say what the repository does: the library example runs as written, CI runs
the README's test command, and every relative link points at a file that exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, free_port, subprocess_env

README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")

#: Link targets that another branch adds. Remove an entry once the file is on main: from then on a
#: missing file fails the test.
PENDING: frozenset[str] = frozenset()


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read()


def _markdown_files() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, n) for n in os.listdir(DOCS) if n.endswith(".md"))


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def test_ci_runs_exactly_the_readme_test_command():
    """`.ci/run` promises "exactly the README's test command": its last line is that command."""
    ci = [ln for ln in _read(os.path.join(ROOT, ".ci", "run")).splitlines() if ln.strip()]
    readme_cmds = [ln for block in _bash_blocks(_read(README)) for ln in block.splitlines()
                   if "-m pytest" in ln]
    assert len(readme_cmds) == 1, readme_cmds
    assert ci[-1] == readme_cmds[0], (ci[-1], readme_cmds[0])


def test_readme_main_command_runs_the_cpu_default_server():
    """The main job's command: the CPU default of launch/serve.py under torchrun, 4 ranks."""
    cmds = [ln for block in _bash_blocks(_read(README)) for ln in block.splitlines()
            if ln.startswith("python3 -m venv")]
    assert len(cmds) == 2, cmds  # the main job and the tests
    main = [c for c in cmds if "pytest" not in c]
    assert main == ["python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 "
                    "-e '.[serve,diffusers]' && torchrun --nproc-per-node 4 launch/serve.py"], main
    assert os.path.exists(os.path.join(ROOT, "launch", "serve.py"))


def test_readme_fits_two_screens_with_a_picture():
    # two screens of ~50 lines: the title, the two commands, one example and the headline with its
    # plot; the first hour's notes (GPU install, versions, serving, stopping, troubleshooting) are
    # one link away in docs/ (test_the_first_hours_questions_are_answered_one_link_away)
    text = _read(README)
    assert len(text.splitlines()) <= 100
    assert re.search(r"^!\[[^\]]+\]\([^)\s]+\.png\)$", text, flags=re.M), "no picture in README.md"


def _section(path: str, title: str) -> str:
    text = _read(path)
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def test_the_first_hours_questions_are_answered_one_link_away():
    """A new user found no GPU install line naming every extra, no supported versions, no word
    that the default weights are random, no way to stop the server without a traceback, no status
    of multi-GPU and no troubleshooting; and "the CPU build these machines install from local
    disk" meant nothing to them. The README links each answer's section of docs/."""
    text = _read(README)
    assert "local disk" not in text and "the CPU wheel of torch" in text
    for link in ("docs/library.md#versions-and-gpus", "docs/serving.md#quick-start",
                 "docs/serving.md#troubleshooting"):
        assert f"]({link})" in text, link
    library, serving = os.path.join(DOCS, "library.md"), os.path.join(DOCS, "serving.md")
    versions = _section(library, "Versions and GPUs")
    for needle in ("pip install -e '.[gpu,serve,diffusers,fp8]'", "Python 3.11", "torch 2.13.0",
                   "CUDA 13.0", "H100", "H200", "Hopper"):
        assert needle in versions, needle
    assert "Nothing has run on more than one GPU" in versions and "gloo" in versions
    start = _section(serving, "Quick start")
    assert "random" in start and "noise" in start and "--checkpoint" in start
    assert "python launch/serve.py --nproc-per-node 4" in start  # the interactive command
    assert "Ctrl-C" in start and "SignalException" in start  # and why not torchrun's
    trouble = _section(serving, "Troubleshooting")
    for needle in ("pip install -e '.[serve]'", "--port", "heads", "memory"):
        assert needle in trouble, needle


def test_relative_links_resolve():
    missing = []
    for path in _markdown_files():
        base = os.path.dirname(path)
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(path)):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            rel = os.path.normpath(os.path.join(base, target.split("#", 1)[0]))
            name = os.path.relpath(rel, ROOT)
            if not os.path.exists(rel) and name not in PENDING:
                missing.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not missing, missing


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for title in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def test_anchors_in_docs_links_exist():
    bad = []
    for path in _markdown_files():
        base = os.path.dirname(path)
        for target in re.findall(r"\]\(([^)\s]+)\)", _read(path)):
            if "#" not in target or re.match(r"[a-z]+://", target):
                continue
            file, anchor = target.split("#", 1)
            dest = os.path.normpath(os.path.join(base, file)) if file else path
            if dest.endswith(".md") and os.path.exists(dest) and anchor not in _anchors(_read(dest)):
                bad.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not bad, bad


def test_readme_library_example_runs_on_two_gloo_ranks(tmp_path):
    blocks = [b for b in re.findall(r"```python\n(.*?)```", _read(README), flags=re.S)
              if b.startswith("# ulysses_example.py")]
    assert len(blocks) == 1, "no ```python block starting with '# ulysses_example.py' in README.md"
    script = tmp_path / "ulysses_example.py"
    script.write_text(blocks[0], encoding="utf-8")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=subprocess_env(),
                         timeout=180)
    assert res.returncode == 0, f"README's library example failed:\n{res.stdout}\n{res.stderr[-4000:]}"
    for rank in (0, 1):
        assert re.search(rf"rank {rank}: \(2, 45, 6, 16\) matches one-device attention", res.stdout), \
            res.stdout


def test_library_doc_example_gathers_the_attention_output():
    """docs/library.md's first example gathered x_local (its input) back, not the attention's
    output: what a reader copies must gather what attn returned."""
    import ast

    block = re.findall(r"```python\n(.*?)```", _read(os.path.join(DOCS, "library.md")), flags=re.S)[0]
    tree = ast.parse(block)
    outputs = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "attn"
               for t in node.targets if isinstance(t, ast.Name)}
    gathered = [node.args[0].id for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "gather_sequence"]
    assert outputs and gathered and set(gathered) <= outputs, (outputs, gathered)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
