# SPDX-License-Identifier: Apache-2.0
"""The optional dependencies of dist_attn (``pyproject.toml``'s extras) and the one way to name them.

dist-attn is not on a package index yet: an extra is installed from a clone of the repository,
with :func:`install_hint`'s command. Optional modules are imported only where they are used, so
the library imports with torch alone; what needs an extra says so in one line.
"""

from __future__ import annotations

import importlib.util

__all__ = ["EXTRAS", "install_hint", "missing_modules"]

#: extra -> the import names of what it installs, in ``pyproject.toml``'s order
#: (``tests/test_packaging.py`` checks the two agree).
EXTRAS: dict[str, tuple[str, ...]] = {
    "gpu": ("sageattention",),
    "test": ("pytest", "xdist"),
    "bench": ("matplotlib",),
    "serve": ("starlette", "uvicorn", "prometheus_client", "safetensors", "accelerate", "av",
              "diffusers", "transformers", "tokenizers"),
    "diffusers": ("diffusers",),
    "fp8": ("torchao",),
    "cute": ("cutlass",),
}


def install_hint(*extras: str) -> str:
    """The command that installs ``extras``: ``pip install -e '.[a,b]'``, run in a clone of the
    repository (the package is not published: ``pip install`` of its name finds nothing)."""
    unknown = [e for e in extras if e not in EXTRAS]
    if unknown or not extras:
        raise ValueError(f"extras={extras!r}: each must be one of {sorted(EXTRAS)}")
    return f"pip install -e '.[{','.join(extras)}]' (in a clone of the repository)"


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be found (none imported: ``find_spec`` only)."""
    return [name for name in EXTRAS[extra] if importlib.util.find_spec(name) is None]
