# SPDX-License-Identifier: Apache-2.0
"""Dense attention kernels behind one small interface, and the registry that names them.

Registered at import: ``"sdpa"`` (torch SDPA, exact), ``"sage"`` (the sageattention package),
``"sage8"`` and ``"sage8_gluon"`` (dist_attn's INT8-QK / FP8-PV kernel for Hopper, its Triton and
its Gluon loop; need triton at call time),
``"fa3"`` (FlashAttention-3 on Hopper, exact, when importable).
``"auto"`` picks the first of sage8, sage8_gluon, sage, fa3, sdpa that can run and is accurate
(exact, or 8-bit with ``accuracy_verified``: :func:`auto_refusal`) and logs what it chose.
"""

from dist_attn.backends.base import AttentionBackend, BackendUnavailableError, default_softmax_scale
from dist_attn.backends.registry import (
    auto_refusal,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from dist_attn.backends.fa3 import Fa3Backend
from dist_attn.backends.sage import SageBackend
from dist_attn.backends.sage8 import Sage8Backend
from dist_attn.backends.sdpa import SdpaBackend

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "Fa3Backend",
    "SageBackend",
    "Sage8Backend",
    "SdpaBackend",
    "auto_refusal",
    "available_backends",
    "default_softmax_scale",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]

register_backend(SdpaBackend())
register_backend(SageBackend())
register_backend(Sage8Backend())
register_backend(Sage8Backend.alternate())
register_backend(Sage8Backend("sage8_cute", "cute"))
register_backend(Fa3Backend())
