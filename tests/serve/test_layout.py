# SPDX-License-Identifier: Apache-2.0
"""The served DiT's layout, read from its source (ast, nothing imported): every module sits in a
sub-package, the sub-packages import one way only (top down, in :data:`LAYERS`), no import runs
in a circle (imports inside functions count), each sub-package's ``__init__`` says what it owns
and exports by name, and no module is longer than :data:`MAX_LINES`."""

from __future__ import annotations

import ast
import os

import pytest

from tests._imports import cycles, import_graph, package_modules
from tests.conftest import ROOT

PREFIX = "dist_attn.models.h3.serve"
SERVE = os.path.join(ROOT, *PREFIX.split("."))
#: Dotted parts of :data:`PREFIX`: a sub-package is the part after them.
_DEPTH = len(PREFIX.split("."))

#: The sub-packages, top down: each may import those after it, never one before it.
LAYERS = ("launch", "ranks", "http", "h3", "jobs", "wire", "config")
#: No module of the served DiT is longer than this.
MAX_LINES = 400


MODULES = package_modules(PREFIX)
GRAPH = import_graph(MODULES)


def _layer(module: str) -> str | None:
    """The sub-package of ``module``; None for the package's own face (:data:`PREFIX`,
    ``__main__``)."""
    parts = module.split(".")
    d = _DEPTH
    return parts[d] if len(parts) > d + 1 or (len(parts) == d + 1 and parts[d] in LAYERS) else None


def test_every_module_is_in_a_declared_sub_package():
    loose = sorted(m for m in MODULES if _layer(m) is None)
    assert loose == [PREFIX, f"{PREFIX}.__main__"], loose
    assert {_layer(m) for m in MODULES} - {None} == set(LAYERS)


def test_sub_packages_import_top_down_only():
    upward = []
    for module, imported in GRAPH.items():
        layer = _layer(module)
        if layer is None:
            continue
        for target in imported:
            other = _layer(target)
            if other is None:  # the face imports the sub-packages, never the reverse
                upward.append(f"{module} -> {target} (the package's face)")
            elif LAYERS.index(other) < LAYERS.index(layer):
                upward.append(f"{module} ({layer}) -> {target} ({other})")
    assert not upward, "imports that run back up:\n  " + "\n  ".join(sorted(upward))


def test_no_import_cycle():
    """Between modules (a sub-package's __init__ counts as a module), lazy imports included."""
    found = cycles(GRAPH)
    assert not found, "import cycles:\n  " + "\n  ".join(found)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_sub_package_says_what_it_owns_and_exports_by_name(layer):
    path = MODULES[f"{PREFIX}.{layer}"]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    doc = ast.get_docstring(tree)
    assert doc and len(doc.splitlines()) == 2, f"{path}: a two-line docstring"
    exported = [node for node in tree.body if isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__all__"]]
    assert len(exported) == 1, f"{path}: one explicit __all__"
    names = ast.literal_eval(exported[0].value)
    bound = {alias.asname or alias.name for node in tree.body
             if isinstance(node, ast.ImportFrom) for alias in node.names}
    assert names and set(names) <= bound, f"{path}: __all__ names {set(names) - bound} unbound"
    # a face only hands names on: every import is one of its own modules'
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            assert node.module.startswith(f"{PREFIX}.{layer}."), (path, node.module)


def test_no_module_is_longer_than_the_limit():
    long = {m: n for m, path in MODULES.items()
            if (n := sum(1 for _ in open(path, encoding="utf-8"))) > MAX_LINES}
    assert not long, long


def test_the_library_never_imports_the_server():
    library = os.path.join(ROOT, "dist_attn")
    offenders = []
    for folder, _, files in os.walk(library):
        if os.path.commonpath([folder, SERVE]) == SERVE:
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                    offenders += [f"{path}: {n}" for n in names
                                  if n == PREFIX or n.startswith(PREFIX + ".")]
    assert not offenders, offenders
