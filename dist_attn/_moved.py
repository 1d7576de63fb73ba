# SPDX-License-Identifier: Apache-2.0
"""The import paths of MiniMax-H3's code from before it moved to :mod:`dist_attn.models.h3`, kept
working for one release: each old module name is an alias of its new module (the same module
object, so patching or ``isinstance`` through either name sees one thing), and the first import of
an old name raises one ``DeprecationWarning`` that names the new path.

:data:`MODULES` is the one table of what moved where; a key that is a package (``dist_attn.serve``)
covers its sub-modules too (``dist_attn.serve.config.load`` is
``dist_attn.models.h3.serve.config.load``), and ``python -m dist_attn.serve`` runs the new
package's ``__main__``. :data:`NAMES` lists the attributes of library packages that moved, served
lazily by :func:`moved_attribute` from the package's ``__getattr__``.

The library imports nothing of :mod:`dist_attn.models` at import time: the new modules are
imported by name, when an old name is imported or read.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MODULES", "NAMES", "install", "moved_attribute", "new_name"]

#: Old module (or package) name -> its new name.
MODULES: dict[str, str] = {
    "dist_attn.serve": "dist_attn.models.h3.serve",
    "dist_attn.fp8_linear": "dist_attn.models.h3.fp8.linear",
    "dist_attn.kernels.swiglu_fp8": "dist_attn.models.h3.fp8.swiglu_kernel",
    "dist_attn.kernels.adaln_fp8": "dist_attn.models.h3.fp8.adaln_kernel",
    "dist_attn.integrations.diffusers.linear_precision": "dist_attn.models.h3.fp8.quantize",
    "dist_attn.integrations.diffusers.h3_activations": "dist_attn.models.h3.activations",
}
#: Library package -> {attribute it no longer defines: the module that does}.
NAMES: dict[str, dict[str, str]] = {
    "dist_attn.integrations.diffusers": {"LinearQuantization": "dist_attn.models.h3.fp8",
                                         "quantize_linears": "dist_attn.models.h3.fp8"},
}


def new_name(old: str) -> str | None:
    """The new name of the module ``old`` (a key of :data:`MODULES` or a sub-module of one), or
    None when ``old`` did not move."""
    for key, new in MODULES.items():
        if old == key or old.startswith(key + "."):
            return new + old[len(key):]
    return None


def _warn(old: str, new: str) -> None:
    # stacklevel 3: past this helper and the loader, to the importing line (importlib's own
    # frames are skipped by warnings)
    warnings.warn(f"{old} moved to {new}; import {new} instead (the old name goes in the next "
                  "release)", DeprecationWarning, stacklevel=3)


class _Alias(importlib.abc.Loader):
    """Loads an old name as the new module itself."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        if new_name(self.old.rpartition(".")[0]) is None:  # the old name's root: warn once, here
            _warn(self.old, self.new)
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module the alias's spec: it keeps its own
        module.__spec__ = self.spec


class _Finder(importlib.abc.MetaPathFinder):
    """Finds every old name of :data:`MODULES` (ahead of the path finder, which would load a
    second copy of a moved package's sub-module under the old name)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        new = new_name(fullname)
        found = None if new is None else importlib.util.find_spec(new)
        if found is None:
            return None
        if fullname.rpartition(".")[2] == "__main__":
            # run by runpy, never imported as the new module: the new file under the old name
            return importlib.util.spec_from_file_location(fullname, found.origin)
        return importlib.machinery.ModuleSpec(fullname, _Alias(fullname, new),
                                              is_package=found.submodule_search_locations is not None)


def moved_attribute(package: str, name: str) -> Any:
    """``package.name`` for an attribute in :data:`NAMES` (imported from its new module, with a
    ``DeprecationWarning``); AttributeError for any other."""
    home = NAMES.get(package, {}).get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {home}.{name}; import it from there (the old name "
                  "goes in the next release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)


def install() -> None:
    """Puts the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
