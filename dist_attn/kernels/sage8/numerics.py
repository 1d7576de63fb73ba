# SPDX-License-Identifier: Apache-2.0
"""The numbers of the Sage8 quantization scheme, shared by the kernels and the torch reference.

Importing this module costs torch only (no triton).
"""

from __future__ import annotations

import torch

__all__ = ["P8_PRMT", "PAD", "INT8_MAX", "FP8_MAX", "LOG2_PSCALE", "MAGIC_I", "MAGIC_F", "MMA_ACC_BITS", "MMA_K_STEP",
           "V_KEY_ORDERS", "mma_key_order", "padded_rows"]

#: Row alignment of every segment in the quantized buffers, a multiple of every block size: every
#: tile starts aligned (TMA boxes and 16-byte loads need no masks) and never spans two segments.
PAD = 128
#: Q and K are quantized to INT8 as round(x / scale) with scale = amax / INT8_MAX.
INT8_MAX = 127.0
#: V and P are quantized to FP8 e4m3, whose largest finite value is 448.
FP8_MAX = 448.0
#: P is stored as p * 2**LOG2_PSCALE (< FP8_MAX) so that probabilities down to 2**-15 keep e4m3's
#: normal range (2**-6) instead of flushing to subnormals; the factor cancels in acc / l.
LOG2_PSCALE = 8.75
# 0x4B400000 is the float 1.5 * 2**23. For |i| < 2**22 the bit pattern (0x4B400000 + i) read as a
# float is 12582912 + i exactly, so an int32 score becomes a float with one integer add instead of
# I2F, which Hopper issues at a quarter of the FFMA rate. Bound: |q.k| <= D * 127**2 = 2,064,512 <
# 2**22 for D <= 128, hence SUPPORTED_HEAD_DIMS.
MAGIC_I = 0x4B400000
MAGIC_F = 12582912.0
#: Hopper's FP8 wgmma (e4m3 x e4m3 -> "f32") does not keep a full fp32 accumulator: the sum of each
#: k-step's products with the accumulator keeps about this many mantissa bits, the rest truncated
#: (DeepSeek-V3 reports ~14 bits on H800; a torch model with 13 bits reproduces the shape of the
#: error measured on a GPU; see benchmarks/KERNEL_NOTES.md). The reference uses it to model what
#: the tensor cores do; the kernels therefore never let one MMA accumulator run over more than one
#: key block (``MMA_K_STEP``-key steps, 4 per 128-key block) before adding it into fp32 registers.
MMA_ACC_BITS = 13
#: keys reduced by one 8-bit wgmma instruction (K of m64nNk32).
MMA_K_STEP = 32


#: How V's keys are laid out along the rows of the quantized V^T buffer. "keys": key r at column r.
#: "mma": within every MMA_K_STEP-key group, key 16 h + 8 j + 2 t + e sits at column
#: 16 h + 4 t + 2 j + e. In the scores' wgmma accumulator a thread holds columns 8 j + 2 t + e (t =
#: its lane within a quad); the 8-bit A operand of the P V wgmma wants columns 4 t + 0..3 of each
#: 16. With V stored in "mma" order, P goes from the one layout to the other by renaming columns
#: inside each thread (``attn_triton``): no shuffles between lanes. The Gluon loop reads "keys".
V_KEY_ORDERS = ("keys", "mma")


#: PRMT selectors that turn two words of e4m3 P in the fp32 accumulator's order (word i: columns
#: 8 i + 2 t + {0, 1} of rows g and g + 8) into the A operand's words of rows g and g + 8 (columns
#: 4 t + 0..3 of a 16-column half), with V's keys in "mma" order (the CuTe loop, attn_cute)
P8_PRMT = (0x5410, 0x7632)


def mma_key_order(n: int) -> torch.Tensor:
    """``perm`` (a LongTensor of ``n`` entries, ``n`` a multiple of MMA_K_STEP) with
    ``perm[column] = key`` for V's "mma" order (see V_KEY_ORDERS): ``vt[..., perm]`` in "keys" order
    is the same buffer in "mma" order."""
    if n % MMA_K_STEP:
        raise ValueError(f"n={n} must be a multiple of MMA_K_STEP={MMA_K_STEP}")
    col = torch.arange(n)
    t, j = (col >> 2) & 3, (col >> 1) & 1
    return (col & ~15) | (j << 3) | (t << 1) | (col & 1)


def padded_rows(total: int, nseg: int, dense: bool) -> int:
    """Rows of the padded row space of the quantized buffers.

    Dense (``nseg`` batches of ``total`` rows each): batch b starts at ``b * roundup(total)``.
    Varlen (``nseg`` segments packed in ``total`` rows): segment s starts at
    ``roundup(lo_s) + PAD * s``; since ``roundup(a) + roundup(b) <= roundup(a + b) + PAD``,
    consecutive segments never overlap, and no prefix sum (no extra launch, no host sync) is needed.
    One spare PAD at the end keeps a one-block-ahead TMA prefetch inside the buffer.
    """
    up = -(-total // PAD) * PAD
    if dense:
        return nseg * up + PAD
    return up + PAD * nseg + PAD
