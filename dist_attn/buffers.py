# SPDX-License-Identifier: Apache-2.0
"""Reusable, bounded staging buffers for the Ulysses all-to-alls.

One flat allocation per (role, dtype, device), shared by every attention layer that uses the same
:class:`StagingBuffers` (by default the process-wide pool from :func:`default_staging_buffers`).
A buffer grows only when a request larger than its capacity arrives, and then to exactly that
request, so memory follows the largest request seen, never the number of distinct shapes.
SGLang keyed its Ulysses buffers by shape and held 12.4 GiB after about 30 varied requests, then
ran out of memory (sgl-project/sglang#35937); keying by role avoids that by construction.

Reuse is safe because one forward finishes with the buffers (its output is a fresh tensor)
before the next forward on the same stream starts writing them.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

__all__ = ["ROLES", "StagingBuffers", "StagingCapacityError", "default_staging_buffers"]

#: The four staging roles of one Ulysses forward.
ROLES = ("in_send", "in_recv", "out_send", "out_recv")

_ENV_MAX_BYTES = "DIST_ATTN_MAX_STAGING_BYTES"
# 16 GiB: the h3-ref forward needs ~1.1 GB of staging at W=4 and ~6.5 GB at W=1, so this only
# trips on runaway growth, never on the reference deployment.
_DEFAULT_MAX_BYTES = 16 << 30


class StagingCapacityError(ValueError):
    """A staging request would take the pool past its ``max_bytes`` limit."""


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class StagingBuffers:
    """A pool of flat staging buffers, one per (role, dtype, device).

    Args:
        max_bytes: upper bound on the bytes the pool may hold in total. ``None`` reads the
            ``DIST_ATTN_MAX_STAGING_BYTES`` environment variable, else 16 GiB.
    """

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is None:
            env = os.environ.get(_ENV_MAX_BYTES)
            if env is not None:
                try:
                    max_bytes = int(env)
                except ValueError:
                    raise ValueError(
                        f"{_ENV_MAX_BYTES}={env!r} is not an integer number of bytes"
                    ) from None
            else:
                max_bytes = _DEFAULT_MAX_BYTES
        if max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be > 0")
        self.max_bytes = int(max_bytes)
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    # -- sizing -----------------------------------------------------------------------------
    def _key(self, role: str, dtype: torch.dtype, device: torch.device | str):
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not one of {ROLES}")
        return (role, dtype, torch.device(device))

    def capacity(self, role: str, dtype: torch.dtype, device: torch.device | str) -> int:
        """Elements currently allocated for ``role`` (0 if none)."""
        buf = self._buffers.get(self._key(role, dtype, device))
        return 0 if buf is None else buf.numel()

    def total_bytes(self) -> int:
        """Bytes held by the pool across all roles, dtypes and devices."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def reserve(self, needs: dict[str, int], dtype: torch.dtype, device: torch.device | str) -> None:
        """Checks, then grows, the buffers so that each ``role`` holds ``needs[role]`` elements.

        Raises :class:`StagingCapacityError` BEFORE allocating anything if the pool would exceed
        ``max_bytes``. Callers pass sizes that are identical on every rank (see
        :func:`dist_attn.ulysses.ulysses_attention`), so every rank takes the same decision.
        """
        esize = _element_size(dtype)
        grown = self.total_bytes()
        for role, numel in needs.items():
            have = self.capacity(role, dtype, device)
            if numel > have:
                grown += (numel - have) * esize
        if grown > self.max_bytes:
            detail = ", ".join(f"{r}={n * esize}" for r, n in needs.items())
            raise StagingCapacityError(
                f"staging buffers would hold {grown} bytes ({detail} for dtype {dtype}), over "
                f"max_bytes={self.max_bytes}; raise the limit with StagingBuffers(max_bytes=...) "
                f"or {_ENV_MAX_BYTES}, or send shorter sequences"
            )
        for role, numel in needs.items():
            key = self._key(role, dtype, device)
            if numel > self.capacity(role, dtype, device):
                # Free the old buffer first so growth never holds old + new at once.
                self._buffers.pop(key, None)
                # A buffer made under inference_mode would be an inference tensor, which a later
                # call under plain no_grad may not write ("Inplace update to inference tensor
                # outside InferenceMode"); a normal tensor serves both modes.
                with torch.inference_mode(False):
                    self._buffers[key] = torch.empty(numel, dtype=dtype, device=key[2])

    def get(self, role: str, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A contiguous 1-D view ``[numel]`` of the ``role`` buffer, growing it if needed."""
        if numel > self.capacity(role, dtype, device):
            self.reserve({role: numel}, dtype, device)
        return self._buffers[self._key(role, dtype, device)][:numel]

    def release(self, roles: Iterable[str] | None = None) -> None:
        """Drops the buffers (all, or those of ``roles``) so their memory can be freed."""
        if roles is None:
            self._buffers.clear()
            return
        wanted = set(roles)
        for key in [k for k in self._buffers if k[0] in wanted]:
            del self._buffers[key]

    def __repr__(self) -> str:
        return f"StagingBuffers(max_bytes={self.max_bytes}, held_bytes={self.total_bytes()})"


_DEFAULT_POOL: StagingBuffers | None = None


def default_staging_buffers() -> StagingBuffers:
    """The process-wide pool used by every layer that is not given one of its own."""
    global _DEFAULT_POOL
    if _DEFAULT_POOL is None:
        _DEFAULT_POOL = StagingBuffers()
    return _DEFAULT_POOL
