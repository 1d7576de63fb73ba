# SPDX-License-Identifier: Apache-2.0
"""One Ulysses call's exchange over W > 1 ranks, for a call :mod:`dist_attn.ulysses` checked:
the head-chunk plan, the staging buffers, then pack -> all-to-all in -> kernel (or ring) ->
all-to-all out -> unpack, chunk by chunk. Also the q/k prologue where no pack can fold it in."""

from __future__ import annotations

import torch

from dist_attn.buffers import default_staging_buffers
from dist_attn.comm import all_to_all_flat, pack_qkv_chunks, unpack_output, unpack_qkv
from dist_attn.plan import make_plan
from dist_attn.qk_prologue import QKNormRope
from dist_attn.ring import ring_attention
from dist_attn.varlen import attend_varlen

__all__ = ["apply_prologue", "exchange"]


def exchange(call, groups, waves, prologue, cu_seqlens, buffers, phase) -> torch.Tensor:
    """``[B, S_local, H, D]``, this rank's rows of the attention of ``call`` (``ulysses._Call``)
    over the Ulysses group of ``groups`` (W > 1), a fresh tensor of q's dtype and device.
    ``waves``: the kernel waves the ranks agreed on (None: equal chunks); ``buffers``: the
    staging pool (None = the process-wide one); ``phase(name)``: a context per timed phase."""
    q4, k4, v4 = call.q4, call.k4, call.v4
    batch, s_local, n_heads, d = q4.shape
    plan = make_plan(world=groups.ulysses_size, rank=groups.ulysses_rank, s_local=s_local,
                     folded_heads=batch * n_heads, head_dim=d,
                     overlap_chunks=call.facts.overlap_chunks, waves=waves)
    if prologue is not None and not _prologue_packs(plan, q4):
        q4, k4 = apply_prologue(q4, k4, prologue)
        prologue = None
    bufs = _staging(plan, buffers, call.q4)
    # Every input all-to-all is issued before any kernel, each right after the pack call that
    # fills its chunk: they run in order on the communicator (the first while the other chunks
    # are packed) and the kernels below wait only for their own chunk.
    asynchronous = len(plan.chunks) > 1
    works_in = _send_inputs(plan, bufs, q4, k4, v4, prologue, groups.ulysses_group, asynchronous,
                            phase)
    works_out = _attend_chunks(plan, bufs, works_in, call, groups, cu_seqlens, asynchronous, phase)
    out = q4.new_empty(q4.shape)
    _receive_outputs(plan, bufs, works_out, out, asynchronous, phase)
    return out


def _view(bufs: dict, role: str, span: tuple[int, int]) -> torch.Tensor:
    """Elements ``[span[0], span[1])`` of the staging buffer of ``role``."""
    return bufs[role][span[0]:span[1]]


def _staging(plan, buffers, q4: torch.Tensor) -> dict:
    """``role -> flat staging buffer`` of ``plan``'s sizes in q's dtype and device, from ``buffers``
    (None = the process-wide pool); raises on every rank alike when they cannot be reserved."""
    pool = buffers if buffers is not None else default_staging_buffers()
    sizes = plan.buffer_sizes()
    pool.reserve(sizes, q4.dtype, q4.device)  # raises on every rank alike
    return {role: pool.get(role, n, q4.dtype, q4.device) for role, n in sizes.items()}


def _send_inputs(plan, bufs, q4, k4, v4, prologue, group, asynchronous, phase) -> list:
    """Packs each run of ``plan.pack_runs`` into ``in_send`` (through ``prologue`` when given) and
    issues its chunks' input all-to-alls right after; returns their works, one per chunk."""
    works_in = []
    for first, stop in plan.pack_runs:
        run = plan.chunks[first:stop]
        with phase("pack"):
            send = _view(bufs, "in_send", (run[0].in_send[0], run[-1].in_send[1]))  # the run's chunks
            ranges = [c.head_ranges for c in run]
            if prologue is None:
                pack_qkv_chunks(q4, k4, v4, send, ranges)
            else:
                from dist_attn.kernels.qk_norm_rope import pack_qkv_prologue
                if not pack_qkv_prologue(q4, k4, v4, send, ranges, prologue):
                    raise RuntimeError("the pack could not apply qk_prologue to a run that "
                                       "_prologue_packs admitted (a dist_attn bug: please report it)")
        with phase("a2a_in"):
            works_in += [all_to_all_flat(_view(bufs, "in_recv", c.in_recv), _view(bufs, "in_send", c.in_send),
                                         recv_splits=list(c.in_recv_splits),
                                         send_splits=list(c.in_send_splits), group=group,
                                         async_op=asynchronous) for c in run]
    return works_in


def _attend_chunks(plan, bufs, works_in, call, groups, cu_seqlens, asynchronous, phase) -> list:
    """Per chunk, once its input has arrived: the kernel (or ring attention) over all S rows of
    its heads into ``out_send``, then its output all-to-all; returns their works."""
    rank, n_ring, group = groups.ulysses_rank, groups.ring_size, groups.ulysses_group
    _, s_local, _, d = call.q4.shape
    chunk = s_local * groups.ulysses_size  # rows one Ulysses group gathers: the whole sequence without a ring
    be, layout, scale = call.be, call.layout, call.scale
    works_out = []
    for c, work in zip(plan.chunks, works_in):
        w_r = c.local_heads(rank)
        if asynchronous:
            with phase("a2a_in"):
                work.wait()
        qc, kc, vc = unpack_qkv(_view(bufs, "in_recv", c.in_recv), chunk, w_r, d)  # [L, w_r, D] views
        dst = _view(bufs, "out_send", c.out_send).view(1, chunk, w_r, d)  # [1, L, w_r, D]
        if n_ring > 1:
            ring_attention(qc[None], kc[None], vc[None], layout=layout, groups=groups, backend=be,
                           softmax_scale=scale, out=dst, phase=phase)
        else:
            with phase("kernel"):
                # k lives in our receive buffer, so Sage 1.0.6 may smooth it in place (no copy).
                attend_varlen(be, qc[None], kc[None], vc[None], layout=layout, cu_seqlens=cu_seqlens,
                              softmax_scale=scale, k_is_scratch=True, out=dst)
        with phase("a2a_out"):
            works_out.append(all_to_all_flat(_view(bufs, "out_recv", c.out_recv),
                                             _view(bufs, "out_send", c.out_send),
                                             recv_splits=list(c.out_recv_splits),
                                             send_splits=list(c.out_send_splits), group=group,
                                             async_op=asynchronous))
    return works_out


def _receive_outputs(plan, bufs, works_out, out, asynchronous, phase) -> None:
    """Unpacks each chunk's returned rows into ``out`` ``[B, S_local, H, D]`` once they arrived."""
    for c, work in zip(plan.chunks, works_out):
        if asynchronous:
            with phase("a2a_out"):
                work.wait()
        with phase("unpack"):
            unpack_output(_view(bufs, "out_recv", c.out_recv), out, c.head_ranges)


def apply_prologue(q4, k4, p: QKNormRope):
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
