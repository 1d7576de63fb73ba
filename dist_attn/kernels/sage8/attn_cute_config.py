# SPDX-License-Identifier: Apache-2.0
"""The launch parameters of the CuTe DSL sage8 loop (:mod:`attn_cute`), checked on construction.
Importing this module costs nothing beyond the standard library (no cutlass)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CuteConfig"]


@dataclass(frozen=True)
class CuteConfig:
    """Launch parameters of the CuTe loop.

    ``stages``: shared-memory slots of the K and V^T ring. ``block_n``: keys per block (64 or
    128; K's INT8 scales and the P V promotion follow it): 64 halves the score tile's and P's
    registers (measured slower). ``overlap``: issue the next block's
    QK wgmma before this block's softmax and alternate the two warpgroups at the tensor cores
    (False: each warpgroup waits on every wgmma, the two interleave only by chance).
    ``defer_add`` (with ``overlap``): a block's P V is added into the output one step later,
    while the next S is in flight, so nothing independent of the softmax follows the P V wait
    (False: added right after that wait, where ptxas hoists the wait above the softmax).
    ``p_smem``: P goes to the P V wgmma through shared memory (two buffers) instead of registers,
    so no register of an in-flight wgmma can be handed to the softmax (implies ``defer_add``;
    slower than registers on an H100: benchmarks/KERNEL_NOTES.md).
    ``prep_early``: the Q K^T wgmma starts from zero and the softmax adds the MAGIC_I offset
    (integer adds where the MUFU leaves issue slots free), and with ``overlap`` the deferred
    promotion runs before a warpgroup's turn at the tensor cores: the 64 constant moves and
    most of the promotion held that turn (not yet timed: off).
    ``p_fence`` (register P with ``overlap``): P's registers are read again after the P V wait,
    so ptxas cannot give them to the softmax and wait for that P V before it (measured level: off).
    ``short_chains``: the row max as a tree and the row sum as four running sums (dependency
    chains of 5 and 8, not 32). ``ks_ahead`` (with ``overlap``): K's per-block scale is loaded one
    block ahead, so its global-memory latency is not waited for at the softmax. ``poly_exp2``
    (0-8): of every 8 scores of a row, this many take their exp2 as a polynomial on the FMA pipe
    instead of the MUFU (FlashAttention-4's trick). ``short_chains`` with ``ks_ahead``, and both
    with ``poly_exp2=2``, measured level with the defaults: off.
    ``turns`` (with ``overlap``): the two consumer warpgroups take turns issuing their wgmmas
    (named barriers, FA3's ping-pong); False: each issues as soon as its operands are in, and the
    tensor cores take the two warpgroups' wgmmas in whatever order they come (not yet timed).
    ``consumer_regs`` / ``producer_regs``: the per-thread register budgets ``setmaxnreg`` gives
    the two roles (their sum over 384 threads must fit 64K registers). The defaults are the
    fastest combination measured.
    """

    stages: int = 2
    overlap: bool = True
    defer_add: bool = True
    p_smem: bool = False
    prep_early: bool = False
    p_fence: bool = False
    short_chains: bool = False
    ks_ahead: bool = False
    poly_exp2: int = 0
    turns: bool = True
    block_n: int = 128
    consumer_regs: int = 232
    producer_regs: int = 40

    @property
    def adds_late(self) -> bool:
        """Whether a block's P V is added one step later (``defer_add``, implied by ``p_smem``)."""
        return self.defer_add or self.p_smem

    def __post_init__(self):
        if self.stages not in (2, 3, 4):
            raise ValueError(f"CuteConfig.stages={self.stages!r} must be 2, 3 or 4")
        if isinstance(self.poly_exp2, bool) or not isinstance(self.poly_exp2, int) or not 0 <= self.poly_exp2 <= 8:
            raise ValueError(f"CuteConfig.poly_exp2={self.poly_exp2!r} must be an int in [0, 8]")
        if self.p_fence and (self.p_smem or not self.overlap):
            raise ValueError(f"CuteConfig.p_fence=True needs P in registers with overlap (p_smem=False, "
                             f"overlap=True), got p_smem={self.p_smem}, overlap={self.overlap}")
        if not self.turns and not self.overlap:
            raise ValueError("CuteConfig.turns=False needs overlap=True (only the overlap schedule takes turns)")
        if self.ks_ahead and not self.overlap:
            raise ValueError("CuteConfig.ks_ahead=True needs overlap=True (the loop it loads ahead in)")
        if self.block_n not in (64, 128):
            raise ValueError(f"CuteConfig.block_n={self.block_n!r} must be 64 or 128")
        for name in ("consumer_regs", "producer_regs"):
            val = getattr(self, name)
            if not isinstance(val, int) or val % 8 or not 24 <= val <= 256:
                raise ValueError(f"CuteConfig.{name}={val!r} must be a multiple of 8 in [24, 256]")
        if 2 * 128 * self.consumer_regs + 128 * self.producer_regs > 65536:
            raise ValueError(f"CuteConfig: 256 x consumer_regs={self.consumer_regs} + 128 x "
                             f"producer_regs={self.producer_regs} exceeds the SM's 65,536 registers")
