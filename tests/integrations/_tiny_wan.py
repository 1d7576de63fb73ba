"""A tiny seeded ``WanTransformer3DModel`` and its inputs, identical in every process that builds them."""

from __future__ import annotations

import torch

__all__ = ["tiny_wan", "wan_inputs", "HEAD_DIM", "IN_CHANNELS", "TEXT_DIM", "TEXT_LEN", "IMAGE_DIM"]

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


def tiny_wan(heads: int, *, seed: int = 0, layers: int = 2, i2v: bool = False):
    """``heads`` x 12-channel heads, 2 blocks, patch (1, 2, 2); every parameter redrawn from a
    seeded N(0, 0.15^2) so no weight or bias is the zero or one of its default init (a zero
    ``norm2.bias`` would hide a wrong row order in cross-attention's input).

    ``i2v`` adds Wan 2.1 I2V's image branch: cross-attention also attends to image tokens."""
    from diffusers import WanTransformer3DModel

    image = {"image_dim": IMAGE_DIM, "added_kv_proj_dim": heads * HEAD_DIM} if i2v else {}
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=HEAD_DIM,
        in_channels=IN_CHANNELS, out_channels=IN_CHANNELS, text_dim=TEXT_DIM, freq_dim=16,
        ffn_dim=32, num_layers=layers, rope_max_seq_len=32, **image,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model.eval()


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
