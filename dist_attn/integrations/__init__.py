# SPDX-License-Identifier: Apache-2.0
"""Adapters that make other libraries' models sequence-parallel with dist_attn.

Each adapter is a subpackage that imports its library only when the subpackage itself is imported,
so ``import dist_attn`` never pulls in an optional dependency:

* :mod:`dist_attn.integrations.diffusers`: ``enable_ulysses(transformer)`` for diffusers video
  transformers (install with ``pip install -e '.[diffusers]'`` in a clone of the repository).
"""

__all__: list[str] = []
