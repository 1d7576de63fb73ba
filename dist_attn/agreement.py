# SPDX-License-Identifier: Apache-2.0
"""The ranks of a Ulysses (x Ring) group agree on a call's layout before its first all-to-all.

The one owner of cross-rank agreement in the library. Each rank describes its call by a
:class:`CallFacts` (shapes, dtype, bounds, ``valid_len``, scale, chunks, the kernel it resolved and
how that kernel fills its GPU). The first time a rank sees a description, the group exchanges
them with ONE all-reduce of a short int64 row (MAX over the row and its negation: every field's
minimum and maximum); every later call of that description makes none. A rank that refused its
own inputs takes part with an error flag (:func:`tell_refusal`), so its peers raise too instead of
waiting for it in an all-to-all.

What it cannot catch without a collective on every call: a rank that repeats a description the
group already agreed on while another passes a new one (the first skips the exchange the second
starts). Ranks that disagree from a description's first call on are caught on every rank.
"""

from __future__ import annotations

import collections
import struct
import zlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dist_attn.plan import KernelWaves

__all__ = ["CallFacts", "agree", "tell_refusal"]

#: dtype -> its number in the row (float16, bfloat16, float32: the supported ones; 0: another).
_DTYPES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_DTYPE_NAMES = {n: str(d) for d, n in _DTYPES.items()}

#: group names -> {facts: the waves the group agreed on}. Bounded; the oldest answer goes first,
#: alike on every member (they see the same facts in the same order), and is asked again if needed.
_AGREED: dict[tuple[str, ...], collections.OrderedDict[tuple, KernelWaves | None]] = {}
_AGREED_MAX = 256


@dataclass(frozen=True)
class CallFacts:
    """What every rank of a group must share for one call (each with its own rows)."""

    batch: int
    rows: int
    """S_local, the rows this rank holds."""
    heads: int
    head_dim: int
    dtype: torch.dtype
    device_type: str
    bounds: tuple[int, ...]
    """The global segment bounds as host ints."""
    valid_len: int
    softmax_scale: float
    """The scale the kernel uses (the default resolved)."""
    overlap_chunks: int
    qk_prologue: bool
    kernel: str
    """The backend's name this rank resolved."""

    def row(self, waves: KernelWaves | None, error_rank: int = -1) -> list[int]:
        """The int64 row exchanged; :data:`_FIELDS` names its entries."""
        scale_bits = struct.unpack("<q", struct.pack("<d", float(self.softmax_scale)))[0]
        return [error_rank + 1, self.rows, self.batch, self.heads, self.head_dim,
                _DTYPES.get(self.dtype, 0), _crc(self.device_type), _crc(repr(self.bounds)),
                self.valid_len, scale_bits, self.overlap_chunks, int(self.qk_prologue),
                -1 if waves is None else waves.tiles_per_head, -1 if waves is None else waves.slots,
                _crc(self.kernel)]


_ERROR, _ROWS, _BATCH, _HEADS, _HEAD_DIM, _DTYPE, _DEVICE, _BOUNDS, _VALID, _SCALE, _CHUNKS, \
    _PROLOGUE, _TILES, _SLOTS, _KERNEL = range(15)
_WIDTH = 15
_RULE = ("every rank must pass the same batch, heads, head_dim, dtype, device type, cu_seqlens, "
         "valid_len, softmax_scale, overlap_chunks and qk_prologue, each with S_local rows of its "
         "own (shard_sequence / plan_shard make them agree)")


def _crc(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def agree(facts: CallFacts, ask_waves: Callable[[], KernelWaves | None], groups, *,
          backend_arg) -> KernelWaves | None:
    """The kernel waves of this call (``ask_waves()``, asked only when ``facts`` are new) once
    every rank of ``groups`` described its call alike; raises on every rank otherwise: ValueError
    naming the argument that differs, RuntimeError when a peer refused its inputs or the kernels
    differ. One all-reduce per group (the Ulysses one, then the ring's) the first time
    ``facts`` are seen, none after."""
    cache = _AGREED.setdefault(_group_names(groups), collections.OrderedDict())
    if facts in cache:
        cache.move_to_end(facts)
        return cache[facts]
    waves = ask_waves()
    lo, hi = _exchange(facts.row(waves), groups)
    _check(facts, lo, hi, groups, backend_arg=backend_arg)
    cache[facts] = waves
    if len(cache) > _AGREED_MAX:
        cache.popitem(last=False)
    return waves


def tell_refusal(groups, rank: int) -> None:
    """This rank refused its inputs: take part in the exchange its peers make, with the error
    flag set, so that they raise too. The caller then raises its own error."""
    _exchange([rank + 1] + [0] * (_WIDTH - 1), groups)


def _group_names(groups) -> tuple[str, ...]:
    return tuple("default" if g is None else getattr(g, "group_name", None) or str(id(g))
                 for g in (groups.ulysses_group, groups.ring_group))


def _exchange(row: list[int], groups) -> tuple[list[int], list[int]]:
    """Every field's minimum and maximum over the ranks: one all-reduce per group of size > 1
    (the ring's after the Ulysses one covers the whole mesh)."""
    t = torch.tensor(row + [-x for x in row], dtype=torch.int64)
    for group, size in ((groups.ulysses_group, groups.ulysses_size), (groups.ring_group, groups.ring_size)):
        if size > 1:
            if "nccl" in str(dist.get_backend(group)).lower():
                t = t.to(torch.device("cuda", torch.cuda.current_device()))
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    values = t.tolist()  # under NCCL: one device sync
    return [-x for x in values[_WIDTH:]], values[:_WIDTH]


def _check(facts: CallFacts, lo: list[int], hi: list[int], groups, *, backend_arg) -> None:
    where = f"the {groups.world} ranks of {groups.desc}"
    if hi[_ERROR] > 0:
        raise RuntimeError(
            f"rank {hi[_ERROR] - 1} of {groups.desc} refused its inputs to this call (its error "
            "says why), so this rank raises too instead of waiting for it in the all-to-all")

    def span(i, show=str):
        return f"from {show(lo[i])} to {show(hi[i])}"

    def scale(bits):
        return f"{struct.unpack('<d', struct.pack('<q', bits))[0]:g}"

    for i, what, show in ((_ROWS, "the rows per rank (S_local)", str), (_BATCH, "the batch", str),
                          (_HEADS, "q's heads", str), (_HEAD_DIM, "head_dim", str),
                          (_DTYPE, "q's dtype", lambda n: _DTYPE_NAMES.get(n, "another")),
                          (_VALID, "valid_len", str), (_SCALE, "softmax_scale", scale),
                          (_CHUNKS, "overlap_chunks", str), (_PROLOGUE, "qk_prologue (given: 1)", str)):
        if lo[i] != hi[i]:
            raise ValueError(f"{what} differs across {where}: {span(i, show)}; {_RULE}")
    if lo[_DEVICE] != hi[_DEVICE]:
        raise ValueError(f"q's device type differs across {where} (this rank: "
                         f"{facts.device_type!r}); {_RULE}")
    if lo[_BOUNDS] != hi[_BOUNDS]:
        raise ValueError(f"cu_seqlens differ across {where} (this rank's bounds: "
                         f"{facts.bounds}); {_RULE}")
    kernels = lo[_KERNEL] != hi[_KERNEL]
    if lo[_TILES:_SLOTS + 1] != hi[_TILES:_SLOTS + 1]:
        unknown = "; -1: a rank whose kernel cannot tell" if lo[_TILES] < 0 else ""
        resolved = (f"; backend={backend_arg!r} resolved to different kernels on different ranks"
                    if kernels else "")
        raise RuntimeError(
            f"overlap_chunks={facts.overlap_chunks}: the ranks of {groups.desc} disagree on how the "
            f"attention kernel fills their GPUs (kernel_waves: tiles per head {span(_TILES)}, slots "
            f"{span(_SLOTS)}{unknown}{resolved}), and the chunks' widths, hence the all-to-all "
            "splits, depend on it. Run the group on one kind of GPU with one named backend, or "
            "pass overlap_chunks=1")
    if kernels:
        raise RuntimeError(
            f"backend={backend_arg!r} resolved to different kernels on different ranks of "
            f"{groups.desc} (this rank: {facts.kernel!r}), so their heads would be computed with "
            "different numerics; run the group on one kind of GPU or name one backend")
