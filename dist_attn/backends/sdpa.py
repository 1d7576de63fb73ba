# SPDX-License-Identifier: Apache-2.0
"""``"sdpa"``: torch's scaled_dot_product_attention (cuDNN or flash on CUDA, math on CPU)."""

from __future__ import annotations

import torch
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

    def dense_lse(self, q, k, v, *, softmax_scale):
        # [B, T, H, D] -> [B, H, T, D] views. The public SDPA does not return the log-sum-exp;
        # these are the kernels it dispatches to, called directly for their second output.
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qt, kt, vt, 0.0, False, scale=softmax_scale)[:2]
        elif q.dtype in (torch.float16, torch.bfloat16):
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
                qt, kt, vt, 0.0, False, False, scale=softmax_scale)[:2]
        else:  # fp32 on CUDA: the memory-efficient kernel computes in fp32 and returns its lse
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                qt, kt, vt, None, True, 0.0, False, scale=softmax_scale)[:2]
        # efficient attention pads lse's row axis to a multiple of 32
        return out.transpose(1, 2), lse[..., :q.shape[1]].float()  # [B, T, H, D], [B, H, T]
