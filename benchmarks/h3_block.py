# SPDX-License-Identifier: Apache-2.0
"""The real H3 block for the benchmarks: diffusers' ``MiniMaxH3TransformerBlock`` with dist_attn's
processor, its inputs at the h3-ref layout, and the h3-ref model inputs.

h3-ref is the reference attention workload: 512 text + 172 audio + 37,296 video rows = 37,980
(a 124-frame 768 x 1344 request with 86 audio latents per channel; H3's own pipeline would give
207), padded by H3's reference implementation to 38,016 = 594 x 64.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_attn.models.h3.serve.config import ModelConfig
from dist_attn.models.h3.serve.config.tokens import PackedLayout

__all__ = ["LayerRuntime", "attach", "block_inputs", "build_block", "h3_ref_layout", "model_inputs",
           "padded_total"]


def h3_ref_layout() -> PackedLayout:
    """The h3-ref rows: ``used`` = 37,980."""
    return PackedLayout(frames=124, latent_shape=(37, 48, 84), patch=(1, 2, 2), text=512,
                        audio_latents=86, audio_channels=2)


def padded_total(used: int, multiple: int = 64) -> int:
    """``used`` rounded up to H3's reference padding (38,016 for h3-ref)."""
    return -(-used // multiple) * multiple


class LayerRuntime:
    """Stands in for enable_ulysses' runtime under the H3 processor: the block's attention is
    ``layer(q, k, v, valid_len=...)`` (a :class:`dist_attn.UlyssesSageAttention` over a group, or
    a stand-in), over a sequence whose rows past ``valid_len`` are padding. The benchmarks swap
    ``layer`` (backend, group, overlap) without rebuilding the block. ``fused``: whether the
    processor normalises and rotates q and k in one kernel; None = as enable_ulysses' runtime
    decides it, from ``layer``'s backend (True for an 8-bit one; False for a layer without one)."""

    def __init__(self, layer: nn.Module, valid_len: int, fused: bool | None = None) -> None:
        self.layer, self.valid_len, self.fused = layer, valid_len, fused

    @property
    def fused_qk_norm_rope(self) -> bool:
        if self.fused is not None:
            return self.fused
        from dist_attn.integrations.diffusers._runtime import fuses_qk_norm_rope

        return fuses_qk_norm_rope(getattr(self.layer, "backend", "auto"))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str,
               qk_prologue=None) -> torch.Tensor:
        """``[B, S_local, H, D]`` each -> ``[B, S_local, H, D]``."""
        extra = {} if qk_prologue is None else {"qk_prologue": qk_prologue}
        return self.layer(q, k, v, valid_len=self.valid_len, **extra)


def build_block(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, *, seed: int = 0) -> nn.Module:
    """One ``MiniMaxH3TransformerBlock`` of ``cfg``'s shape, the class's own initialisation drawn
    on ``device`` from ``seed``, in ``dtype`` (an H3 block has no fp32 module), eval, no grad."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock

    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            block = MiniMaxH3TransformerBlock(
                hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                attention_head_dim=cfg.attention_head_dim, ffn_dim=cfg.ffn_dim,
                time_embed_dim=cfg.time_embed_dim, norm_eps=cfg.norm_eps, qk_norm_eps=cfg.qk_norm_eps)
    return block.to(dtype).eval().requires_grad_(False)


def attach(block: nn.Module, layer: nn.Module, valid_len: int, *, fused: bool | None = None) -> LayerRuntime:
    """Gives ``block.attn`` dist_attn's H3 processor with attention through ``layer``; returns
    the runtime whose ``layer`` / ``valid_len`` may be swapped later (``fused``: see
    :class:`LayerRuntime`)."""
    from dist_attn.integrations.diffusers._minimax_h3 import MiniMaxH3UlyssesProcessor

    runtime = LayerRuntime(layer, valid_len, fused)
    block.attn.set_processor(MiniMaxH3UlyssesProcessor(runtime))
    return runtime


def block_inputs(cfg: ModelConfig, layout: PackedLayout, total: int, s_local: int, row_offset: int,
                 device: torch.device, dtype: torch.dtype, *, seed: int = 0) -> tuple[Any, ...]:
    """A block's arguments for rows ``[row_offset, row_offset + s_local)`` of ``layout`` padded to
    ``total`` rows: ``hidden [1, s_local, hidden]`` in ``dtype``, ``temb [2, time_embed_dim]``
    float32 (two timesteps, as a video + audio step has), ``adaln_indices [s_local]`` and the RoPE
    ``(cos, sin)`` ``[s_local, 6 * rope_freq_dim]`` float32 of those rows (padding rows: 0)."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed

    rows = layout.rows()
    _, idx = layout.timestep_rows(0.3, 0.4)
    adaln = torch.zeros(total, dtype=torch.long)
    adaln[:layout.used] = idx * 3 + rows["token_tags"]
    rope = MiniMaxH3RotaryPosEmbed(cfg.rope_freq_dim, cfg.rope_theta)
    cos, sin = rope(rows["position_ids"])
    tables = []
    for t in (cos, sin):
        full = torch.zeros(total, t.shape[1], dtype=torch.float32)
        full[:layout.used] = t
        tables.append(full[row_offset:row_offset + s_local].to(device))
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(1, s_local, cfg.hidden_size, generator=g, device=device).to(dtype)
    temb = torch.randn(2, cfg.time_embed_dim, generator=g, device=device)
    return hidden, temb, adaln[row_offset:row_offset + s_local].to(device), tuple(tables)


def model_inputs(cfg: ModelConfig, layout: PackedLayout, device: torch.device, dtype: torch.dtype, *,
                 seed: int = 0) -> dict[str, torch.Tensor]:
    """Full forward arguments of ``MiniMaxH3Transformer3DModel`` for ``layout`` (batch 1): noise
    latents, a stand-in text embedding in ``dtype``, a two-timestep step (video 0.3, audio 0.4)."""
    g = torch.Generator(device=device).manual_seed(seed)
    timestep, indices = layout.timestep_rows(0.3, 0.4)
    video_ch = cfg.in_channels * cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    return {
        "hidden_states": torch.randn(1, layout.video, video_ch, generator=g, device=device),
        "audio_hidden_states": torch.randn(1, layout.audio, cfg.audio_in_channels, generator=g, device=device),
        "encoder_hidden_states": torch.randn(1, layout.text, cfg.text_dim, generator=g,
                                             device=device).to(dtype),
        "timestep": timestep.to(device), "timestep_indices": indices.to(device),
        **{k: v.to(device) for k, v in layout.rows().items()},
    }


if __name__ == "__main__":
    raise SystemExit("benchmarks.h3_block is a module of other benchmarks, with nothing to run by itself; "
                     "run python -m benchmarks.h3_model or python -m benchmarks.h3_fp8")
