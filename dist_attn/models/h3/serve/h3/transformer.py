# SPDX-License-Identifier: Apache-2.0
"""The diffusers class the server runs, imported on first use with an error that names the extra;
:mod:`dist_attn.models.h3.serve.h3.model` builds it, :mod:`dist_attn.models.h3.serve.h3.weights`
loads it."""

from __future__ import annotations

from dist_attn.extras import install_hint

__all__ = ["H3_CLASS_NAME", "h3_class"]

#: The diffusers class the server runs.
H3_CLASS_NAME = "MiniMaxH3Transformer3DModel"


def h3_class() -> type:
    """``diffusers.MiniMaxH3Transformer3DModel``; a clear ImportError names the extra if absent."""
    try:
        from diffusers import MiniMaxH3Transformer3DModel
    except ImportError as e:
        raise ImportError("the served DiT is diffusers' MiniMaxH3Transformer3DModel, and diffusers is "
                          f"not installed: {install_hint('serve')}") from e
    return MiniMaxH3Transformer3DModel
