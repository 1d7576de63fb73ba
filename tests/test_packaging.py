# SPDX-License-Identifier: Apache-2.0
"""What a user installs: the extras and their install hints, the package metadata, a missing
extra at launch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import ROOT, subprocess_env

PYPROJECT = os.path.join(ROOT, "pyproject.toml")


def _project() -> dict:
    with open(PYPROJECT, "rb") as f:
        return tomllib.load(f)["project"]


def _tracked_text_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [os.path.join(ROOT, p) for p in out.stdout.splitlines()
            if p.endswith((".py", ".md", ".toml", ".sh")) and not p.startswith("benchmarks/results/")]


def test_no_install_hint_names_the_unpublished_package():
    """Messages and docs said pip install 'dist-attn[...]', which finds nothing: the package is
    not published. What works from a clone is pip install -e '.[...]' (dist_attn.extras)."""
    bad = []
    for path in _tracked_text_files():
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if re.search(r"dist-attn\[", line) and "test_packaging.py" not in path:
                    bad.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_the_extras_table_is_pyprojects():
    from dist_attn.extras import EXTRAS, install_hint

    declared = _project()["optional-dependencies"]
    assert list(EXTRAS) == list(declared)
    imports = {"prometheus-client": "prometheus_client", "pytest-xdist": "xdist", "nvidia-cutlass-dsl": "cutlass"}
    for extra, reqs in declared.items():
        names = [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in reqs]
        assert EXTRAS[extra] == tuple(imports.get(n, n) for n in names), extra
    assert install_hint("serve", "fp8") == "pip install -e '.[serve,fp8]' (in a clone of the repository)"
    with pytest.raises(ValueError, match="extras=\\('srve',\\)"):
        install_hint("srve")


def test_pyproject_is_publish_ready():
    project = _project()
    assert project["name"] == "dist-attn" and re.fullmatch(r"\d+\.\d+\.\d+", project["version"])
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE"), encoding="utf-8") as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    classifiers = project["classifiers"]
    assert "Programming Language :: Python :: 3.11" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # the SPDX license says it
    assert project["readme"] == "README.md" and project["requires-python"] == ">=3.11"


_BLOCKED_RUN = """
import runpy, sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None  # import fails as if not installed; find_spec says None
sys.argv = ["launch/serve.py", *sys.argv[2:]]
runpy.run_path("launch/serve.py", run_name="__main__")
"""


@pytest.mark.parametrize("blocked,args,rank", [
    ("uvicorn", ["--check-only"], "0"),
    ("av,diffusers", ["--port", "0"], "0"),
    ("uvicorn", ["--check-only"], "1"),
    ("starlette", ["--nproc-per-node", "2"], None),
], ids=["uvicorn", "av_and_diffusers", "rank1_silent", "supervisor"])
def test_a_missing_extra_is_one_line_naming_the_install_command(blocked, args, rank):
    """Without the serve extra, rank 0 printed a 124-line ModuleNotFoundError (uvicorn, imported
    first by the HTTP app) on each of 4 ranks and the friendly message never showed. The launch
    checks every module of the extra first: one line on rank 0, nothing on the others, exit 1;
    the supervisor says it before starting torchrun."""
    env = subprocess_env()
    for key in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    if rank is not None:
        env["RANK"] = rank
    res = subprocess.run([sys.executable, "-c", _BLOCKED_RUN, blocked, *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1, res.stderr[-3000:]
    if rank == "1":
        assert res.stderr == "" and res.stdout == "", res.stderr
        return
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr[-3000:]
    modules = ", ".join(blocked.split(","))
    assert lines[0] == (f"launch/serve.py: error: the server needs the 'serve' extra, and {modules} "
                        "cannot be imported: pip install -e '.[serve]' (in a clone of the "
                        "repository)"), lines[0]


def test_a_non_editable_install_runs_the_default_server(tmp_path):
    """configs/ was resolved outside the package, so `pip install .` could not run the default
    server ("no default config"). The default configs are package data now: the package, built
    and installed without -e into a folder of its own (no dependency fetched: the test's
    interpreter has them), checks the CPU default from a directory that is not the clone."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(os.path.join(ROOT, "dist_attn"), src / "dist_attn",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), src / name)
    site = tmp_path / "site"
    env = {k: v for k, v in subprocess_env().items() if k != "PYTHONPATH"}
    built = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                            "--no-build-isolation", "--target", str(site), str(src)],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert (site / "dist_attn" / "models" / "h3" / "serve" / "configs" / "tiny.toml").is_file()
    run = tmp_path / "run"
    run.mkdir()
    env["PYTHONPATH"] = str(site)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    res = subprocess.run([sys.executable, "-c", "import dist_attn, runpy, sys; print(dist_attn.__file__); "
                          "sys.argv = ['dist_attn.models.h3.serve', '--check-only']; "
                          "runpy.run_module('dist_attn.models.h3.serve', run_name='__main__')"],
                         cwd=run, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    first, *rest = res.stdout.splitlines()
    assert first.startswith(str(site)), first  # the installed copy, not the clone
    assert rest and rest[-1].startswith("check-only: OK (config tiny, world 1"), res.stdout
    meta = [p for p in os.listdir(site) if p.endswith(".dist-info")]
    with open(site / meta[0] / "METADATA", encoding="utf-8") as f:
        assert "License-Expression: Apache-2.0" in f.read()
