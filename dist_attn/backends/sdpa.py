"""``"sdpa"``: torch's scaled_dot_product_attention (cuDNN or flash on CUDA, math on CPU)."""

from __future__ import annotations

import torch.nn.functional as F

from dist_attn.backends.base import AttentionBackend

__all__ = ["SdpaBackend"]


class SdpaBackend(AttentionBackend):
    """``torch.nn.functional.scaled_dot_product_attention``: cuDNN or flash on CUDA, math on CPU."""

    name = "sdpa"
    exact = True

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        return None

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        # [B, T, H, D] -> [B, H, T, D] views; SDPA never writes its inputs.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=softmax_scale
        )
        return out.transpose(1, 2)  # [B, H, T, D] -> [B, T, H, D]
