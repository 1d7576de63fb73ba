# SPDX-License-Identifier: Apache-2.0
"""What one rank holds of a diffusers-format H3 pipeline (:class:`H3Components`): each component
loaded with its own ``from_pretrained``, where it runs (:mod:`dist_attn.models.h3.serve.h3.pipeline`
says why), and the checks that the served DiT fits the rest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from dist_attn.models.h3.serve.h3.decode import video_vae_dtype
from dist_attn.models.h3.serve.h3.text import (load_processor, load_text_encoder,
                                               load_text_encoder_sharded)
from dist_attn.models.h3.serve.h3.tiny import MARKER

__all__ = ["H3Components", "load_components", "check_fit", "checkpoint_is_tiny"]


@dataclass(kw_only=True)
class H3Components:
    """What one rank holds. ``text_encoder``/``tokenizer``/``processor`` are None off rank 0
    unless the text encoder is sharded (then every rank holds its share and runs it);
    ``audio_vae`` is on the meta device off rank 0 (geometry only)."""

    transformer: Any
    scheduler: Any
    audio_scheduler: Any
    vae: Any
    audio_vae: Any
    text_encoder: Any = None
    tokenizer: Any = None
    processor: Any = None


def _meta_model(cls: Any, path: str) -> Any:
    """``cls`` built from its config on the meta device: its geometry, no weights."""
    with torch.device("meta"):
        return cls.from_config(cls.load_config(path))


def load_components(checkpoint: str, *, device: torch.device, dtype: torch.dtype, rank0: bool,
                    transformer: Any = None, shard_text: bool = False) -> H3Components:
    """Loads a diffusers-format H3 directory, each component with its own ``from_pretrained``
    (the classes' ``_keep_in_fp32_modules`` stay float32). ``transformer`` reuses a transformer
    already built (the served DiT's) instead of loading a second copy. ``shard_text``: every
    rank holds 1/W of the text encoder (FSDP2, :func:`load_text_encoder_sharded`) and its
    tokenizer, and every rank runs it; otherwise rank 0 alone holds it whole."""
    from diffusers import (AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio,
                           MiniMaxH3Scheduler, MiniMaxH3Transformer3DModel)

    def sub(name: str) -> str:
        path = os.path.join(checkpoint, name)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--checkpoint {checkpoint}: no {name}/ directory (a "
                                    "diffusers-format MiniMax-H3 checkpoint has transformer/, "
                                    "scheduler/, audio_scheduler/, vae/, audio_vae/, "
                                    "text_encoder/, tokenizer/)")
        return path

    if transformer is None:
        transformer = MiniMaxH3Transformer3DModel.from_pretrained(sub("transformer"),
                                                                  torch_dtype=dtype)
        transformer = transformer.to(device).eval().requires_grad_(False)
    comps = H3Components(
        transformer=transformer,
        scheduler=MiniMaxH3Scheduler.from_pretrained(sub("scheduler")),
        audio_scheduler=MiniMaxH3Scheduler.from_pretrained(sub("audio_scheduler")),
        vae=None, audio_vae=None)
    # Every rank decodes a share of the video: its VAE is real everywhere, the decoder block
    # stack in float16 on CUDA (dist_attn.models.h3.serve.h3.decode says why), its float32 modules kept.
    comps.vae = AutoencoderKLMiniMaxH3.from_pretrained(
        sub("vae"), torch_dtype=video_vae_dtype(device)).to(device).eval().requires_grad_(False)
    if not rank0:
        comps.audio_vae = _meta_model(AutoencoderKLMiniMaxH3Audio, sub("audio_vae"))
    else:  # the audio VAE keeps its float32 modules (it degrades audibly in bf16, per its class)
        comps.audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(sub("audio_vae")).to(
            device).eval().requires_grad_(False)
    if not (rank0 or shard_text):
        return comps
    from transformers import Qwen2TokenizerFast, Qwen3VLForConditionalGeneration

    if shard_text:
        comps.text_encoder = load_text_encoder_sharded(
            Qwen3VLForConditionalGeneration, sub("text_encoder"), dtype=dtype, device=device)
    else:
        comps.text_encoder = load_text_encoder(Qwen3VLForConditionalGeneration,
                                               sub("text_encoder"), dtype=dtype, device=device)
    comps.tokenizer = Qwen2TokenizerFast.from_pretrained(sub("tokenizer"))
    comps.processor = load_processor(checkpoint, comps.tokenizer)
    return comps


def check_fit(comps: H3Components, checkpoint: str) -> None:
    """Raises ValueError naming each field where the transformer and the other components of
    ``checkpoint`` disagree (the served DiT may come from another config than the checkpoint)."""
    t = comps.transformer.config
    pairs = [("text_dim", t.text_dim, "text_encoder hidden_size",
              comps.text_encoder.config.text_config.hidden_size if comps.text_encoder is not None
              else t.text_dim),
             ("in_channels", t.in_channels, "vae latent_channels", comps.vae.config.latent_channels),
             ("audio_in_channels", t.audio_in_channels, "audio_vae latent_channels",
              comps.audio_vae.config.latent_channels)]
    bad = [f"transformer {a}={x} but {b}={y}" for a, x, b, y in pairs if x != y]
    if bad:
        raise ValueError(f"the served DiT does not fit the pipeline of {checkpoint}: "
                         + "; ".join(bad) + " (pass --checkpoint with a full H3 pipeline whose "
                         "transformer/ the served config matches)")


def checkpoint_is_tiny(path: str) -> bool:
    """Whether ``path`` is the generated tiny checkpoint (its marker file)."""
    return os.path.isfile(os.path.join(path, MARKER))
