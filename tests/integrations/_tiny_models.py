# SPDX-License-Identifier: Apache-2.0
"""Tiny seeded diffusers transformers (Wan, LTX-Video, MiniMax-H3) and their inputs, identical in
every process that builds them."""

from __future__ import annotations

import torch

__all__ = ["build", "h3_inputs", "h3_layout_functions", "ltx_inputs", "tiny_h3", "tiny_ltx", "tiny_wan",
           "wan_inputs", "HEAD_DIM", "IMAGE_DIM", "IN_CHANNELS", "TEXT_DIM", "TEXT_LEN"]

# Wan splits each head's RoPE channels into time / height / width parts of 2*(D//6) each (the
# rest to time): D = 12 gives 4 / 4 / 4, the smallest head with all three parts non-empty.
HEAD_DIM = 12
IN_CHANNELS = 4
TEXT_DIM = 16
TEXT_LEN = 7
IMAGE_DIM = 8
# Wan's I2V cross-attention takes the last 512 context tokens as text (its T5 length, fixed in
# diffusers) and the ones before them as image tokens.
I2V_TEXT_LEN = 512
IMAGE_TOKENS = 5


def _redraw(model, seed: int):
    """Every parameter from a seeded N(0, 0.15^2), so no weight or bias keeps the zero or one of
    its default init (a zero bias can hide a wrong row order)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


def tiny_wan(heads: int, *, seed: int = 0, layers: int = 2, i2v: bool = False):
    """``heads`` x 12-channel heads, 2 blocks, patch (1, 2, 2), seeded random parameters.

    ``i2v`` adds Wan 2.1 I2V's image branch: cross-attention also attends to image tokens."""
    from diffusers import WanTransformer3DModel

    image = {"image_dim": IMAGE_DIM, "added_kv_proj_dim": heads * HEAD_DIM} if i2v else {}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=HEAD_DIM,
        in_channels=IN_CHANNELS, out_channels=IN_CHANNELS, text_dim=TEXT_DIM, freq_dim=16,
        ffn_dim=32, num_layers=layers, rope_max_seq_len=32, **image,
    )
    return _redraw(model, seed)


def wan_inputs(batch: int, frames: int, height: int, width: int, *, seed: int = 1,
               per_token_timestep: bool = False, i2v: bool = False) -> dict:
    """Full forward arguments; S = frames * (height // 2) * (width // 2) tokens.

    ``per_token_timestep`` gives Wan 2.2's ``[B, S]`` timestep (a different value per token);
    ``i2v`` adds ``encoder_hidden_states_image`` and makes the text 512 tokens long."""
    g = torch.Generator().manual_seed(seed)
    seq = frames * (height // 2) * (width // 2)
    if per_token_timestep:
        timestep = torch.randint(0, 1000, (batch, seq), generator=g).float()
    else:
        timestep = torch.randint(0, 1000, (batch,), generator=g).float()
    inputs = {
        "hidden_states": torch.randn(batch, IN_CHANNELS, frames, height, width, generator=g),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(batch, I2V_TEXT_LEN if i2v else TEXT_LEN, TEXT_DIM,
                                             generator=g),
    }
    if i2v:
        inputs["encoder_hidden_states_image"] = torch.randn(batch, IMAGE_TOKENS, IMAGE_DIM, generator=g)
    return inputs


def tiny_ltx(heads: int, *, seed: int = 0, layers: int = 2):
    """LTX-Video with ``heads`` x 12-channel heads, 2 blocks, patch 1, seeded random parameters."""
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=IN_CHANNELS, out_channels=IN_CHANNELS, num_attention_heads=heads,
        attention_head_dim=HEAD_DIM, cross_attention_dim=heads * HEAD_DIM, num_layers=layers,
        caption_channels=TEXT_DIM,
    )
    return _redraw(model, seed)


def ltx_inputs(batch: int, frames: int, height: int, width: int, *, seed: int = 1,
               per_token_timestep: bool = False) -> dict:
    """Full forward arguments of LTX: S = frames * height * width patch tokens ``[B, S, C]``; the
    last sample's caption has its last two tokens masked out."""
    g = torch.Generator().manual_seed(seed)
    seq = frames * height * width
    shape = (batch, seq) if per_token_timestep else (batch,)
    mask = torch.ones(batch, TEXT_LEN)
    mask[-1, -2:] = 0
    return {
        "hidden_states": torch.randn(batch, seq, IN_CHANNELS, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "timestep": torch.randint(0, 1000, shape, generator=g).float(),
        "encoder_attention_mask": mask,
        "num_frames": frames, "height": height, "width": width,
        "rope_interpolation_scale": (1 / 25, 32, 32),
    }


def build(kind: str, heads: int, batch: int, frames: int, height: int, width: int, variant: str):
    """``(model, inputs)`` for a test case; ``variant``: "t2v", "per_token" (``[B, S]``
    timestep) or "i2v" (Wan's image tokens in cross-attention)."""
    per_token = variant == "per_token"
    if kind == "wan":
        i2v = variant == "i2v"
        return tiny_wan(heads, i2v=i2v), wan_inputs(batch, frames, height, width,
                                                    per_token_timestep=per_token, i2v=i2v)
    if kind == "ltx":
        return tiny_ltx(heads), ltx_inputs(batch, frames, height, width, per_token_timestep=per_token)
    raise ValueError(f"kind={kind!r} must be 'wan' or 'ltx'")


# ---- MiniMax-H3 -------------------------------------------------------------------------------
# H3's real structure at toy widths: a 2-block token refiner, a [text | keyframe | audio | video]
# packed layout with rows at three timesteps, RoPE on 2 * 3 * rope_freq_dim = 12 of 16 head
# channels (H3: 96 of 128), SwiGLU FFN, the per-(timestep, modality) AdaLN table.
H3_HEAD_DIM = 16
H3_VIDEO_CHANNELS = 4  # x the (1, 2, 2) patch = 16 channels per video row
H3_AUDIO_CHANNELS = 6
H3_TEXT_DIM = 12


def tiny_h3(heads: int, *, seed: int = 0, layers: int = 2):
    """``MiniMaxH3Transformer3DModel`` with ``heads`` x 16-channel heads, ``layers`` blocks and
    H3's 2 refiner blocks, every parameter redrawn from a seeded N(0, 0.15^2) (float32)."""
    from diffusers import MiniMaxH3Transformer3DModel

    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=heads, attention_head_dim=H3_HEAD_DIM, hidden_size=32, num_layers=layers,
        num_refiner_layers=2, ffn_dim=48, in_channels=H3_VIDEO_CHANNELS,
        audio_in_channels=H3_AUDIO_CHANNELS, patch_size=(1, 2, 2), text_dim=H3_TEXT_DIM,
        freq_dim=16, time_embed_hidden_dim=24, time_embed_dim=20, rope_freq_dim=2,
    )
    return _redraw(model, seed)


def h3_layout_functions():
    """``(build_packed_sequence, build_row_timesteps)`` of diffusers' H3 modular pipeline.

    The pipeline package imports ``transformers`` (for its Qwen3-VL text encoder) through
    ``diffusers.loaders.MiniMaxH3LoraLoaderMixin``; the layout code needs none of it. Without
    transformers installed (the ``diffusers`` extra does not bring it) the mixin is stood in by an
    empty class so that ``before_denoise`` imports, unchanged."""
    import diffusers.loaders as loaders

    try:
        loaders.MiniMaxH3LoraLoaderMixin  # noqa: B018 - present when transformers is installed
    except (ImportError, AttributeError, RuntimeError):
        loaders.MiniMaxH3LoraLoaderMixin = type("MiniMaxH3LoraLoaderMixin", (), {})
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep, MiniMaxH3SetTimestepsStep,
    )

    return MiniMaxH3PrepareLayoutStep.build_packed_sequence, MiniMaxH3SetTimestepsStep.build_row_timesteps


def h3_inputs(batch: int, *, text: int = 5, frames: int = 2, height: int = 4, width: int = 6,
              audio: int = 3, keyframes: tuple[str, ...] = ("first",), seed: int = 1) -> dict:
    """Full forward arguments of :func:`tiny_h3`, laid out by diffusers' own pipeline code
    (``fl2va``: ``[text | keyframe rows | audio | video]``). ``frames`` x ``height`` x ``width`` are
    video latents (patch 1x2x2), ``audio`` audio latents per channel (2 channels). Rows sit at
    three timesteps: video 0.3, audio 0.4, keyframes 0.999.

    S = text + (len(keyframes) + frames) * (height/2) * (width/2) + 2 * audio; the default is
    5 + 6 + 12 + 6 = 29 rows, which 2, 3 and 4 do not divide."""
    build_packed_sequence, build_row_timesteps = h3_layout_functions()
    layout = build_packed_sequence(torch.ones(text, dtype=torch.long), frames, height, width, audio,
                                   (1, 2, 2), 2, 2, 0, keyframes)
    position_ids, token_tags, video_indices, audio_indices, text_indices, n_cond_video, n_cond_audio = layout
    timestep, timestep_indices = build_row_timesteps(video_indices, audio_indices, n_cond_video,
                                                     n_cond_audio, text, 0.3, 0.4, 0.999, 1.0)
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, video_indices.numel(), H3_VIDEO_CHANNELS * 4, generator=g),
        "audio_hidden_states": torch.randn(batch, audio_indices.numel(), H3_AUDIO_CHANNELS, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, H3_TEXT_DIM, generator=g),
        "timestep": timestep, "timestep_indices": timestep_indices, "token_tags": token_tags,
        "position_ids": position_ids, "video_indices": video_indices,
        "audio_indices": audio_indices, "text_indices": text_indices,
    }
