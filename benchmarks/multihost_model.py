# SPDX-License-Identifier: Apache-2.0
"""Analytic per-rank model of one attention layer on several hosts: pure Ulysses vs Ulysses x Ring.

Pure arithmetic (no device): every time is bytes / bandwidth or FLOPs / kernel rate, with the
rates given as parameters. It answers which layout to run H3 in on 2 x 8 GPUs before such
machines are lent; it is NOT a measurement. The head split and the head chunks come from
:func:`dist_attn.plan.make_plan` (the core's own plan), the ring steps from the core's rule
(R-1 K/V transfers, step t pairs query chunk r with key chunk r - t, only valid rows computed).

Per rank (the slowest rank is reported), with C head chunks (``overlap_chunks``):

* pack / unpack: payload bytes / ``copy_gbs``;
* all-to-all of chunk c: per link class, ``max(bytes sent, bytes received)`` over the peers of that
  class; peers on this host at ``nvlink_gbs``, on other hosts at ``internode_gbs``; both classes run
  at once, so ``A_c = max(intra / nvlink, inter / internode)``;
* kernel: ``4 * q_rows * k_rows * heads * D / kernel_tflops`` over the valid rows only;
* ring (R > 1) of chunk c: step t computes ``k_t`` (+ its fp32 merge ``m_t``); with overlap the
  K/V transfer of ``2 * L * w * D * 2 B`` runs under it, ``sum_{t<R-1} max(k_t + m_t, X) + k_{R-1}
  + m_{R-1}``; without, ``sum (k_t + m_t) + (R-1) X``; plus the K/V staging copy;
* the layer pipelines chunks as the core issues them: its pack calls back to back (the first chunk
  alone, then each run of equally wide chunks: ``UlyssesPlan.pack_runs``; the pack time split by
  the heads each call packs), each chunk's input all-to-all issued right after its call,
  ``in_end[c] = max(in_end[c-1], P_c) + A_in[c]`` with ``P_c`` the end of chunk c's pack call,
  ``k_end[c] = max(k_end[c-1], in_end[c]) + K_c`` (``k_end`` starts at the end of the last pack),
  ``out_end[c] = max(out_end[c-1], k_end[c]) + A_out[c]`` (``out_end`` starts at ``in_end[C-1]``),
  the unpacks behind the last kernel, each waiting for its chunk's output,
  ``u[c] = max(u[c-1], out_end[c]) + unpack_c`` (``u`` starts at ``k_end[C-1]``; the unpack time
  split by heads), ``T = u[C-1]``. C = 1 is the plain serial sum.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dist_attn.plan import make_plan

__all__ = ["Params", "LayoutSpec", "model_layer"]

_BYTES = 2  # bf16


def pipelined_ms(pack_runs: list[tuple[int, float]], a_in: list[float], k_chunks: list[float],
                 a_out: list[float], unpacks: list[float]) -> float:
    """The recurrence of :data:`benchmarks.scaling.MODEL_FORMULA` on per-chunk stage times (the
    pack calls back to back, each chunk's input all-to-all after its call on one channel, kernels
    behind the last pack, output all-to-alls behind their kernels, unpacks behind the last kernel
    and their own output): the one-host model's and this module's, whose all-to-alls differ from
    chunk to chunk."""
    in_end, packed, t, c = [], 0.0, 0.0, 0
    for n, ms in pack_runs:
        packed += ms
        for a in a_in[c:c + n]:
            t = max(t, packed) + a
            in_end.append(t)
        c += n
    if not c == len(a_in) == len(k_chunks) == len(a_out) == len(unpacks):
        raise ValueError(f"pack_runs={pack_runs} cover {c} chunks; a_in, k_chunks, a_out and unpacks "
                         f"have {len(a_in)}, {len(k_chunks)}, {len(a_out)} and {len(unpacks)}")
    k_end, out_end, out_ends = packed, in_end[-1], []
    for c, (k, a) in enumerate(zip(k_chunks, a_out)):
        k_end = max(k_end, in_end[c]) + k
        out_end = max(out_end, k_end) + a
        out_ends.append(out_end)
    t = k_end  # the unpacks queue behind the last kernel, each also waiting for its chunk's output
    for out_end, ms in zip(out_ends, unpacks):
        t = max(t, out_end) + ms
    return t


@dataclass(frozen=True, kw_only=True)
class Params:
    """Rates of the model. The bandwidths are PLANNING figures, not measurements."""

    nvlink_gbs: float = 360.0
    """Per-GPU all-to-all bandwidth inside a host (planning figure)."""
    internode_gbs: float = 50.0
    """Per-GPU bandwidth to other hosts (planning figure: one 400 Gb/s NIC per GPU)."""
    kernel_tflops: float = 767.0
    """Attention kernel rate, TFLOP/s-equivalent (sage8 at 7 heads on one H200, measured
    2026-12-03; assumed the same at every shape of the model)."""
    copy_gbs: float = 750.0
    """Pack / unpack payload rate (measured on one H200, 2026-12-02: 204 MB packed in 0.273 ms)."""
    merge_gbs: float = 4200.0
    """Read + write rate of the ring's fp32 merge and K/V staging (an H200 copy, measured)."""
    nonattn_full_ms: float = 52.08
    """The non-attention part of one H3 block at all 38,016 rows on one H200 (measured
    2026-12-02); a rank's share scales with its rows."""


@dataclass(frozen=True)
class LayoutSpec:
    """One way to place a layer on ``ulysses * ring`` GPUs."""

    name: str
    ulysses: int
    ring: int
    gpus_per_host: int

    @property
    def world(self) -> int:
        return self.ulysses * self.ring


def _a2a_ms(sizes_send: list[float], sizes_recv: list[float], me: int, hosts: list[int],
            p: Params) -> float:
    """One all-to-all on rank ``me``: bytes to / from every peer, grouped by link class."""
    intra = [0.0, 0.0]
    inter = [0.0, 0.0]
    for j, (s, r) in enumerate(zip(sizes_send, sizes_recv)):
        if j == me:
            continue
        cls = intra if hosts[j] == hosts[me] else inter
        cls[0] += s
        cls[1] += r
    return max(max(intra) / (p.nvlink_gbs * 1e6), max(inter) / (p.internode_gbs * 1e6))


def _kernel_ms(q_rows: int, k_rows: int, heads: int, d: int, p: Params) -> float:
    return 4.0 * q_rows * k_rows * heads * d / (p.kernel_tflops * 1e9)


def _rank_ms(spec: LayoutSpec, *, seq: int, used: int, heads: int, d: int, chunks: int,
             ring_overlap: bool, shard: int, p: Params) -> dict:
    u_size, r_size = spec.ulysses, spec.ring
    s_local = seq // spec.world
    r, u = divmod(shard, u_size)
    chunk_len = s_local * u_size
    plan = make_plan(world=u_size, rank=u, s_local=s_local, folded_heads=heads, head_dim=d,
                     overlap_chunks=chunks)
    hosts = [(r * u_size + j) // spec.gpus_per_host for j in range(u_size)]
    ring_peer_remote = r_size > 1 and (((r + 1) % r_size) * u_size + u) // spec.gpus_per_host \
        != shard // spec.gpus_per_host

    def valid(c: int) -> int:  # valid rows of ring chunk c (one request padded at the end)
        return max(0, min(used, (c + 1) * chunk_len) - c * chunk_len)

    a_in, a_out, k_stage, kern, xfer, merge = [], [], [], 0.0, 0.0, 0.0
    for c in plan.chunks:
        widths = [b - a for a, b in c.head_ranges]
        w = widths[u]
        if u_size > 1:
            a_in.append(_a2a_ms([s_local * 3 * x * d * _BYTES for x in widths],
                                [s_local * 3 * w * d * _BYTES] * u_size, u, hosts, p))
            a_out.append(_a2a_ms([s_local * w * d * _BYTES] * u_size,
                                 [s_local * x * d * _BYTES for x in widths], u, hosts, p))
        else:
            a_in.append(0.0)
            a_out.append(0.0)
        if r_size == 1:
            k = _kernel_ms(used, used, w, d, p)
            k_stage.append(k)
            kern += k
            continue
        x = 2 * chunk_len * w * d * _BYTES / ((p.internode_gbs if ring_peer_remote else p.nvlink_gbs) * 1e6)
        elems = chunk_len * w * d
        staging = elems * 2 * _BYTES * 2 / (p.merge_gbs * 1e6)  # K and V into the ring buffer
        step_merge = elems * 18 / (p.merge_gbs * 1e6)  # fp32 acc read+write, partial upcast, weights
        final = elems * 6 / (p.merge_gbs * 1e6)  # fp32 -> bf16 into the output staging
        steps = [_kernel_ms(valid(r), valid((r - t) % r_size), w, d, p) + step_merge for t in range(r_size)]
        if ring_overlap:
            ring = sum(max(s, x) for s in steps[:-1]) + steps[-1]
        else:
            ring = sum(steps) + (r_size - 1) * x
        k_stage.append(staging + ring + final)
        kern += sum(s - step_merge for s in steps)
        xfer += (r_size - 1) * x
        merge += staging + r_size * step_merge + final
    pack = s_local * 3 * heads * d * _BYTES / (p.copy_gbs * 1e6) if u_size > 1 else 0.0
    unpack = s_local * heads * d * _BYTES / (p.copy_gbs * 1e6) if u_size > 1 else 0.0
    # the core's pack calls (plan.pack_runs) and each chunk's unpack, their times split by heads
    packs = [sum(b - a for a, b in c.head_ranges) for c in plan.chunks]
    pack_runs = [(stop - first, pack * sum(packs[first:stop]) / heads) for first, stop in plan.pack_runs]
    total = pipelined_ms(pack_runs, a_in, k_stage, a_out, [unpack * n / heads for n in packs])
    serial = pack + sum(a_in) + kern + xfer + merge + sum(a_out) + unpack
    return {"total_ms": total, "pack": pack, "a2a_in": sum(a_in), "kernel": kern, "ring_xfer": xfer,
            "merge": merge, "a2a_out": sum(a_out), "unpack": unpack, "hidden_ms": serial - total,
            "heads": plan.counts[u],
            "effective_chunks": len(plan.chunks), "s_local": s_local, "ring_peer_remote": ring_peer_remote}


def model_layer(spec: LayoutSpec, *, seq: int, used: int, heads: int, head_dim: int, chunks: int,
                ring_overlap: bool, params: Params) -> dict:
    """The slowest rank of ``spec`` for one attention layer (and its block estimate).

    Args:
        spec: the layout (U x R on hosts of ``gpus_per_host``).
        seq, used: packed rows and valid rows (one request padded at the end).
        heads, head_dim: H and D.
        chunks: ``overlap_chunks`` C (capped by the plan at the smallest head share).
        ring_overlap: whether the K/V transfer of a ring step runs under its kernel.

    Returns:
        A flat dict: ``total_ms`` and the phase sums of the slowest rank, ``block_ms`` =
        total + the rank's share of the non-attention block, the config echoed.
    """
    if seq % spec.world:
        raise ValueError(f"seq={seq} rows do not split over {spec.world} ranks")
    per_rank = [_rank_ms(spec, seq=seq, used=used, heads=heads, d=head_dim, chunks=chunks,
                         ring_overlap=ring_overlap, shard=i, p=params) for i in range(spec.world)]
    slow = max(per_rank, key=lambda x: x["total_ms"])
    nonattn = params.nonattn_full_ms * (seq // spec.world) / seq
    return {**asdict(spec), "gpus": spec.world, "hosts": -(-spec.world // spec.gpus_per_host),
            "overlap_chunks": chunks, "ring_overlap": ring_overlap, **slow,
            "nonattn_ms": nonattn, "block_ms": slow["total_ms"] + nonattn}


if __name__ == "__main__":
    raise SystemExit("benchmarks.multihost_model is a module of other benchmarks, with nothing to run by itself; "
                     "run python -m benchmarks.scaling --modeled --multi-host")
