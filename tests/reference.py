"""Float64 single-process reference for block-diagonal packed attention."""

from __future__ import annotations

import math

import torch

__all__ = ["reference_attention", "rel_l2", "cosine"]


def reference_attention(q, k, v, bounds, max_seqlen, softmax_scale=None, device="cpu"):
    """``[T, H, D]`` inputs -> float64 ``[T, H, D]`` on ``device``: each segment attends only to itself; for
    the trailing-padding layout ``(0, used, T)`` with ``used == max_seqlen < T`` the padding rows
    are zero (the contract of dist_attn's bridge)."""
    q, k, v = (t.detach().to(device, torch.float64) for t in (q, k, v))
    total, _, d = q.shape
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros_like(q)
    bounds = [int(b) for b in bounds]
    padded = len(bounds) == 3 and bounds[1] == max_seqlen and 0 < bounds[1] < total
    segments = [(bounds[0], bounds[1])] if padded else list(zip(bounds[:-1], bounds[1:]))
    for a, b in segments:
        if b <= a:
            continue
        # [L, H, D] -> [H, L, L] scores
        s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
        p = torch.softmax(s, dim=-1)
        out[a:b] = torch.einsum("hqk,khd->qhd", p, v[a:b])
    return out


def rel_l2(x, ref) -> float:
    x = x.detach().to(ref.device, torch.float64)
    ref = ref.detach().to(torch.float64)
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def cosine(x, ref) -> float:
    x = x.detach().to(ref.device, torch.float64).flatten()
    ref = ref.detach().to(torch.float64).flatten()
    return float(torch.nn.functional.cosine_similarity(x, ref, dim=0))
