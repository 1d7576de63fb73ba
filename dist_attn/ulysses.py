# SPDX-License-Identifier: Apache-2.0
"""Ulysses sequence-parallel attention: pack -> all-to-all -> varlen bridge -> all-to-all back.

Each of the W ranks of a group holds a contiguous shard ``[B, S_local, H, D]`` of the packed global
sequence. One all-to-all of a single destination-major staging buffer gives every rank all S rows
of q, k and v for its share of the B*H (sample, head) pairs; the varlen bridge attends; one
all-to-all returns the output shard in the caller's layout. With ``overlap_chunks=C > 1`` the heads
are cut into C chunks whose all-to-alls are issued asynchronously, so chunk c+1's transfer runs
while chunk c's kernel does; the first chunk is packed alone and sent while the others are packed
(``UlyssesPlan.pack_runs``: with batch 1 and H divisible by W, one copy per role for each run of
equally wide chunks); when the attention backend says how its kernel fills the GPU
(``kernel_waves``), the chunks' widths are the split whose kernel calls take the fewest waves
(:func:`dist_attn.plan.chunk_widths`). Under ``torch.compile`` the whole call is one opaque custom op.

Beyond one host, a 2-D mesh ``("ring", "ulysses")`` (:mod:`dist_attn.mesh`) replaces the group:
the all-to-all runs over the mesh's Ulysses dim and gathers the rows of this rank's ring chunk,
and the kernel step becomes ring attention over the ring dim (:mod:`dist_attn.ring`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from dist_attn.agreement import CallFacts, agree, tell_refusal
from dist_attn.backends import available_backends, default_softmax_scale
from dist_attn.buffers import StagingBuffers, default_staging_buffers
from dist_attn.comm import all_to_all_flat, pack_qkv_chunks, unpack_output, unpack_qkv
from dist_attn.distributed import (check_group, compile_key, register_for_compile,
                                   resolve_compile_key)
from dist_attn.mesh import check_mesh, check_mesh_or_group, parallel_groups
from dist_attn.plan import heads_per_rank, make_plan, too_few_heads_fix
from dist_attn.profiling import PhaseTimer
from dist_attn.qk_prologue import QKNormRope, check_qk_prologue
from dist_attn.ring import check_ring_transport, resolve_ring_backend, ring_attention
from dist_attn.validation import (CheckedScalars, check_bounds, check_no_grad, check_op_scalars,
                                  check_qkv, check_scalars, checked_scalars, host_bounds,
                                  positive_int)
from dist_attn.varlen import SegmentLayout, attend_varlen, segment_layout

__all__ = ["UlyssesSageAttention", "ulysses_attention"]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None,
                      max_seqlen=None, cu_seqlens_host: Sequence[int] | None = None, *,
                      valid_len: int | torch.Tensor | None = None, group=None, mesh=None, backend: str = "auto",
                      softmax_scale: float | None = None, num_heads: int | None = None,
                      head_dim: int | None = None, buffers: StagingBuffers | None = None,
                      timer: PhaseTimer | None = None, overlap_chunks: int = 1,
                      qk_prologue: QKNormRope | None = None) -> torch.Tensor:
    """Sequence-parallel block-diagonal attention over the ranks of ``group`` or ``mesh`` (forward only).

    Args:
        q, k, v: ``[S_local, H, D]`` or ``[B, S_local, H, D]`` fp16/bf16/fp32 on one device:
            shard i's rows ``[i*S_local, (i+1)*S_local)`` of the packed global sequence of
            ``S = S_local * W`` rows. With ``group``: i = the rank in the group, W its size. With
            ``mesh`` (R ring x U Ulysses): i = ``r*U + u`` at mesh coordinate ``(r, u)``, W = R*U.
            Never modified.
        cu_seqlens: GLOBAL segment bounds 0, ..., S, the same for every sample: an int32/int64
            tensor (q's device or CPU) or a list of ints. None = one segment of S rows. Bounds
            are documents, never padding.
        max_seqlen: the longest segment (an int, a one-element tensor, or None).
        cu_seqlens_host: optional list/tuple of the same bounds as Python ints; when given the
            call makes no device-to-host synchronisation, except the first call of each layout
            (:mod:`dist_attn.agreement`): the ranks then compare their inputs and kernel waves
            with one all-reduce of 30 integers, which the host reads (through the device under
            NCCL). Ranks that differ raise on every rank.
        valid_len: rows ``>= valid_len`` of the global sequence are padding: never attended, and
            exactly zero in the output. None = no padding. A Python int, or a one-element
            int32/int64 tensor on the CPU (read on the host, no device sync): under
            ``torch.compile`` an int is a constant of the graph, so each new value recompiles,
            while a tensor is a graph input whose value may change from call to call.
        group: process group (None = the default group; no group initialised = local attention).
        mesh: a 2-D ``DeviceMesh`` with dims ``("ring", "ulysses")`` for Ulysses x Ring; not
            together with ``group``. Ring size > 1 needs a backend that returns a log-sum-exp.
        backend: ``"auto"`` or a registered backend name (see :mod:`dist_attn.backends`).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        num_heads, head_dim: expected H and D (checked when given).
        buffers: staging pool; None = the process-wide pool.
        timer: optional :class:`PhaseTimer` that records pack / a2a_in / kernel / a2a_out / unpack.
        overlap_chunks: number of head chunks to pipeline (1 = two all-to-alls per call, plus
            R-1 K/V ring steps with a mesh; each chunk runs its own ring; with a Ulysses size
            of 1 there is no all-to-all to overlap and one ring runs). Without a ring the chunks
            are cut to the kernel's waves where the backend reports them (``kernel_waves``;
            :func:`dist_attn.plan.chunk_widths`).
        qk_prologue: a :class:`dist_attn.QKNormRope` (per-head RMSNorm + RoPE, its tables of
            this rank's rows): q and k are then the raw projections, transformed inside the pack's
            one pass over q, k and v where its kernel can, else by one kernel first (and always
            so without an all-to-all). float32 arithmetic, one rounding: not bit for bit diffusers'
            bf16 ops.

    Returns:
        Fresh tensor of q's shape, dtype and device.
    """
    if torch.compiler.is_compiling():
        if timer is not None or buffers is not None:
            raise ValueError("timer= and buffers= cannot cross torch.compile's custom-op boundary; "
                             "leave them None in compiled code (the process-wide pool is used)")
        check_op_scalars(valid_len=valid_len, max_seqlen=max_seqlen, num_heads=num_heads,
                         head_dim=head_dim, softmax_scale=softmax_scale,
                         overlap_chunks=overlap_chunks)
        check_mesh_or_group(mesh, group)
        check_group(group)  # before compile_key reads it
        if isinstance(cu_seqlens, (list, tuple)):
            cu_seqlens_host, cu_seqlens = list(cu_seqlens), None
        # A CPU tensor valid_len is a graph input (its value may change without a recompile);
        # an int is a constant of the graph.
        as_tensor = isinstance(valid_len, torch.Tensor)
        p = qk_prologue
        if p is not None and q.ndim in (3, 4):  # its fields become the op's arguments; other q: the op's checks
            check_qk_prologue(p, q if q.ndim == 4 else q[None])
        return torch.ops.dist_attn.ulysses_attention(
            q, k, v, cu_seqlens, None if cu_seqlens_host is None else list(cu_seqlens_host),
            max_seqlen, None if as_tensor else valid_len, compile_key(group, mesh), backend,
            softmax_scale, num_heads, head_dim, overlap_chunks, valid_len if as_tensor else None,
            *((None, None, 0.0, None, None) if p is None else (p.q_weight, p.k_weight, float(p.eps), p.cos, p.sin)))
    return _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len=valid_len,
                    group=group, mesh=mesh, backend=backend, softmax_scale=softmax_scale,
                    num_heads=num_heads, head_dim=head_dim, buffers=buffers, timer=timer,
                    overlap_chunks=overlap_chunks, prologue=qk_prologue)


def _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, *, valid_len, group, mesh, backend,
             softmax_scale, num_heads, head_dim, buffers, timer, overlap_chunks,
             prologue=None, checked: CheckedScalars | None = None) -> torch.Tensor:
    groups = parallel_groups(mesh=mesh, group=group)
    # checks of host facts; a rank that refuses its inputs tells its peers, which raise too
    try:
        call = _prepare(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len=valid_len,
                        groups=groups, backend=backend, softmax_scale=softmax_scale,
                        num_heads=num_heads, head_dim=head_dim, overlap_chunks=overlap_chunks,
                        prologue=prologue, checked=checked)
    except Exception:
        if groups.world > 1:
            tell_refusal(groups, groups.shard)
        raise
    q4, k4, v4, layout, be, scale = call.q4, call.k4, call.v4, call.layout, call.be, call.scale
    group, world, rank, n_ring = (groups.ulysses_group, groups.ulysses_size, groups.ulysses_rank,
                                  groups.ring_size)
    (batch, s_local, n_heads, d), overlap_chunks = q4.shape, call.facts.overlap_chunks
    chunk = s_local * world  # rows one Ulysses group gathers: the whole sequence without a ring
    wants_waves = n_ring == 1 and overlap_chunks > 1 and min(heads_per_rank(batch * n_heads, world)) > 1
    kernel_waves = getattr(be, "kernel_waves", None) if wants_waves else None
    # the first call of a layout: ranks that differ raise on every rank
    waves = None if groups.world == 1 else agree(
        call.facts, lambda: kernel_waves(layout, q4) if kernel_waves is not None else None, groups,
        backend_arg=backend)
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())

    if prologue is not None and world == 1:  # no pack to fold it into
        q4, k4 = _apply_prologue(q4, k4, prologue)
    if world == 1:
        if n_ring > 1:
            out = ring_attention(q4, k4, v4, layout=layout, groups=groups, backend=be,
                                 softmax_scale=scale, phase=phase)
        else:
            with phase("kernel"):
                out = attend_varlen(be, q4, k4, v4, layout=layout, cu_seqlens=cu_seqlens,
                                    softmax_scale=scale, k_is_scratch=False)
        return out if call.batched else out[0]

    plan = make_plan(world=world, rank=rank, s_local=s_local, folded_heads=batch * n_heads,
                     head_dim=d, overlap_chunks=overlap_chunks, waves=waves)
    if prologue is not None and not _prologue_packs(plan, q4):
        q4, k4 = _apply_prologue(q4, k4, prologue)
        prologue = None
    pool = buffers if buffers is not None else default_staging_buffers()
    pool.reserve(plan.buffer_sizes(), q.dtype, q.device)  # raises on every rank alike
    bufs = {role: pool.get(role, n, q.dtype, q.device) for role, n in plan.buffer_sizes().items()}

    def view(role, span):
        return bufs[role][span[0]:span[1]]

    # Every input all-to-all is issued before any kernel, each right after the pack call that
    # fills its chunk: they run in order on the communicator (the first while the other chunks
    # are packed) and the kernels below wait only for their own chunk.
    asynchronous = len(plan.chunks) > 1
    works_in = []
    for first, stop in plan.pack_runs:
        run = plan.chunks[first:stop]
        with phase("pack"):
            send, ranges = bufs["in_send"][run[0].in_send[0]:run[-1].in_send[1]], [c.head_ranges for c in run]
            if prologue is None:
                pack_qkv_chunks(q4, k4, v4, send, ranges)
            else:
                from dist_attn.kernels.qk_norm_rope import pack_qkv_prologue
                if not pack_qkv_prologue(q4, k4, v4, send, ranges, prologue):
                    raise RuntimeError("the pack could not apply qk_prologue to a run that "
                                       "_prologue_packs admitted (a dist_attn bug: please report it)")
        with phase("a2a_in"):
            works_in += [all_to_all_flat(view("in_recv", c.in_recv), view("in_send", c.in_send),
                                         recv_splits=list(c.in_recv_splits),
                                         send_splits=list(c.in_send_splits), group=group,
                                         async_op=asynchronous) for c in run]
    works_out = []
    for c, work in zip(plan.chunks, works_in):
        w_r = c.local_heads(rank)
        if asynchronous:
            with phase("a2a_in"):
                work.wait()
        qc, kc, vc = unpack_qkv(view("in_recv", c.in_recv), chunk, w_r, d)  # [L, w_r, D] views
        dst = view("out_send", c.out_send).view(1, chunk, w_r, d)  # [1, L, w_r, D]
        if n_ring > 1:
            ring_attention(qc[None], kc[None], vc[None], layout=layout, groups=groups, backend=be,
                           softmax_scale=scale, out=dst, phase=phase)
        else:
            with phase("kernel"):
                # k lives in our receive buffer, so Sage 1.0.6 may smooth it in place (no copy).
                attend_varlen(be, qc[None], kc[None], vc[None], layout=layout, cu_seqlens=cu_seqlens,
                              softmax_scale=scale, k_is_scratch=True, out=dst)
        with phase("a2a_out"):
            works_out.append(all_to_all_flat(view("out_recv", c.out_recv), view("out_send", c.out_send),
                                             recv_splits=list(c.out_recv_splits),
                                             send_splits=list(c.out_send_splits), group=group,
                                             async_op=asynchronous))
    out = q4.new_empty(q4.shape)
    for c, work in zip(plan.chunks, works_out):
        if asynchronous:
            with phase("a2a_out"):
                work.wait()
        with phase("unpack"):
            unpack_output(view("out_recv", c.out_recv), out, c.head_ranges)
    return out if call.batched else out[0]


@dataclass(frozen=True)
class _Call:
    """One call as checked on this rank (q/k/v as ``[B, S_local, H, D]`` views)."""

    q4: torch.Tensor
    k4: torch.Tensor
    v4: torch.Tensor
    batched: bool
    layout: SegmentLayout
    be: object
    scale: float
    facts: CallFacts


def _prepare(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, *, valid_len, groups, backend,
             softmax_scale, num_heads, head_dim, overlap_chunks, prologue, checked) -> _Call:
    """Every check of one call that reads only this rank's host facts (no collective); the
    scalars are taken as they are when ``checked`` holds them."""
    check_qkv(q, k, v, num_heads=num_heads, head_dim=head_dim)
    check_no_grad(q, k, v)
    if checked is None:
        check_scalars(softmax_scale, overlap_chunks)
    else:
        softmax_scale, overlap_chunks = checked.softmax_scale, checked.overlap_chunks
    check_bounds(cu_seqlens, device=q.device)
    world, n_ring = groups.ulysses_size, groups.ring_size
    q4, k4, v4 = (t if q.ndim == 4 else t[None] for t in (q, k, v))  # [S_local, H, D] -> [1, S_local, H, D]
    check_qk_prologue(prologue, q4)
    if prologue is not None and torch.is_grad_enabled() and (
            prologue.q_weight.requires_grad or prologue.k_weight.requires_grad):
        raise RuntimeError("dist_attn attention is forward-only (inference): qk_prologue's weights "
                           "require grad while grad mode is on; wrap the call in torch.no_grad() "
                           "or torch.inference_mode()")
    batch, s_local, n_heads, d = q4.shape
    seq = s_local * world * n_ring
    sizes, what, m = ((f"W = {s_local}*{world}", f"W={world} is the size of", "W") if n_ring == 1 else
                      (f"U*R = {s_local}*{world}*{n_ring}", f"U={world}, R={n_ring}:", "U*R"))
    total_desc = (f"S = S_local*{sizes} = {seq} ({what} {groups.desc}; each rank holds S_local="
                  f"{s_local} rows: pad the packed sequence to a multiple of {m} and pass valid_len)")
    bounds = host_bounds(cu_seqlens, cu_seqlens_host, total=seq, total_desc=total_desc)
    layout = segment_layout(bounds, total=seq, valid_len=valid_len, max_seqlen=max_seqlen)
    be = resolve_ring_backend(backend, q, ring_size=n_ring)
    if n_ring > 1:
        check_ring_transport(ring_size=n_ring, comm_backend=dist.get_backend(groups.ring_group),
                             device=q.device)
    if world > 1 and batch * n_heads < world:
        raise ValueError(
            f"num_heads={n_heads} x batch {batch} = {batch * n_heads} (sample, head) pairs must be "
            f">= the Ulysses world size {world} (the size of {groups.desc}): every rank needs at "
            f"least one head; {too_few_heads_fix(batch * n_heads, world)}")
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    facts = CallFacts(batch=batch, rows=s_local, heads=n_heads, head_dim=d, dtype=q.dtype,
                      device_type=q.device.type, bounds=layout.bounds, valid_len=layout.valid_len,
                      softmax_scale=scale, overlap_chunks=overlap_chunks,
                      qk_prologue=prologue is not None, kernel=str(getattr(be, "name", backend)))
    return _Call(q4=q4, k4=k4, v4=v4, batched=q.ndim == 4, layout=layout, be=be, scale=scale,
                 facts=facts)


def _apply_prologue(q4, k4, p: QKNormRope):
    """``(q', k')`` through ``p`` by one kernel (its torch reference on a CPU without Triton's
    interpreter)."""
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope
    return qk_norm_rope(q4, k4, p.q_weight, p.k_weight, p.eps, p.cos, p.sin)


def _prologue_packs(plan, q4) -> bool:
    """Whether every pack call of ``plan`` can apply the prologue itself (one strided run each,
    and a device its kernel runs on)."""
    from dist_attn.comm import strided_run
    from dist_attn.kernels._op_support import launchable
    return launchable(q4) and all(strided_run(q4.shape, [c.head_ranges for c in plan.chunks[a:b]])
                                  is not None for a, b in plan.pack_runs)


# ---- torch.compile: the whole call as one custom op with a fake (shape-only) implementation ----
# Groups and meshes cannot cross the op boundary: the op gets a key (dist_attn.distributed).


@torch.library.custom_op("dist_attn::ulysses_attention", mutates_args=())
def _ulysses_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                cu_seqlens_host: Optional[list[int]], max_seqlen: Optional[int],
                valid_len: Optional[int], group_key: str, backend: str,
                softmax_scale: Optional[float], num_heads: Optional[int], head_dim: Optional[int],
                overlap_chunks: int, valid_len_host: Optional[torch.Tensor] = None,
                qk_q_weight: Optional[torch.Tensor] = None, qk_k_weight: Optional[torch.Tensor] = None,
                qk_eps: float = 0.0, qk_cos: Optional[torch.Tensor] = None,
                qk_sin: Optional[torch.Tensor] = None) -> torch.Tensor:
    # valid_len_host, then a QKNormRope's fields, come last (positional callers of the older
    # schema keep working); valid_len_host replaces valid_len when given: a CPU tensor, a graph
    # input whose value is read here, at run time
    group, mesh = resolve_compile_key(group_key)
    if valid_len_host is not None:
        valid_len = valid_len_host
    given = any(t is not None for t in (qk_q_weight, qk_k_weight, qk_cos, qk_sin))
    return _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len=valid_len,
                    group=group, mesh=mesh, backend=backend,
                    softmax_scale=softmax_scale, num_heads=num_heads, head_dim=head_dim,
                    buffers=None, timer=None, overlap_chunks=overlap_chunks,
                    prologue=QKNormRope(qk_q_weight, qk_k_weight, qk_eps, qk_cos, qk_sin) if given else None)


@_ulysses_op.register_fake
def _(q, k, v, cu_seqlens, cu_seqlens_host, max_seqlen, valid_len, group_key, backend,
      softmax_scale, num_heads, head_dim, overlap_chunks, valid_len_host=None, qk_q_weight=None,
      qk_k_weight=None, qk_eps=0.0, qk_cos=None, qk_sin=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


class UlyssesSageAttention(nn.Module):
    """Drop-in attention for a sequence-parallel DiT block (forward only).

    Args:
        num_heads: H, heads of q/k/v (plain multi-head; need not divide the group size W: the
            first ``(B*H) % W`` ranks take one extra (sample, head) pair; ``B*H >= W``).
        head_dim: D.
        mesh: 2-D ``DeviceMesh`` with dims ``("ring", "ulysses")`` for Ulysses x Ring (see
            :mod:`dist_attn.mesh` for which rows each rank holds); not together with ``group``.
        group: process group of the Ulysses ranks (None = default group).
        backend: ``"auto"``, ``"sage8"``, ``"sage8_gluon"``, ``"sage"``, ``"fa3"``, ``"sdpa"`` or
            another registered name.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        buffers: staging pool shared by layers (None = the process-wide pool).
        timer: optional :class:`~dist_attn.profiling.PhaseTimer`.
        overlap_chunks: head chunks pipelined against their all-to-alls (1 = plain path).

    Call: ``attn(q, k, v, cu_seqlens=None, max_seqlen=None, cu_seqlens_host=None, *,
    valid_len=None, qk_prologue=None)`` with q/k/v ``[S_local, H, D]`` or ``[B, S_local, H, D]``; see
    :func:`ulysses_attention`.
    """

    def __init__(self, num_heads: int, head_dim: int, *, mesh=None, group=None, backend: str = "auto",
                 softmax_scale: float | None = None, buffers: StagingBuffers | None = None,
                 timer: PhaseTimer | None = None, overlap_chunks: int = 1) -> None:
        super().__init__()
        num_heads, head_dim = positive_int("num_heads", num_heads), positive_int("head_dim", head_dim)
        # Checked here, not at the first forward: a module built with a typo would otherwise
        # construct fine and fail minutes later inside a model's first call.
        if not isinstance(backend, str) or backend not in available_backends():
            raise ValueError(f"backend={backend!r} is not one of {available_backends()} "
                             "(register_backend adds others)")
        check_group(group)
        if mesh is not None:
            check_mesh(mesh)
        self._checked = checked_scalars(softmax_scale, overlap_chunks)  # forward trusts them
        check_mesh_or_group(mesh, group)
        register_for_compile(group, mesh)  # eagerly, so a compiled forward finds its key
        self.num_heads, self.head_dim, self.mesh, self.group = num_heads, head_dim, mesh, group
        self.backend, self.buffers, self.timer = backend, buffers, timer

    softmax_scale = property(lambda self: self._checked.softmax_scale, doc="read-only: checked once")
    overlap_chunks = property(lambda self: self._checked.overlap_chunks, doc="read-only: checked once")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None,
                max_seqlen=None, cu_seqlens_host: Sequence[int] | None = None, *,
                valid_len: int | torch.Tensor | None = None,
                qk_prologue: QKNormRope | None = None) -> torch.Tensor:
        args = (q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host)
        kw = dict(valid_len=valid_len, group=self.group, mesh=self.mesh, backend=self.backend,
                  softmax_scale=self.softmax_scale, num_heads=self.num_heads,
                  head_dim=self.head_dim, overlap_chunks=self.overlap_chunks)
        if torch.compiler.is_compiling():  # the op's boundary checks its scalars again
            return ulysses_attention(*args, **kw, qk_prologue=qk_prologue)
        return _forward(*args, **kw, buffers=self.buffers, timer=self.timer, prologue=qk_prologue,
                        checked=self._checked)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}, "
                f"overlap_chunks={self.overlap_chunks}")
