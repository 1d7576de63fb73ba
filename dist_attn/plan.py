# SPDX-License-Identifier: Apache-2.0
"""How heads, chunks and staging buffers are split across the ranks of a Ulysses group.

Pure functions of integers: every rank computes the same plan for every other rank, which is
what lets each rank size its buffers and split sizes without asking its peers. The batch is
folded into the head axis: sample b's head h is "folded head" ``b * H + h``, so one pair of
all-to-alls serves the whole batch and ``B * H >= W`` is all a batch needs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

__all__ = ["heads_per_rank", "too_few_heads_fix", "head_offsets", "chunk_widths", "KernelWaves",
           "MAX_SEARCH_STEPS", "UlyssesPlan", "ChunkSlices", "make_plan"]


def heads_per_rank(num_heads: int, world_size: int) -> tuple[int, ...]:
    """Number of heads each rank owns after the input all-to-all.

    When ``num_heads`` is not divisible by ``world_size`` the first ``num_heads % world_size``
    ranks take one extra head (DeepSpeed's rule), e.g. 7 heads on 3 ranks -> (3, 2, 2).

    Args:
        num_heads: total attention heads H (>= world_size).
        world_size: Ulysses degree W (>= 1).

    Returns:
        A tuple of W positive ints summing to H.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if num_heads < world_size:
        raise ValueError(
            f"num_heads={num_heads} must be >= the Ulysses world size {world_size}: "
            f"every rank needs at least one head; {too_few_heads_fix(num_heads, world_size)}"
        )
    base, extra = divmod(num_heads, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def too_few_heads_fix(heads: int, world_size: int, *, pad: bool = True) -> str:
    """What to do when ``heads`` (folded (sample, head) pairs) are fewer than the ``world_size``
    ranks of the all-to-all: the fix that goes with :func:`heads_per_rank`'s rule. ``pad``: the
    caller owns q, k and v, so it may also pad them with zero heads."""
    fix = (f"run the all-to-all on at most {heads} ranks (fewer ranks, or Ulysses x Ring: a "
           f"('ring', 'ulysses') mesh whose Ulysses size is at most {heads})")
    if pad:
        fix += (f", or pad q, k and v with zero heads up to {world_size} and drop those heads "
                "from the output (heads are independent)")
    return fix


def head_offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Prefix sums of ``counts``: rank r owns global heads ``[offsets[r], offsets[r + 1])``."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return tuple(offsets)


@dataclass(frozen=True)
class KernelWaves:
    """How an attention kernel fills the GPU: ``tiles_per_head`` programs for each head of a call,
    at most ``slots`` of them resident at once (SMs x programs per SM). A call of w heads runs in
    ``ceil(w * tiles_per_head / slots)`` waves; the last one may be part-full."""

    tiles_per_head: int
    slots: int

    def __post_init__(self):
        for name in ("tiles_per_head", "slots"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelWaves.{name}={value!r} must be an int >= 1")

    def waves(self, heads: int) -> int:
        """Waves of a call on ``heads`` heads, the last part-full one counted whole."""
        return -(-heads * self.tiles_per_head // self.slots)


#: Above this many DP steps (chunks x heads^2) :func:`chunk_widths` keeps the even split: the
#: search is Python, and shapes that large (hundreds of folded heads a rank) are not pipelined.
MAX_SEARCH_STEPS = 500_000


@functools.lru_cache(maxsize=1024)
def chunk_widths(heads: int, n_chunks: int, waves: KernelWaves | None = None) -> tuple[int, ...]:
    """How many heads each of ``n_chunks`` pipelined chunks attends, out of ``heads``.

    Without ``waves``: as even as possible, the first chunks one head wider (:func:`heads_per_rank`).
    With ``waves``: the split whose kernel calls leave the fewest slots idle in their last waves
    (a part-full last wave costs a full one or more; benchmarks/KERNEL_NOTES.md), the most
    even of those (least sum of squared widths), sorted narrowest first (the first chunk's input
    all-to-all is the one nothing hides). E.g. 14 heads,
    594 tiles a head, 396 slots (sage8 at H3's W = 4 on an H100 / H200), 4 chunks: ``(2, 4, 4, 4)``,
    3 + 6 + 6 + 6 = 21 waves, where the even split ``(4, 4, 3, 3)`` takes 22. A search over
    ``n_chunks * heads**2`` steps; beyond ``MAX_SEARCH_STEPS`` the even split stands.
    """
    even = heads_per_rank(heads, n_chunks)
    if waves is None or n_chunks * heads * heads > MAX_SEARCH_STEPS:
        return even
    t, s = waves.tiles_per_head, waves.slots

    def idle(w: int) -> int:  # empty slots of the last wave of a w-head call, in tiles
        return -w * t % s

    # best[c][h]: ((idle tiles, sum of squared widths), width of the last chunk) of the best split
    # of h heads into c chunks. Both terms add up chunk by chunk, so comparing the pairs in order
    # (fewest idle tiles, then the most even) keeps the search exact.
    best: list[dict[int, tuple[tuple[int, int], int]]] = [{0: ((0, 0), 0)}]
    for c in range(1, n_chunks + 1):
        row = {}
        for h in range(c, heads - (n_chunks - c) + 1):
            row[h] = min(((best[c - 1][h - w][0][0] + idle(w), best[c - 1][h - w][0][1] + w * w), w)
                         for w in range(1, h - c + 2) if h - w in best[c - 1])
        best.append(row)
    widths, h = [], heads
    for c in range(n_chunks, 0, -1):
        w = best[c][h][1]
        widths.append(w)
        h -= w
    return tuple(sorted(widths))


@dataclass(frozen=True)
class ChunkSlices:
    """One pipelined chunk of a Ulysses forward: which folded heads travel, and where.

    Buffer slices are ``(start, stop)`` element offsets into the flat staging buffers; splits are
    the per-rank element counts of one ``all_to_all_single``.
    """

    head_ranges: tuple[tuple[int, int], ...]
    """For each rank j, the folded heads ``(start, stop)`` it attends in this chunk."""
    in_send: tuple[int, int]
    in_recv: tuple[int, int]
    out_send: tuple[int, int]
    out_recv: tuple[int, int]
    in_send_splits: tuple[int, ...]
    in_recv_splits: tuple[int, ...]
    out_send_splits: tuple[int, ...]
    out_recv_splits: tuple[int, ...]

    def local_heads(self, rank: int) -> int:
        """How many folded heads ``rank`` attends in this chunk."""
        a, b = self.head_ranges[rank]
        return b - a


@dataclass(frozen=True)
class UlyssesPlan:
    """Everything one rank needs to run one Ulysses forward, derived from integers only.

    Buffer sizes use the LARGEST rank's head count so every rank reserves the same amount and
    a capacity error is raised on all ranks together.
    """

    world: int
    rank: int
    s_local: int
    """Rows this rank holds of the packed sequence."""
    folded_heads: int
    """B * H: the head axis the all-to-all splits."""
    head_dim: int
    counts: tuple[int, ...]
    """Folded heads per rank (the first ``B*H % W`` ranks take one more)."""
    chunks: tuple[ChunkSlices, ...]

    @property
    def seq(self) -> int:
        """S = S_local * W, the global packed length."""
        return self.s_local * self.world

    @property
    def pack_runs(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` runs of :attr:`chunks` packed by one call each, in order: the first
        chunk alone (its input all-to-all can start while the rest are packed), then the longest
        runs of chunks as wide as one another on every rank (one strided copy per role packs such
        a run when the heads allow it: :func:`dist_attn.comm.pack_qkv_chunks`). E.g. widths
        ``(2, 4, 4, 4)`` -> ``((0, 1), (1, 4))``; ``(4, 4, 3, 3)`` -> ``((0, 1), (1, 2), (2, 4))``."""
        runs = [(0, 1)]
        for c in range(1, len(self.chunks)):
            start = runs[-1][0]
            if start > 0 and _widths(self.chunks[c]) == _widths(self.chunks[start]):
                runs[-1] = (start, c + 1)
            else:
                runs.append((c, c + 1))
        return tuple(runs)

    def buffer_sizes(self) -> dict[str, int]:
        """Elements per staging role, identical on every rank."""
        h_max, s, d = max(self.counts), self.seq, self.head_dim
        return {"in_send": self.s_local * 3 * self.folded_heads * d, "in_recv": s * 3 * h_max * d,
                "out_send": s * h_max * d, "out_recv": self.s_local * self.folded_heads * d}


def _widths(chunk: ChunkSlices) -> tuple[int, ...]:
    return tuple(b - a for a, b in chunk.head_ranges)


def make_plan(*, world: int, rank: int, s_local: int, folded_heads: int, head_dim: int,
              overlap_chunks: int, waves: KernelWaves | None = None) -> UlyssesPlan:
    """The plan of one forward; raises ValueError (on every rank alike) when B*H < W.

    ``overlap_chunks`` is capped at the smallest rank's head count so no chunk is empty. ``waves``
    (the attention kernel's, for one call over the whole sequence) shapes the chunks' widths
    (:func:`chunk_widths`); it must be the same on every rank, as every other argument.
    """
    counts = heads_per_rank(folded_heads, world)
    n_chunks = min(overlap_chunks, min(counts))
    offsets = head_offsets(counts)
    splits = [head_offsets(chunk_widths(n, n_chunks, waves)) for n in counts]
    seq, d = s_local * world, head_dim
    chunks = []
    pos = dict.fromkeys(("in_send", "in_recv", "out_send", "out_recv"), 0)
    for c in range(n_chunks):
        ranges = tuple((offsets[j] + splits[j][c], offsets[j] + splits[j][c + 1]) for j in range(world))
        widths = [b - a for a, b in ranges]
        w_r = widths[rank]
        sizes = {"in_send": s_local * 3 * sum(widths) * d, "in_recv": seq * 3 * w_r * d,
                 "out_send": seq * w_r * d, "out_recv": s_local * sum(widths) * d}
        spans = {role: (pos[role], pos[role] + n) for role, n in sizes.items()}
        for role, n in sizes.items():
            pos[role] += n
        chunks.append(ChunkSlices(
            head_ranges=ranges, **spans,
            in_send_splits=tuple(s_local * 3 * w * d for w in widths),
            in_recv_splits=(s_local * 3 * w_r * d,) * world,
            out_send_splits=(s_local * w_r * d,) * world,
            out_recv_splits=tuple(s_local * w * d for w in widths),
        ))
    return UlyssesPlan(world=world, rank=rank, s_local=s_local, folded_heads=folded_heads,
                       head_dim=head_dim, counts=counts, chunks=tuple(chunks))
