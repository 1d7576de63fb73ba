"""Tiny seeded diffusers transformers (Wan, LTX-Video) and their inputs, identical in every
process that builds them."""

from __future__ import annotations

import torch

__all__ = ["build", "ltx_inputs", "tiny_ltx", "tiny_wan", "wan_inputs", "HEAD_DIM", "IMAGE_DIM",
           "IN_CHANNELS", "TEXT_DIM", "TEXT_LEN"]

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
