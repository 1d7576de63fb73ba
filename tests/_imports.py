# SPDX-License-Identifier: Apache-2.0
"""The import graph of a package, read from its source with ast (nothing imported): which of its
modules each module imports anywhere in its file (top level, inside functions, under
TYPE_CHECKING), and the cycles in that graph. A package's ``__init__`` is a module of its own."""

from __future__ import annotations

import ast
import os

from tests.conftest import ROOT

__all__ = ["cycles", "import_graph", "package_modules"]


def package_modules(package: str) -> dict[str, str]:
    """Dotted module name -> file path, for every .py under the package ``package`` (a dotted
    name, its folder under the repository root)."""
    top = os.path.join(ROOT, *package.split("."))
    found = {}
    for folder, dirs, files in os.walk(top):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            parts = os.path.relpath(path, ROOT).removesuffix(".py").split(os.sep)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(module: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules of ``modules`` that ``module`` imports anywhere in its file, each resolved to
    the module file it names (``from pkg import name``: the submodule pkg.name when there is one,
    else pkg; ``import a.b.c`` of a name in a.b: a.b)."""
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
            named.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
    out = set()
    for name in named:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)
    out.discard(module)
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (see :func:`_imports`)."""
    return {module: _imports(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each import cycle that a depth-first walk of ``graph`` meets, as ``a -> b -> a``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    found = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                found.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found
