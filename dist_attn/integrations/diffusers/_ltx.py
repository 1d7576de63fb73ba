# SPDX-License-Identifier: Apache-2.0
"""LTX-Video (``LTXVideoTransformer3DModel``): where its sequence lives, and a processor.

The model takes the patch tokens already flattened, ``hidden_states`` ``[B, S, C]``. The sequence
is cut at the RoPE tables leaving ``rope`` (``[B, S, inner_dim]`` each), at the hidden states
entering ``transformer_blocks.0`` and, for the image-to-video and conditioning pipelines' per-token
timesteps, at the ``timestep`` argument (``[B, S]``); it is gathered at the output of ``proj_out``.
Each block's ``attn1`` runs :class:`LTXUlyssesProcessor`; ``attn2`` (cross-attention to the
replicated caption, with its mask) keeps diffusers' processor.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers import LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from torch import nn

from dist_attn.integrations.diffusers._spec import ForwardInputs, ModelSpec, ShardPoint

__all__ = ["LTX", "LTXUlyssesProcessor"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """LTX's rotary embedding on interleaved pairs, before the heads are split.

    Args:
        x: ``[B, S_local, H*D]``.
        cos, sin: ``[B, S_local, H*D]`` float32 (each angle repeated for both members of a pair).

    Returns:
        ``[B, S_local, H*D]`` in x's dtype, computed in float32 as LTX's processor does.
    """
    real, imag = x.unflatten(-1, (-1, 2)).unbind(-1)  # [B, S, H*D] -> 2 x [B, S, H*D/2]
    turned = torch.stack((-imag, real), dim=-1).flatten(-2)  # [B, S, H*D/2, 2] -> [B, S, H*D]
    return (x.float() * cos + turned.float() * sin).to(x.dtype)


class LTXUlyssesProcessor:
    """Self-attention of an ``LTXAttention`` whose attention spans every rank's rows.

    Projections, qk-norm and RoPE act on this rank's ``S_local`` rows; the attention itself is
    :func:`dist_attn.ulysses_attention` over the group, padding rows never attended.
    """

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, C]`` -> ``[B, S_local, C]``."""
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("LTXUlyssesProcessor is self-attention without a mask: got "
                             f"encoder_hidden_states={encoder_hidden_states is not None}, "
                             f"attention_mask={attention_mask is not None}")
        q = attn.norm_q(attn.to_q(hidden_states))
        k = attn.norm_k(attn.to_k(hidden_states))
        v = attn.to_v(hidden_states)
        if image_rotary_emb is not None:
            q, k = _rotate(q, *image_rotary_emb), _rotate(k, *image_rotary_emb)
        # [B, S_local, H*D] -> [B, S_local, H, D]
        q, k, v = (t.unflatten(2, (attn.heads, -1)) for t in (q, k, v))
        out = self._rt.attend(q, k, v, "an LTX self-attention (attn1)")
        out = out.flatten(2, 3).to(q.dtype)  # [B, S_local, H, D] -> [B, S_local, H*D]
        return attn.to_out[1](attn.to_out[0](out))


def _read_inputs(model: nn.Module, args: Mapping[str, Any]) -> ForwardInputs:
    x = args.get("hidden_states")
    if not isinstance(x, torch.Tensor) or x.ndim != 3:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"hidden_states={shape} must be a [B, S, C] tensor of patch tokens for "
                         f"{type(model).__name__}")
    b, seq, _ = x.shape
    t = args.get("timestep")
    if isinstance(t, torch.Tensor) and t.ndim == 2 and t.shape[1] != seq:
        raise ValueError(f"timestep of shape {tuple(t.shape)} is per token but hidden_states of "
                         f"shape {tuple(x.shape)} has S={seq} tokens; a [B, S] timestep needs S = {seq}")
    return ForwardInputs(seq_len=seq, batch=b)


def _self_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"transformer_blocks.{i}.attn1", b.attn1) for i, b in enumerate(model.transformer_blocks)]


def _check_model(model: nn.Module) -> None:
    if len(model.transformer_blocks) < 1:
        raise ValueError(f"{type(model).__name__} has no blocks: nothing to parallelise")
    for name, attn in _self_attention(model):
        if attn.inner_kv_dim != attn.inner_dim or attn.cross_attention_dim != attn.query_dim:
            raise ValueError(f"{name} is expected to be plain multi-head self-attention")


LTX = ModelSpec(
    model_class=LTXVideoTransformer3DModel,
    read_inputs=_read_inputs,
    # num_frames/height/width and the RoPE scale place every token: a rank with other values
    # (same S, e.g. height and width swapped) rotated its rows differently, a silent mix
    compared_inputs=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask",
                     "video_coords", "num_frames", "height", "width", "rope_interpolation_scale"),
    num_heads=lambda model: model.config.num_attention_heads,
    shards=(
        ShardPoint(module="", where="input", name="timestep", dim=1, only_if_ndim=2),
        ShardPoint(module="rope", where="output", items=(0, 1), dim=1),
        ShardPoint(module="transformer_blocks.0", where="input", items=(0,), name="hidden_states", dim=1),
    ),
    gathers=(("proj_out", 1),),
    self_attention=_self_attention,
    expected_processor=LTXVideoAttnProcessor,
    make_processor=LTXUlyssesProcessor,
    check_model=_check_model,
)
