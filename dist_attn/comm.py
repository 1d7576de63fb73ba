# SPDX-License-Identifier: Apache-2.0
"""Packing and the two all-to-alls of a Ulysses forward, as pure functions.

Layout of the input staging buffer on every rank (destination-major): for each destination rank
j, a block ``[S_local, 3, H_j, D]`` holding this rank's rows of q, k, v for j's heads. After ONE
all-to-all, rank r's receive buffer is ``[W, S_local, 3, H_r, D] = [S, 3, H_r, D]``: all S rows of
q, k and v for its own heads, readable as strided ``[S, H_r, D]`` views with a contiguous last dim.

The attention output ``[S, H_r, D]`` is already destination-major by rows (rank i needs rows
``[i*S_local, (i+1)*S_local)``), so the output all-to-all needs no packing, only the unpack of the
received ``[S_local, H_j, D]`` blocks into ``[S_local, H, D]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = [
    "pack_qkv",
    "pack_qkv_chunks",
    "unpack_qkv",
    "unpack_output",
    "all_to_all_flat",
]


def _widen(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same bytes viewed as 8-byte words along the (contiguous) last dim, for all tensors or
    none. A strided copy moves one element per thread step, so bf16 packing ran at well under half
    a plain copy's bandwidth (``benchmarks/alltoall.py``); 8-byte words move 4x the bytes per
    step. Falls back to the tensors as they are when a view is impossible (odd sizes or
    offsets)."""
    if tensors[0].element_size() >= 8 or any(t.data_ptr() % 8 for t in tensors):
        return tensors  # misaligned memory from outside torch's allocator: copy element-wise
    try:
        return tuple(t.view(torch.int64) for t in tensors)
    except RuntimeError:
        return tensors


def strided_run(shape, chunk_ranges) -> tuple[int, int, int, int] | None:
    """``(W, H/W, first head, w)`` when ``n`` consecutive chunks of ``w`` heads for each of W ranks
    (``chunk_ranges[i][j]``: chunk i's heads for rank j) can be read from a ``[1, S_local, H, D]``
    tensor as one strided view: each rank's heads lie H/W apart and each chunk starts where the one
    before it ends (batch 1, even heads: one chunk, or a run of equally wide ones); None when a
    loop is needed."""
    batch, _, num_heads, _ = shape
    world = len(chunk_ranges[0])
    if batch != 1 or num_heads % world:
        return None
    hw = num_heads // world
    base = chunk_ranges[0][0][0]
    w = chunk_ranges[0][0][1] - base
    if base + len(chunk_ranges) * w > hw or any(
            a != base + i * w + j * hw or b - a != w
            for i, ranges in enumerate(chunk_ranges) for j, (a, b) in enumerate(ranges)):
        return None
    return world, hw, base, w


def _run_view(t: torch.Tensor, run: tuple[int, int, int, int], n: int) -> torch.Tensor:
    """The ``[n, W, S_local, w, D]`` view of ``t`` ``[1, S_local, H, D]`` that :func:`strided_run` found."""
    world, hw, base, w = run
    _, s_local, _, head_dim = t.shape
    # [1, S_local, H, D] -> [S_local, W, H/W, D] -> [S_local, W, n, w, D] -> [n, W, S_local, w, D]
    view = t[0].view(s_local, world, hw, head_dim)[:, :, base:base + n * w]
    return view.unflatten(2, (n, w)).permute(2, 1, 0, 3, 4)


def _pieces(a: int, b: int, num_heads: int):
    """Splits folded heads ``[a, b)`` into ``(sample, head_start, head_stop, offset)`` runs that
    stay inside one sample (folded head f is sample ``f // H``, head ``f % H``)."""
    f = a
    while f < b:
        sample, h0 = divmod(f, num_heads)
        h1 = min(num_heads, h0 + (b - f))
        yield sample, h0, h1, f - a
        f += h1 - h0


def pack_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, send: torch.Tensor,
             head_ranges) -> torch.Tensor:
    """Writes q, k, v into a destination-major send buffer.

    Args:
        q, k, v: ``[B, S_local, H, D]``, this rank's rows (last dim contiguous).
        send: flat buffer of ``S_local * 3 * sum(widths) * D`` elements, q's dtype and device.
        head_ranges: for each destination rank j, the FOLDED heads ``(start, stop)`` (folded head
            ``b * H + h``) it receives in this all-to-all (all of its heads, or one chunk).

    Returns:
        ``send`` (filled): for each destination a block ``[S_local, 3, width_j, D]``.
    """
    result = send
    q, k, v, send = _widen(q, k, v, send)
    _, s_local, num_heads, head_dim = q.shape  # head_dim counted in (possibly widened) elements
    if _copy_strided_run(q, k, v, send, (head_ranges,)):
        return result
    start = 0
    for a, b in head_ranges:
        n = s_local * 3 * (b - a) * head_dim
        dst = send[start:start + n].view(s_local, 3, b - a, head_dim)  # [S_local, 3, w_j, D]
        for sample, h0, h1, off in _pieces(a, b, num_heads):
            for i, t in enumerate((q, k, v)):
                dst[:, i, off:off + h1 - h0].copy_(t[sample, :, h0:h1])
        start += n
    return result


def _copy_strided_run(q, k, v, send, chunk_ranges) -> bool:
    """One strided copy per role of a run of chunks into its send blocks ``[n, W, S_local, 3, w,
    D]`` (tensors already widened); False, copying nothing, when the heads need a loop."""
    run = strided_run(q.shape, chunk_ranges)
    if run is None:
        return False
    n = len(chunk_ranges)
    world, _, _, w = run
    dst = send.view(n, world, q.shape[1], 3, w, q.shape[3])  # [n, W, S_local, 3, w, D]
    for i, t in enumerate((q, k, v)):
        dst[:, :, :, i].copy_(_run_view(t, run, n))
    return True


def pack_qkv_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, send: torch.Tensor,
                    chunk_ranges) -> torch.Tensor:
    """:func:`pack_qkv` for consecutive chunks whose send blocks follow one another in ``send``.

    One strided copy per role packs them all when they are equally wide, each rank's heads lie
    H/W apart and each chunk starts where the one before it ends (batch 1 with even heads: the
    chunks of :attr:`dist_attn.plan.UlyssesPlan.pack_runs`); otherwise one :func:`pack_qkv` per
    chunk. The bytes written are the same either way.

    Args:
        q, k, v: ``[B, S_local, H, D]``, this rank's rows (last dim contiguous).
        send: flat buffer of exactly the chunks' send blocks, back to back.
        chunk_ranges: for each chunk, its ``head_ranges`` (see :func:`pack_qkv`).

    Returns:
        ``send`` (filled).
    """
    if len(chunk_ranges) > 1 and _copy_strided_run(*_widen(q, k, v, send), chunk_ranges):
        return send
    s_local, head_dim = q.shape[-3], q.shape[-1]
    start = 0
    for ranges in chunk_ranges:
        n = s_local * 3 * sum(b - a for a, b in ranges) * head_dim
        pack_qkv(q, k, v, send[start:start + n], ranges)
        start += n
    return send


def unpack_qkv(recv: torch.Tensor, seq: int, local_heads: int, head_dim: int):
    """Views of q, k, v for this rank's heads in the input receive buffer.

    Args:
        recv: flat receive buffer of ``seq * 3 * local_heads * head_dim`` elements.

    Returns:
        q, k, v: ``[S, H_r, D]`` strided views (strides ``(3*H_r*D, D, 1)``), no copy.
    """
    qkv = recv.view(seq, 3, local_heads, head_dim)  # [W, S_local, 3, H_r, D] -> [S, 3, H_r, D]
    return qkv[:, 0], qkv[:, 1], qkv[:, 2]


def unpack_output(recv: torch.Tensor, out: torch.Tensor, head_ranges) -> torch.Tensor:
    """Scatters an output receive buffer into the caller's layout.

    Args:
        recv: flat buffer, for each source rank j a block ``[S_local, width_j, D]``.
        out: destination ``[B, S_local, H, D]``.
        head_ranges: for each source rank j, the folded heads ``(start, stop)`` its block holds.

    Returns:
        ``out`` (filled at those heads).
    """
    result = out
    recv, out = _widen(recv, out)
    _, s_local, num_heads, head_dim = out.shape  # head_dim counted in (possibly widened) elements
    run = strided_run(out.shape, (head_ranges,))
    if run is not None:
        dst = _run_view(out, run, 1)  # [1, W, S_local, w, D]
        dst.copy_(recv.view(dst.shape))  # one copy
        return result
    start = 0
    for a, b in head_ranges:
        n = s_local * (b - a) * head_dim
        block = recv[start:start + n].view(s_local, b - a, head_dim)  # [S_local, w_j, D]
        for sample, h0, h1, off in _pieces(a, b, num_heads):
            out[sample, :, h0:h1].copy_(block[:, off:off + h1 - h0])
        start += n
    return result


def all_to_all_flat(recv: torch.Tensor, send: torch.Tensor, *, recv_splits: list[int],
                    send_splits: list[int], group, async_op: bool = False):
    """One ``all_to_all_single`` of flat buffers; equal splits are passed as None (NCCL's fast path)."""
    even = len(set(recv_splits)) == 1 and len(set(send_splits)) == 1
    return dist.all_to_all_single(
        recv, send,
        output_split_sizes=None if even else recv_splits,
        input_split_sizes=None if even else send_splits,
        group=group, async_op=async_op,
    )
