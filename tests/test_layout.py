# SPDX-License-Identifier: Apache-2.0
"""The package's two floors: the generic library (``dist_attn`` outside ``dist_attn/models``) and
the model code above it (``dist_attn.models.<name>``). Read from the source (ast): no import cycle
in the whole package, no library module that imports a model package (imports inside functions
count), and H3's sub-packages import top down. Imported: the paths from before the move still
work for one release, as the very module objects of the new paths, each with one
DeprecationWarning."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings

import pytest

from tests._imports import cycles, import_graph, package_modules
from tests.conftest import ROOT, subprocess_env

MODELS = "dist_attn.models"
#: H3's sub-packages, top down: each may import those after it (and the library), never one before.
H3_LAYERS = ("serve", "activations", "fp8")
#: The one library module that names model modules as code: the table of the old import paths.
MOVED = "dist_attn._moved"

MODULES = package_modules("dist_attn")
GRAPH = import_graph(MODULES)


def _is_model(module: str) -> bool:
    return module == MODELS or module.startswith(MODELS + ".")


def test_the_package_has_no_import_cycle():
    assert len(MODULES) > 100 and f"{MODELS}.h3.fp8.linear" in MODULES
    found = cycles(GRAPH)
    assert not found, "import cycles:\n  " + "\n  ".join(found)


def test_the_library_never_imports_a_model_package():
    upward = sorted(f"{module} -> {target}" for module, imported in GRAPH.items()
                    if not _is_model(module) for target in imported if _is_model(target))
    assert not upward, "library modules that import model code:\n  " + "\n  ".join(upward)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (modules, classes, functions) and bare string statements."""
    return {id(node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)}


def test_only_the_old_paths_table_names_model_modules_in_library_code():
    """A string that is a model module's dotted name (what ``importlib.import_module`` takes) in
    library code outside docstrings: only in :data:`MOVED`, which imports it when an old name is
    used, never at import time."""
    dotted = re.compile(r"^dist_attn\.models(\.\w+)*$")
    named = []
    for module, path in MODULES.items():
        if _is_model(module) or module == MOVED:
            continue
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        docs = _docstrings(tree)
        named += [f"{module}:{node.lineno}: {node.value}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docs and dotted.match(node.value)]
    assert not named, named


def test_h3_sub_packages_import_top_down():
    prefix = f"{MODELS}.h3."
    layer = {m: m[len(prefix):].split(".")[0] for m in MODULES if m.startswith(prefix)}
    assert set(layer.values()) == set(H3_LAYERS)
    upward = sorted(f"{m} ({layer[m]}) -> {t} ({layer[t]})" for m in layer for t in GRAPH[m]
                    if t in layer and H3_LAYERS.index(layer[t]) < H3_LAYERS.index(layer[m]))
    assert not upward, "imports that run back up:\n  " + "\n  ".join(upward)


def test_the_layout_picture_names_every_box():
    """docs/import_graph.svg (drawn by docs/import_graph.py, its text kept as text) holds a box
    for every group of modules the graph has today: a new package is not missing from it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("import_graph", f"{ROOT}/docs/import_graph.py")
    drawer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drawer)
    with open(f"{ROOT}/docs/import_graph.svg", encoding="utf-8") as f:
        svg = f.read()
    boxes = set(drawer.package_graph()) - {drawer._GROUND}
    assert len(boxes) > 15
    missing = sorted(b for b in boxes if f">{b}<" not in svg)
    assert not missing, f"docs/import_graph.svg lacks {missing}: run python docs/import_graph.py"


def test_importing_the_library_imports_no_model_code():
    code = ("import sys, dist_attn, dist_attn.integrations.diffusers, dist_attn.weight_sharding, "
            "dist_attn.kernels; print(sorted(m for m in sys.modules if m.startswith('dist_attn.models')))")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip() == "[]", res.stdout


#: old module name -> new module name (each a key of dist_attn._moved.MODULES, or under one).
OLD_MODULES = {
    "dist_attn.serve": "dist_attn.models.h3.serve",
    "dist_attn.serve.config": "dist_attn.models.h3.serve.config",
    "dist_attn.serve.config.load": "dist_attn.models.h3.serve.config.load",
    "dist_attn.serve.h3.model": "dist_attn.models.h3.serve.h3.model",
    "dist_attn.fp8_linear": "dist_attn.models.h3.fp8.linear",
    "dist_attn.kernels.swiglu_fp8": "dist_attn.models.h3.fp8.swiglu_kernel",
    "dist_attn.kernels.adaln_fp8": "dist_attn.models.h3.fp8.adaln_kernel",
    "dist_attn.integrations.diffusers.linear_precision": "dist_attn.models.h3.fp8.quantize",
    "dist_attn.integrations.diffusers.h3_activations": "dist_attn.models.h3.activations",
}


@pytest.fixture
def forget_old_names():
    """Imports of old names start afresh (the new modules stay loaded) and leave no trace."""
    from dist_attn import _moved

    def old():
        return {m for m in sys.modules if _moved.new_name(m) is not None}

    for name in old():
        del sys.modules[name]
    yield
    for name in old():
        del sys.modules[name]


def _deprecations(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize("old", sorted(OLD_MODULES))
def test_an_old_module_path_is_the_new_module_with_one_warning(old, forget_old_names):
    pytest.importorskip("diffusers")
    if "swiglu" in old or "adaln" in old:
        pytest.importorskip("triton")
    new = importlib.import_module(OLD_MODULES[old])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    assert module is new and module.__spec__.name == OLD_MODULES[old]
    from dist_attn._moved import MODULES as TABLE

    root = next(key for key in TABLE if old == key or old.startswith(key + "."))
    (message,) = _deprecations(caught)
    assert message.startswith(f"{root} moved to {TABLE[root]};"), message


def test_names_keep_their_objects_through_old_paths(forget_old_names):
    pytest.importorskip("diffusers")
    from dist_attn.models.h3.fp8 import LinearQuantization, quantize_linears
    from dist_attn.models.h3.fp8.linear import Fp8Linear
    from dist_attn.models.h3.serve.config import load_config

    with pytest.deprecated_call():
        from dist_attn.serve.config import load_config as old_load_config
    with pytest.deprecated_call():
        from dist_attn.fp8_linear import Fp8Linear as OldFp8Linear
    with pytest.deprecated_call(match="dist_attn.integrations.diffusers.quantize_linears moved to "
                                      "dist_attn.models.h3.fp8.quantize_linears"):
        from dist_attn.integrations.diffusers import quantize_linears as old_quantize
    with pytest.deprecated_call():
        from dist_attn.integrations.diffusers import LinearQuantization as OldSummary
    assert (old_load_config, OldFp8Linear, old_quantize, OldSummary) == (
        load_config, Fp8Linear, quantize_linears, LinearQuantization)
    import dist_attn.integrations.diffusers as adapters

    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        adapters.nope  # noqa: B018


def test_a_fresh_interpreter_warns_once_and_runs_the_old_main():
    """``import dist_attn.serve`` then a sub-module: one warning, one copy of each module (no
    second load under the old name); ``python -m dist_attn.serve`` still runs the server's CLI."""
    code = ("import sys, warnings; warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    import dist_attn.serve.jobs.queue as old, dist_attn.serve.http\n"
            "import dist_attn.models.h3.serve.jobs.queue as new\n"
            "print(len([w for w in caught if w.category is DeprecationWarning]), old is new,\n"
            "      sys.modules['dist_attn.serve.http'] is sys.modules['dist_attn.models.h3.serve.http'])")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["1", "True", "True"], res.stdout
    res = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "dist_attn.serve",
                          "--help"], cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--config" in res.stdout and "--check-only" in res.stdout, res.stdout
    assert "DeprecationWarning: dist_attn.serve moved to dist_attn.models.h3.serve" in res.stderr
