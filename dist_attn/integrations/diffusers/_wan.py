# SPDX-License-Identifier: Apache-2.0
"""Wan (``WanTransformer3DModel``, Wan 2.1 and 2.2): where its sequence lives, and a processor.

The sequence is the S = (F/p_t)*(H/p_h)*(W/p_w) patch tokens. It is cut at three places, once
per forward: the RoPE tables leaving ``rope`` (``[1, S, 1, D]`` each), the hidden states entering
``blocks.0`` (``[B, S, C]``), and, for Wan 2.2's per-token timesteps, the ``timestep`` argument
(``[B, S]``). It is gathered once, at the output of ``proj_out`` (``[B, S, C_out]``), before the
model unpatchifies. Each block's ``attn1`` (self-attention) runs :class:`WanUlyssesProcessor`;
``attn2`` (cross-attention to the replicated text, and image tokens for I2V) keeps diffusers'
processor: its queries are this rank's rows and its keys the full text, which is exact per row.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch import nn

from dist_attn.integrations.diffusers._spec import ForwardInputs, ModelSpec, ShardPoint

__all__ = ["WAN", "WanUlyssesProcessor"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding on interleaved pairs ``(x[2i], x[2i+1])``.

    Args:
        x: ``[B, S_local, H, D]``.
        cos, sin: ``[1, S_local, 1, D]`` (float64 in Wan; each angle repeated for both members
            of its pair). Padding rows are zero, which rotates them to zero.

    Returns:
        ``[B, S_local, H, D]`` in x's dtype. The products run in the tables' dtype and are rounded
        once, as diffusers' Wan processor does, so the float32 result is bit-identical to it.
    """
    pairs = x.unflatten(-1, (-1, 2))  # [B, S, H, D] -> [B, S, H, D/2, 2]
    even, odd = pairs[..., 0], pairs[..., 1]
    c, s = cos[..., 0::2], sin[..., 1::2]  # [1, S, 1, D/2]
    rotated = torch.stack((even * c - odd * s, even * s + odd * c), dim=-1)
    return rotated.flatten(-2).type_as(x)  # [B, S, H, D/2, 2] -> [B, S, H, D]


class WanUlyssesProcessor:
    """Self-attention of a ``WanAttention`` whose attention spans every rank's rows.

    Projections, qk-norm (RMSNorm across heads) and RoPE act on this rank's ``S_local`` rows; the
    attention itself is :func:`dist_attn.ulysses_attention` over the group, with the rows past
    the true length S (padding to a multiple of W) never attended.
    """

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, C]`` -> ``[B, S_local, C]``."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError(
                "WanUlyssesProcessor is self-attention without a mask: got encoder_hidden_states="
                f"{_kind(encoder_hidden_states)}, attention_mask={_kind(attention_mask)}"
            )
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        q, k = attn.norm_q(q), attn.norm_k(k)
        # [B, S_local, H*D] -> [B, S_local, H, D]
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        if rotary_emb is not None:
            q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
        out = self._rt.attend(q, k, v, "a Wan self-attention (attn1)")
        out = out.flatten(2, 3).type_as(q)  # [B, S_local, H, D] -> [B, S_local, H*D]
        return attn.to_out[1](attn.to_out[0](out))


def _kind(x: Any) -> str:
    return "None" if x is None else f"a {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}"


def _read_inputs(model: nn.Module, args: Mapping[str, Any]) -> ForwardInputs:
    x = args.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.ndim != 5:
        raise ValueError(
            f"hidden_states={_kind(x)} must be a [B, C, F, H, W] tensor for {type(model).__name__}"
        )
    p_t, p_h, p_w = model.config.patch_size
    b, _, f, h, w = x.shape
    seq = (f // p_t) * (h // p_h) * (w // p_w)
    if seq < 1:
        raise ValueError(f"hidden_states of shape {tuple(x.shape)} has no whole patch of "
                         f"patch_size={tuple(model.config.patch_size)}")
    t = args.get("timestep")
    if isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[1] != seq:
        raise ValueError(
            f"timestep of shape {tuple(t.shape)} is per token but hidden_states of shape "
            f"{tuple(x.shape)} has S={seq} tokens; a [B, S] timestep needs S = {seq}"
        )
    return ForwardInputs(seq_len=seq, batch=b)


def _self_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"blocks.{i}.attn1", block.attn1) for i, block in enumerate(model.blocks)]


def _check_model(model: nn.Module) -> None:
    if len(model.blocks) < 1:
        raise ValueError(f"{type(model).__name__} has no blocks: nothing to parallelise")
    for name, attn in _self_attention(model):
        if attn.is_cross_attention or attn.add_k_proj is not None:
            raise ValueError(f"{name} is expected to be plain self-attention (Wan's attn1)")


WAN = ModelSpec(
    model_class=WanTransformer3DModel,
    read_inputs=_read_inputs,
    compared_inputs=("hidden_states", "timestep", "encoder_hidden_states",
                     "encoder_hidden_states_image"),
    num_heads=lambda model: model.config.num_attention_heads,
    shards=(
        ShardPoint(module="", where="input", name="timestep", dim=1, only_if_ndim=2),
        ShardPoint(module="rope", where="output", items=(0, 1), dim=1),
        ShardPoint(module="blocks.0", where="input", items=(0,), name="hidden_states", dim=1),
    ),
    gathers=(("proj_out", 1),),
    self_attention=_self_attention,
    expected_processor=WanAttnProcessor,
    make_processor=WanUlyssesProcessor,
    check_model=_check_model,
)
