# SPDX-License-Identifier: Apache-2.0
"""Per-phase timing of the Ulysses attention path.

A :class:`PhaseTimer` is handed to :class:`~dist_attn.UlyssesSageAttention` (``timer=``) or to a
model; every phase of every forward (``pack``, ``a2a_in``, ``kernel``, ``a2a_out``, ``unpack``) is
bracketed with CUDA events on GPU, or with ``time.perf_counter`` on CPU. Events are only read when
:meth:`PhaseTimer.totals_ms` is called, so timing adds no host sync to the forward on GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Iterator

import torch

__all__ = ["PhaseTimer", "PHASES"]

#: The phases of one UlyssesSageAttention forward, in execution order.
PHASES = ("pack", "a2a_in", "kernel", "a2a_out", "unpack")


class PhaseTimer:
    """Accumulates wall time per named phase.

    Args:
        device: the device whose work is timed. On CUDA, phases are bracketed by CUDA events on
            the current stream (no host sync until :meth:`totals_ms`); elsewhere by
            ``time.perf_counter`` (CPU work, including gloo collectives, is synchronous).
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._cuda = self.device.type == "cuda"
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self._host_ms: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the enclosed block under ``name``; nested or repeated names accumulate."""
        self._counts[name] += 1
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events[name].append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._host_ms[name] += (time.perf_counter() - t0) * 1e3

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last :meth:`reset` (synchronises the device on CUDA)."""
        out = dict(self._host_ms)
        if self._cuda and self._events:
            torch.cuda.synchronize(self.device)
            for name, pairs in self._events.items():
                out[name] = out.get(name, 0.0) + sum(s.elapsed_time(e) for s, e in pairs)
        return out

    def counts(self) -> dict[str, int]:
        """How many times each phase was entered since the last :meth:`reset`."""
        return dict(self._counts)

    def reset(self) -> None:
        """Forgets all recorded phases."""
        self._events.clear()
        self._host_ms.clear()
        self._counts.clear()
