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
from dist_attn._ulysses_exchange import apply_prologue, exchange
from dist_attn.backends import available_backends, default_softmax_scale
from dist_attn.buffers import StagingBuffers
from dist_attn.distributed import (check_group, compile_key, register_for_compile,
                                   resolve_compile_key)
from dist_attn.mesh import check_mesh, check_mesh_or_group, parallel_groups
from dist_attn.plan import heads_per_rank, too_few_heads_fix
from dist_attn.profiling import PhaseTimer
from dist_attn.qk_prologue import QKNormRope, check_qk_prologue
from dist_attn.ring import check_ring_transport, resolve_ring_backend, ring_attention
from dist_attn.validation import (CheckedScalars, check_bounds, check_no_grad, check_op_scalars,
                                  check_qkv, check_scalars, checked_scalars, host_bounds,
                                  positive_int)
from dist_attn.varlen import SegmentLayout, attend_varlen, segment_layout

__all__ = ["UlyssesSageAttention", "checked_attention", "ulysses_attention"]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens=None,
                      max_seqlen=None, cu_seqlens_host: Sequence[int] | None = None, *,
                      valid_len: int | torch.Tensor | None = None, group=None, mesh=None, backend: str = "auto",
                      softmax_scale: float | None = None, num_heads: int | None = None,
                      head_dim: int | None = None, buffers: StagingBuffers | None = None,
                      timer: PhaseTimer | None = None, overlap_chunks: int = 1,
                      qk_prologue: QKNormRope | None = None) -> torch.Tensor:
    """Sequence-parallel block-diagonal attention over the ranks of ``group`` or ``mesh`` (forward
    only); returns a fresh tensor of q's shape, dtype and device.

    Args:
        q, k, v: ``[S_local, H, D]`` or ``[B, S_local, H, D]`` fp16/bf16/fp32 on one device, never
            modified: shard i's rows ``[i*S_local, (i+1)*S_local)`` of the packed sequence of
            ``S = S_local * W`` rows; with ``group`` i = the rank in the group, W its size; with
            ``mesh`` (R ring x U Ulysses) i = ``r*U + u`` at mesh coordinate ``(r, u)``, W = R*U.
        cu_seqlens: GLOBAL segment bounds 0, ..., S (documents, never padding), the same for every
            sample: an int32/int64 tensor (q's device or CPU) or a list of ints; None = one segment.
        max_seqlen: the longest segment (an int, a one-element tensor, or None).
        cu_seqlens_host: the same bounds as a list/tuple of ints: no device-to-host sync, but in
            the first call of a layout one all-reduce (read by the host) compares the ranks'
            inputs and kernel waves (:mod:`dist_attn.agreement`); ranks that differ all raise.
        valid_len: rows ``>= valid_len`` of the global sequence are padding, never attended and
            exactly zero in the output (None = none): an int (a constant of a compiled graph:
            each value recompiles) or a one-element int32/int64 CPU tensor (read on the host
            without a device sync; a graph input whose value may change).
        group: process group (None = the default group; no group initialised = local attention).
        mesh: a 2-D ``("ring", "ulysses")`` ``DeviceMesh``, not together with ``group``; ring
            size > 1 needs a backend that returns a log-sum-exp.
        backend: ``"auto"`` or a registered backend name (see :mod:`dist_attn.backends`).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        num_heads, head_dim: expected H and D (checked when given).
        buffers, timer: staging pool (None = the process-wide one); optional :class:`PhaseTimer`
            that records pack / a2a_in / kernel / a2a_out / unpack.
        overlap_chunks: head chunks pipelined against their all-to-alls (1 = two all-to-alls a
            call, plus R-1 K/V ring steps with a mesh, one ring per chunk; U = 1: nothing to
            overlap, one ring). Without a ring, cut to the kernel's waves where the backend
            reports them (``kernel_waves``; :func:`dist_attn.plan.chunk_widths`).
        qk_prologue: a :class:`dist_attn.QKNormRope` (per-head RMSNorm + RoPE, tables of this
            rank's rows): q and k are the raw projections, transformed in the pack's one pass
            where its kernel can, else (and always without an all-to-all) by one kernel first;
            float32 arithmetic, one rounding: not bit for bit diffusers' bf16 ops.
    """
    if torch.compiler.is_compiling():
        return _compiled_call(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len, group, mesh,
                              backend, softmax_scale, num_heads, head_dim, buffers, timer,
                              overlap_chunks, qk_prologue)
    return _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len=valid_len,
                    group=group, mesh=mesh, backend=backend, softmax_scale=softmax_scale,
                    num_heads=num_heads, head_dim=head_dim, buffers=buffers, timer=timer,
                    overlap_chunks=overlap_chunks, prologue=qk_prologue)


def _compiled_call(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, valid_len, group, mesh, backend,
                   softmax_scale, num_heads, head_dim, buffers, timer, overlap_chunks,
                   p: QKNormRope | None) -> torch.Tensor:
    """:func:`ulysses_attention` under ``torch.compile``: its arguments checked where they cannot
    cross the custom op's boundary (ValueError, TypeError as eager), then the op."""
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
    if p is not None and q.ndim in (3, 4):  # its fields become the op's arguments; other q: the op's checks
        check_qk_prologue(p, q if q.ndim == 4 else q[None])
    return torch.ops.dist_attn.ulysses_attention(
        q, k, v, cu_seqlens, None if cu_seqlens_host is None else list(cu_seqlens_host),
        max_seqlen, None if as_tensor else valid_len, compile_key(group, mesh), backend,
        softmax_scale, num_heads, head_dim, overlap_chunks, valid_len if as_tensor else None,
        *((None, None, 0.0, None, None) if p is None else (p.q_weight, p.k_weight, float(p.eps), p.cos, p.sin)))


def checked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, checked: CheckedScalars, *,
                      cu_seqlens=None, max_seqlen=None, cu_seqlens_host: Sequence[int] | None = None,
                      valid_len: int | torch.Tensor | None = None, group=None, mesh=None,
                      backend: str = "auto", num_heads: int | None = None, head_dim: int | None = None,
                      buffers: StagingBuffers | None = None, timer: PhaseTimer | None = None,
                      qk_prologue: QKNormRope | None = None) -> torch.Tensor:
    """:func:`ulysses_attention` for a wrapper that checked its scalars once, at its own boundary
    (``checked``: :func:`dist_attn.validation.checked_scalars` of its ``softmax_scale`` and
    ``overlap_chunks``): the eager call trusts them; under ``torch.compile`` the custom op's
    boundary checks them again, and ``buffers`` and ``timer`` (host state) are not passed in.
    Every other argument, shape, dtype and error as :func:`ulysses_attention`."""
    kw = dict(valid_len=valid_len, group=group, mesh=mesh, backend=backend,
              softmax_scale=checked.softmax_scale, num_heads=num_heads, head_dim=head_dim,
              overlap_chunks=checked.overlap_chunks)
    if torch.compiler.is_compiling():
        return ulysses_attention(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, **kw, qk_prologue=qk_prologue)
    return _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, **kw, buffers=buffers, timer=timer,
                    prologue=qk_prologue, checked=checked)


def _forward(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, *, valid_len, group, mesh, backend,
             softmax_scale, num_heads, head_dim, buffers, timer, overlap_chunks,
             prologue=None, checked: CheckedScalars | None = None) -> torch.Tensor:
    """The eager call (the compiled op's too): checks, the ranks' agreement, then the kernel on
    this rank alone (Ulysses size 1) or the exchange; ``checked`` holds scalars already checked."""
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
    waves = _agreed_waves(call, groups, backend)
    phase = timer.phase if timer is not None else _no_phase
    if groups.ulysses_size == 1:
        out = _attend_alone(call, groups, cu_seqlens, prologue, phase)
    else:
        out = exchange(call, groups, waves, prologue, cu_seqlens, buffers, phase)
    return out if call.batched else out[0]


def _no_phase(name: str) -> contextlib.nullcontext:
    """The phase context when no timer is given: times nothing."""
    return contextlib.nullcontext()


def _agreed_waves(call: _Call, groups, backend: str):
    """On several ranks, the first call of a layout compares the ranks' facts (ranks that differ
    raise on every rank) and returns the kernel waves they agree on (None: no waves asked or
    reported; always None on one rank)."""
    batch, _, n_heads, _ = call.q4.shape
    wants_waves = (groups.ring_size == 1 and call.facts.overlap_chunks > 1
                   and min(heads_per_rank(batch * n_heads, groups.ulysses_size)) > 1)
    kernel_waves = getattr(call.be, "kernel_waves", None) if wants_waves else None
    return None if groups.world == 1 else agree(
        call.facts, lambda: kernel_waves(call.layout, call.q4) if kernel_waves is not None else None,
        groups, backend_arg=backend)


def _attend_alone(call: _Call, groups, cu_seqlens, prologue, phase) -> torch.Tensor:
    """Ulysses size 1, no all-to-all: the prologue by its own kernel, then the kernel on this
    rank's rows (or ring attention over the ring dim); ``[B, S_local, H, D]``."""
    q4, k4 = call.q4, call.k4
    if prologue is not None:  # no pack to fold it into
        q4, k4 = apply_prologue(q4, k4, prologue)
    if groups.ring_size > 1:
        return ring_attention(q4, k4, call.v4, layout=call.layout, groups=groups, backend=call.be,
                              softmax_scale=call.scale, phase=phase)
    with phase("kernel"):
        return attend_varlen(call.be, q4, k4, call.v4, layout=call.layout, cu_seqlens=cu_seqlens,
                             softmax_scale=call.scale, k_is_scratch=False)


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
    # A custom op's schema lists every tensor on its own: the qk_* fields are a QKNormRope's (all
    # None: no prologue). valid_len_host replaces valid_len when given: a CPU tensor, a graph input
    # whose value is read here, at run time
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
        return checked_attention(q, k, v, self._checked, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                                 cu_seqlens_host=cu_seqlens_host, valid_len=valid_len, group=self.group,
                                 mesh=self.mesh, backend=self.backend, num_heads=self.num_heads,
                                 head_dim=self.head_dim, buffers=self.buffers, timer=self.timer,
                                 qk_prologue=qk_prologue)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}, "
                f"overlap_chunks={self.overlap_chunks}")
