# SPDX-License-Identifier: Apache-2.0
"""Per-head RMSNorm of q and k and rotate-half RoPE on their first R channels, in one pass
(Triton on the GPU; importing this module imports triton).

MiniMax-H3 normalises q and k per head (``nn.RMSNorm(head_dim)``) and rotates their first 96 of
128 channels before attention. Compiled, inductor runs that as three kernels that read q and k
twice and write them once. Here a program holds ``ROWS`` rows' RoPE tables in registers and
walks q's and k's heads over them: q and k are read once, written once, and each table row is
read once per head block rather than once per head. Under Ulysses the same
transform rides in the pack (:func:`pack_qkv_prologue`), whose pass over q, k and v the
all-to-all needs anyway: no pass of its own at all.

The arithmetic is float32 from the inputs to one rounding to q's dtype at the end (diffusers'
eager path rounds to bf16 after the norm, after the weight and after each RoPE product): nearer
float64 than the eager path, and a few bf16 ulps from it. The "lossless" tier never runs it.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from dist_attn.kernels._op_support import launchable
from dist_attn.qk_prologue import qk_fields_rule

__all__ = ["pack_qkv_prologue", "qk_norm_rope", "qk_norm_rope_reference"]

#: rows a program holds tables for, and heads it walks: 16 x 8 kept for W = 4's 9,504 rows, where
#: 16 x 56 took 1.2x as long on an H100 (benchmarks/dev/qk_norm_rope_probe.py)
ROWS, HEADS = 16, 8


@triton.jit
def _norm_rope(base, rows, ok, offs_d, perm, sign, w, wp, c, s, stride_r, eps,
               ROT: tl.constexpr, D: tl.constexpr):
    ptr = base + rows[:, None] * stride_r
    x = tl.load(ptr + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
    if ROT > 0:
        # each channel's partner in the rotation, read again (an L1 hit) rather than shuffled
        xp = tl.load(ptr + perm[None, :], mask=ok, other=0.0).to(tl.float32)
        return (x * w[None, :] * c + xp * (wp * sign)[None, :] * s) * rstd
    return x * w[None, :] * rstd


@triton.jit
def _out(y, dtype: tl.constexpr, INTERP: tl.constexpr):
    """float32 -> ``dtype``, to nearest even; by the bits for bfloat16 under the interpreter,
    whose cast truncates."""
    if INTERP and dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        y = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return y.to(dtype)


@triton.jit
def _qk_norm_rope_kernel(Q, K, QO, KO, Wq, Wk, Cos, Sin, n_rows, seq, H, eps,
                         sq_r, sq_h, sk_r, sk_h, so_r, so_h,
                         D: tl.constexpr, ROT: tl.constexpr, ROWS: tl.constexpr, HEADS: tl.constexpr,
                         INTERP: tl.constexpr):
    """Rows ``[ROWS * pid0, ...)`` of the flattened ``[B * S]`` row axis, heads ``[HEADS * pid1, ...)``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok_r = rows < n_rows
    ok = ok_r[:, None]
    rows = rows.to(tl.int64)
    offs_d = tl.arange(0, D)
    HALF: tl.constexpr = ROT // 2
    rot = offs_d < ROT
    perm = tl.where(offs_d < HALF, offs_d + HALF, tl.where(rot, offs_d - HALF, offs_d))
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    if ROT > 0:
        t = (rows % seq)[:, None] * ROT + offs_d[None, :]  # the table row of each row
        tmask = ok & rot[None, :]
        c = tl.load(Cos + t, mask=tmask, other=1.0)
        s = tl.load(Sin + t, mask=tmask, other=0.0)
    else:
        c = tl.full([ROWS, D], 1.0, tl.float32)
        s = tl.zeros([ROWS, D], tl.float32)
    wq = tl.load(Wq + offs_d).to(tl.float32)
    wk = tl.load(Wk + offs_d).to(tl.float32)
    wqp = tl.load(Wq + perm).to(tl.float32)
    wkp = tl.load(Wk + perm).to(tl.float32)
    h0 = tl.program_id(1) * HEADS
    for i in range(HEADS):
        h = (h0 + i).to(tl.int64)
        if h < H:
            dst = rows[:, None] * so_r + h * so_h + offs_d[None, :]
            y = _norm_rope(Q + h * sq_h, rows, ok, offs_d, perm, sign, wq, wqp, c, s, sq_r, eps, ROT, D)
            tl.store(QO + dst, _out(y, QO.dtype.element_ty, INTERP), mask=ok)
            y = _norm_rope(K + h * sk_h, rows, ok, offs_d, perm, sign, wk, wkp, c, s, sk_r, eps, ROT, D)
            tl.store(KO + dst, _out(y, KO.dtype.element_ty, INTERP), mask=ok)


@triton.jit
def _pack_kernel(Q, K, V, Dst, Wq, Wk, Cos, Sin, s_local, eps, sq_r, sq_h, sk_r, sk_h, sv_r, sv_h,
                 W, HW, BASE, WIDTH, N,
                 D: tl.constexpr, ROT: tl.constexpr, ROWS: tl.constexpr, INTERP: tl.constexpr):
    """Rows ``[ROWS * pid0, ...)`` of destination rank ``j`` and chunk ``i`` (``pid1 = i * W + j``):
    its WIDTH heads of q and k through the prologue, and of v as they are, into the send blocks
    ``[N, W, S_local, 3, WIDTH, D]``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ok = (rows < s_local)[:, None]
    rows = rows.to(tl.int64)
    blk = tl.program_id(1)
    i = blk // W
    j = blk % W
    offs_d = tl.arange(0, D)
    HALF: tl.constexpr = ROT // 2
    rot = offs_d < ROT
    perm = tl.where(offs_d < HALF, offs_d + HALF, tl.where(rot, offs_d - HALF, offs_d))
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    t = rows[:, None] * ROT + offs_d[None, :]
    tmask = ok & rot[None, :]
    c = tl.load(Cos + t, mask=tmask, other=1.0)
    s = tl.load(Sin + t, mask=tmask, other=0.0)
    wq = tl.load(Wq + offs_d).to(tl.float32)
    wk = tl.load(Wk + offs_d).to(tl.float32)
    wqp = tl.load(Wq + perm).to(tl.float32)
    wkp = tl.load(Wk + perm).to(tl.float32)
    # dst[i, j, row, role, h, :]: a row of the block holds 3 * WIDTH heads
    row_base = ((blk.to(tl.int64) * s_local + rows) * 3 * WIDTH)[:, None] * D + offs_d[None, :]
    for hh in range(WIDTH):
        g = (j * HW + BASE + i * WIDTH + hh).to(tl.int64)
        y = _norm_rope(Q + g * sq_h, rows, ok, offs_d, perm, sign, wq, wqp, c, s, sq_r, eps, ROT, D)
        tl.store(Dst + row_base + hh * D, _out(y, Dst.dtype.element_ty, INTERP), mask=ok)
        y = _norm_rope(K + g * sk_h, rows, ok, offs_d, perm, sign, wk, wkp, c, s, sk_r, eps, ROT, D)
        tl.store(Dst + row_base + (WIDTH + hh) * D, _out(y, Dst.dtype.element_ty, INTERP), mask=ok)
        x = tl.load(V + g * sv_h + rows[:, None] * sv_r + offs_d[None, :], mask=ok, other=0.0)
        tl.store(Dst + row_base + (2 * WIDTH + hh) * D, x, mask=ok)


def pack_qkv_prologue(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, send: torch.Tensor, chunk_ranges,
                      prologue) -> bool:
    """:func:`dist_attn.comm.pack_qkv_chunks` with q and k through ``prologue`` (a checked
    :class:`dist_attn.QKNormRope`) on the way, in one pass; False, writing nothing, where the
    chunks are not one strided run (batch 1, H divisible by W, equally wide chunks) or the kernel
    cannot launch (a CPU without ``TRITON_INTERPRET=1``): the caller then applies the prologue
    first and packs as usual."""
    from dist_attn.comm import strided_run

    run = strided_run(q.shape, chunk_ranges)
    if run is None or not launchable(q):
        return False
    world, hw, base, width = run
    _, s_local, _, d = q.shape
    cos, sin = prologue.cos.contiguous(), prologue.sin.contiguous()
    wq, wk = prologue.q_weight.contiguous(), prologue.k_weight.contiguous()  # read with stride 1
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _pack_kernel[(triton.cdiv(s_local, ROWS), len(chunk_ranges) * world)](
            q, k, v, send, wq, wk, cos, sin, s_local, float(prologue.eps),
            q.stride(1), q.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
            world, hw, base, width, len(chunk_ranges),
            D=d, ROT=cos.shape[-1], ROWS=ROWS, INTERP=not q.is_cuda, num_warps=4)
    return True


@torch.library.custom_op("dist_attn::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not launchable(q):  # the CPU without Triton's interpreter: the same arithmetic in torch
        return qk_norm_rope_reference(q, k, q_weight, k_weight, eps, cos, sin)
    B, S, H, D = q.shape
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # rows of [B, S] flattened: B * S rows of stride S's (q.stride(1)) when the batch is dense
    qf, kf = (x.reshape(B * S, H, D) if x.stride(0) != S * x.stride(1) else x.view(B * S, H, D) for x in (q, k))
    cos, sin = cos.contiguous(), sin.contiguous()
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()  # read with stride 1
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _qk_norm_rope_kernel[(triton.cdiv(B * S, ROWS), triton.cdiv(H, HEADS))](
            qf, kf, qo, ko, q_weight, k_weight, cos, sin, B * S, S, H, float(eps),
            qf.stride(0), qf.stride(1), kf.stride(0), kf.stride(1), qo.stride(1), qo.stride(2),
            D=D, ROT=cos.shape[-1], ROWS=ROWS, HEADS=HEADS, INTERP=not q.is_cuda, num_warps=4)
    return qo, ko


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, eps, cos, sin):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(q.shape, dtype=q.dtype, device=q.device))


def qk_norm_rope_reference(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                           eps: float, cos: torch.Tensor, sin: torch.Tensor, *,
                           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`qk_norm_rope` computes, in torch at ``dtype`` (float64 for an exact reference),
    returned in q's dtype (float32 / float64 results stay at ``dtype`` when q is of it)."""
    out_dtype = q.dtype if dtype == torch.float32 else dtype
    r = cos.shape[-1]
    c, s = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]  # [S, 1, R]

    def one(x, w):
        y = x.to(dtype)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w.to(dtype)
        if r:
            head, half = y[..., :r], r // 2
            turned = torch.cat((-head[..., half:], head[..., :half]), dim=-1)
            y = torch.cat((head * c + turned * s, y[..., r:]), dim=-1)
        return y.to(out_dtype)

    return one(q, q_weight), one(k, k_weight)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q', k')``: per head, ``y = x * rsqrt(mean(x**2) + eps) * weight``, then on channels
    ``c < R``: ``y_c * cos[t, c] + r_c * sin[t, c]`` with ``r_c = -y[c + R/2]`` for ``c < R/2`` and
    ``y[c - R/2]`` otherwise (rotate half); channels ``[R, D)`` keep ``y``.

    Args:
        q, k: ``[B, S, H, D]`` of one float dtype, shape and device; last dim contiguous. Not modified.
        q_weight, k_weight: ``[D]`` RMSNorm weights.
        eps: RMSNorm's epsilon (> 0).
        cos, sin: ``[S, R]`` float32 RoPE tables (row t for row t of every sample; R even,
            ``2 <= R <= D``, a power-of-two ``D``).

    Returns:
        Fresh contiguous tensors of q's shape and dtype: float32 arithmetic, one rounding at the
        end (module doc). On a CPU without ``TRITON_INTERPRET=1`` the same arithmetic in torch.

    Raises:
        ValueError: naming the argument, its value and the rule.
    """
    if q.dim() != 4 or k.shape != q.shape or k.dtype != q.dtype or k.device != q.device:
        raise ValueError(f"q and k must be [B, S, H, D] of one shape, dtype and device, got q "
                         f"{tuple(q.shape)} {q.dtype} {q.device} and k {tuple(k.shape)} {k.dtype} {k.device}")
    if not q.is_floating_point() or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q and k must be floating with a contiguous last dim, got {q.dtype} strides "
                         f"{q.stride()} / {k.stride()}")
    rule = qk_fields_rule(q_weight, k_weight, eps, cos, sin, head_dim=q.shape[3], rows=q.shape[1],
                          device=q.device, rows_name="S")
    if rule:
        raise ValueError(rule)
    return torch.ops.dist_attn.qk_norm_rope(q, k, q_weight, k_weight, float(eps), cos, sin)
