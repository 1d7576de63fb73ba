# SPDX-License-Identifier: Apache-2.0
"""benchmarks/h200.sh, the one driver of the H200 runs, checked on CPU through --dry-run: every
subcommand its header lists expands to commands whose modules, tests and scripts exist, and a
wrong subcommand is refused before anything runs (a typo must not cost a device call)."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import ROOT

DRIVER = os.path.join(ROOT, "benchmarks", "h200.sh")


def _header_subcommands() -> list[str]:
    with open(DRIVER, encoding="utf-8") as fh:
        head = fh.read().split("\nset -u", 1)[0]
    return re.findall(r"^#   ([a-z0-9][a-z0-9-]*) {2,}", head, flags=re.M)


def _dry(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", DRIVER, "--dry-run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "OUT": "/nonexistent/out"})


def _steps(out: str) -> list[str]:
    """The step lines of a dry run ('NAME (cap Ns): COMMAND'), setup and build lines left out."""
    return [ln for ln in out.splitlines() if re.match(r"^\S.* \(cap \d+s\): ", ln)]


SUBCOMMANDS = _header_subcommands()
#: the two calls that carry CuTe DSL's wheels over (a setup, no result): named only, never by "all"
CUTE_SETUP = ("cute-a", "cute-b")
with open(DRIVER, encoding="utf-8") as _fh:  # the driver's CUTE=(...), TREES=(...): named only
    _text = _fh.read()
    NAMED_ONLY = tuple(name for lst in ("CUTE", "TREES")
                       for name in re.search(rf"^{lst}=\(([^)]*)\)", _text, re.M).group(1).split())


def test_header_lists_the_runs_by_what_they_measure():
    # the names the runs had before the scripts were merged keep working
    kept = {"decode", "job", "job-full", "job-full-compiled", "job-full-fp8", "decode-mux", "fp8-tests", "fp8"}
    assert kept <= set(SUBCOMMANDS) and {"tests", "kernels", "kernels-side", "accuracy", "h3", "all"} <= set(
        SUBCOMMANDS), SUBCOMMANDS
    assert len(SUBCOMMANDS) == len(set(SUBCOMMANDS))
    with open(DRIVER, encoding="utf-8") as fh:
        text = fh.read()
    assert "export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in text


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_each_subcommand_expands_to_commands_that_exist(sub):
    res = _dry(sub)
    assert res.returncode == 0, res.stderr
    steps = _steps(res.stdout)
    assert steps, res.stdout
    for line in steps:
        cmd = line.split("): ", 1)[1]
        if sub in CUTE_SETUP:  # a copy and an install: the wheels' halves, nothing written to $OUT
            assert "/tmp/cute-wheels" in cmd, line
            continue
        assert "/nonexistent/out" in cmd, line  # every step writes where $OUT says
        targets = re.findall(r"-m (benchmarks(?:\.\w+)+)", cmd)
        tests = re.findall(r"-m pytest ((?:tests/\S+\.py ?)+)", cmd)
        scripts = re.findall(r"\b(launch/\w+\.py)\b", cmd)
        assert targets or tests or scripts, line
        for mod in targets:
            assert os.path.isfile(os.path.join(ROOT, *mod.split(".")) + ".py"), line
        for path in " ".join(tests).split() + scripts:
            assert os.path.isfile(os.path.join(ROOT, path)), line


def test_all_runs_every_subcommand_once_in_the_header_order():
    every = _steps(_dry("all").stdout)
    one_by_one = [s for sub in SUBCOMMANDS if sub not in ("all", *NAMED_ONLY) for s in _steps(_dry(sub).stdout)]
    assert every == one_by_one


def test_cute_dsl_arrives_in_two_halves_joined_before_install():
    cmd = " ".join(_steps(_dry("cute-b").stdout))
    assert "cu13part.aa" in cmd and "cu13part.ab" in cmd and "-m zipfile -e" in cmd and "/tmp/site" in cmd
    assert cmd.index("cat ") < cmd.index("zipfile")
    # a --target install reads no .pth file: CuTe DSL's packages must be on PYTHONPATH themselves
    assert "PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:" in _dry("cute-check").stdout


@pytest.mark.parametrize("args", [("bogus",), ("decode", "bogus"), ()])
def test_a_wrong_or_missing_subcommand_is_refused_before_anything_runs(args):
    res = _dry(*args)
    assert res.returncode != 0
    assert "h200.sh: " in res.stderr and ("unknown subcommand 'bogus'" in res.stderr or not args)
    assert res.stdout == ""  # no setup, no step


def test_the_kernels_doc_command_is_what_the_driver_runs():
    """docs/kernels.md shows the command `h200.sh --dry-run kernels-side` prints; it had fallen
    behind (its --kernels list lacked a row the driver runs)."""
    import shlex

    with open(os.path.join(ROOT, "docs", "kernels.md"), encoding="utf-8") as fh:
        doc = fh.read()
    block = re.search(r"bash benchmarks/h200.sh --dry-run kernels-side[^\n]*\n(.*?)```", doc, flags=re.S)
    assert block, "docs/kernels.md no longer shows the kernels-side dry run"
    shown = shlex.split(block.group(1).replace("\\\n", " "))
    (step,) = [ln for ln in _steps(_dry("kernels-side").stdout) if ln.startswith("kernels-side ")]
    run = shlex.split(step.split("): ", 1)[1])
    module = run.index("-m")
    assert shown[:3] == ["python", "-m", run[module + 1]], (shown, run)

    def flags(args):
        out, key = {}, None
        for a in args:
            if a.startswith("--"):
                key = a
                out[key] = None
            elif key is not None:
                out[key], key = a, None
        return out

    ran, doc_flags = flags(run[module + 2:]), flags(shown[3:])
    for key in ("--out", "--theme"):  # where the driver writes: not the reader's business
        ran.pop(key, None)
    assert doc_flags == ran, (doc_flags, ran)
