# SPDX-License-Identifier: Apache-2.0
"""``"fa3"``: FlashAttention-3 (Hopper), exact bf16 attention with a log-sum-exp.

Loads ``flash_attn_interface`` (a build of flash-attention's ``hopper/``) or, failing that, the
``fa3-fwd`` wheel from PyPI (FA3's forward only; ``pip install fa3-fwd``). The fastest exact
kernel at H3's shapes (1.12x torch's cuDNN SDPA in ``benchmarks/kernels.py``; docs/kernels.md),
which is why SGLang runs it for H3 and why ``"auto"`` prefers it among the exact kernels.
"""

from __future__ import annotations

import importlib
import sys

import torch

from dist_attn.backends.base import AttentionBackend

__all__ = ["Fa3Backend"]


class Fa3Backend(AttentionBackend):
    """FlashAttention-3's ``flash_attn_func`` on ``[B, T, H, D]`` tensors (non-causal)."""

    name = "fa3"
    exact = True
    head_dims = (64, 96, 128, 192, 256)

    def __init__(self) -> None:
        self._loaded = False
        self._fn = None
        self._source: str | None = None
        self._dtypes: tuple[torch.dtype, ...] = ()
        self._import_error: str | None = None

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        errors = []
        try:
            mod = importlib.import_module("flash_attn_interface")
            self._fn, self._source = mod.flash_attn_func, "flash_attn_interface"
            self._dtypes = (torch.float16, torch.bfloat16)
            return
        except Exception as exc:  # ImportError, or a build that does not load on this torch
            errors.append(f"flash_attn_interface: {type(exc).__name__}: {exc}")
        try:
            # The wheel's interface imports its build flags under the name its source tree uses.
            config = importlib.import_module("fa3_fwd_config")
            sys.modules.setdefault("flash_attn_config", config)
            mod = importlib.import_module("fa3_fwd_interface")
            self._fn, self._source = mod.flash_attn_func, "fa3_fwd"
            flags = config.CONFIG["build_flags"]
            self._dtypes = ((torch.bfloat16,) if flags.get("FLASHATTENTION_DISABLE_FP16")
                            else (torch.float16, torch.bfloat16))
        except Exception as exc:
            errors.append(f"fa3_fwd: {type(exc).__name__}: {exc}")
            self._import_error = "; ".join(errors)

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        self._load()
        if self._fn is None:
            return (f"FlashAttention-3 is not importable ({self._import_error}); install the "
                    "`fa3-fwd` wheel (pip install fa3-fwd) or build flash-attention's hopper/, or "
                    "use backend='sdpa'")
        if q.device.type != "cuda":
            return f"FlashAttention-3 runs only on CUDA tensors, got device {q.device}; use backend='sdpa'"
        cc = torch.cuda.get_device_capability(q.device)
        if cc != (9, 0):
            return (f"FlashAttention-3 needs a Hopper GPU (compute capability 9.0), this one is "
                    f"{cc[0]}.{cc[1]}; use backend='sdpa'")
        if q.dtype not in self._dtypes:
            return (f"this FlashAttention-3 build ({self._source}) takes {self._dtypes}, got "
                    f"{q.dtype}; cast q/k/v or use backend='sdpa'")
        if q.shape[-1] not in self.head_dims:
            return f"FlashAttention-3 supports head_dim in {self.head_dims}, got {q.shape[-1]}"
        return None

    def _call(self, q, k, v, softmax_scale, lse: bool):
        res = self._fn(q, k, v, softmax_scale=softmax_scale, causal=False, return_attn_probs=lse)
        if lse:
            return res[0], res[1]
        return res[0] if isinstance(res, tuple) else res

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        return self._call(q, k, v, softmax_scale, lse=False)

    def dense_lse(self, q, k, v, *, softmax_scale):
        out, lse = self._call(q, k, v, softmax_scale, lse=True)
        return out, lse.float()  # [B, T, H, D], [B, H, T]
