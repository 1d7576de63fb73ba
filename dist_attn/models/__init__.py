# SPDX-License-Identifier: Apache-2.0
"""Model-specific code, one sub-package per model, above the generic library: a model package
imports ``dist_attn`` and the library never imports a model package.

- :mod:`dist_attn.models.h3`: MiniMax H3 (diffusers' ``MiniMaxH3Transformer3DModel``): its FP8
  linear recipe and fused block kernels, its activation capture, and the server.
"""

__all__: list[str] = []
