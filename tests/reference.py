# SPDX-License-Identifier: Apache-2.0
"""Float64 single-process reference for block-diagonal packed attention."""

from __future__ import annotations

import math

import torch

__all__ = ["reference_attention", "rel_l2", "cosine"]


def reference_attention(q, k, v, bounds, valid_len=None, *, softmax_scale=None, device="cpu"):
    """``[T, H, D]`` or ``[B, T, H, D]`` inputs -> float64 of the same shape on ``device``: each
    segment of ``bounds`` attends only to itself, segments clipped to ``[0, valid_len)``; rows
    ``>= valid_len`` are padding and exactly zero (the contract of dist_attn)."""
    q, k, v = (t.detach().to(device, torch.float64) for t in (q, k, v))
    if q.ndim == 4:
        return torch.stack([reference_attention(*(t[i] for t in (q, k, v)), bounds, valid_len,
                                                softmax_scale=softmax_scale, device=device)
                            for i in range(q.shape[0])])
    total, _, d = q.shape
    valid = total if valid_len is None else valid_len
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out = torch.zeros_like(q)
    bounds = [int(b) for b in bounds]
    for a, b in zip(bounds[:-1], bounds[1:]):
        b = min(b, valid)
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
