"""Ulysses sequence-parallel attention: pack -> all-to-all -> varlen bridge -> all-to-all back.

Each of the W ranks of a group holds a contiguous shard ``[S_local, H, D]`` of the packed global
sequence. One all-to-all of a single destination-major staging buffer gives every rank all S rows
of q, k and v for its H_r heads; the varlen bridge attends; one all-to-all returns the output
shard in the caller's layout. With ``overlap_chunks=C > 1`` the heads are cut into C chunks whose
all-to-alls are issued asynchronously, so chunk c+1's transfer runs while chunk c's kernel does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Sequence

import torch
from torch import nn

from dist_attn.backends import default_softmax_scale, resolve_backend
from dist_attn.varlen import attend_varlen
from dist_attn.buffers import StagingBuffers, default_staging_buffers
from dist_attn.distributed import group_size_and_rank
from dist_attn.comm import all_to_all_flat, pack_qkv, unpack_output, unpack_qkv
from dist_attn.plan import head_offsets, heads_per_rank
from dist_attn.profiling import PhaseTimer
from dist_attn.validation import check_bounds, check_no_grad, check_qkv, host_bounds

__all__ = ["UlyssesSageAttention", "ulysses_attention"]


def _check_scale(softmax_scale) -> None:
    if softmax_scale is None:
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale={softmax_scale!r} must be a positive finite number or None")


def _check_chunks(overlap_chunks) -> None:
    if isinstance(overlap_chunks, bool) or not isinstance(overlap_chunks, int) or overlap_chunks < 1:
        raise ValueError(f"overlap_chunks={overlap_chunks!r} must be an int >= 1")


def _chunk_ranges(counts: tuple[int, ...], chunks: int) -> list[list[tuple[int, int]]]:
    """``ranges[c][j]``: the global heads ``(start, stop)`` of rank j that travel in chunk c."""
    offsets = head_offsets(counts)
    splits = [head_offsets(heads_per_rank(n, chunks)) for n in counts]
    return [[(offsets[j] + splits[j][c], offsets[j] + splits[j][c + 1]) for j in range(len(counts))]
            for c in range(chunks)]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, cu_seqlens_host: Sequence[int] | None = None, *,
                      group=None, backend: str = "auto", softmax_scale: float | None = None,
                      num_heads: int | None = None, head_dim: int | None = None,
                      buffers: StagingBuffers | None = None, timer: PhaseTimer | None = None,
                      overlap_chunks: int = 1) -> torch.Tensor:
    """Sequence-parallel block-diagonal attention over the ranks of ``group``.

    Args:
        q, k, v: ``[S_local, H, D]`` fp16/bf16/fp32 on one device: rank r's rows
            ``[r*S_local, (r+1)*S_local)`` of the packed global sequence of ``S = S_local * W`` rows.
            Never modified.
        cu_seqlens: ``[num_segments + 1]`` int32/int64 on q's device, GLOBAL bounds 0, ..., S.
        max_seqlen: the longest segment, an int.
        cu_seqlens_host: optional list/tuple of the same bounds as Python ints; when given the
            call makes no device-to-host synchronisation.
        group: process group (None = the default group; world 1 or no group = local attention).
        backend: ``"auto"`` or a registered backend name (see :mod:`dist_attn.backends`).
        softmax_scale: defaults to ``1 / sqrt(D)``.
        num_heads, head_dim: expected H and D (checked when given).
        buffers: staging pool; None = the process-wide pool.
        timer: optional :class:`PhaseTimer` that records pack / a2a_in / kernel / a2a_out / unpack.
        overlap_chunks: number of head chunks to pipeline (1 = two collectives per call).

    Returns:
        Fresh ``[S_local, H, D]`` in q's dtype and device. For bounds ``(0, used, S)`` with
        ``used == max_seqlen < S`` rows ``>= used`` of the global sequence are exactly zero.
    """
    # ---- validation: host-only facts, identical on every rank, before any collective ----
    check_qkv(q, k, v, num_heads=num_heads, head_dim=head_dim)
    check_no_grad(q, k, v)
    _check_scale(softmax_scale)
    _check_chunks(overlap_chunks)
    group, world, rank = group_size_and_rank(group)
    s_local, n_heads, d = q.shape
    seq = s_local * world
    check_bounds(cu_seqlens, device=q.device, total=seq)
    bounds = host_bounds(
        cu_seqlens, cu_seqlens_host, total=seq, max_seqlen=max_seqlen,
        total_desc=f"S = S_local*W = {s_local}*{world} = {seq} (each of the W={world} ranks holds "
                   f"S_local={s_local} rows; pad the packed sequence to a multiple of W)",
    )
    be = resolve_backend(backend, q)
    scale = default_softmax_scale(d) if softmax_scale is None else float(softmax_scale)
    phase = timer.phase if timer is not None else (lambda name: contextlib.nullcontext())

    if world == 1:
        with phase("kernel"):
            return attend_varlen(be, q, k, v, bounds=bounds, cu_seqlens=cu_seqlens,
                                 max_seqlen=max_seqlen, softmax_scale=scale, k_is_scratch=False)

    counts = heads_per_rank(n_heads, world)  # raises when H < W, on every rank alike
    chunks = min(overlap_chunks, min(counts))
    ranges = _chunk_ranges(counts, chunks)
    pool = buffers if buffers is not None else default_staging_buffers()
    # Sizes use the LARGEST rank's head count so every rank reserves the same amount and a
    # capacity error is raised on all ranks together.
    h_max = max(counts)
    pool.reserve({"in_send": s_local * 3 * n_heads * d, "in_recv": seq * 3 * h_max * d,
                  "out_send": seq * h_max * d, "out_recv": s_local * n_heads * d}, q.dtype, q.device)
    h_r = counts[rank]
    in_send = pool.get("in_send", s_local * 3 * n_heads * d, q.dtype, q.device)
    in_recv = pool.get("in_recv", seq * 3 * h_r * d, q.dtype, q.device)
    out_send = pool.get("out_send", seq * h_r * d, q.dtype, q.device)
    out_recv = pool.get("out_recv", s_local * n_heads * d, q.dtype, q.device)

    # Per-chunk slices of the four buffers, laid out chunk after chunk.
    send_in, recv_in, send_out, recv_out = [], [], [], []
    o_si = o_ri = o_so = o_ro = 0
    for rng in ranges:
        widths = [b - a for a, b in rng]
        w_r = widths[rank]
        send_in.append((in_send[o_si:o_si + s_local * 3 * sum(widths) * d], [s_local * 3 * w * d for w in widths]))
        recv_in.append((in_recv[o_ri:o_ri + seq * 3 * w_r * d], [s_local * 3 * w_r * d] * world))
        send_out.append((out_send[o_so:o_so + seq * w_r * d], [s_local * w_r * d] * world))
        recv_out.append((out_recv[o_ro:o_ro + s_local * sum(widths) * d], [s_local * w * d for w in widths]))
        o_si += s_local * 3 * sum(widths) * d
        o_ri += seq * 3 * w_r * d
        o_so += seq * w_r * d
        o_ro += s_local * sum(widths) * d

    with phase("pack"):
        for c, rng in enumerate(ranges):
            pack_qkv(q, k, v, send_in[c][0], rng)
    # All input all-to-alls are issued up front: they run in order on the communicator while
    # the kernels below wait only for their own chunk.
    with phase("a2a_in"):
        works_in = [all_to_all_flat(recv_in[c][0], send_in[c][0], recv_splits=recv_in[c][1],
                                    send_splits=send_in[c][1], group=group, async_op=chunks > 1)
                    for c in range(chunks)]
    works_out = []
    for c, rng in enumerate(ranges):
        w_r = rng[rank][1] - rng[rank][0]
        if chunks > 1:
            with phase("a2a_in"):
                works_in[c].wait()
        qc, kc, vc = unpack_qkv(recv_in[c][0], seq, w_r, d)  # [S, w_r, D] views, no copy
        with phase("kernel"):
            # k lives in our receive buffer, so Sage 1.0.6 may smooth it in place (no copy).
            attend_varlen(be, qc, kc, vc, bounds=bounds, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                          softmax_scale=scale, k_is_scratch=True,
                          out=send_out[c][0].view(seq, w_r, d))
        with phase("a2a_out"):
            works_out.append(all_to_all_flat(recv_out[c][0], send_out[c][0], recv_splits=recv_out[c][1],
                                             send_splits=send_out[c][1], group=group,
                                             async_op=chunks > 1))
    out = q.new_empty(q.shape)
    for c, rng in enumerate(ranges):
        if chunks > 1:
            with phase("a2a_out"):
                works_out[c].wait()
        with phase("unpack"):
            unpack_output(recv_out[c][0], out, rng)
    return out


class UlyssesSageAttention(nn.Module):
    """Drop-in attention for a sequence-parallel DiT block (forward only).

    Args:
        num_heads: H, heads of q/k/v (plain multi-head; H >= the group size; need not divide it:
            the first ``H % W`` ranks then take one extra head).
        head_dim: D.
        group: process group of the Ulysses ranks (None = default group).
        backend: ``"auto"``, ``"sage"``, ``"sage8"``, ``"sdpa"`` or another registered name.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        buffers: staging pool shared by layers (None = the process-wide pool).
        timer: optional :class:`~dist_attn.profiling.PhaseTimer`.
        overlap_chunks: head chunks pipelined against their all-to-alls (1 = plain path).

    Call: ``attn(q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host=None)`` with q/k/v
    ``[S_local, H, D]``; see :func:`ulysses_attention`.
    """

    def __init__(self, num_heads: int, head_dim: int, *, group=None, backend: str = "auto",
                 softmax_scale: float | None = None, buffers: StagingBuffers | None = None,
                 timer: PhaseTimer | None = None, overlap_chunks: int = 1) -> None:
        super().__init__()
        for name, val in (("num_heads", num_heads), ("head_dim", head_dim)):
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"{name}={val!r} must be a positive int")
        if not isinstance(backend, str):
            raise TypeError(f"backend={backend!r} must be a str")
        _check_scale(softmax_scale)
        _check_chunks(overlap_chunks)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.group = group
        self.backend = backend
        self.softmax_scale = softmax_scale
        self.buffers = buffers
        self.timer = timer
        self.overlap_chunks = overlap_chunks

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, cu_seqlens_host: Sequence[int] | None = None) -> torch.Tensor:
        return ulysses_attention(
            q, k, v, cu_seqlens, max_seqlen, cu_seqlens_host, group=self.group, backend=self.backend,
            softmax_scale=self.softmax_scale, num_heads=self.num_heads, head_dim=self.head_dim,
            buffers=self.buffers, timer=self.timer, overlap_chunks=self.overlap_chunks,
        )

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend!r}, "
                f"overlap_chunks={self.overlap_chunks}")
