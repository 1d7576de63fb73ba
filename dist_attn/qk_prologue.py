# SPDX-License-Identifier: Apache-2.0
"""What q and k go through between their projections and the attention: per-head RMSNorm, then
rotate-half RoPE on their first R channels (MiniMax-H3's ``norm_q`` / ``norm_k`` and rotary
embedding), said once so that the Ulysses pack can apply it (plain torch; no triton here).

Handed to :func:`dist_attn.ulysses_attention` as ``qk_prologue``, it is applied to this rank's
rows before the all-to-all: inside the pack's one pass over q, k and v where the kernel can
(:func:`dist_attn.kernels.qk_norm_rope.pack_qkv_prologue`), else by one kernel over q and k
first (:func:`dist_attn.kernels.qk_norm_rope.qk_norm_rope`). Either way float32 arithmetic and
one rounding at the end: not diffusers' bf16 ops bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QKNormRope", "check_qk_prologue", "qk_fields_rule"]


@dataclass(frozen=True)
class QKNormRope:
    """Per head and row ``x`` of q (k): ``y = x * rsqrt(mean(x**2) + eps) * q_weight``
    (``k_weight``), then on channels ``c < R``: ``y_c * cos[t, c] + r_c * sin[t, c]`` with
    ``r_c = -y[c + R/2]`` for ``c < R/2`` and ``y[c - R/2]`` otherwise; channels ``[R, D)`` keep ``y``.

    Attributes:
        q_weight, k_weight: ``[D]`` RMSNorm weights.
        eps: RMSNorm's epsilon (> 0).
        cos, sin: ``[S_local, R]`` float32 tables of THIS rank's rows, row t for its row t (R even,
            ``2 <= R <= D``).
    """

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor


def qk_fields_rule(q_weight, k_weight, eps, cos, sin, *, head_dim: int, rows: int, device: torch.device,
                   prefix: str = "", rows_name: str = "S_local") -> str | None:
    """The broken rule, naming the field (``prefix`` + its name), its value and the rule, if the
    fields of a :class:`QKNormRope` do not fit q's ``head_dim`` and ``rows`` rows on ``device``;
    None when they do. Shapes, dtypes and devices only (no device sync)."""
    d = head_dim
    if d & (d - 1):
        return f"{prefix}head_dim={d} must be a power of two (the kernel holds a row in registers)"
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d,) or w.device != device:
            return f"{prefix}{name} must be a [{d}] tensor on {device}, got {_desc(w)}"
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        return f"{prefix}eps={eps!r} must be a positive float"
    for name, t in (("cos", cos), ("sin", sin)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32
                or t.device != device):
            return f"{prefix}{name} must be a float32 [{rows_name}, R] tensor on {device}, got {_desc(t)}"
    r = cos.shape[1]
    if tuple(sin.shape) != tuple(cos.shape) or cos.shape[0] != rows or r < 2 or r % 2 or r > d:
        return (f"{prefix}cos / sin have shapes {tuple(cos.shape)} / {tuple(sin.shape)}: they need "
                f"{rows_name}={rows} rows (q's) and an even R in [2, head_dim={d}]")
    return None


def check_qk_prologue(prologue, q: torch.Tensor) -> None:
    """ValueError naming the field, its value and the rule, unless ``prologue`` is None or a
    :class:`QKNormRope` that fits ``q`` (``[B, S_local, H, D]``). Shapes, dtypes and devices only:
    every rank raises it before any collective."""
    if prologue is None:
        return
    if not isinstance(prologue, QKNormRope):
        raise ValueError(f"qk_prologue={type(prologue).__name__} must be a dist_attn.QKNormRope or None")
    p = prologue
    rule = qk_fields_rule(p.q_weight, p.k_weight, p.eps, p.cos, p.sin, head_dim=q.shape[-1],
                          rows=q.shape[-3], device=q.device, prefix="qk_prologue.")
    if rule:
        raise ValueError(rule)


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x) if x is None else f"a {type(x).__name__}"
