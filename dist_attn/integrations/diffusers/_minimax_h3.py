# SPDX-License-Identifier: Apache-2.0
"""MiniMax-H3 (``MiniMaxH3Transformer3DModel``): where its packed sequence lives, and a processor.

H3 runs every block over ONE packed sequence of S rows that ``forward`` builds itself: it projects
the text, video and audio streams and scatters their rows into a ``[B, S, hidden]`` buffer with
sequence-wide indices (``text_indices``, ``video_indices``, ``audio_indices``). The sequence can
therefore be cut only once that buffer exists, at the hidden states entering
``transformer_blocks.0``; everything indexed per row of it is cut alongside, to the same rows:

* the RoPE tables leaving ``rope`` (``[S, 2 * 3 * rope_freq_dim]`` each, H3: 96 channels),
* ``adaln_indices`` entering every block (``[S]``; forward hands each block its full tensor),
* ``timestep_indices`` entering ``norm_out`` (``[S]``).

The sequence is padded at the end to a multiple of W; padding rows get index 0 and zero RoPE, are
never attended (``valid_len``) and are dropped by the gathers. The two output heads are gathered
(``proj_out`` ``[B, S, C_video]``, ``audio_proj_out`` ``[B, S, C_audio]``; small, float32) because
forward selects the video and audio rows from them with sequence-wide indices. Each block's
``attn`` runs :class:`MiniMaxH3UlyssesProcessor`: one pair of all-to-alls per self-attention.

The token refiner (two plain blocks over the text rows, before packing) is left as diffusers runs
it: every rank refines all text rows with diffusers' own attention. It costs 2 blocks over
``N_text`` rows against the stack's 50 blocks over ``S / W`` rows each (H3 at h3-ref: 512 rows
against 50 x 9,504 at W = 4, 0.2% of the block work); sharding it would save three quarters of
that and add two all-to-all pairs and a gather per forward.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from diffusers import MiniMaxH3Transformer3DModel
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from torch import nn

from dist_attn.integrations.diffusers._spec import ForwardInputs, ModelSpec, ShardPoint
from dist_attn.qk_prologue import QKNormRope, qk_fields_rule

__all__ = ["MINIMAX_H3", "MiniMaxH3UlyssesProcessor"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """H3's rotate-half RoPE on the first ``R = cos.shape[-1]`` channels of every head.

    Args:
        x: ``[B, S_local, H, D]``.
        cos, sin: ``[S_local, R]`` float32 (R <= D; padding rows are zero).

    Returns:
        ``[B, S_local, H, D]`` in x's dtype; channels ``[R, D)`` pass through. The tables are cast to
        x's dtype first and the products summed in that dtype, as diffusers' H3 processor does,
        so the result is bit-identical to it.
    """
    rot = cos.shape[-1]
    head, tail = x[..., :rot], x[..., rot:]
    c = cos.to(x.dtype)[None, :, None, :]  # [S, R] -> [1, S, 1, R]
    s = sin.to(x.dtype)[None, :, None, :]
    first, second = head.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return torch.cat((head * c + turned * s, tail), dim=-1)


def _fusable(attn: nn.Module, q: torch.Tensor, rotary_emb) -> bool:
    """Whether q's and k's norms and RoPE are what :class:`dist_attn.QKNormRope` computes:
    ``nn.RMSNorm(head_dim)`` with weights and one eps, and tables the prologue admits
    (:func:`dist_attn.qk_prologue.qk_fields_rule`); anything else keeps diffusers' ops."""
    d = q.shape[-1]
    if rotary_emb is None or not all(
            type(n) is nn.RMSNorm and tuple(n.normalized_shape) == (d,) and n.weight is not None
            and n.eps is not None and n.eps == attn.norm_q.eps for n in (attn.norm_q, attn.norm_k)):
        return False
    return qk_fields_rule(attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, *rotary_emb, head_dim=d,
                          rows=q.shape[1], device=q.device) is None


class MiniMaxH3UlyssesProcessor:
    """Self-attention of a block's ``MiniMaxH3Attention`` whose attention spans every rank's rows.

    Projections, per-head RMSNorm of q and k, and RoPE act on this rank's ``S_local`` rows; the
    attention itself is :func:`dist_attn.ulysses_attention` over the group (or mesh), rows past the
    true length never attended. With an 8-bit backend (``runtime.fused_qk_norm_rope``) q and k go
    to the attention as projected, with a :class:`dist_attn.QKNormRope` that the Ulysses pack
    applies in its pass over them (:mod:`dist_attn.kernels.qk_norm_rope`: float32, one rounding);
    with an exact backend the norm and RoPE are diffusers' own ops, bit for bit.
    """

    def __init__(self, runtime: Any) -> None:
        self._rt = runtime

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_states`` ``[B, S_local, hidden]`` -> ``[B, S_local, hidden]``."""
        if attention_mask is not None:
            raise ValueError(
                "MiniMaxH3UlyssesProcessor attends over one packed document without a mask (H3's "
                f"forward passes none): got attention_mask of shape {tuple(attention_mask.shape)}"
            )
        if getattr(attn, "fused_projections", False):
            q, k, v = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            q, k, v = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        # [B, S_local, H*D] -> [B, S_local, H, D]
        q, k, v = (t.unflatten(-1, (attn.heads, -1)) for t in (q, k, v))
        where = "an H3 block's self-attention (transformer_blocks.*.attn)"
        if self._rt.fused_qk_norm_rope and _fusable(attn, q, rotary_emb):
            # q and k as projected: the Ulysses pack normalises and rotates them in its one pass
            # (one kernel first without an all-to-all); an 8-bit backend: not bit for bit anyway
            prologue = QKNormRope(attn.norm_q.weight, attn.norm_k.weight, attn.norm_q.eps, *rotary_emb)
            out = self._rt.attend(q, k, v, where, qk_prologue=prologue)
        else:
            q, k = attn.norm_q(q), attn.norm_k(k)
            if rotary_emb is not None:
                q, k = _rotate(q, *rotary_emb), _rotate(k, *rotary_emb)
            out = self._rt.attend(q, k, v, where)
        out = out.flatten(2, 3).type_as(q)  # [B, S_local, H, D] -> [B, S_local, H*D]
        return attn.to_out[1](attn.to_out[0](out))


def _shape(x: Any) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _read_inputs(model: nn.Module, args: Mapping[str, Any]) -> ForwardInputs:
    """S = rows of the packed sequence (``position_ids.shape[0]``), B = the batch; the layout
    arguments are checked against each other so that a bad one is named before any block runs."""
    streams = {}
    for name, what in (("hidden_states", "[B, N_video, C_video] video rows"),
                       ("audio_hidden_states", "[B, N_audio, C_audio] audio rows"),
                       ("encoder_hidden_states", "[B, N_text, text_dim] text rows")):
        x = args.get(name)
        if not isinstance(x, torch.Tensor) or x.ndim != 3:
            raise ValueError(f"{name}={_shape(x)} must be a {what} tensor for {type(model).__name__}")
        streams[name] = x
    batch = streams["hidden_states"].shape[0]
    for name, x in streams.items():
        if x.shape[0] != batch:
            raise ValueError(f"{name} of shape {tuple(x.shape)} has batch {x.shape[0]} but "
                             f"hidden_states of shape {tuple(streams['hidden_states'].shape)} has "
                             f"batch {batch}; the three streams share the batch axis")
    pos = args.get("position_ids")
    if not isinstance(pos, torch.Tensor) or pos.ndim != 2 or pos.shape[1] != 3 or pos.shape[0] < 1:
        raise ValueError(f"position_ids={_shape(pos)} must be a [S, 3] tensor of (t, h, w) "
                         f"coordinates, one row per row of the packed sequence (S >= 1)")
    seq = pos.shape[0]
    for name in ("timestep_indices", "token_tags"):
        x = args.get(name)
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (seq,):
            raise ValueError(f"{name}={_shape(x)} must be a [S] tensor with S={seq}, the rows of "
                             f"position_ids of shape {tuple(pos.shape)}")
    for name, stream in (("video_indices", "hidden_states"), ("audio_indices", "audio_hidden_states"),
                         ("text_indices", "encoder_hidden_states")):
        x, rows = args.get(name), streams[stream].shape[1]
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (rows,):
            raise ValueError(f"{name}={_shape(x)} must be a [{rows}] tensor: one packed position per "
                             f"row of {stream} of shape {tuple(streams[stream].shape)}")
    return ForwardInputs(seq_len=seq, batch=batch)


def _self_attention(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"transformer_blocks.{i}.attn", b.attn) for i, b in enumerate(model.transformer_blocks)]


def _check_model(model: nn.Module) -> None:
    if len(model.transformer_blocks) < 1:
        raise ValueError(f"{type(model).__name__} has no transformer_blocks: nothing to parallelise")
    heads = model.config.num_attention_heads
    for name, attn in _self_attention(model):
        if attn.heads != heads:
            raise ValueError(f"{name} has {attn.heads} heads, the config num_attention_heads={heads}")


MINIMAX_H3 = ModelSpec(
    model_class=MiniMaxH3Transformer3DModel,
    read_inputs=_read_inputs,
    compared_inputs=("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep",
                     "timestep_indices", "token_tags", "position_ids", "video_indices",
                     "audio_indices", "text_indices"),
    num_heads=lambda model: model.config.num_attention_heads,
    shards=(
        ShardPoint(module="rope", where="output", items=(0, 1), dim=0),
        ShardPoint(module="transformer_blocks.0", where="input", items=(0,), name="hidden_states", dim=1),
        ShardPoint(module="transformer_blocks.*", where="input", items=(2,), name="adaln_indices", dim=0),
        ShardPoint(module="norm_out", where="input", items=(2,), name="timestep_indices", dim=0),
    ),
    gathers=(("proj_out", 1), ("audio_proj_out", 1)),
    self_attention=_self_attention,
    expected_processor=MiniMaxH3AttnProcessor,
    make_processor=MiniMaxH3UlyssesProcessor,
    check_model=_check_model,
)
