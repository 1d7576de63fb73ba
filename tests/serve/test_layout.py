# SPDX-License-Identifier: Apache-2.0
"""The served DiT's layout, read from its source (ast, nothing imported): every module sits in a
sub-package, the sub-packages import one way only (top down, in :data:`LAYERS`), no import runs
in a circle (imports inside functions count), each sub-package's ``__init__`` says what it owns
and exports by name, and no module is longer than :data:`MAX_LINES`."""

from __future__ import annotations

import ast
import os

import pytest

from tests.conftest import ROOT

PREFIX = "dist_attn.models.h3.serve"
SERVE = os.path.join(ROOT, *PREFIX.split("."))
#: Dotted parts of :data:`PREFIX`: a sub-package is the part after them.
_DEPTH = len(PREFIX.split("."))

#: The sub-packages, top down: each may import those after it, never one before it.
LAYERS = ("launch", "ranks", "http", "h3", "jobs", "wire", "config")
#: No module of the served DiT is longer than this.
MAX_LINES = 400


def _modules() -> dict[str, str]:
    """Dotted module name -> file path, for every .py under dist_attn/models/h3/serve."""
    found = {}
    for folder, _, files in os.walk(SERVE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT).removesuffix(".py").split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: str) -> set[str]:
    """The dist_attn.models.h3.serve modules ``module`` imports anywhere in its file (top level, inside
    functions, under TYPE_CHECKING), each resolved to the module file it names."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import name`: the submodule pkg.name when there is one, else pkg
            named.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                         for alias in node.names)
    out = set()
    for name in named:
        while name and name not in MODULES:  # `import a.b.c` of a module a.b.c, or a name in a.b
            name = name.rpartition(".")[0]
        if name.startswith(PREFIX):
            out.add(name)
    out.discard(module)
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


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
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                cycles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


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
