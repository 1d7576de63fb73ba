# SPDX-License-Identifier: Apache-2.0
"""Ring attention over the "ring" dim of a USP mesh: K/V chunks rotate, partial outputs merge by
their log-sum-exp.

After the Ulysses all-to-all, the rank at ring position r holds q, k and v of ring chunk r (the
``L = U * S_local`` rows ``[r*L, (r+1)*L)`` of the packed sequence) for its heads. In R steps its
K/V buffer holds chunk ``r, r-1, ..., r-R+1`` (mod R): each step sends the buffer to position r+1
and receives the next one from r-1 (one ``batch_isend_irecv`` of one send and one receive: K and
V travel together), issued BEFORE this step's kernels so the transfer runs under them. R-1
transfers per forward.

Which (query rows, key rows) pairs a step computes is decided on the host from the segment layout
(:func:`ring_pieces`): a query row attends exactly the keys of its own segment wherever they live,
keys at or past ``valid_len`` never. A step whose chunks share no segment computes nothing (its
transfer still runs: every rank takes part in every step, which keeps the ring in lockstep).

Merging is exact and stable in fp32: with running ``(o, lse)`` and a partial ``(o_i, lse_i)``,
``lse' = logaddexp(lse, lse_i)`` and ``o' = o * exp(lse - lse') + o_i * exp(lse_i - lse')``. Both
weights are <= 1, so large logits cannot overflow. A row starts at ``lse = -inf, o = 0``; only
pieces with at least one key are ever merged, so ``lse_i`` is finite and no ``-inf - -inf`` (NaN)
arises. Rows no piece touches (padding) keep ``o = 0`` and come back exactly zero.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dist_attn.backends import AttentionBackend, BackendUnavailableError, resolve_backend
from dist_attn.mesh import ParallelGroups
from dist_attn.varlen import SegmentLayout

__all__ = ["RingPiece", "ring_pieces", "check_ring_backend", "resolve_ring_backend",
           "check_ring_transport", "merge_partial", "ring_attention"]


@dataclass(frozen=True)
class RingPiece:
    """One dense call of a ring step: chunk-local query rows against chunk-local key rows."""

    q_rows: tuple[int, int]
    """``(start, stop)`` rows of the query chunk."""
    k_rows: tuple[int, int]
    """``(start, stop)`` rows of the key chunk held this step."""


def ring_pieces(layout: SegmentLayout, *, chunk_len: int, q_chunk: int, k_chunk: int) -> tuple[RingPiece, ...]:
    """The non-empty segment intersections of query chunk ``q_chunk`` and key chunk ``k_chunk``.

    Args:
        layout: the global segment layout (segments already clipped to ``[0, valid_len)``).
        chunk_len: L, rows per ring chunk; chunk c covers global rows ``[c*L, (c+1)*L)``.
        q_chunk, k_chunk: ring chunk indices.

    Returns:
        One piece per segment that has rows in both chunks (for two different chunks at most one
        segment can, since segments are disjoint intervals), in row order. Host integers only.
    """
    q0, k0 = q_chunk * chunk_len, k_chunk * chunk_len
    pieces = []
    for a, b in layout.segments:
        qa, qb = max(a, q0), min(b, q0 + chunk_len)
        ka, kb = max(a, k0), min(b, k0 + chunk_len)
        if qa < qb and ka < kb:
            pieces.append(RingPiece(q_rows=(qa - q0, qb - q0), k_rows=(ka - k0, kb - k0)))
    return tuple(pieces)


def check_ring_backend(backend: AttentionBackend, *, requested: str, ring_size: int) -> None:
    """Raises :class:`BackendUnavailableError` when ``ring_size > 1`` and ``backend`` cannot return
    a log-sum-exp. Reads no tensor, so every rank raises alike before any collective."""
    if ring_size == 1 or backend.supports_lse:
        return
    chose = "" if requested == backend.name else f" (backend={requested!r} chose {backend.name!r})"
    fix = ("; sage8's kernels return it only for queries and keys of equal length, and ring steps "
           "pair chunks of different lengths" if backend.name.startswith("sage8") else "")
    raise BackendUnavailableError(
        f"backend {backend.name!r}{chose} does not return a log-sum-exp (supports_lse is False), "
        f"which ring attention needs to merge its {ring_size} partial results{fix}. Fix: pass "
        "backend='sdpa' (or another backend with dense_lse), or use a mesh whose 'ring' dim has "
        "size 1")


def resolve_ring_backend(name: str, q: torch.Tensor, *, ring_size: int,
                         exact_only: bool = False) -> AttentionBackend:
    """The backend for ``backend=name`` on a ring of ``ring_size``: "auto" chooses among kernels
    that return a log-sum-exp (it may choose; it logs what it chose), an explicit name that lacks
    one raises :class:`BackendUnavailableError` saying so (:func:`check_ring_backend`)."""
    backend = resolve_backend(name, q, exact_only=exact_only, require_lse=ring_size > 1 and name == "auto")
    check_ring_backend(backend, requested=name, ring_size=ring_size)
    return backend


def check_ring_transport(*, ring_size: int, comm_backend: str | None, device: torch.device) -> None:
    """Raises ValueError when the ring's point-to-point ops cannot move tensors on ``device``:
    gloo sends and receives CPU tensors only (torch.distributed's backend table), so gloo ranks
    sharing a GPU can run Ulysses (gloo's all-to-all takes CUDA tensors) but not the ring.

    Args:
        ring_size: R; nothing is sent when it is 1.
        comm_backend: the ring group's process-group backend name (``dist.get_backend``).
        device: where q, k, v live.

    Reads names only, so every rank decides alike (and a launcher can ask before any mesh exists).
    """
    if ring_size == 1 or device.type == "cpu":
        return
    if comm_backend == "gloo":
        raise ValueError(
            f"the mesh's 'ring' dim uses the gloo backend, which cannot send {device.type} tensors "
            "point-to-point (ring attention needs that); give every rank its own GPU and use NCCL "
            "(dist_attn.init_distributed(backend='nccl')), or use a mesh whose 'ring' dim has size 1")


def merge_partial(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  rows: tuple[int, int]) -> None:
    """Folds one partial result into the running one, in place, on rows ``[rows[0], rows[1])``.

    Args:
        acc_out: ``[B, L, H, D]`` float32 running output (0 where nothing merged yet).
        acc_lse: ``[B, L, H]`` float32 running log-sum-exp (-inf where nothing merged yet).
        out: ``[B, n, H, D]`` partial output (any float dtype), n = rows[1] - rows[0].
        lse: ``[B, H, n]`` float32 finite log-sum-exp of the partial (at least one key per row).
    """
    a, b = rows
    old = acc_lse[:, a:b]  # [B, n, H]
    new_part = lse.transpose(1, 2)  # [B, H, n] -> [B, n, H]
    merged = torch.logaddexp(old, new_part)
    w_old = torch.exp(old - merged).unsqueeze(-1)  # [B, n, H, 1]; exp(-inf) = 0 for a fresh row
    w_new = torch.exp(new_part - merged).unsqueeze(-1)
    acc = acc_out[:, a:b]
    acc.mul_(w_old).add_(out.float() * w_new)
    old.copy_(merged)


def _exchange(send: torch.Tensor, recv: torch.Tensor, groups: ParallelGroups) -> list:
    """Issues this step's transfer: ``send`` to ring position r+1, ``recv`` from r-1."""
    ops = [dist.P2POp(dist.isend, send, groups.ring_send_to, groups.ring_group),
           dist.P2POp(dist.irecv, recv, groups.ring_recv_from, groups.ring_group)]
    return dist.batch_isend_irecv(ops)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, layout: SegmentLayout,
                   groups: ParallelGroups, backend: AttentionBackend, softmax_scale: float,
                   out: torch.Tensor | None = None,
                   phase: Callable[[str], contextlib.AbstractContextManager] | None = None) -> torch.Tensor:
    """Block-diagonal attention of ring chunk ``groups.ring_rank`` against every ring chunk.

    Args:
        q, k, v: ``[B, L, H, D]`` (last dim contiguous; other strides free): global rows
            ``[r*L, (r+1)*L)`` of the packed sequence for this rank's heads (the same heads on
            every ring position). Never modified.
        layout: the GLOBAL segment layout, ``layout.total == L * R``.
        groups: from :func:`dist_attn.mesh.parallel_groups`; ``ring_size`` >= 1.
        backend: a backend with ``supports_lse`` (see :func:`check_ring_backend`).
        softmax_scale: score multiplier.
        out: optional ``[B, L, H, D]`` destination in q's dtype.
        phase: optional ``phase(name)`` context factory for timing (``kernel``, ``merge``,
            ``ring_wait``).

    Returns:
        ``out`` (or a fresh tensor) in q's dtype; rows at or past ``valid_len`` exactly zero.
    """
    phase = phase or (lambda name: contextlib.nullcontext())
    batch, chunk_len, heads, d = q.shape
    n_ring, r = groups.ring_size, groups.ring_rank
    # K and V travel as one buffer: [2, B, L, H, D] (index 0 = K, 1 = V). Two buffers alternate:
    # one is read by this step's kernels and sent on, the other receives the next chunk.
    cur = q.new_empty((2, batch, chunk_len, heads, d))
    cur[0].copy_(k)
    cur[1].copy_(v)
    spare = torch.empty_like(cur) if n_ring > 1 else None
    acc_out = torch.zeros((batch, chunk_len, heads, d), dtype=torch.float32, device=q.device)
    acc_lse = torch.full((batch, chunk_len, heads), float("-inf"), dtype=torch.float32, device=q.device)
    for step in range(n_ring):
        pending = _exchange(cur, spare, groups) if step < n_ring - 1 else []
        k_chunk = (r - step) % n_ring
        for piece in ring_pieces(layout, chunk_len=chunk_len, q_chunk=r, k_chunk=k_chunk):
            (qa, qb), (ka, kb) = piece.q_rows, piece.k_rows
            with phase("kernel"):
                part, lse = backend.dense_lse(q[:, qa:qb], cur[0, :, ka:kb], cur[1, :, ka:kb],
                                              softmax_scale=softmax_scale)
            with phase("merge"):
                merge_partial(acc_out, acc_lse, part, lse, (qa, qb))
        if pending:
            with phase("ring_wait"):
                for req in pending:
                    req.wait()
            cur, spare = spare, cur
    if out is None:
        return acc_out.to(q.dtype)
    out.copy_(acc_out)
    return out
