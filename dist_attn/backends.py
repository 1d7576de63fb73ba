"""Dense attention kernels behind one small interface.

A backend computes non-causal attention on ``[B, T, H, D]`` tensors (batch, tokens, heads,
head_dim), the last dim contiguous and the others arbitrarily strided. The varlen bridge
(:mod:`dist_attn.bridge`) turns packed varlen attention into calls of this interface. A backend
may also offer a native ``varlen`` entry; the bridge then hands it the whole packed layout.

Registered here: ``"sage"`` (the sageattention package), ``"sage8"`` (dist_attn's own Triton
INT8-QK / FP8-PV kernel for Hopper, when its module imports) and ``"sdpa"`` (torch SDPA).
``"auto"`` picks the first of sage8, sage, sdpa that can run and logs what it chose.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import math
from typing import Callable

import torch
import torch.nn.functional as F

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "SageBackend",
    "SdpaBackend",
    "available_backends",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]

logger = logging.getLogger("dist_attn")


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run on these inputs; the message says why and what to do."""


class AttentionBackend:
    """Interface of a dense attention kernel.

    Attributes:
        name: registry key, e.g. ``"sdpa"``.
        exact: True for kernels that compute in the input precision (no 8-bit quantization);
            the ``"lossless"`` quality tier admits only these.
        head_dims: the head_dim values the kernel accepts (None = any); configs check it
            before any tensor exists.
    """

    name: str = ""
    exact: bool = True
    head_dims: tuple[int, ...] | None = None

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        """None if this backend can run on tensors like ``q`` (``[..., D]``), else why not and how to fix it."""
        raise NotImplementedError

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
              k_is_scratch: bool, out: torch.Tensor | None = None) -> torch.Tensor:
        """Non-causal attention.

        Args:
            q, k, v: ``[B, T, H, D]``, one dtype and device, last dim contiguous.
            softmax_scale: multiplier of q.k before the softmax.
            k_is_scratch: True when ``k`` lives in a buffer dist_attn owns (the all-to-all receive
                buffer) and may be overwritten; False when it is the caller's tensor.
            out: optional ``[B, T, H, D]`` destination. A kernel that can write there does and
                returns it; others ignore it and the bridge copies their result in.

        Returns:
            ``[B, T, H, D]`` in q's dtype; a tensor no caller input aliases.
        """
        raise NotImplementedError

    # A backend that handles packed varlen natively sets this to a callable
    # (q, k, v, cu_seqlens, max_seqlen, *, used, softmax_scale, out) -> out.
    varlen: Callable | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


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
                "with `pip install 'dist-attn[gpu]'` (sageattention 1.0.6) or build SageAttention 2 "
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


class _Sage8Backend(AttentionBackend):
    """dist_attn's Triton INT8-QK / FP8-PV kernel for Hopper (:mod:`dist_attn.kernels`)."""

    name = "sage8"
    exact = False

    def __init__(self, kernels) -> None:
        self._k = kernels
        self.varlen = self._varlen
        self.head_dims = tuple(kernels.SUPPORTED_HEAD_DIMS)

    def unsupported_reason(self, q: torch.Tensor) -> str | None:
        return self._k.unsupported_reason(q)

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        return self._k.sage8_dense(q, k, v, softmax_scale=softmax_scale, out=out)

    def _varlen(self, q, k, v, cu_seqlens, max_seqlen, *, used, softmax_scale, out):
        return self._k.sage8_varlen(q, k, v, cu_seqlens, max_seqlen, used=used,
                                    softmax_scale=softmax_scale, out=out)


_REGISTRY: dict[str, AttentionBackend] = {}
# "auto" tries these in order and takes the first that can run.
_AUTO_ORDER = ("sage8", "sage", "sdpa")
_AUTO_LOGGED: set[tuple] = set()


def register_backend(backend: AttentionBackend, *, replace: bool = False) -> None:
    """Adds ``backend`` under ``backend.name``; ``replace=True`` overrides an existing entry."""
    if not backend.name or backend.name == "auto":
        raise ValueError(f"backend name {backend.name!r} is reserved or empty")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True")
    _REGISTRY[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Removes a backend registered with :func:`register_backend`."""
    _REGISTRY.pop(name, None)


def available_backends() -> tuple[str, ...]:
    """Names accepted by ``backend=`` (registered ones plus ``"auto"``)."""
    return ("auto", *_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name`` (``"auto"`` is not a backend: use resolve_backend)."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"backend={name!r} is not one of {available_backends()}"
        ) from None


def resolve_backend(name: str, q: torch.Tensor) -> AttentionBackend:
    """The backend that will run for ``backend=name`` on tensors like ``q``.

    An explicit name that cannot run raises :class:`BackendUnavailableError` saying why and how
    to fix it (no silent fallback). ``"auto"`` takes the first runnable of sage8, sage, sdpa and
    logs its choice once per (device type, dtype, head_dim).
    """
    if not isinstance(name, str):
        raise TypeError(f"backend={name!r} must be a str, one of {available_backends()}")
    if name != "auto":
        backend = get_backend(name)
        reason = backend.unsupported_reason(q)
        if reason is not None:
            raise BackendUnavailableError(f"backend={name!r} cannot run: {reason}")
        return backend
    skipped = []
    for candidate in _AUTO_ORDER + tuple(n for n in _REGISTRY if n not in _AUTO_ORDER):
        backend = _REGISTRY.get(candidate)
        if backend is None:
            continue
        reason = backend.unsupported_reason(q)
        if reason is None:
            key = (q.device.type, q.dtype, q.shape[-1], candidate)
            if key not in _AUTO_LOGGED:
                _AUTO_LOGGED.add(key)
                logger.info(
                    "backend='auto' chose %r for %s %s head_dim=%d%s", candidate, q.device.type,
                    q.dtype, q.shape[-1],
                    "" if not skipped else " (skipped: " + "; ".join(skipped) + ")",
                )
            return backend
        skipped.append(f"{candidate}: {reason}")
    raise BackendUnavailableError("backend='auto' found no runnable backend: " + "; ".join(skipped))


def default_softmax_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the scale every kernel here defaults to."""
    return 1.0 / math.sqrt(head_dim)


register_backend(SdpaBackend())
register_backend(SageBackend())
try:  # the Triton kernel is optional: the package must import where triton does not
    from dist_attn import kernels as _kernels

    register_backend(_Sage8Backend(_kernels))
except ImportError:
    pass
