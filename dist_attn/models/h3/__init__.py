# SPDX-License-Identifier: Apache-2.0
"""MiniMax H3 (diffusers' ``MiniMaxH3Transformer3DModel``) on the dist_attn library. Sub-packages,
top down; each imports only those below it and the library:

- :mod:`.serve`: the served model (``python -m dist_attn.models.h3.serve``; the ``serve`` extra);
- :mod:`.activations`: q, k, v and block inputs captured from a real forward (tests, benchmarks);
- :mod:`.fp8`: the FP8 linear recipe, its fused block kernels and ``quantize_linears``.

Importing this package imports none of them.
"""

__all__: list[str] = []
