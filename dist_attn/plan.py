"""How heads and rows are split across the ranks of a Ulysses group.

Pure functions of integers: every rank computes the same answer for every other rank, which is
what lets each rank size its buffers and split sizes without asking its peers.
"""

from __future__ import annotations

__all__ = ["heads_per_rank", "head_offsets"]


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
            "every rank needs at least one head"
        )
    base, extra = divmod(num_heads, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def head_offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Prefix sums of ``counts``: rank r owns global heads ``[offsets[r], offsets[r + 1])``."""
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return tuple(offsets)
