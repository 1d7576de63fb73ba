# SPDX-License-Identifier: Apache-2.0
"""Cutting a full sequence into the contiguous per-rank shards Ulysses expects, and back.

Ranks that compute different shard shapes make the all-to-all fail with "Received data size
doesn't match expected size" (or hang); :func:`plan_shard` is the one place where the padded
length and every rank's rows are decided, from integers that are the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dist_attn.distributed import group_size_and_rank
from dist_attn.validation import as_int, positive_int

__all__ = ["SequenceShard", "bucket_multiple", "padded_length", "plan_shard", "shard_rows", "shard_sequence",
           "gather_sequence"]


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of a sequence padded at the end to a multiple of the group size."""

    valid_len: int
    """Rows of the real sequence (pass it as ``valid_len=`` to the attention)."""
    total_len: int
    """``valid_len`` rounded up to a multiple of ``world_size`` (times the plan's
    ``multiple_of``): the packed length S."""
    world_size: int
    rank: int

    @property
    def local_len(self) -> int:
        """S_local = total_len / world_size rows per rank."""
        return self.total_len // self.world_size

    @property
    def start(self) -> int:
        """This rank's first global row."""
        return self.rank * self.local_len

    @property
    def local_valid(self) -> int:
        """How many of this rank's rows are real (the rest are padding)."""
        return max(0, min(self.local_len, self.valid_len - self.start))

    @property
    def cu_seqlens_host(self) -> list[int]:
        """``[0, total_len]``: one segment (padding is said by ``valid_len``, not by the bounds)."""
        return [0, self.total_len]


def _seq_axis(dim, x: torch.Tensor, name: str) -> int:
    """``dim`` as an axis of ``x`` in ``[0, x.ndim)``; out of range raises (no wrap-around: dim=5
    of a 3-D tensor would otherwise cut the feature axis)."""
    axis = as_int(dim)
    if axis is None:
        raise TypeError(f"dim={dim!r} must be an int (the sequence axis of {name})")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"dim={dim} is out of range for {name} of shape {tuple(x.shape)}: expected "
                         f"{-x.ndim} <= dim < {x.ndim}")
    return axis % x.ndim


def plan_shard(seq_len: int, group=None, *, multiple_of: int = 1) -> SequenceShard:
    """The shard plan of a ``seq_len``-row sequence over ``group`` (None: the default group,
    or a single rank when torch.distributed is not initialised).

    Args:
        seq_len: rows of the real sequence (>= 1).
        multiple_of: pad the total to a multiple of ``world_size * multiple_of`` (e.g. 64 for
            H3's packed-sequence alignment).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} must be a positive int")
    if isinstance(multiple_of, bool) or not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of!r} must be a positive int")
    _, world, rank = group_size_and_rank(group)
    return SequenceShard(valid_len=seq_len, total_len=padded_length(seq_len, world, multiple_of),
                         world_size=world, rank=rank)


def padded_length(seq_len: int, world: int, multiple_of: int = 1) -> int:
    """``seq_len`` rounded up to a multiple of ``world * multiple_of``: :func:`plan_shard`'s
    packed length S, for callers that know the world size but hold no group. Each argument must
    be a positive int (ValueError naming it)."""
    seq_len, world, multiple_of = (positive_int(n, v) for n, v in (
        ("seq_len", seq_len), ("world", world), ("multiple_of", multiple_of)))
    step = world * multiple_of
    return -(-seq_len // step) * step


def bucket_multiple(bucket: int, world: int) -> int:
    """:func:`plan_shard`'s ``multiple_of`` for a sequence bucket of ``bucket`` rows over
    ``world`` ranks: ``ceil(bucket / world)``, so S is a multiple of ``bucket`` when ``world``
    divides it, of the next multiple of ``world`` above it otherwise (W = 3, bucket 16: 18).
    Both must be positive ints (ValueError naming it)."""
    bucket, world = positive_int("bucket", bucket), positive_int("world", world)
    return -(-bucket // world)


def shard_sequence(x: torch.Tensor, group=None, *, dim: int = 1,
                   multiple_of: int = 1) -> tuple[torch.Tensor, SequenceShard]:
    """This rank's rows of the full tensor ``x`` along ``dim``, zero-padded at the end.

    Args:
        x: the full tensor, identical on every rank, e.g. ``[B, S, ...]`` with ``dim=1``.
        group: the Ulysses group (None: the default group).
        dim: the sequence axis.
        multiple_of: see :func:`plan_shard`.

    Returns:
        ``(x_local, shard)``: ``x_local`` has ``shard.local_len`` rows along ``dim`` (a fresh
        contiguous tensor; ``x`` is not modified); ``shard`` describes the split.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension (the sequence axis)")
    dim = _seq_axis(dim, x, "x")
    shard = plan_shard(x.shape[dim], group, multiple_of=multiple_of)
    return shard_rows(x, shard, dim=dim), shard


def shard_rows(x: torch.Tensor, shard: SequenceShard, *, dim: int = 1) -> torch.Tensor:
    """This rank's rows of ``x`` under an existing plan, zero-padded at the end.

    The pure half of :func:`shard_sequence` (no process-group query, so it traces under
    torch.compile): a caller that already holds the plan of a sequence cuts every tensor that
    carries it with the same rows.

    Args:
        x: the full tensor with ``shard.valid_len`` rows along ``dim``, e.g. ``[B, S, ...]``.
        shard: the plan (from :func:`plan_shard`).
        dim: the sequence axis.

    Returns:
        ``shard.local_len`` rows along ``dim``, contiguous with standard strides: a view of ``x``
        when no padding is needed and the rows are contiguous already, else a fresh tensor (``x``
        is not modified).
    """
    dim = _seq_axis(dim, x, "x")
    if x.shape[dim] != shard.valid_len:
        raise ValueError(f"x has {x.shape[dim]} rows along dim {dim} (shape {tuple(x.shape)}) but "
                         f"the plan is for a sequence of valid_len={shard.valid_len} rows")
    rows = x.narrow(dim, min(shard.start, x.shape[dim]), shard.local_valid)
    if shard.local_valid < shard.local_len:
        pad = [0, 0] * (x.ndim - 1 - dim) + [0, shard.local_len - shard.local_valid]
        return F.pad(rows, pad)
    # standard strides without a copy: ``.contiguous()`` keeps a narrow of [1, S, C] as it is (its
    # size-1 dim's stride S*C is not checked) and torch.compile specialises on that stride, one more
    # cache entry for a compiled block fed the cut rows; ``view`` recomputes the strides
    rows = rows.contiguous()
    return rows.view(rows.shape)


def gather_sequence(x_local: torch.Tensor, shard: SequenceShard, group=None, *,
                    dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: every rank gets the full ``valid_len`` rows.

    Args:
        x_local: ``shard.local_len`` rows along ``dim`` (same shape on every rank).
        shard: the plan this rank's rows came from.
        group: the group the shards live on (None: the default group).
        dim: the sequence axis.

    Returns:
        The full tensor with ``shard.valid_len`` rows along ``dim`` (one all-gather).
    """
    dim = _seq_axis(dim, x_local, "x_local")
    if x_local.shape[dim] != shard.local_len:
        raise ValueError(f"x_local.shape[{dim}]={x_local.shape[dim]} must equal shard.local_len="
                         f"{shard.local_len} (the rows shard_sequence gave this rank)")
    group, world, _ = group_size_and_rank(group)
    if world != shard.world_size:
        raise ValueError(f"the group has {world} ranks but the shard was planned for "
                         f"{shard.world_size}")
    if world == 1:
        return x_local.narrow(dim, 0, shard.valid_len)
    # all_gather_into_tensor concatenates along dim 0: move the sequence axis there and back.
    moved = x_local.movedim(dim, 0).contiguous()  # [S_local, ...]
    full = moved.new_empty((shard.total_len, *moved.shape[1:]))  # [S, ...]
    # torch >= 2.13 renamed the op (the old name warns); torch 2.11 has only the old name.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(full, moved, group=group)
    return full[:shard.valid_len].movedim(0, dim)
