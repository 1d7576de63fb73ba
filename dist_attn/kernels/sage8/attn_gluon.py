# SPDX-License-Identifier: Apache-2.0
"""The Sage8 attention kernel, warp-specialized, in Gluon for Hopper (imports triton).

FA3's structure on the operands of :func:`quant.quantize`:

* one CTA = 128 query rows of one (segment, head), split between two consumer warpgroups of 64
  rows each; a 1-warp producer partition loads both Q tiles once and then every key block (K as
  INT8 ``[BN, D]``, V^T as FP8 ``[D, BN]``) by TMA into a ring of ``stages`` shared-memory slots,
  signalled by mbarriers (``ready``: the TMA bytes landed; ``empty``: both consumers are done);
* inside a consumer the QK wgmma of block j and the PV wgmma of block j-1 are issued
  asynchronously before the softmax of block j runs, so the tensor cores work under the
  softmax; the second warpgroup fills the tensor cores while this one exponentiates. ``pingpong``
  makes the two warpgroups take turns issuing their wgmmas (an mbarrier pair) as FA3 does; it
  measured slower here and is off by default;
* scores: INT8 x INT8 -> int32 with the accumulator initialised to 0x4B400000, so the result read
  as fp32 is 12582912 + s exactly (numerics.MAGIC_I), then one FFMA and one exp2 per score
  (``exp16``, two exponentials per ``ex2.approx.f16x2``, measured slower: ptxas splits it);
* P -> FP8 e4m3, stored to a double-buffered shared tile per warpgroup and read from there by the
  PV wgmma (B = V^T tile, K-major). ``p_smem=False`` feeds P from registers instead, but Gluon's
  layout conversion to the A-operand fragment costs ~230 byte-permute/shuffle instructions per
  block (slower; see benchmarks/KERNEL_NOTES.md);
* P V of each key block goes into a fresh MMA accumulator (``use_acc=False``) and is added into the
  fp32 output with one FFMA, which also applies the previous block's rescale
  (``pv_accum="block"``): Hopper's FP8 wgmma keeps only ~13 bits of its running sum, and summing a
  whole row inside it (``"running"``) gave 0.37 rel-L2 at 38k keys when V has channel means
  (see benchmarks/KERNEL_NOTES.md);
* every segment of a varlen layout in one launch (grid axis 1), padding keys masked in the last
  block only; an optional natural-log LSE per row.

The consumer and producer partitions are in :mod:`.attn_gluon_partitions`; this module holds the
launch config, the kernel that allocates the shared memory and barriers and specializes the warps,
and the host side (descriptors, launch, the CPU-side sm_90 compile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from dist_attn.kernels.sage8 import numerics
from dist_attn.kernels.sage8.attn_gluon_partitions import _consumer, _producer  # module globals: the kernel calls them
from dist_attn.kernels.sage8.attn_triton import lse_args, pv_block
from dist_attn.kernels.sage8.quant import Quantized, seg_strides

__all__ = ["GluonConfig", "V_ORDER", "attention", "BLOCK_M", "BLOCK_N"]

#: query rows per consumer warpgroup (one m64 wgmma) and keys per block; a CTA covers 2 * BLOCK_M
#: = PAD rows, so its tiles never leave a segment's padded rows.
BLOCK_M = 64
BLOCK_N = 128
_PAD = gl.constexpr(numerics.PAD)
#: the order of V's keys this loop reads (numerics.V_KEY_ORDERS)
V_ORDER = "keys"


@dataclass(frozen=True)
class GluonConfig:
    """Launch parameters of the warp-specialized kernel (defaults: the fastest measured).

    ``maxnreg`` x 384 threads (2 consumer warpgroups + the producer's warpgroup) is the CTA's
    register file share; the producer gives back to ``producer_regs`` and the consumers take
    ``consumer_regs`` (168 x 384 = 240 x 256 + 24 x 128: all 64K registers of an SM).

    ``pv_accum``: "block" (each key block's P V into a fresh MMA accumulator, added into fp32
    registers: the accurate default) or "running" (the whole row's sum inside the FP8 MMA, far
    less accurate when V has channel means; kept to measure against). ``pv_first``: issue block
    j-1's P V before block j's scores and finish it first (measured slower).
    ``add_magic``: see the score-init comment in ``_consumer``.
    """

    stages: int = 3
    exp16: bool = False
    pingpong: bool = False
    p_smem: bool = True
    consumer_regs: int = 240
    producer_regs: int = 24
    maxnreg: int = 168
    pv_accum: Literal["block", "running"] = "block"
    pv_first: bool = False
    add_magic: bool = True

    def __post_init__(self):
        pv_block(self.pv_accum)  # raises on an unknown value
        if self.pv_first and self.pingpong:
            # the pv_first loop has no turn hand-over: the other warpgroup would wait forever
            raise ValueError("GluonConfig(pv_first=True, pingpong=True): the P-V-first loop does not take "
                             "turns; set one of them")


@gluon.jit
def _seg_bounds(cu, seg, used, T, DENSE: gl.constexpr):
    """:func:`quant.seg_bounds` in Gluon, derived from it token for token (``tl`` -> ``gl``; the
    dense ``lo`` is ``gl.to_tensor(0)``: the warp partitions take it as a tensor argument).
    tests/core/test_kernel_sage8.py checks the two bodies agree."""
    if DENSE:
        lo = gl.to_tensor(0)
        hi = T
        pst = ((T + _PAD - 1) // _PAD) * _PAD * seg
    else:
        lo = gl.load(cu + seg).to(gl.int32)
        hi = gl.load(cu + seg + 1).to(gl.int32)
        hi = gl.minimum(hi, used)
        lo = gl.minimum(lo, hi)
        pst = ((lo + _PAD - 1) // _PAD) * _PAD + _PAD * seg
    return lo, hi - lo, pst



# sizes and strides stay runtime values: one binary serves every shape (a value of 1 would otherwise
# become a compile-time constant and a new compilation)
@gluon.jit(do_not_specialize=["used", "T", "H", "R", "sob", "sot", "soh", "sqb", "sqt", "sqh", "slb", "slh"])
def _attn_ws_kernel(q_desc, k_desc, v_desc, Qs, Ks, Vscale, Out, Q, Ksum, Lse, cu, used, T, H, R,
                    sob, sot, soh, sqb, sqt, sqh, slb, slh, qk_scale,
                    D: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, DENSE: gl.constexpr,
                    WITH_LSE: gl.constexpr, EXP16: gl.constexpr, PINGPONG: gl.constexpr, P_SMEM: gl.constexpr,
                    PV_BLOCK: gl.constexpr, PV_FIRST: gl.constexpr, ADD_MAGIC: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    BM: gl.constexpr = q_desc.block_type.shape[0]
    mb = gl.program_id(0)
    seg = gl.program_id(1)
    h = gl.program_id(2)
    lo, L, pst = _seg_bounds(cu, seg, used, T, DENSE)
    mrow0 = mb * (2 * BM)
    if mrow0 < L:
        q_smem = gl.allocate_shared_memory(gl.int8, [2, BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BN], v_desc.layout)
        # P of each warpgroup, double-buffered (a 1 KB placeholder without P_SMEM)
        if P_SMEM:
            p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, BM, BN],
                                               gl.NVMMASharedLayout.get_default_for([BM, BN], gl.float8e4nv))
        else:
            p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 8, 32],
                                               gl.NVMMASharedLayout.get_default_for([8, 32], gl.float8e4nv))
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups release a slot
        mbarrier.init(turn.index(0), count=1)
        mbarrier.init(turn.index(1), count=1)
        fence_async_shared()
        n_blocks = gl.cdiv(L, BN)
        # a warpgroup whose rows all lie past L still runs the loop (its stores are masked off):
        # the producer waits for both warpgroups on every slot
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn, Qs, Ks, Vscale, Out, Q,
                         Ksum, Lse, h, seg, lo, L, pst, mrow0, R, H, n_blocks, sob, sot, soh, sqb, sqt, sqh, slb,
                         slh, qk_scale, 0, D, BN, STAGES, WITH_LSE, EXP16, PINGPONG, P_SMEM, PV_BLOCK,
                         PV_FIRST, ADD_MAGIC)),
            (_consumer, (q_smem, k_smem, v_smem, p_smem, q_bar, ready, empty, turn, Qs, Ks, Vscale, Out, Q,
                         Ksum, Lse, h, seg, lo, L, pst, mrow0, R, H, n_blocks, sob, sot, soh, sqb, sqt, sqh, slb,
                         slh, qk_scale, 1, D, BN, STAGES, WITH_LSE, EXP16, PINGPONG, P_SMEM, PV_BLOCK,
                         PV_FIRST, ADD_MAGIC)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty,
                         h, R, pst, mrow0, n_blocks, D, BN, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def descriptors(qz: Quantized):
    """TMA descriptors of the quantized Q, K and V^T buffers (Gluon's, with their smem layouts)."""
    H, R, D = qz.qi8.shape
    ql = gl.NVMMASharedLayout.get_default_for([BLOCK_M, D], gl.int8)
    kl = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.int8)
    vl = gl.NVMMASharedLayout.get_default_for([D, BLOCK_N], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(qz.qi8.view(H * R, D), [BLOCK_M, D], ql),
            TensorDescriptor.from_tensor(qz.ki8.view(H * R, D), [BLOCK_N, D], kl),
            TensorDescriptor.from_tensor(qz.vt8.view(H * D, R), [D, BLOCK_N], vl))


def attention(qz: Quantized, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
              softmax_scale: float, cfg: GluonConfig):
    """Launches the warp-specialized kernel on ``qz``; same contract as :func:`attn_triton.attention`."""
    lay = qz.layout
    assert qz.kblock == BLOCK_N and 2 * BLOCK_M == numerics.PAD and qz.v_order == V_ORDER
    H, R, D = qz.qi8.shape
    q_desc, k_desc, v_desc = descriptors(qz)
    lse_arg, sl = lse_args(lse, lay.dense, qz.qscale)
    cu = qz.qscale if lay.dense else lay.cu
    return _attn_ws_kernel[(triton.cdiv(lay.max_seqlen, 2 * BLOCK_M), lay.nseg, H)](
        q_desc, k_desc, v_desc, qz.qscale, qz.kscale, qz.vscale, out, q, qz.ksum, lse_arg, cu,
        lay.used, lay.total, H, R, *seg_strides(out, lay.dense), *seg_strides(q, lay.dense), *sl,
        softmax_scale * math.log2(math.e),
        D=D, BN=BLOCK_N, STAGES=cfg.stages, DENSE=lay.dense, WITH_LSE=lse is not None, EXP16=cfg.exp16,
        PINGPONG=cfg.pingpong, P_SMEM=cfg.p_smem, PV_BLOCK=pv_block(cfg.pv_accum),
        PV_FIRST=cfg.pv_first and pv_block(cfg.pv_accum), ADD_MAGIC=cfg.add_magic, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=4, maxnreg=cfg.maxnreg)


def compile_sm90(cfg: GluonConfig, *, head_dim: int = 128, dense: bool = True, with_lse: bool = False,
                 out_dtype: str = "bf16"):
    """Compiles the kernel for compute capability 9.0 without a GPU (ptxas ships with triton).

    Returns triton's compiled kernel: ``.asm`` holds the ttgir, PTX and cubin, ``.metadata`` the
    shared memory; lets CPU CI and the notes check registers, spills and instructions.
    """
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    class _Fake:  # what TensorDescriptor and mangle_type read off a tensor
        def __init__(self, dtype, shape):
            self.dtype, self.shape = dtype, shape

        def data_ptr(self):
            return 1 << 20

        def stride(self):
            return tuple(int(math.prod(self.shape[i + 1:])) for i in range(len(self.shape)))

    D = head_dim
    rows = 4096
    descs = [TensorDescriptor.from_tensor(_Fake(dt, shape), block, gl.NVMMASharedLayout.get_default_for(block, gdt))
             for dt, gdt, shape, block in ((torch.int8, gl.int8, [rows, D], [BLOCK_M, D]),
                                           (torch.int8, gl.int8, [rows, D], [BLOCK_N, D]),
                                           (torch.float8_e4m3fn, gl.float8e4nv, [D, rows], [D, BLOCK_N]))]
    fn = _attn_ws_kernel
    sig, consts = {}, {}
    ptr = {"Out": f"*{out_dtype}", "Q": f"*{out_dtype}", "cu": "*i32"}
    values = dict(zip(("q_desc", "k_desc", "v_desc"), descs))
    constexprs = dict(D=D, BN=BLOCK_N, STAGES=cfg.stages, DENSE=dense, WITH_LSE=with_lse, EXP16=cfg.exp16,
                      PINGPONG=cfg.pingpong, P_SMEM=cfg.p_smem, PV_BLOCK=pv_block(cfg.pv_accum),
                      PV_FIRST=cfg.pv_first and pv_block(cfg.pv_accum), ADD_MAGIC=cfg.add_magic, CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs)
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
            consts[(fn.arg_names.index(name),)] = constexprs[name]
        elif name in values:
            sig[name] = mangle_type(values[name])
        elif name in ("Qs", "Ks", "Vscale", "Ksum", "Lse"):
            sig[name] = "*fp32"
        elif name in ptr:
            sig[name] = ptr[name]
        elif name == "qk_scale":
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    src = GluonASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "maxnreg": cfg.maxnreg})
