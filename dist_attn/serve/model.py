"""A video-DiT, sequence-sharded end to end: the consumer of :class:`UlyssesSageAttention`.

Every rank holds the full (replicated) weights and a contiguous shard of the packed rows:
rank r owns global rows [r * S_local, (r + 1) * S_local). Everything except attention is
row-wise, so only attention communicates (two all-to-alls inside UlyssesSageAttention).

Block (per layer), with ``mod = time_mod + block.modulation`` split into six [hidden] vectors::

    h = LN(x) * (1 + scale_msa) + shift_msa
    q, k, v = split(h @ W_qkv)                  # fused QKV projection
    q, k = RMSNorm(q), RMSNorm(k)               # per head, over head_dim
    q, k = RoPE(q[..., :rope_dims]), ...        # first rope_dims of each head only
    x = x + gate_msa * (UlyssesSageAttention(q, k, v) @ W_o)
    x = x + gate_mlp * MLP(LN(x) * (1 + scale_mlp) + shift_mlp)

The timestep modulation is projected once per step and shared by all blocks, each adding its own
learned [6, hidden] table (as Wan 2.x does): a per-block 6 x hidden x hidden AdaLN projection
would add 173M parameters per H3 layer (8.7B over 50 layers) for no effect on attention.

RoPE positions are the global packed row indices (1-D), so a rank needs only its row offset.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_attn.serve.config import ModelConfig

__all__ = [
    "DiT",
    "DiTBlock",
    "rms_norm",
    "apply_rope",
    "rope_tables",
    "timestep_embedding",
    "init_weights",
    "build_model",
    "compile_blocks",
]


def _attention_cls() -> type:
    # The core exports UlyssesSageAttention from the package root; imported lazily so this module
    # imports (and its pure helpers are testable) independently of the attention backends.
    from dist_attn import UlyssesSageAttention

    return UlyssesSageAttention


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32.

    Args:
        x: [..., D] any float dtype.
        weight: [D].
    Returns:
        [..., D] in x's dtype.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def rope_tables(positions: torch.Tensor, rope_dims: int, theta: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for rotate-half RoPE.

    Args:
        positions: [S] int64 global row indices.
    Returns:
        (cos, sin), each [S, 1, rope_dims // 2] float32 (the 1 broadcasts over heads).
    """
    half = rope_dims // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64, device=positions.device) / half)
    # Angles in float64: positions reach ~38k at h3-ref, where float32 angle error is ~4e-3 rad.
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]  # [S, half]
    return angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates the first ``2 * cos.shape[-1]`` dims of each head; the rest pass through.

    Args:
        x: [S, H, D].
        cos, sin: [S, 1, R/2] float32 from :func:`rope_tables`, R <= D.
    Returns:
        [S, H, D] in x's dtype.
    """
    half = cos.shape[-1]
    if half == 0:
        return x
    rot = x[..., : 2 * half].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., 2 * half:]], dim=-1)


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of the diffusion time.

    Args:
        t: [] or [1] float, in [0, 1] (scaled by 1000 as DiTs conventionally are).
    Returns:
        [dim] float32.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32,
                                                        device=t.device) / half)
    args = t.float().reshape(()) * 1000.0 * freqs
    return torch.cat([args.cos(), args.sin()])


class DiTBlock(nn.Module):
    """One DiT layer on a sequence shard. See the module docstring for the computation."""

    def __init__(self, cfg: ModelConfig, *, group: Any = None, backend: str = "auto",
                 timer: Any = None, device: Any = None, dtype: torch.dtype | None = None,
                 overlap_chunks: int = 1, mesh: Any = None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        hidden, inner = cfg.hidden_size, cfg.inner_dim
        self.modulation = nn.Parameter(torch.empty(6, hidden, **fk))
        self.norm1 = nn.LayerNorm(hidden, eps=cfg.norm_eps, elementwise_affine=False)
        self.qkv = nn.Linear(hidden, 3 * inner, **fk)
        self.q_norm = nn.Parameter(torch.empty(cfg.head_dim, **fk))
        self.k_norm = nn.Parameter(torch.empty(cfg.head_dim, **fk))
        self.attn = _attention_cls()(cfg.num_heads, cfg.head_dim, group=group, mesh=mesh,
                                     backend=backend, timer=timer, overlap_chunks=overlap_chunks)
        self.out = nn.Linear(inner, hidden, **fk)
        self.norm2 = nn.LayerNorm(hidden, eps=cfg.norm_eps, elementwise_affine=False)
        self.fc1 = nn.Linear(hidden, cfg.ffn_size, **fk)
        self.fc2 = nn.Linear(cfg.ffn_size, hidden, **fk)

    def forward(self, x: torch.Tensor, time_mod: torch.Tensor, rope: tuple[torch.Tensor, ...],
                cu_seqlens: torch.Tensor, valid_len: int,
                cu_seqlens_host: list[int] | None) -> torch.Tensor:
        """
        Args:
            x: [S_local, hidden] this rank's rows.
            time_mod: [6, hidden] shared timestep modulation.
            rope: (cos, sin) from :func:`rope_tables` for this rank's rows.
            cu_seqlens: [B + 1] int32 GLOBAL bounds on x's device; ``cu_seqlens_host`` its list.
            valid_len: the request's used rows; global rows >= valid_len are padding.
        Returns:
            [S_local, hidden].
        """
        cfg = self.cfg
        shift1, scale1, gate1, shift2, scale2, gate2 = (time_mod + self.modulation).unbind(0)
        h = self.norm1(x) * (1 + scale1) + shift1
        # [S_local, 3 * H * D] -> [S_local, 3, H, D]
        qkv = self.qkv(h).view(x.shape[0], 3, cfg.num_heads, cfg.head_dim)
        q, k, v = qkv.unbind(1)
        q = apply_rope(rms_norm(q, self.q_norm, cfg.norm_eps), *rope)
        k = apply_rope(rms_norm(k, self.k_norm, cfg.norm_eps), *rope)
        o = self.attn(q, k, v, cu_seqlens, None, cu_seqlens_host,
                      valid_len=valid_len)  # [S_local, H, D]
        x = x + gate1 * self.out(o.reshape(x.shape[0], cfg.inner_dim))
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


class DiT(nn.Module):
    """The denoiser: latent rows in, velocity rows out, sequence-sharded.

    Args:
        cfg: model shape.
        group: process group of the Ulysses degree (None: default group, or local if none).
        mesh: ("ring", "ulysses") DeviceMesh for Ulysses x Ring instead of ``group``.
        backend: attention backend name passed to UlyssesSageAttention.
        timer: optional PhaseTimer shared by every layer's attention.
        overlap_chunks: head chunks whose all-to-alls overlap the attention kernel (1 = plain).
        device, dtype: where and in what the parameters are created ("meta" to defer, see
            :func:`build_model`).
    """

    def __init__(self, cfg: ModelConfig, *, group: Any = None, backend: str = "auto",
                 timer: Any = None, device: Any = None, dtype: torch.dtype | None = None,
                 overlap_chunks: int = 1, mesh: Any = None) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.cfg = cfg
        hidden = cfg.hidden_size
        self.patch_in = nn.Linear(cfg.latent_channels, hidden, **fk)
        self.time_in = nn.Linear(cfg.freq_dim, hidden, **fk)
        self.time_hidden = nn.Linear(hidden, hidden, **fk)
        self.time_mod = nn.Linear(hidden, 6 * hidden, **fk)
        self.blocks = nn.ModuleList(
            DiTBlock(cfg, group=group, backend=backend, timer=timer, overlap_chunks=overlap_chunks,
                     mesh=mesh, **fk)
            for _ in range(cfg.num_layers))
        self.final_modulation = nn.Parameter(torch.empty(2, hidden, **fk))
        self.final_norm = nn.LayerNorm(hidden, eps=cfg.norm_eps, elementwise_affine=False)
        self.proj_out = nn.Linear(hidden, cfg.latent_channels, **fk)

    @property
    def backend_name(self) -> str:
        """Name of the attention backend the layers resolved to (or the requested name)."""
        if not self.blocks:
            return "none"
        attn = self.blocks[0].attn
        backend = getattr(attn, "backend", None)
        return str(getattr(backend, "name", backend or "unknown"))

    def forward(self, x: torch.Tensor, t: torch.Tensor, cu_seqlens: torch.Tensor,
                valid_len: int, *, row_offset: int,
                cu_seqlens_host: list[int] | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """
        Args:
            x: [S_local, latent_channels] this rank's latent rows (global rows
                [row_offset, row_offset + S_local)).
            t: [] float diffusion time in [0, 1].
            cu_seqlens: [B + 1] int32 GLOBAL bounds on x's device; ``cu_seqlens_host`` the same
                bounds as a Python list (so the attention needs no device-to-host sync).
            valid_len: the request's used rows: global rows >= valid_len are padding (never
                attended, zero attention output).
            rope: precomputed :func:`rope_tables` for this shard (reused across steps).
        Returns:
            [S_local, latent_channels] velocity, in x's dtype.
        """
        cfg = self.cfg
        if rope is None:
            positions = torch.arange(row_offset, row_offset + x.shape[0], device=x.device)
            rope = rope_tables(positions, cfg.rope_dims, cfg.rope_theta)
        dtype = self.patch_in.weight.dtype
        temb = timestep_embedding(t, cfg.freq_dim).to(dtype)  # [freq_dim]
        temb = self.time_hidden(F.silu(self.time_in(temb)))  # [hidden]
        time_mod = self.time_mod(F.silu(temb)).view(6, cfg.hidden_size)  # [6, hidden]
        h = self.patch_in(x.to(dtype))  # [S_local, hidden]
        for block in self.blocks:
            h = block(h, time_mod, rope, cu_seqlens, valid_len, cu_seqlens_host)
        shift, scale = (self.final_modulation + temb).unbind(0)
        return self.proj_out(self.final_norm(h) * (1 + scale) + shift).to(x.dtype)


def _param_seed(seed: int, name: str) -> int:
    # Per-parameter seed from its name: weights do not depend on creation order, device count,
    # or how many layers were built (a --layers 1 model has layer 0 of the full model).
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Seeded-random weights, identical on every rank (and across world sizes) for one device
    type. Linear weights ~ N(0, 1/fan_in), biases and modulation tables ~ N(0, 0.02^2), norm
    scales = 1. Gates are left non-zero (no adaLN-zero) so that every block, and so attention,
    contributes to the output a parity test compares."""
    for name, p in model.named_parameters():
        gen = torch.Generator(device=p.device).manual_seed(_param_seed(seed, name))
        if name.endswith(("q_norm", "k_norm")):
            p.fill_(1.0)
        elif name.endswith("weight") and p.dim() == 2:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[1]), generator=gen)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def build_model(cfg: ModelConfig, *, device: torch.device, dtype: torch.dtype, group: Any = None,
                backend: str = "auto", timer: Any = None, overlap_chunks: int = 1,
                state_dict: dict[str, torch.Tensor] | None = None, mesh: Any = None) -> DiT:
    """Creates the DiT directly on ``device`` (through "meta", so the 15B-parameter H3 model is
    never materialised on the host) and fills it from ``state_dict`` or :func:`init_weights`.

    ``state_dict`` must already be validated (see :func:`dist_attn.weights.check_state_dict`).
    """
    model = DiT(cfg, group=group, backend=backend, timer=timer, device="meta", dtype=dtype,
                overlap_chunks=overlap_chunks, mesh=mesh)
    model.to_empty(device=device)
    if state_dict is None:
        init_weights(model, cfg.weight_seed)
    else:
        model.load_state_dict(state_dict, strict=True)
    return model.eval().requires_grad_(False)


def compile_blocks(model: DiT) -> None:
    """``torch.compile`` each block in place (``nn.Module.compile``): the row-wise work around
    attention (norms, RoPE, projections, MLP) fuses, attention stays one opaque call. Blocks
    share their code, so one compilation serves every layer of a shape."""
    for block in model.blocks:
        block.compile()
