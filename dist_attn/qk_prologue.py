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

__all__ = ["QKNormRope", "check_qk_prologue"]


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


def check_qk_prologue(prologue, q: torch.Tensor) -> None:
    """ValueError naming the field, its value and the rule, unless ``prologue`` is None or a
    :class:`QKNormRope` that fits ``q`` (``[B, S_local, H, D]``). Shapes, dtypes and devices only:
    every rank raises it before any collective."""
    if prologue is None:
        return
    if not isinstance(prologue, QKNormRope):
        raise ValueError(f"qk_prologue={type(prologue).__name__} must be a dist_attn.QKNormRope or None")
    s_local, d = q.shape[-3], q.shape[-1]
    if d & (d - 1):
        raise ValueError(f"qk_prologue needs a power-of-two head_dim, got {d}")
    for name in ("q_weight", "k_weight"):
        w = getattr(prologue, name)
        if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d,) or w.device != q.device:
            raise ValueError(f"qk_prologue.{name}={_desc(w)} must be a [{d}] tensor on {q.device}")
    eps = prologue.eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"qk_prologue.eps={eps!r} must be a positive float")
    cos, sin = prologue.cos, prologue.sin
    for name, t in (("cos", cos), ("sin", sin)):
        if (not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32
                or t.device != q.device):
            raise ValueError(f"qk_prologue.{name}={_desc(t)} must be a float32 [S_local, R] tensor on {q.device}")
    r = cos.shape[1]
    if tuple(sin.shape) != tuple(cos.shape) or cos.shape[0] != s_local or r < 2 or r % 2 or r > d:
        raise ValueError(f"qk_prologue.cos / sin have shapes {tuple(cos.shape)} / {tuple(sin.shape)}: "
                         f"both [S_local={s_local}, R] (this rank's rows), R even in [2, head_dim={d}]")


def _desc(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return repr(x) if x is None else f"a {type(x).__name__}"
