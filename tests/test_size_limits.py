# SPDX-License-Identifier: Apache-2.0
"""Size bounds of the package's source, read with ast (nothing imported): no module of
``dist_attn`` is longer than :data:`MAX_MODULE_LINES`, and no function or method (nested ones
counted on their own too) longer than :data:`MAX_FUNCTION_LINES`, from its ``def`` line to its
last line (decorators not counted, its docstring counted). A failure lists every offender with
its length."""

from __future__ import annotations

import ast
import os

from tests._imports import package_modules
from tests.conftest import ROOT

#: No module of the package is longer than this.
MAX_MODULE_LINES = 400
#: No function or method of the package is longer than this.
MAX_FUNCTION_LINES = 60

MODULES = package_modules("dist_attn")


def _source(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _functions(path: str) -> list[tuple[str, int, int]]:
    """``(qualified name, def line, lines)`` of every function and method in the file ``path``."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                found.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, f"{name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(_source(path), path), "")
    return found


def _where(path: str) -> str:
    return os.path.relpath(path, ROOT)


def test_the_walk_sees_the_whole_package():
    assert len(MODULES) > 100 and "dist_attn.models.h3.fp8.quantize" in MODULES
    names = {name for name, _, _ in _functions(MODULES["dist_attn.models.h3.serve.h3.engine"])}
    assert {"latent_checksum", "Engine.run", "Engine.__init__"} <= names, names


def test_no_module_is_over_the_line_bound():
    long = sorted((n, _where(path)) for path in MODULES.values()
                  if (n := len(_source(path).splitlines())) > MAX_MODULE_LINES)
    assert not long, (f"modules over {MAX_MODULE_LINES} lines:\n  "
                      + "\n  ".join(f"{where}: {n} lines" for n, where in reversed(long)))


def test_no_function_is_over_the_line_bound():
    long = sorted(((n, f"{_where(path)}:{line} {name}") for path in MODULES.values()
                   for name, line, n in _functions(path) if n > MAX_FUNCTION_LINES),
                  reverse=True)
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines:\n  "
                      + "\n  ".join(f"{where}: {n} lines" for n, where in long))
