# SPDX-License-Identifier: Apache-2.0
"""The video VAE decoder's repeated blocks under ``torch.compile``: regional compilation, as
diffusers' ``compile_repeated_blocks`` does for transformers, applied to the decoder alone.

H3's video decoder is a 36-block ViT run once per (clip, tile) decoder call (196 at h3-ref, in
batches of up to 8 tiles); its blocks share one class, so one compilation per input shape serves
all 36, and the decoder's cheap prologue and epilogue (patch projection, register tokens, the
unpatchify) stay eager. Which blocks: the classes the VAE itself declares repeated
(``_repeated_blocks``, ``MiniMaxH3VideoTransformerBlock`` for ``AutoencoderKLMiniMaxH3``).

    handle = enable_parallel_decode(vae)
    compile_vae_decoder(vae)                 # either order; the decode's calls are unchanged

Each distinct batch of tiles is its own shape (``dynamic=False``: kernels specialised to it): a
video's decode has at most two (full calls and the last wave's remainder), so warm one decode of
each served geometry (the server's warm-up does) to keep compilation out of jobs.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

__all__ = ["compile_vae_decoder"]

logger = logging.getLogger(__name__)


def compile_vae_decoder(vae: nn.Module, **compile_kwargs: Any) -> int:
    """``block.compile(fullgraph=True, dynamic=False, **compile_kwargs)`` of every block of
    ``vae.decoder`` whose class the VAE lists in ``_repeated_blocks``, in place; returns how many.

    Raises:
        TypeError: the VAE declares no repeated block, or its decoder holds none of them.
    """
    names = set(getattr(type(vae), "_repeated_blocks", None) or ())
    decoder = getattr(vae, "decoder", None)
    if not names or decoder is None:
        raise TypeError(f"{type(vae).__name__} declares no _repeated_blocks decoder to compile")
    blocks = [m for m in decoder.modules() if type(m).__name__ in names]
    if not blocks:
        raise TypeError(f"{type(vae).__name__}.decoder holds none of its repeated blocks {sorted(names)}")
    compile_kwargs.setdefault("fullgraph", True)
    compile_kwargs.setdefault("dynamic", False)
    for block in blocks:
        block.compile(**compile_kwargs)
    logger.info("compile_vae_decoder: %d %s blocks of %s.decoder under torch.compile(%s)",
                len(blocks), "/".join(sorted(names)), type(vae).__name__,
                ", ".join(f"{k}={v!r}" for k, v in sorted(compile_kwargs.items())))
    return len(blocks)
