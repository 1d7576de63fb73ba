# SPDX-License-Identifier: Apache-2.0
"""``"sage"``: the sageattention package (SageAttention 2's API when installed, else 1.0.6)."""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

from dist_attn.backends.base import AttentionBackend
from dist_attn.extras import install_hint

__all__ = ["SageBackend"]


# Entry points that SageAttention 2.x exports and 1.0.6 does not.
_SAGE_V2_ONLY = ("sageattn_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp16_cuda",
                 "sageattn_qk_int8_pv_fp8_cuda")


class SageBackend(AttentionBackend):
    """The ``sageattention`` package: the 2.x API when installed, else 1.0.6's Triton kernel.

    sageattention 1.0.6 subtracts the key mean IN PLACE (``k -= k.mean(...)``; measured on an
    H200: max |dK| = 0.55 on N(0,1)+0.5 data). We therefore give it the caller's K only as a
    copy, and our own K (the all-to-all receive buffer, overwritten by the next call anyway)
    as is, so no extra copy is paid on the Ulysses path. Either way the call is the kernel's
    own, so results are bit-identical to calling it directly.
    """

    name = "sage"
    exact = False
    _HEAD_DIMS_V1 = (64, 96, 128)
    _HEAD_DIMS_V2 = (64, 128)

    @property
    def head_dims(self) -> tuple[int, ...]:
        self._load()
        return self._HEAD_DIMS_V2 if self._v2 else self._HEAD_DIMS_V1

    def __init__(self) -> None:
        self._loaded = False
        self._fn = None
        self._v2 = False
        self._import_error: str | None = None
        self.version: str | None = None

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        try:
            mod = importlib.import_module("sageattention")
        except Exception as exc:  # ImportError, or a broken triton underneath
            self._import_error = f"{type(exc).__name__}: {exc}"
            return
        try:
            self.version = importlib.metadata.version("sageattention")
        except importlib.metadata.PackageNotFoundError:
            self.version = None
        # Both 1.0.6 and 2.x export ``sageattn`` at the top level, so tell them apart by what
        # only 2.x has (its per-kernel entry points), not by the presence of ``sageattn``.
        self._v2 = any(hasattr(mod, name) for name in _SAGE_V2_ONLY)
        self._fn = getattr(mod, "sageattn", None)
        if self._fn is None:
            self._import_error = "the installed sageattention has no sageattn function"

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        self._load()
        if self._fn is None:
            return (
                f"the sageattention package cannot be imported ({self._import_error}); install it "
                f"with `{install_hint('gpu')}` (sageattention 1.0.6) or build SageAttention 2 "
                "from source, or use backend='sdpa'"
            )
        if q.device.type != "cuda":
            return (
                f"sageattention runs only on CUDA tensors, got device {q.device}; move q/k/v to a "
                "GPU or use backend='sdpa'"
            )
        dims = self.head_dims
        if q.shape[-1] not in dims:
            return (
                f"sageattention {self.version} supports head_dim in {dims}, got head_dim={q.shape[-1]}; "
                "use backend='sdpa'"
            )
        if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"sageattention needs fp16, bf16 or fp32 inputs, got dtype {q.dtype}"
        return None

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        self._load()
        if self._v2:
            return self._fn(q, k, v, tensor_layout="NHD", is_causal=False, sm_scale=softmax_scale)
        # 1.0.6 smooths K in place: hand it our own scratch K as is, the caller's K as a copy.
        # The copy costs what an out-of-place `k - mean` would, and keeps the call exactly the
        # kernel's own (an out-of-place mean subtraction measured 1-ulp differences on an H200).
        return self._fn(q, k if k_is_scratch else k.clone(), v, tensor_layout="NHD",
                        is_causal=False, sm_scale=softmax_scale, smooth_k=True)
