# SPDX-License-Identifier: Apache-2.0
"""The backend registry: names -> kernels, and what ``backend="auto"`` picks.

``"auto"`` takes the first kernel of its order that can run on the given tensors AND is accurate
(exact, or an 8-bit kernel whose accuracy was verified: :func:`auto_refusal` is the one rule) and
logs its choice; an explicit name that cannot run raises and says why (no silent fallback). An
explicit 8-bit name runs whether verified or not: the caller chose it.
"""

from __future__ import annotations

import logging

import torch

from dist_attn.backends.base import AttentionBackend, BackendUnavailableError

__all__ = [
    "auto_refusal",
    "available_backends",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "unregister_backend",
]

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, AttentionBackend] = {}
# "auto" tries these in order and takes the first that can run and that auto_refusal admits.
# Accuracy-verified 8-bit kernels first, the faster one first ("sage8", the Triton loop, before
# "sage8_gluon": benchmarks/kernels.py times them, docs/kernels.md has the figures); then the
# exact ones, FA3 before torch SDPA (1.12x cuDNN, benchmarks/kernels.py). "sage" (the
# sageattention package) declares no verified accuracy, so auto passes it over.
_AUTO_ORDER = ("sage8", "sage8_gluon", "sage8_cute", "sage", "fa3", "sdpa")
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


def _refusal(backend: AttentionBackend, q: torch.Tensor, *, exact_only: bool,
             require_lse: bool) -> str | None:
    """Why ``backend`` may not run here (its own reason, or the caller's constraints), or None."""
    reason = backend.unsupported_reason(q)
    if reason is not None:
        return reason
    if exact_only and not backend.exact:
        return "it quantizes to 8 bits and only exact kernels are allowed here (e.g. quality='lossless')"
    if require_lse and not backend.supports_lse:
        return ("it returns no log-sum-exp, which ring attention needs to merge partial results; "
                "use an LSE-capable backend such as 'sdpa' or 'fa3'")
    return None


def auto_refusal(backend: AttentionBackend) -> str | None:
    """Why ``"auto"`` may not choose ``backend`` whatever the tensors, or None: the one owner of
    "auto picks only what is accurate". An 8-bit kernel qualifies once its accuracy on real-model
    activations is verified (:attr:`AttentionBackend.accuracy_verified`); a fast kernel that is
    wrong must be asked for by name."""
    if backend.exact or backend.accuracy_verified:
        return None
    return ("it quantizes to 8 bits and its accuracy against float64 on real-model activations is not "
            "verified (accuracy_verified=False), so 'auto' does not choose it; name it explicitly to use it")


def resolve_backend(name: str, q: torch.Tensor, *, exact_only: bool = False,
                    require_lse: bool = False) -> AttentionBackend:
    """The backend that will run for ``backend=name`` on tensors like ``q``.

    An explicit name that cannot run raises :class:`BackendUnavailableError` saying why and how
    to fix it (no silent fallback). ``"auto"`` takes the first runnable of sage8, sage8_gluon, sage, fa3, sdpa
    (then any other registered backend) that :func:`auto_refusal` admits, and logs its choice
    and what it skipped at INFO (one short line), why at DEBUG, once per (device type, dtype,
    head_dim, constraints).

    Args:
        exact_only: admit only exact (non-quantized) kernels.
        require_lse: admit only kernels with :meth:`AttentionBackend.dense_lse`.
    """
    if not isinstance(name, str):
        raise TypeError(f"backend={name!r} must be a str, one of {available_backends()}")
    if name != "auto":
        backend = get_backend(name)
        reason = _refusal(backend, q, exact_only=exact_only, require_lse=require_lse)
        if reason is not None:
            raise BackendUnavailableError(f"backend={name!r} cannot run: {reason}")
        return backend
    skipped, reasons = [], []
    for candidate in _AUTO_ORDER + tuple(n for n in _REGISTRY if n not in _AUTO_ORDER):
        backend = _REGISTRY.get(candidate)
        if backend is None:
            continue
        reason = auto_refusal(backend) or _refusal(backend, q, exact_only=exact_only, require_lse=require_lse)
        if reason is None:
            key = (q.device.type, q.dtype, q.shape[-1], candidate, exact_only, require_lse)
            if key not in _AUTO_LOGGED:
                _AUTO_LOGGED.add(key)
                # one short line; why each was skipped (a paragraph each, with developer advice
                # such as TRITON_INTERPRET) is DEBUG's
                logger.info("backend='auto' chose %r for %s %s head_dim=%d%s", candidate,
                            q.device.type, q.dtype, q.shape[-1],
                            f" (skipped {', '.join(skipped)}; why: DEBUG log)" if skipped else "")
                if skipped:
                    logger.debug("backend='auto' skipped: %s", "; ".join(
                        f"{name}: {why}" for name, why in zip(skipped, reasons)))
            return backend
        skipped.append(candidate)
        reasons.append(reason)
    raise BackendUnavailableError("backend='auto' found no runnable backend: " + "; ".join(
        f"{name}: {why}" for name, why in zip(skipped, reasons)))
