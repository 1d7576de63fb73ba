# SPDX-License-Identifier: Apache-2.0
"""Ulysses scaling at h3-ref: UlyssesSageAttention forward and one real H3 block vs the number of ranks.

The block is diffusers' ``MiniMaxH3TransformerBlock`` (its own init, bf16) with dist_attn's H3
processor (:mod:`benchmarks.h3_block`); its inputs are the h3-ref rows (37,980 used of 38,016).

Two modes, never mixed in one table or plot:

* measured (default; under torchrun): for every N in ``--ranks`` that fits the launched world, the
  first N ranks form a group and run the layer while the others wait, so one launch covers
  N = 1, 2, 4, ... The layer's phases (pack, a2a_in, kernel, a2a_out, unpack) come from
  dist_attn.profiling.PhaseTimer attached during the timed iterations; the total is wall clock
  with a device sync, ranks aligned by a barrier, slowest rank reported. With gloo ranks sharing
  one GPU the ranks contend for that GPU and the all-to-alls go through host memory: such rows
  are labelled and measure the code path, not NVLink scaling.
* ``--modeled`` (one process, one GPU): for each N the per-rank work is timed on the real GPU
  (pack of S/N rows x H heads, the kernel at H/N heads over all S rows reading the receive buffer
  layout, the unpack, and the non-attention part of the block at S/N rows), and the all-to-alls
  are computed as bytes sent to other ranks / ``--bandwidth-gbs``. The N = 1 attention layer and
  full block are also measured for real, as a check of the model (own table section).

* ``--modeled --multi-host`` (no device at all): one layer on several hosts, computed from rates
  given as parameters (:mod:`benchmarks.multihost_model`): one host's Ulysses U=g against pure
  Ulysses over all hosts (uneven heads, all-to-all across hosts) and Ulysses x Ring (U=g inside each
  host, ring across hosts), with and without overlap. NVLink and inter-node bandwidths are planning
  figures; the report says so.

Speedup = T(1) / T(N) and efficiency = T(1) / (N * T(N)), against N = 1 of the same backend and
mode in the same report; ``overlap_chunks`` C in ``--overlap`` (C = 1 is the plain path).

Examples::

    python -m benchmarks.scaling --modeled --bandwidth-gbs 360           # one GPU, N = 1,2,4,8
    python -m benchmarks.scaling --modeled --multi-host --internode-gbs 50   # 2 x 8 GPUs, computed
    torchrun --standalone --nproc-per-node 4 -m benchmarks.scaling        # measured, N = 1,2,4
    python -m torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.scaling --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

from benchmarks.harness import (
    Budget,
    DistContext,
    ResultWriter,
    add_common_args,
    describe_exception,
    init_distributed,
    markdown_table,
    time_fn,
)

import torch
import torch.distributed as dist
from torch import nn

import dist_attn
from dist_attn import backends as da_backends
from dist_attn.varlen import attend_varlen, segment_layout
from dist_attn.buffers import StagingBuffers
from dist_attn.comm import pack_qkv_chunks, unpack_output, unpack_qkv
from benchmarks.h3_block import attach, block_inputs, build_block, h3_ref_layout, padded_total
from benchmarks.multihost_model import pipelined_ms
from dist_attn.models.h3.serve.config import load_config
from dist_attn.plan import heads_per_rank, make_plan
from dist_attn.profiling import PHASES, PhaseTimer

THEME = "scaling"
_BUDGET_REASON = "skipped: the --budget-s wall-time budget was spent"
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL_FORMULA = (
    "plain (C = 1): T = pack + A_in + K + A_out + unpack, with A_in = 3 * S_local * (H - H_r) * D * 2 B "
    "/ bandwidth and A_out = S_local * (H - H_r) * D * 2 B / bandwidth (bytes rank 0 sends to the other "
    "ranks; 0 at N = 1). overlapped (C chunks of w_c heads out of H_r; the core packs the first chunk "
    "alone, then each run of equally wide chunks in one call, and issues each chunk's input "
    "all-to-all right after its run is packed, all on one communication channel; each output "
    "all-to-all after its chunk's kernel): P_c = the end of the pack call holding chunk c (the calls "
    "back to back), P = the end of the last; in_end[c] = max(in_end[c-1], P_c) + A_in * w_c / H_r; "
    "k_end[c] = max(k_end[c-1], in_end[c]) + K_c with k_end[-1] = P (the kernels queue behind the "
    "packs); out_end[c] = max(out_end[c-1], in_end[C-1], k_end[c]) + A_out * w_c / H_r; the "
    "unpacks queue behind the last kernel, each waiting for its chunk's output: u[c] = "
    "max(u[c-1], out_end[c]) + U_c with u[-1] = k_end[C-1]; T = u[C-1]. In steady state each stage "
    "costs max(K_c, A_in * w_c / H_r): the all-to-all is hidden behind the kernel. K_c = the kernel "
    "measured at the chunk's heads; the pack calls and U_c = the core's calls measured one by one. Block = "
    "attention layer + the non-attention part of the block measured at S_local rows (attention "
    "replaced by a no-op).")


class _NoAttention(nn.Module):
    """Stands in for the attention of a block to time everything else (returns garbage)."""

    def forward(self, q, k, v, *args, **kwargs):
        return torch.empty_like(q)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """The attention workload: rows ``[0, used)`` real, ``[used, total)`` padding; ``layout``
    the packed rows behind them (text, audio, video) for the block's inputs."""

    used: int
    total: int
    layout: Any


def _workload(cfg, smoke: bool) -> _Rows:
    """h3-ref (37,980 used of 38,016), or with --smoke the config's default request padded to 64."""
    if smoke:
        r = cfg.request
        lay = cfg.layout(frames=r.frames, height=r.height, width=r.width)
    else:
        lay = h3_ref_layout()
    return _Rows(used=lay.used, total=padded_total(lay.used), layout=lay)


def _ints(text: str) -> list[int]:
    """Comma-separated positive ints (rank counts, chunk counts)."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated ints >= 1")
    return values


def _runnable_backends(requested: str, device: torch.device, head_dim: int) -> list[tuple[str, str | None]]:
    """[(name, reason-or-None)]; the default list is every registered backend except auto."""
    probe = torch.empty(1, 1, head_dim, device=device, dtype=torch.bfloat16)
    if requested == "all":
        names = [n for n in da_backends.available_backends() if n != "auto"]
    else:
        names = [n.strip() for n in requested.split(",") if n.strip()]
    out = []
    for name in names:
        try:
            be = da_backends.resolve_backend(name, probe)
            out.append((be.name if name == "auto" else name, None))
        except Exception as exc:  # noqa: BLE001
            out.append((name, describe_exception(exc)))
    seen, uniq = set(), []
    for name, reason in out:
        if name not in seen:
            seen.add(name)
            uniq.append((name, reason))
    return uniq


def _qkv(rows: int, heads: int, d: int, dev, seed: int):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(rows, heads, d, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16)
            for _ in range(3)]


def _build_block(cfg, dev, lay: _Rows):
    """The real H3 block (own init, bf16) with dist_attn's processor; attention is swapped
    through ``block.attn.processor._rt.layer``."""
    block = build_block(cfg.model, dev, torch.bfloat16, seed=cfg.model.weight_seed)
    attach(block, _NoAttention(), lay.used)
    return block


def _runtime(block):
    return block.attn.processor._rt


def _block_inputs(cfg, lay: _Rows, s_local: int, row_offset: int, dev, seed: int):
    """``(hidden, temb, adaln_indices, rope)`` of rows ``[row_offset, row_offset + s_local)``."""
    return block_inputs(cfg.model, lay.layout, lay.total, s_local, row_offset, dev, torch.bfloat16,
                        seed=seed)


def _add_scaling(rows: list[dict[str, Any]]) -> None:
    """speedup / efficiency against N = 1 of the same mode, what and backend (C = 1 there)."""
    base = {(r["mode"], r["what"], r["backend"]): r["total_ms"] for r in rows
            if r.get("N") == 1 and r.get("total_ms") and r.get("overlap_chunks") == 1}
    for r in rows:
        t1 = base.get((r["mode"], r["what"], r["backend"]))
        if t1 and r.get("total_ms"):
            r["speedup"] = t1 / r["total_ms"]
            r["efficiency"] = t1 / (r["N"] * r["total_ms"])


# ---------------------------------------------------------------------------------------------
# measured mode
# ---------------------------------------------------------------------------------------------
def run_measured(args, cfg, lay, ctx: DistContext, backends, writer, budget) -> None:
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    H, D = cfg.model.num_heads, cfg.model.head_dim
    label = ("gloo, shared GPU — not representative of NVLink" if ctx.shared_gpu and dev.type == "cuda"
             else f"{ctx.backend}, {'GPU' if dev.type == 'cuda' else 'CPU'}")
    if writer is not None:
        writer.payload["config"]["comm_label"] = label
        writer.note(f"measured rows: {label}.")
    # N = 1 first (the baseline), then the largest N: when the budget runs out, the middle goes
    ns = [n for n in args.ranks if n <= world]
    ns = [n for n in ns if n == 1] + sorted((n for n in ns if n != 1), reverse=True)
    pool = StagingBuffers()
    block = None
    for n in ns:
        sub = dist.new_group(list(range(n))) if dist.is_initialized() else None  # every rank calls it
        active = rank < n
        s_local = lay.total // n
        bounds = [0, lay.used, lay.total] if lay.used < lay.total else [0, lay.total]
        cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
        if active and lay.total % n == 0:
            q, k, v = _qkv(s_local, H, D, dev, seed=10 + rank)
        for what in ("attention", "block"):
            if what == "block" and args.no_block:
                continue
            for be_name, be_reason in backends:
                if be_reason:
                    if writer is not None and n == ns[0] and what == "attention":
                        writer.rows.append({"mode": "measured", "what": what, "backend": be_name, "N": None,
                                            "overlap_chunks": None, "status": "unavailable",
                                            "reason": be_reason})
                    continue
                for C in (args.overlap if n > 1 else [1]):
                    row = {"mode": "measured", "what": what, "backend": be_name, "N": n,
                           "overlap_chunks": C, "S_local": s_local, "comm": label,
                           "heads_per_rank": max(heads_per_rank(H, n)) if H >= n else None}
                    stop = any(ctx.gather(budget.expired()))  # one decision on every rank
                    result = None
                    if lay.total % n:
                        row.update(status="unavailable", reason=f"{lay.total} rows do not split over {n} ranks")
                    elif H < n:
                        row.update(status="unavailable", reason=f"{H} heads < {n} ranks")
                    elif be_reason:
                        row.update(status="unavailable", reason=be_reason)
                    elif stop:
                        row.update(status="skipped", reason=_BUDGET_REASON)
                    elif active:
                        try:
                            result = _measure_one(what, be_name, C, n, sub, q, k, v, cu, bounds, lay,
                                                  cfg, dev, pool, args, s_local, rank,
                                                  block_holder=lambda: _get_block(cfg, dev, lay))
                        except Exception as exc:  # noqa: BLE001
                            result = {"status": "error", "reason": describe_exception(exc)}
                    per_rank = ctx.gather(result)
                    if writer is not None and "status" not in row:
                        got = [r for r in per_rank[:n] if r is not None]
                        errs = [r for r in got if r.get("status") == "error"]
                        if not got:
                            row.update(status="error", reason="no rank reported a result")
                        elif errs:
                            row.update(status="error", reason=errs[0]["reason"])
                        else:
                            slow = max(got, key=lambda r: r["total_ms"])
                            row.update(status="ok", total_ms=slow["total_ms"], iters=slow["iters"],
                                       timing=slow["timing"], phases_ms=slow.get("phases_ms"),
                                       total_ms_per_rank=[r["total_ms"] for r in got])
                    if writer is not None:
                        writer.rows.append(row)
                        _add_scaling(writer.rows)
                        writer.save(_sections(writer))
        if active and lay.total % n == 0:
            del q, k, v
        pool.release()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        ctx.barrier()
    del block


_BLOCKS: dict[str, Any] = {}


def _get_block(cfg, dev, lay):
    # one set of weights per process: the attention layer (backend, group, overlap) is swapped
    if "block" not in _BLOCKS:
        _BLOCKS["block"] = _build_block(cfg, dev, lay)
    return _BLOCKS["block"]


def _measure_one(what, be_name, C, n, sub, q, k, v, cu, bounds, lay, cfg, dev, pool, args, s_local, rank,
                 block_holder):
    H, D = cfg.model.num_heads, cfg.model.head_dim
    timer = PhaseTimer(dev)
    if what == "attention":
        layer = dist_attn.UlyssesSageAttention(H, D, group=sub, backend=be_name, buffers=pool,
                                               overlap_chunks=C)

        def fn():
            return layer(q, k, v, cu, lay.used, cu_seqlens_host=bounds)
    else:
        block = block_holder()
        layer = dist_attn.UlyssesSageAttention(H, D, group=sub, backend=be_name, buffers=pool,
                                               overlap_chunks=C)
        _runtime(block).layer, _runtime(block).valid_len = layer, lay.used
        x, temb, adaln, rope = _block_inputs(cfg, lay, s_local, rank * s_local, dev, seed=20 + rank)

        def fn():
            return block(x, temb, adaln, rope)
    barrier = (lambda: dist.barrier(group=sub)) if sub is not None else None
    with torch.no_grad():
        for _ in range(max(1, args.warmup)):
            fn()
        layer.timer = timer
        timer.reset()
        t = time_fn(fn, device=dev, iters=args.iters, warmup=0, method="wall", barrier=barrier)
        layer.timer = None
    phases = {name: ms / t.iters for name, ms in timer.totals_ms().items()}
    return {"status": "ok", "total_ms": t.median_ms, "iters": t.iters, "timing": t.method,
            "phases_ms": phases}


# ---------------------------------------------------------------------------------------------
# modeled mode
# ---------------------------------------------------------------------------------------------
def overlapped_ms(pack_runs: list[tuple[int, float]], unpacks: list[float], a_in: float, a_out: float,
                  k_chunks: list[float], widths: list[int]) -> float:
    """End time of the overlapped layer (see MODEL_FORMULA). ``pack_runs``: for each pack call of
    the core, in order (``UlyssesPlan.pack_runs``), how many chunks it packs and its time;
    ``unpacks``: each chunk's unpack time; ``a_in`` / ``a_out`` are split by the chunks' widths."""
    h = sum(widths)
    return pipelined_ms(pack_runs, [a_in * w / h for w in widths], k_chunks,
                        [a_out * w / h for w in widths], unpacks)


def _progress(row: dict) -> None:
    """One line per finished row, as the run goes (a modeled run on a slow device takes minutes)."""
    print(f"[scaling] row {row['mode']} {row['what']} {row['backend']} N={row['N']} "
          f"C={row['overlap_chunks']}: {row.get('status')}"
          + (f" {row['total_ms']:.2f} ms" if row.get("total_ms") is not None else ""), flush=True)


def run_modeled(args, cfg, lay, dev, backends, writer, budget) -> None:
    H, D = cfg.model.num_heads, cfg.model.head_dim
    es = 2  # bf16
    bw = args.bandwidth_gbs * 1e9
    bounds = [0, lay.used, lay.total] if lay.used < lay.total else [0, lay.total]
    cu = torch.tensor(bounds, dtype=torch.int32, device=dev)
    scale = 1.0 / (D ** 0.5)
    kernel_cache: dict[tuple[str, int], float] = {}

    def timed(fn):
        return time_fn(fn, device=dev, iters=args.iters, warmup=args.warmup, budget=budget).median_ms

    def kernel_ms(be, width: int) -> float:
        key = (be.name, width)
        if key not in kernel_cache:
            # the receive-buffer layout: [S, 3, w, D] with strided q/k/v views, as in the core
            recv = torch.randn(lay.total * 3 * width * D, device=dev).to(torch.bfloat16)
            qv, kv, vv = unpack_qkv(recv, lay.total, width, D)
            out = torch.empty(lay.total, width, D, device=dev, dtype=torch.bfloat16)
            layout = segment_layout(bounds, total=lay.total, valid_len=lay.used)
            kernel_cache[key] = timed(lambda: attend_varlen(
                be, qv[None], kv[None], vv[None], layout=layout, cu_seqlens=cu, softmax_scale=scale,
                k_is_scratch=True, out=out[None]))
            del recv, out
        return kernel_cache[key]

    # the non-attention part of the block at S_local rows, and the real N = 1 layer and block
    block = None if args.no_block else _build_block(cfg, dev, lay)
    nonattn: dict[int, float] = {}
    for be_name, be_reason in backends:
        if be_reason:  # one row says why, instead of a grid of identical ones
            writer.rows.append({"mode": "modeled", "what": "attention", "backend": be_name, "N": None,
                                "overlap_chunks": None, "status": "unavailable", "reason": be_reason})
            _progress(writer.rows[-1])
            continue
        be = da_backends.get_backend(be_name)
        for n in args.ranks:
            s_local = lay.total // n
            counts = heads_per_rank(H, n) if H >= n else None
            common = {"backend": be_name, "N": n, "S_local": s_local,
                      "heads_per_rank": max(counts) if counts else None,
                      "bandwidth_gbs": args.bandwidth_gbs}
            reason = (f"{lay.total} rows do not split over {n} ranks" if lay.total % n else
                      f"{H} heads < {n} ranks" if counts is None else be_reason)
            whats = ["attention"] + ([] if block is None else ["block"])
            for C in (args.overlap if n > 1 else [1]):  # the N = 1 path has no chunks
                for what in whats:
                    row = {"mode": "modeled", "what": what, "overlap_chunks": C, **common}
                    if reason:
                        row.update(status="unavailable", reason=reason)
                    elif budget.expired():
                        row.update(status="skipped", reason=_BUDGET_REASON)
                    else:
                        try:
                            row.update(_model_row(what, be, n, C, s_local, counts, lay, cfg, dev, es, bw,
                                                  kernel_ms, timed, block, nonattn))
                        except Exception as exc:  # noqa: BLE001
                            row.update(status="error", reason=describe_exception(exc))
                    writer.rows.append(row)
                    _progress(row)
                    _add_scaling(writer.rows)
                    writer.save(_sections(writer))
        # the real thing at N = 1 (same GPU, world-1 path: the kernel alone), a check of the model
        for what in (["attention"] + ([] if block is None else ["block"])):
            row = {"mode": "measured", "what": what, "backend": be_name, "N": 1, "overlap_chunks": 1,
                   "S_local": lay.total, "comm": "none (N = 1)"}
            if be_reason:
                row.update(status="unavailable", reason=be_reason)
            elif budget.expired():
                row.update(status="skipped", reason=_BUDGET_REASON)
            else:
                try:
                    q, k, v = _qkv(lay.total, H, D, dev, seed=3)
                    timer = PhaseTimer(dev)
                    if what == "attention":
                        layer = dist_attn.UlyssesSageAttention(H, D, backend=be_name, timer=timer)
                        fn = lambda: layer(q, k, v, cu, lay.used, cu_seqlens_host=bounds)  # noqa: E731
                    else:
                        _runtime(block).layer = dist_attn.UlyssesSageAttention(
                            H, D, backend=be_name, timer=timer)
                        x, temb, adaln, rope = _block_inputs(cfg, lay, lay.total, 0, dev, seed=4)
                        fn = lambda: block(x, temb, adaln, rope)  # noqa: E731
                    with torch.no_grad():
                        fn()
                        timer.reset()
                        t = time_fn(fn, device=dev, iters=args.iters, warmup=0, budget=budget)
                    row.update(status="ok", total_ms=t.median_ms, iters=t.iters, timing=t.method,
                               phases_ms={kk: vv / t.iters for kk, vv in timer.totals_ms().items()})
                    if block is not None:
                        _runtime(block).layer = _NoAttention()
                    del q, k, v
                except Exception as exc:  # noqa: BLE001
                    row.update(status="error", reason=describe_exception(exc))
            writer.rows.append(row)
            _progress(row)
            writer.save(_sections(writer))
        kernel_cache.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _model_row(what, be, n, C, s_local, counts, lay, cfg, dev, es, bw, kernel_ms, timed, block, nonattn):
    H, D = cfg.model.num_heads, cfg.model.head_dim
    # rank 0 holds the most heads (the first H % N ranks take one extra); the core's own plan
    # gives its chunks, their head ranges and the staging sizes
    plan = make_plan(world=n, rank=0, s_local=s_local, folded_heads=H, head_dim=D,
                     overlap_chunks=C if n > 1 else 1)
    chunks, h0 = len(plan.chunks), plan.counts[0]
    widths = [c.local_heads(0) for c in plan.chunks]
    q, k, v = _qkv(s_local, H, D, dev, seed=5)
    send = torch.empty(s_local * 3 * H * D, device=dev, dtype=torch.bfloat16)
    recv_out = torch.randn(s_local * H * D, device=dev).to(torch.bfloat16)
    out = torch.empty(s_local, H, D, device=dev, dtype=torch.bfloat16)

    def pack_run(first, stop):  # one pack call of the core
        run = plan.chunks[first:stop]
        return lambda: pack_qkv_chunks(q[None], k[None], v[None], send[run[0].in_send[0]:run[-1].in_send[1]],
                                       [c.head_ranges for c in run])

    def unpack_chunk(c):  # one unpack call of the core
        return lambda: unpack_output(recv_out[c.out_recv[0]:c.out_recv[1]], out[None], c.head_ranges)

    if n > 1:
        pack_runs = [(b - a, timed(pack_run(a, b))) for a, b in plan.pack_runs]
        unpacks = [timed(unpack_chunk(c)) for c in plan.chunks]
    else:  # the world-1 path of the core neither packs nor unpacks
        pack_runs, unpacks = [(chunks, 0.0)], [0.0]
    pack, unpack = sum(ms for _, ms in pack_runs), sum(unpacks)
    del q, k, v, send, recv_out, out
    a_in = 3 * s_local * (H - h0) * D * es / bw * 1e3
    a_out = s_local * (H - h0) * D * es / bw * 1e3
    k_chunks = [kernel_ms(be, w) for w in widths]
    if chunks == 1:
        total = pack + a_in + k_chunks[0] + a_out + unpack
    else:
        total = overlapped_ms(pack_runs, unpacks, a_in, a_out, k_chunks, widths)
    phases = {"pack": pack, "a2a_in": a_in, "kernel": sum(k_chunks), "a2a_out": a_out, "unpack": unpack}
    row = {"status": "ok", "effective_chunks": chunks, "phases_ms": phases,
           "hidden_ms": sum(phases.values()) - total, "kernel_chunk_ms": k_chunks,
           "pack_runs": [[n_run, ms] for n_run, ms in pack_runs], "unpack_chunk_ms": unpacks,
           "formula": "plain" if chunks == 1 else "pipelined"}
    if what == "attention":
        row["total_ms"] = total
        return row
    if n not in nonattn:
        _runtime(block).layer = _NoAttention()
        x, temb, adaln, rope = _block_inputs(cfg, lay, s_local, 0, dev, seed=6)
        with torch.no_grad():
            nonattn[n] = timed(lambda: block(x, temb, adaln, rope))
        del x, temb, adaln, rope
    row.update(total_ms=total + nonattn[n], nonattn_ms=nonattn[n])
    return row


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------
def _flat(rows):
    out = []
    for r in rows:
        f = dict(r)
        for p in PHASES:
            f[f"ph_{p}"] = (r.get("phases_ms") or {}).get(p)
        out.append(f)
    return out


_COLS = [("what", "what", ""), ("backend", "backend", ""), ("N", "N", "d"), ("overlap_chunks", "C", "d"),
         ("S_local", "S_local", "d"), ("heads_per_rank", "H/rank", ""), ("status", "status", ""),
         ("total_ms", "total ms", ".2f"), ("ph_pack", "pack", ".3f"), ("ph_a2a_in", "a2a_in", ".3f"),
         ("ph_kernel", "kernel", ".2f"), ("ph_a2a_out", "a2a_out", ".3f"), ("ph_unpack", "unpack", ".3f"),
         ("nonattn_ms", "non-attn ms", ".2f"), ("speedup", "speedup", ".2f"),
         ("efficiency", "efficiency", ".3f"), ("reason", "reason", "")]


def _sections(writer: ResultWriter) -> list[tuple[str, str]]:
    rows = _flat(writer.rows)
    modeled = [r for r in rows if r["mode"] == "modeled"]
    measured = [r for r in rows if r["mode"] == "measured"]
    cfg = writer.payload["config"]
    out = []
    expl = ("Times are per forward, per rank (ms). Phase columns: measured rows, per-forward sums of "
            "the PhaseTimer phases (CUDA events on GPU; with gloo the a2a phases include host staging); "
            "modeled rows, the model's components. With C > 1 the phases overlap, so they add up to "
            "more than the total. "
            "speedup = T(N=1) / T(N), efficiency = T(N=1) / (N * T(N)) against N = 1 of the same "
            "backend, C = 1, same mode.")
    if modeled:
        out.append(("MODELED (one GPU; all-to-all = bytes / bandwidth)",
                    f"mode = \"modeled\": compute measured on {writer.gpu} at the per-rank shapes; all-to-all "
                    f"time computed at {cfg.get('bandwidth_gbs')} GB/s. {expl}\n\nModel: {MODEL_FORMULA}\n\n"
                    + markdown_table(modeled, _COLS)))
    if measured:
        head = ("Measured at N = 1 on the same GPU (no all-to-all), a check of the model's N = 1 rows"
                if modeled else f"MEASURED ({cfg.get('comm_label', '')})")
        out.append((head, "mode = \"measured\": wall clock with a device sync, ranks aligned by a barrier "
                    f"before each forward, slowest rank. {expl}\n\n" + markdown_table(measured, _COLS)))
    return out


def _plot(writer: ResultWriter, main_mode: str, overlaps: list[int]):
    def draw(plt):
        rows = [r for r in writer.rows if r["mode"] == main_mode and r.get("efficiency")]
        fig, axes = plt.subplots(1, len(overlaps), figsize=(5 * len(overlaps), 4.3), sharey=True, squeeze=False)
        style = {"measured": dict(marker="o", ls="-"), "modeled": dict(marker="x", ls="--")}[main_mode]
        for ax, C in zip(axes[0], overlaps):
            for what in ("attention", "block"):
                for be in sorted({r["backend"] for r in rows}):
                    pts = sorted((r["N"], r["efficiency"]) for r in rows if r["what"] == what
                                 and r["backend"] == be and (r["overlap_chunks"] == C or r["N"] == 1))
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=f"{be} {what}",
                                alpha=0.9 if what == "attention" else 0.6, **style)
            ax.set_xscale("log", base=2)
            ticks = sorted({r["N"] for r in rows}) or [1]
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
            ax.set_xlabel("ranks N")
            ax.set_title(("plain (C=1)" if C == 1 else f"overlapped (C={C})") + f" — {main_mode}")
            ax.axhline(1.0, color="grey", lw=0.5)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("efficiency T1 / (N TN)")
        axes[0][-1].legend(fontsize=7)
        cfg = writer.payload["config"]
        sub = (f"modeled: a2a at {cfg.get('bandwidth_gbs')} GB/s, compute on {writer.gpu}"
               if main_mode == "modeled" else f"measured: {cfg.get('comm_label', '')}")
        fig.suptitle(f"Ulysses scaling, {cfg['model']} ({sub})", fontsize=10)
        fig.tight_layout()
    return draw


# ---------------------------------------------------------------------------------------------
# multi-host model (arithmetic only)
# ---------------------------------------------------------------------------------------------
_MH_COLS = [("name", "layout", ""), ("gpus", "GPUs", "d"), ("overlap", "overlap", ""),
            ("effective_chunks", "C", "d"), ("heads", "H/rank", "d"), ("s_local", "S_local", "d"),
            ("total_ms", "attention ms", ".3f"), ("pack", "pack", ".3f"), ("a2a_in", "a2a_in", ".3f"),
            ("kernel", "kernel", ".3f"), ("ring_xfer", "ring K/V", ".3f"), ("merge", "merge", ".3f"),
            ("a2a_out", "a2a_out", ".3f"), ("unpack", "unpack", ".3f"), ("hidden_ms", "hidden", ".3f"),
            ("block_ms", "block ms", ".2f"), ("speedup", "speedup", ".2f"),
            ("efficiency", "efficiency", ".3f")]


def run_multihost(args):
    """One host's Ulysses, pure Ulysses over all hosts and Ulysses x Ring, modeled per rank."""
    from benchmarks.multihost_model import LayoutSpec, Params, model_layer

    cfg = load_config(args.config or os.path.join(_REPO, "configs", "h3.toml"))
    lay = _workload(cfg, smoke=False)
    H, D = cfg.model.num_heads, cfg.model.head_dim
    params = Params(nvlink_gbs=args.bandwidth_gbs, internode_gbs=args.internode_gbs,
                    kernel_tflops=args.kernel_tflops, copy_gbs=args.copy_gbs, merge_gbs=args.merge_gbs,
                    nonattn_full_ms=args.nonattn_full_ms)
    g, n_hosts = args.gpus_per_host, args.hosts
    specs = [LayoutSpec("1 GPU", 1, 1, g), LayoutSpec(f"1 host: U{g}", g, 1, g),
             LayoutSpec(f"{n_hosts} hosts: U{g * n_hosts}", g * n_hosts, 1, g),
             LayoutSpec(f"{n_hosts} hosts: U{g} x R{n_hosts}", g, n_hosts, g)]
    if args.hardware is None:
        args.hardware = f"{n_hosts}x{g}h200-planning"
    if args.theme is None:
        args.theme = f"{THEME}-multihost-modeled"
    config = {"mode": "modeled-multihost", "model": cfg.model.name, "used": lay.used, "total": lay.total,
              "num_heads": H, "head_dim": D, "dtype": "bfloat16", "hosts": n_hosts, "gpus_per_host": g,
              "overlap": args.overlap, "params": dataclasses.asdict(params),
              "layouts": [dataclasses.asdict(sp) for sp in specs]}
    writer = ResultWriter(theme=THEME, args=args, config=config, device=torch.device("cpu"),
                          title=f"H3 attention on {n_hosts} x {g} GPUs at h3-ref (MODELED, planning figures)")
    writer.note("MODELED, not measured: every time is bytes / bandwidth or FLOPs / kernel rate. "
                f"NVLink {params.nvlink_gbs:g} GB/s and inter-node {params.internode_gbs:g} GB/s per GPU are "
                "PLANNING figures; the kernel rate (sage8, 7 heads), pack/unpack and copy rates and the "
                "non-attention block time were measured on one H200 and are assumed to hold at every "
                "shape here. No multi-GPU machine ran this.")
    base = None
    for spec in specs:
        settings = [(C, True) for C in (args.overlap if spec.ulysses > 1 else [1])]
        if spec.ring > 1:
            settings.insert(0, (1, False))
        for C, ring_overlap in settings:
            row = model_layer(spec, seq=lay.total, used=lay.used, heads=H, head_dim=D, chunks=C,
                              ring_overlap=ring_overlap, params=params)
            row["overlap"] = ("none" if C == 1 and not (spec.ring > 1 and ring_overlap) else
                              ("ring K/V" if spec.ring > 1 else "") +
                              (" + " if spec.ring > 1 and row["effective_chunks"] > 1 else "") +
                              (f"a2a chunks C={row['effective_chunks']}" if row["effective_chunks"] > 1 else ""))
            if spec.world == 1:
                base = row
            row["speedup"] = base["block_ms"] / row["block_ms"]
            row["efficiency"] = row["speedup"] / spec.world
            writer.rows.append(row)
    expl = ("Per rank, slowest rank, one attention layer at h3-ref (ms). 'hidden' = serial sum of the "
            "phases minus the overlapped total. block ms = attention + the rank's share of the "
            "non-attention block; speedup and efficiency are of the block against 1 GPU. "
            "overlap 'none' = every phase serial; 'ring K/V' = the next K/V transfer runs under the "
            "current ring step's kernel (what dist_attn.ring does); 'a2a chunks C' = overlap_chunks=C "
            f"(each chunk runs its own ring).\n\nModel: {_multihost_formula()}")
    section = [("MODELED multi-host (planning figures; not a measurement)",
                expl + "\n\n" + markdown_table(writer.rows, _MH_COLS))]
    paths = writer.finish(_plot_multihost(writer), section)
    for row in writer.rows:
        print(f"  {row['name']:<20} {row['overlap']:<28} attention {row['total_ms']:7.3f} ms  block "
              f"{row['block_ms']:7.2f} ms  eff {row['efficiency']:.3f}", flush=True)
    print(f"[scaling] wrote {paths['json']} (+ .md, .png)", flush=True)
    return paths


def _multihost_formula() -> str:
    from benchmarks import multihost_model

    return " ".join(multihost_model.__doc__.split("\n\n", 2)[2].split())


def _plot_multihost(writer: ResultWriter):
    def draw(plt):
        rows = [r for r in writer.rows if r["gpus"] > 1]
        labels = [f"{r['name']}\n{r['overlap']}" for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(13, 5))
        phases = ["pack", "a2a_in", "kernel", "ring_xfer", "merge", "a2a_out", "unpack"]
        bottom = [0.0] * len(rows)
        for ph in phases:
            vals = [r[ph] for r in rows]
            axes[0].bar(range(len(rows)), vals, bottom=bottom, label=ph)
            bottom = [b + v for b, v in zip(bottom, vals)]
        axes[0].plot(range(len(rows)), [r["total_ms"] for r in rows], "k_", markersize=22, mew=2,
                     label="total (overlap applied)")
        axes[0].set_ylabel("ms per attention layer, slowest rank")
        axes[0].set_title("phases (stacked, serial) vs total")
        axes[1].bar(range(len(rows)), [r["efficiency"] for r in rows], color="tab:green")
        axes[1].set_ylabel("block efficiency vs 1 GPU")
        axes[1].set_ylim(0, 1.05)
        for ax in axes:
            ax.set_xticks(range(len(rows)))
            ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
            ax.grid(axis="y", alpha=0.3)
        axes[0].legend(fontsize=7)
        p = writer.payload["config"]["params"]
        fig.suptitle(f"H3 at h3-ref, MODELED: NVLink {p['nvlink_gbs']:g} GB/s, inter-node "
                     f"{p['internode_gbs']:g} GB/s per GPU (planning figures), kernel "
                     f"{p['kernel_tflops']:g} TFLOP/s", fontsize=9)
        fig.tight_layout()
    return draw


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, help="model config TOML (default configs/h3.toml; "
                                                  "configs/tiny.toml with --smoke)")
    p.add_argument("--modeled", action="store_true", help="one GPU: compute measured, all-to-all modeled")
    p.add_argument("--bandwidth-gbs", type=float, default=360.0,
                   help="per-rank all-to-all bandwidth of the model, GB/s (NVLink planning figure 360)")
    p.add_argument("--ranks", type=_ints, default=None, help="N values (default 1,2,4,8; measured: <= world)")
    p.add_argument("--overlap", type=_ints, default=[1, 2, 4], help="overlap_chunks values")
    p.add_argument("--backends", default="all",
                   help="comma-separated attention backends, 'auto', or 'all' (every registered one)")
    p.add_argument("--comm-backend", choices=("auto", "gloo", "nccl"), default="auto")
    p.add_argument("--seq", type=int, default=None, help="override total packed rows")
    p.add_argument("--used", type=int, default=None, help="override used rows")
    p.add_argument("--no-block", action="store_true", help="attention layer only (no H3 block)")
    mh = p.add_argument_group("--modeled --multi-host: several hosts, computed (no device runs)")
    mh.add_argument("--multi-host", action="store_true",
                    help="with --modeled: one host's U vs pure Ulysses over all hosts (uneven heads) "
                         "vs Ulysses x Ring, all arithmetic from the rates below")
    mh.add_argument("--hosts", type=int, default=2)
    mh.add_argument("--gpus-per-host", type=int, default=8)
    mh.add_argument("--internode-gbs", type=float, default=50.0,
                    help="per-GPU bandwidth between hosts, GB/s (planning figure); NVLink is "
                         "--bandwidth-gbs")
    mh.add_argument("--kernel-tflops", type=float, default=767.0,
                    help="attention kernel rate (default: sage8 at 7 heads, one H200, measured)")
    mh.add_argument("--copy-gbs", type=float, default=750.0,
                    help="pack/unpack payload rate (measured on one H200: 204 MB in 0.273 ms)")
    mh.add_argument("--merge-gbs", type=float, default=4200.0,
                    help="read+write rate of the ring's fp32 merge (an H200 copy, measured)")
    mh.add_argument("--nonattn-full-ms", type=float, default=52.08,
                    help="non-attention part of one block at all rows on one GPU (H200, measured)")
    add_common_args(p, iters=10, warmup=2, budget_s=0)
    args = p.parse_args(argv)
    if args.multi_host:
        if not args.modeled:
            p.error("--multi-host is a model: pass --modeled too")
        return run_multihost(args)
    smoke = args.smoke
    if args.config is None:
        args.config = os.path.join(_REPO, "configs", "tiny.toml" if smoke else "h3.toml")
    if args.ranks is None:
        args.ranks = [1, 2, 4, 8]
    if smoke and args.iters == 10:
        args.iters, args.warmup = 2, 1
    if 1 not in args.ranks:
        args.ranks = [1] + args.ranks  # the baseline of speedup and efficiency
    args.ranks = sorted(set(args.ranks))
    args.overlap = sorted(set(args.overlap)) or [1]
    if 1 not in args.overlap:
        args.overlap = [1] + args.overlap

    cfg = load_config(args.config)
    lay = _workload(cfg, smoke)
    if args.seq or args.used:
        if not args.no_block:
            p.error("--seq / --used change the attention's rows only: pass --no-block too (the "
                    "block's inputs are the packed rows of a real layout)")
        total = args.seq or lay.total
        lay = _Rows(used=min(args.used or lay.used, total), total=total, layout=None)

    device_flag = "cpu" if smoke and args.device == "auto" else args.device
    if args.modeled:
        # one process, no process group (a world-1 layer must never see a larger default group)
        ctx = None
        if int(os.environ.get("RANK", "0")) != 0:
            print(f"[scaling] --modeled runs on one process; rank {os.environ['RANK']} exits", flush=True)
            return None
        dev = torch.device("cuda", 0) if device_flag in ("auto", "cuda") and torch.cuda.is_available() \
            else torch.device("cpu")
        if dev.type != "cuda" and not smoke and args.device != "cpu":
            p.error("--modeled times each rank's work on one GPU, and CUDA is not available here; "
                    "pass --smoke for a CPU check of the script (seconds), or --device cpu to time "
                    "h3-ref on the CPU anyway (many minutes, with a line per row)")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
    else:
        ctx = init_distributed(args.comm_backend, device_flag)
        dev = ctx.device
    rank = ctx.rank if ctx else 0
    backends = _runnable_backends(args.backends, dev, cfg.model.head_dim)
    budget = Budget(args.budget_s)
    mode = "modeled" if args.modeled else "measured"
    config = {"mode": mode, "model": cfg.model.name, "config_file": os.path.relpath(args.config, _REPO),
              "model_config": cfg.to_dict()["model"], "used": lay.used, "total": lay.total,
              "cu_seqlens": [0, lay.used, lay.total], "ranks": args.ranks, "overlap": args.overlap,
              "backends": [b for b, _ in backends], "dtype": "torch.bfloat16", "iters": args.iters,
              "warmup": args.warmup, "device": str(dev), "budget_s": args.budget_s, "smoke": smoke,
              "world": ctx.world if ctx else 1}
    if args.modeled:
        config.update(bandwidth_gbs=args.bandwidth_gbs, formula=MODEL_FORMULA)
    else:
        config.update(comm_backend=ctx.backend, shared_gpu=ctx.shared_gpu)
    writer = None
    if rank == 0:
        if args.theme is None:
            args.theme = (f"{THEME}-modeled" if args.modeled else f"{THEME}-{ctx.backend}{ctx.world}")
        writer = ResultWriter(theme=THEME, args=args, config=config, device=dev,
                              title=f"Ulysses scaling at {'h3-ref' if not smoke else 'smoke size'} ({mode})")
        if ctx is not None and ctx.note:
            writer.note(ctx.note)
        if args.modeled:
            writer.note("MODELED: compute is measured on one GPU, the all-to-alls are computed from bytes "
                        f"and {args.bandwidth_gbs} GB/s; not a multi-GPU measurement. " + MODEL_FORMULA)
        print(f"[scaling] {mode}, device {dev}, backends {backends}, N {args.ranks}, C {args.overlap}",
              flush=True)
    if args.modeled:
        run_modeled(args, cfg, lay, dev, backends, writer, budget)
    else:
        run_measured(args, cfg, lay, ctx, backends, writer, budget)
    paths = None
    if writer is not None:
        writer.payload["elapsed_s"] = budget.elapsed()
        paths = writer.finish(_plot(writer, mode, args.overlap), _sections(writer))
        for row in writer.rows:
            print(f"  {row['mode']:<8} {row['what']:<9} {row['backend']:<6} N={row['N']} C={row['overlap_chunks']} "
                  f"{row.get('status'):<11} {(row.get('total_ms') or 0):9.2f} ms  "
                  f"eff {(row.get('efficiency') or 0):.3f}  {row.get('reason', '')[:80]}", flush=True)
        print(f"[scaling] wrote {paths['json']} (+ .md, .png) in {budget.elapsed():.1f}s", flush=True)
    if ctx is not None and not args.modeled and dist.is_initialized():
        ctx.barrier()
        dist.destroy_process_group()
    return paths


if __name__ == "__main__":
    main()
