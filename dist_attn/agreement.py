# SPDX-License-Identifier: Apache-2.0
"""The one owner of cross-rank agreement in the library: the core, the diffusers adapter, the
parallel VAE decode and the server's launch checks all agree through this module.

- :func:`gather_rows` / :func:`gather_objects`: every rank's description, in rank order, on every
  rank (one all-gather), so that every rank runs the same check and raises the same error;
- :func:`fingerprint`: a fixed-width row describing one input (absent, shape, kind, contents) that
  ranks compare (:func:`fingerprints_differ`) to find out whether they passed the same inputs;
- :func:`agree`: the Ulysses (x Ring) core's per-call layout, described below.

The ranks of a Ulysses (x Ring) group agree on a call's layout before its first all-to-all. Each
rank describes its call by a
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
import numbers
import struct
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from dist_attn.plan import KernelWaves

__all__ = ["CallFacts", "FINGERPRINT_RTOL", "FLOAT_TENSOR", "FP_ROW", "FP_SHAPE", "HOST_NUMBERS",
           "INT_TENSOR", "UNCOMPARABLE", "agree", "describe_fingerprint",
           "fingerprint", "fingerprint_kind", "fingerprints_differ", "gather_objects", "gather_rows",
           "tell_refusal"]

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


def gather_rows(mine: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    """``[world, *mine.shape]`` on the host: every rank's ``mine`` (one shape and dtype on every
    rank) in rank order. One all-gather, then one device-to-host copy."""
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    return torch.stack(rows).cpu()


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (one all_gather_object); ``[obj]`` when
    torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


# Per compared input: present flag (0 absent, 1 present, UNCOMPARABLE), ndim, up to _MAX_DIMS
# sizes, kind flag (FLOAT_TENSOR, INT_TENSOR, HOST_NUMBERS), then two contents slots (float64):
# sum |x| and sum x^2 for floating tensors; for integer and bool tensors, and for Python numbers
# (a scalar: ndim 0; a flat tuple/list: ndim 1) by their float64 bits, an exact, order-sensitive
# hash (bit-cast into the first slot) and 0. Index tensors (H3's video_indices, token_tags, ...)
# are compared exactly: a rank with the same rows in another order has the same sums but scatters
# its rows elsewhere.
_MAX_DIMS = 6
FP_SHAPE = 2 + _MAX_DIMS + 1
FP_ROW = FP_SHAPE + 2
FLOAT_TENSOR, INT_TENSOR, HOST_NUMBERS = 0.0, 1.0, 2.0
UNCOMPARABLE = 2.0
# Relative tolerance on the contents fingerprint. Another draw of N Gaussian values moves
# sum |x| by ~0.75/sqrt(N) relative (3e-4 for the 4.8M latent values of a 720p Wan video, 3e-2
# for the test's 1,440), so unseeded ranks are caught up to N ~ 5e9; values equal up to float32
# rounding (a nondeterministic text encoder) move it by <= ~1e-7 and pass.
FINGERPRINT_RTOL = 1e-5


def _host_codes(x: Any) -> torch.Tensor | None:
    """A number (Python, numpy, or a one-element tensor inside a tuple) or a flat tuple/list of
    them as int64 codes of their float64 values, compared exactly: host values are computed alike
    on every rank, so no tolerance, and 5 equals 5.0 (the models use them as floats). A scalar
    gives a 0-d tensor. None when ``x`` is anything else. Never raises (a rank raising here
    alone would leave its peers in the all-gather)."""
    items = x if isinstance(x, (tuple, list)) else (x,)
    values = []
    try:
        for v in items:
            if isinstance(v, torch.Tensor) and v.numel() == 1:
                v = v.item()  # LTX types rope_interpolation_scale tuple[Tensor, float, float]
            if not isinstance(v, numbers.Real):
                return None
            values.append(float(v))
    except Exception:  # noqa: BLE001 - e.g. an int too large for a float, a meta tensor
        return None
    if not values:
        return None
    codes = torch.tensor([struct.unpack("<q", struct.pack("<d", v))[0] for v in values],
                         dtype=torch.int64)
    return codes if isinstance(x, (tuple, list)) else codes[0]


def fingerprint(x: Any, device: torch.device) -> torch.Tensor:
    """``[FP_ROW]`` float64 on ``device``; the sums stay on the device (no host synchronisation)."""
    row = torch.zeros(FP_ROW, dtype=torch.float64, device=device)
    if x is None:
        return row  # absent
    kind = FLOAT_TENSOR
    if not isinstance(x, torch.Tensor):
        x, kind = _host_codes(x), HOST_NUMBERS
        if x is None:  # present, but nothing this check can compare: refused after the gather
            row[0] = UNCOMPARABLE
            return row
    elif not (x.is_floating_point() or x.is_complex()):
        kind = INT_TENSOR
    # Nothing here may raise on one rank only: its peers would wait in the all-gather. A tensor
    # of more dims than _MAX_DIMS is told apart by its ndim; the model's own checks refuse it.
    dims = list(map(float, x.shape[:_MAX_DIMS]))
    exact = kind != FLOAT_TENSOR
    sizes = [1.0, float(x.ndim), *dims] + [-1.0] * (_MAX_DIMS - len(dims)) + [kind]
    if exact:
        flat = x.detach().reshape(-1).to(device, torch.int64)
        weights = 2 * torch.arange(flat.numel(), device=device, dtype=torch.int64) + 1
        # int64 products and sums wrap mod 2**64: exact and order-sensitive (a swap of two
        # different values at rows i and j changes it by 2 (x_i - x_j)(i - j)).
        code = (flat * weights).sum().view(torch.float64)
        sums = torch.stack((code, torch.zeros((), dtype=torch.float64, device=device)))
    else:
        flat = x.detach().to(device, torch.float64)
        sums = torch.stack((flat.abs().sum(), flat.square().sum()))
    return torch.cat((torch.tensor(sizes, dtype=torch.float64, device=device), sums))


def fingerprints_differ(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """``"shape"`` or ``"contents"`` when two fingerprint rows describe different inputs (the
    contents of integers and Python numbers compared bit for bit, of floating tensors within
    :data:`FINGERPRINT_RTOL`), else None."""
    if not torch.equal(a[:FP_SHAPE], b[:FP_SHAPE]):
        return "shape"
    sums_a, sums_b = a[FP_SHAPE:], b[FP_SHAPE:]
    if a[FP_SHAPE - 1] != FLOAT_TENSOR:
        same = torch.equal(sums_a.view(torch.int64), sums_b.view(torch.int64))
    else:
        same = torch.allclose(sums_a, sums_b, rtol=FINGERPRINT_RTOL, atol=0.0, equal_nan=True)
    return None if same else "contents"


def describe_fingerprint(row: torch.Tensor) -> str:
    """What a fingerprint row describes, for a message: absent, Python numbers or a shape."""
    if row[0] == 0:
        return "absent"
    ndim = int(row[1])
    if row[FP_SHAPE - 1] == HOST_NUMBERS:
        return "a Python number" if ndim == 0 else f"{int(row[2])} Python numbers"
    return f"shape {tuple(int(s) for s in row[2:2 + min(ndim, _MAX_DIMS)])}" + ("..." if ndim > _MAX_DIMS else "")


def fingerprint_kind(row: torch.Tensor) -> str:
    """The kind of input a fingerprint row describes, for a message."""
    if row[0] == 0:
        return "absent"
    return {INT_TENSOR: "an integer tensor", HOST_NUMBERS: "Python numbers"}.get(
        float(row[FP_SHAPE - 1]), "a floating tensor")
