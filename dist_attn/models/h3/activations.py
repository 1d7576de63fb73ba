# SPDX-License-Identifier: Apache-2.0
"""Real attention inputs of diffusers' MiniMax-H3 transformer, for accuracy work on the kernels.

An 8-bit kernel that is right on N(0,1) can be wrong on what a real model hands it (V with channel
means, RMS-normed q/k with learned gains, RoPE): the accuracy tests and benchmarks therefore also
attend the q/k/v that the FIRST block of ``MiniMaxH3Transformer3DModel`` computes, with the model's
own initialisation (no checkpoint needed) on a packed layout built by the H3 pipeline's own layout
code (``MiniMaxH3PrepareLayoutStep.build_packed_sequence`` and ``build_row_timesteps``):
``[text | target audio | target video]`` rows, 3-axis RoPE positions, modality tags, per-row
timestep indices.

    model = build_h3_model(device="cuda", num_layers=1)        # 56 heads x 128, its own init, bf16
    inputs = h3_inputs(model, H3_REF_LAYOUT, device="cuda")      # 512 + 172 + 37,296 = 37,980 rows
    q, k, v = first_block_qkv(model, inputs)                     # [S, 56, 128] bf16 each

Importing this module needs diffusers (the ``diffusers`` extra).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers import transformer_minimax_h3 as _h3_module
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
)
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
)

__all__ = ["H3Layout", "H3_REF_LAYOUT", "build_h3_model", "h3_inputs", "first_block_qkv", "row_timesteps"]


@dataclass(frozen=True, kw_only=True)
class H3Layout:
    """The sizes of one t2va request's packed sequence."""

    text_rows: int
    """Prompt tokens (rows tagged text)."""
    latent_frames: int
    """Video latent frames."""
    latent_height: int
    """Video latent height (the transformer's patch halves it)."""
    latent_width: int
    """Video latent width."""
    audio_latents: int
    """Audio latents per channel (the soundtrack has MINIMAX_H3_AUDIO_CHANNELS channels)."""
    video_timestep: float = 0.0
    """Timestep of the video rows on H3's clock, t = 1 - sigma (0.0 = the first denoise step, pure
    noise; 1.0 = clean)."""
    audio_timestep: float = 0.0
    """Timestep of the audio rows."""

    @property
    def rows(self) -> int:
        patch = 2 * 2
        return (self.text_rows + self.latent_frames * self.latent_height * self.latent_width // patch
                + self.audio_latents * MINIMAX_H3_AUDIO_CHANNELS)


#: h3-ref: 512 text + 37 x 42 x 24 = 37,296 video + 2 x 86 = 172 audio rows = 37,980 rows
H3_REF_LAYOUT = H3Layout(text_rows=512, latent_frames=37, latent_height=84, latent_width=48, audio_latents=86)


def build_h3_model(*, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                   **config) -> MiniMaxH3Transformer3DModel:
    """``MiniMaxH3Transformer3DModel(**config)`` (default config = H3's) with its modules' own
    random initialisation, built directly on ``device``, in ``dtype`` except the modules the class
    keeps in float32 (``_keep_in_fp32_modules``, as ``from_pretrained`` would), in eval mode."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = MiniMaxH3Transformer3DModel(**config)
    # every entry of _keep_in_fp32_modules names a top-level module (the patch projections, the
    # time MLP, the heads, rope): cast the others (model.to(dtype) would cast all, and warn)
    keep = set(MiniMaxH3Transformer3DModel._keep_in_fp32_modules)
    for name, child in model.named_children():
        child.to(torch.float32 if name in keep else dtype)
    return model.eval()


def h3_inputs(model: MiniMaxH3Transformer3DModel, layout: H3Layout, *, device: str | torch.device = "cpu",
              batch: int = 1, seed: int = 0) -> dict[str, torch.Tensor]:
    """Keyword arguments of ``model.forward`` for one ``layout`` request: latents and text
    embeddings ~ N(0, 1) (pure noise, as at the first denoise step; random prompt states), the
    rest built by the H3 pipeline's own layout and timestep code (:func:`row_timesteps`)."""
    cfg = model.config
    text_tags = torch.full((layout.text_rows,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    pos, tags, video_idx, audio_idx, text_idx, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_tags, layout.latent_frames, layout.latent_height, layout.latent_width, layout.audio_latents,
            tuple(cfg.patch_size), MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG))
    timestep, timestep_idx = row_timesteps(video_idx, audio_idx, layout.text_rows, layout.video_timestep,
                                           layout.audio_timestep)
    g = torch.Generator().manual_seed(seed)
    patch_dim = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]

    def noise(*shape):
        return torch.randn(shape, generator=g).to(device)

    return dict(
        hidden_states=noise(batch, video_idx.numel(), patch_dim),
        audio_hidden_states=noise(batch, audio_idx.numel(), cfg.audio_in_channels),
        encoder_hidden_states=noise(batch, layout.text_rows, cfg.text_dim),
        timestep=timestep.to(device), timestep_indices=timestep_idx.to(device), token_tags=tags.to(device),
        position_ids=pos.to(device, torch.float32), video_indices=video_idx.to(device),
        audio_indices=audio_idx.to(device), text_indices=text_idx.to(device),
    )


def row_timesteps(video_indices: torch.Tensor, audio_indices: torch.Tensor, text_rows: int, video_timestep: float,
                  audio_timestep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timestep, timestep_indices)`` of a t2va sequence (no conditioning rows), from the H3
    pipeline's own ``build_row_timesteps``."""
    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices.cpu(), audio_indices.cpu(), 0, 0, text_rows, float(video_timestep), float(audio_timestep),
        0.0, 0.0)


class _Captured(Exception):
    """Raised inside the first block to stop the forward once its q/k/v are in hand."""

    def __init__(self, q, k, v):
        super().__init__("captured")
        self.qkv = (q, k, v)


@torch.no_grad()
def first_block_qkv(model: MiniMaxH3Transformer3DModel,
                    inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q, k, v that the first transformer block hands to attention (after its q/k RMSNorm and
    RoPE), each ``[S, heads, head_dim]`` of the block's dtype, for batch element 0.

    The model's own processor runs unchanged; only the attention call of that block is replaced
    by one that records its arguments and stops the forward (the rest of the stack never runs).
    """
    block = model.transformer_blocks[0]
    target = block.attn
    original = _h3_module.dispatch_attention_fn

    def capture(query, key, value, *args, **kwargs):
        if capture.active:
            raise _Captured(query, key, value)
        return original(query, key, value, *args, **kwargs)

    capture.active = False

    def arm(module, args):
        capture.active = module is target

    hooks = [m.register_forward_pre_hook(arm) for m in model.modules()
             if isinstance(m, _h3_module.MiniMaxH3Attention)]
    _h3_module.dispatch_attention_fn = capture
    try:
        model(**inputs)
    except _Captured as done:
        q, k, v = done.qkv  # [B, S, H, D]
        return q[0].contiguous(), k[0].contiguous(), v[0].contiguous()
    finally:
        _h3_module.dispatch_attention_fn = original
        for h in hooks:
            h.remove()
    raise RuntimeError("the first transformer block never called attention")
