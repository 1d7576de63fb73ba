# SPDX-License-Identifier: Apache-2.0
"""The Ulysses all-to-alls at h3-ref sizes: one packed Q/K/V all-to-all vs three separate ones.

Per rank (N ranks): q, k, v of ``[S_local = S / N, H, D]`` bf16 (h3-ref: S = 38,016, H = 56,
D = 128). Measured:

* local data movement (bandwidth = bytes read + written / time), each beside a plain device copy
  of the same bytes timed in the same run:
  - ``pack_qkv``: dist_attn.comm.pack_qkv into the destination-major staging buffer (the input
    side of the packed path; target on H200 >= 3 TB/s, plain copy 4.2 TB/s, permute-copy 1.7);
  - ``pack_separate``: the DeepSpeed/yunchang input side, one permute-copy per tensor;
  - ``unpack_output``: dist_attn.comm.unpack_output of the output receive buffer;
* the collectives (achieved bandwidth = bytes each rank sends to OTHER ranks / time):
  - ``raw_a2a_in``: one all_to_all_single of a flat buffer of 3 * S_local * H * D elements (no
    packing): the floor for the input side;
  - ``packed_in``: pack_qkv + ONE all_to_all_single (what UlyssesSageAttention does; the receive
    buffer is read through strided views, no unpack copy);
  - ``separate_in_a2a``: three all_to_all_single calls of already-packed q, k, v;
  - ``separate_in``: the yunchang ``all_to_all_4D`` way (batch 1), three times: permute-copy,
    all-to-all (its receive side is then already ``[S, H/N, D]``);
  - ``raw_a2a_out`` and ``packed_out`` (all-to-all of the attention output + unpack_output).

Run under torchrun (gloo or NCCL: ``--backend auto`` picks NCCL when each rank has its own GPU)::

    torchrun --standalone --nproc-per-node 4 -m benchmarks.alltoall
    python -m benchmarks.alltoall --smoke                     # one CPU rank
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.harness import (
    H3_REF,
    Budget,
    ResultWriter,
    add_common_args,
    describe_exception,
    init_distributed,
    markdown_table,
    time_fn,
)

import torch
import torch.distributed as dist

from dist_attn.comm import all_to_all_flat, pack_qkv, unpack_output, unpack_qkv
from dist_attn.plan import head_offsets, heads_per_rank

THEME = "alltoall"
_BUDGET_REASON = "skipped: the --budget-s wall-time budget was spent"
# Measured on an H200: plain copy 4.2 TB/s, permute-copy 1.7 TB/s; the pack must reach 3.
PACK_TARGET_TBS = 3.0


def _comm_label(ctx) -> str:
    if ctx.backend == "nccl":
        return f"nccl, {ctx.world} GPUs"
    if ctx.device.type == "cuda" and ctx.shared_gpu:
        return "gloo, shared GPU — not representative of NVLink"
    if ctx.device.type == "cuda":
        return "gloo over CUDA tensors (host-staged) — not representative of NVLink"
    return "gloo on CPU tensors — not representative of NVLink"


def _yunchang_in(t: torch.Tensor, world: int, group) -> torch.Tensor:
    """yunchang all_to_all_4D (scatter heads, gather rows) on one ``[S_local, H, D]`` tensor."""
    s_local, h, d = t.shape
    # [S_local, H, D] -> [S_local, W, H/W, D] -> [W, S_local, H/W, D] (permute-copy)
    send = t.reshape(s_local, world, h // world, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # [W(source), S_local, H/W, D] = [S, H/W, D]
    dist.all_to_all_single(recv, send, group=group)
    # yunchang transposes the receive side back to [bs, seq, hc/P, hs]; with bs = 1 the
    # source-major order already is row order, so (as there) this is a view, not a copy.
    return recv.reshape(world * s_local, h // world, d)  # [W, S_local, H/W, D] -> [S, H/W, D]


def main(argv: list[str] | None = None) -> dict[str, str] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="process-group backend (auto: NCCL when every local rank has a GPU, else gloo)")
    p.add_argument("--seq", type=int, default=None, help="global packed rows S (default 38016)")
    p.add_argument("--heads", type=int, default=None, help="H (default 56)")
    p.add_argument("--head-dim", type=int, default=None, help="D (default 128)")
    p.add_argument("--comm-iters", type=int, default=None,
                   help="timed iterations of the collectives (default --iters)")
    add_common_args(p, iters=20, warmup=3, budget_s=0)
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = ({"seq": 256, "heads": 8, "head_dim": 64} if smoke else
                {"seq": H3_REF["total"], "heads": H3_REF["heads"], "head_dim": H3_REF["head_dim"]})
    for key, val in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    if smoke and args.iters == 20:
        args.iters, args.warmup = 3, 1
    comm_iters = args.comm_iters or args.iters

    ctx = init_distributed(args.backend, "cpu" if smoke and args.device == "auto" else args.device,
                           single_process_group=True)
    world, rank, dev = ctx.world, ctx.rank, ctx.device
    group = dist.group.WORLD
    if args.seq % world:
        raise SystemExit(f"--seq={args.seq} is not divisible by the {world} ranks")
    if args.heads < world:
        raise SystemExit(f"--heads={args.heads} < {world} ranks: every rank needs a head")
    s_local, H, D = args.seq // world, args.heads, args.head_dim
    dtype = torch.bfloat16
    es = torch.empty((), dtype=dtype).element_size()
    counts = heads_per_rank(H, world)
    offs = head_offsets(counts)
    ranges = [(offs[j], offs[j + 1]) for j in range(world)]
    h_r = counts[rank]
    even = H % world == 0
    budget = Budget(args.budget_s)
    label = _comm_label(ctx)

    config = {"workload": "h3-ref" if not smoke else "smoke (tiny)", "world": world, "seq": args.seq,
              "s_local": s_local, "heads": H, "heads_per_rank": list(counts), "head_dim": D,
              "dtype": str(dtype), "iters": args.iters, "comm_iters": comm_iters, "warmup": args.warmup,
              "comm_backend": ctx.backend, "device": str(dev), "shared_gpu": ctx.shared_gpu,
              "comm_label": label, "budget_s": args.budget_s, "smoke": smoke,
              "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                     "OMP_NUM_THREADS") if os.environ.get(k) is not None}}
    writer = None
    if rank == 0:
        theme = f"{THEME}-{ctx.backend}{world}" if args.theme is None else args.theme
        args.theme = theme
        writer = ResultWriter(theme=theme, args=args, config=config, device=dev,
                              title=f"Ulysses all-to-alls at h3-ref sizes, {world} ranks ({label})")
        if ctx.note:
            writer.note(ctx.note)
        writer.note(f"all-to-all numbers: {label}.")
        print(f"[alltoall] {world} ranks, {label}, device {dev}, S_local={s_local} H={H} D={D}", flush=True)

    g = torch.Generator(device=dev).manual_seed(100 + rank)
    q, k, v = (torch.randn(s_local, H, D, generator=g, device=dev, dtype=torch.float32).to(dtype)
               for _ in range(3))
    n_in = s_local * 3 * H * D  # elements this rank sends in the input all-to-all
    send_in = torch.empty(n_in, dtype=dtype, device=dev)
    recv_in = torch.empty(args.seq * 3 * h_r * D, dtype=dtype, device=dev)
    in_send_splits = [s_local * 3 * c * D for c in counts]
    in_recv_splits = [s_local * 3 * h_r * D] * world
    out_send = torch.randn(args.seq * h_r * D, generator=g, device=dev, dtype=torch.float32).to(dtype)
    out_recv = torch.empty(s_local * H * D, dtype=dtype, device=dev)
    out_send_splits = [s_local * h_r * D] * world
    out_recv_splits = [s_local * c * D for c in counts]
    out = torch.empty(s_local, H, D, dtype=dtype, device=dev)
    copy_src = torch.randn(n_in, generator=g, device=dev, dtype=torch.float32).to(dtype)
    copy_dst = torch.empty_like(copy_src)
    n_out = s_local * H * D

    rows: list[dict] = []

    # ---- local data movement: one rank at a time when ranks share a GPU (no contention) ----
    local_ops = [
        ("copy_in", "plain device copy, same bytes as pack_qkv", 2 * n_in * es,
         lambda: copy_dst.copy_(copy_src)),
        ("pack_qkv", "dist_attn.comm.pack_qkv (destination-major staging)", 2 * n_in * es,
         lambda: pack_qkv(q[None], k[None], v[None], send_in, ranges)),
        ("pack_separate", "3 permute-copies (DeepSpeed/yunchang input side)", 2 * n_in * es,
         (lambda: [t.reshape(s_local, world, H // world, D).transpose(0, 1).contiguous() for t in (q, k, v)])
         if even else None),
        ("copy_out", "plain device copy, same bytes as unpack_output", 2 * n_out * es,
         lambda: copy_dst[:n_out].copy_(copy_src[:n_out])),
        ("unpack_output", "dist_attn.comm.unpack_output into [S_local, H, D]", 2 * n_out * es,
         lambda: unpack_output(out_recv, out[None], ranges)),
    ]
    measure_here = rank == 0 or not ctx.shared_gpu
    local_rows = []
    if measure_here:
        for name, what, nbytes, fn in local_ops:
            row = {"section": "local", "op": name, "what": what, "bytes_rw": nbytes}
            if fn is None:
                row.update(status="unavailable", reason=f"H={H} not divisible by {world} ranks")
            elif budget.expired():
                row.update(status="skipped", reason=_BUDGET_REASON)
            else:
                try:
                    t = time_fn(fn, device=dev, iters=args.iters, warmup=args.warmup, budget=budget)
                    row.update(status="ok", **t.as_dict(), tb_per_s=nbytes / (t.median_ms * 1e-3) / 1e12)
                except Exception as exc:  # noqa: BLE001
                    row.update(status="error", reason=describe_exception(exc))
            local_rows.append(row)
    all_local = ctx.gather(local_rows)
    if rank == 0:
        # slowest rank per op (identical shapes on every rank)
        for i, row in enumerate(all_local[0]):
            peers = [lr[i] for lr in all_local if lr and i < len(lr) and lr[i].get("median_ms")]
            if peers:
                worst = max(peers, key=lambda r: r["median_ms"])
                row.update(median_ms=worst["median_ms"], tb_per_s=worst["tb_per_s"],
                           ranks_measured=len(peers))
            rows.append(row)
        base = {r["op"]: r for r in rows}
        for r in rows:
            ref = base.get("copy_in" if r["op"].startswith("pack") else "copy_out")
            if r.get("tb_per_s") and ref and ref.get("tb_per_s"):
                r["vs_copy"] = r["tb_per_s"] / ref["tb_per_s"]
            if r["op"] == "pack_qkv" and r.get("tb_per_s") and dev.type == "cuda":
                r["target_tbs"] = PACK_TARGET_TBS
                r["meets_target"] = r["tb_per_s"] >= PACK_TARGET_TBS
        writer.payload["rows"] = rows
        writer.save(_sections(writer))

    # ---- collectives: every rank takes part in every measurement, or none does ----
    def a2a_in_raw():
        all_to_all_flat(recv_in, send_in, recv_splits=in_recv_splits, send_splits=in_send_splits, group=group)

    def packed_in():
        pack_qkv(q[None], k[None], v[None], send_in, ranges)
        all_to_all_flat(recv_in, send_in, recv_splits=in_recv_splits, send_splits=in_send_splits, group=group)
        return unpack_qkv(recv_in, args.seq, h_r, D)

    sep_send = [torch.empty(n_out, dtype=dtype, device=dev) for _ in range(3)]
    sep_recv = [torch.empty(args.seq * h_r * D, dtype=dtype, device=dev) for _ in range(3)]

    def separate_a2a():
        for s, r in zip(sep_send, sep_recv):
            dist.all_to_all_single(r, s, group=group)

    def separate_in():
        return [_yunchang_in(t, world, group) for t in (q, k, v)]

    def a2a_out_raw():
        all_to_all_flat(out_recv, out_send, recv_splits=out_recv_splits, send_splits=out_send_splits,
                        group=group)

    def packed_out():
        a2a_out_raw()
        unpack_output(out_recv, out[None], ranges)

    frac = (world - 1) / world  # share of the send buffer that leaves the rank
    comm_ops = [
        ("raw_a2a_in", "1 all_to_all_single, flat buffer, q+k+v bytes", n_in * es, a2a_in_raw),
        ("packed_in", "pack_qkv + 1 all_to_all_single (dist_attn)", n_in * es, packed_in),
        ("separate_in_a2a", "3 all_to_all_single, q/k/v already packed", n_in * es,
         separate_a2a if even else None),
        ("separate_in", "3 x (permute-copy + all_to_all_single) (yunchang all_to_all_4D)", n_in * es,
         separate_in if even else None),
        ("raw_a2a_out", "1 all_to_all_single, flat buffer, output bytes", n_out * es, a2a_out_raw),
        ("packed_out", "1 all_to_all_single + unpack_output (dist_attn)", n_out * es, packed_out),
    ]
    comm_rows = []
    for name, what, send_bytes, fn in comm_ops:
        row = {"section": "a2a", "op": name, "what": what, "send_bytes": send_bytes,
               "bytes_to_others": int(send_bytes * frac), "comm": label}
        stop = any(ctx.gather(budget.expired()))  # one decision for all ranks, or they deadlock
        if fn is None:
            row.update(status="unavailable", reason=f"H={H} not divisible by {world} ranks")
        elif stop:
            row.update(status="skipped", reason=_BUDGET_REASON)
        else:
            try:
                # no budget inside: every rank must run the same number of collectives
                t = time_fn(fn, device=dev, iters=comm_iters, warmup=args.warmup, method="wall",
                            barrier=ctx.barrier)
                row.update(status="ok", **t.as_dict())
            except Exception as exc:  # noqa: BLE001
                row.update(status="error", reason=describe_exception(exc))
        comm_rows.append(row)

    # packed and separate paths must deliver identical q, k, v (placement check, not timing)
    parity = None
    if even:
        try:
            got = [t.clone() for t in packed_in()]
            ref = separate_in()
            parity = all(torch.equal(a, b) for a, b in zip(got, ref))
        except Exception as exc:  # noqa: BLE001
            parity = describe_exception(exc)
    gathered = ctx.gather((comm_rows, parity))
    if rank == 0:
        for i, row in enumerate(comm_rows):
            times = [g_[0][i].get("median_ms") for g_ in gathered]
            if all(t is not None for t in times):
                row["median_ms"] = max(times)  # the slowest rank finishes the collective
                row["median_ms_per_rank"] = times
                if row["bytes_to_others"]:
                    row["gb_per_s"] = row["bytes_to_others"] / (row["median_ms"] * 1e-3) / 1e9
            rows.append(row)
        by = {r["op"]: r for r in rows if r.get("section") == "a2a"}
        for r in by.values():
            raw = by.get("raw_a2a_in" if r["op"].endswith(("_in", "_in_a2a")) else "raw_a2a_out")
            if r.get("median_ms") and raw and raw.get("median_ms"):
                r["vs_raw"] = raw["median_ms"] / r["median_ms"]
        writer.payload["parity_packed_vs_separate"] = {str(i): par for i, (_, par) in enumerate(gathered)}
        if world == 1:
            writer.note("1 rank: the all-to-alls move nothing between ranks (bytes_to_others = 0); "
                        "only the local copies mean something.")
        writer.payload["elapsed_s"] = budget.elapsed()
        paths = writer.finish(_plot(writer), _sections(writer))
        for r in rows:
            rate = (f"{r['tb_per_s']:.3f} TB/s" if r.get("tb_per_s") else
                    f"{r['gb_per_s']:.2f} GB/s" if r.get("gb_per_s") else "")
            print(f"  {r['section']:<5} {r['op']:<16} {r.get('status'):<11} "
                  f"{(r.get('median_ms') or 0):9.3f} ms  {rate}  {r.get('reason', '')[:80]}", flush=True)
        print(f"[alltoall] parity packed vs separate: {writer.payload['parity_packed_vs_separate']}")
        print(f"[alltoall] wrote {paths['json']} (+ .md, .png) in {budget.elapsed():.1f}s", flush=True)
    ctx.barrier()
    if dist.is_initialized():
        dist.destroy_process_group()
    return paths if rank == 0 else None


def _sections(writer: ResultWriter) -> list[tuple[str, str]]:
    rows = writer.rows
    local = [r for r in rows if r.get("section") == "local"]
    comm = [r for r in rows if r.get("section") == "a2a"]
    label = writer.payload["config"]["comm_label"]
    return [
        ("Pack / unpack bandwidth", "TB/s = (bytes read + bytes written) / median time, slowest rank "
         "(when ranks share a GPU only rank 0 measures, alone). `vs copy` = TB/s / the plain copy of the "
         f"same bytes in this run. Target for pack_qkv on H200: >= {PACK_TARGET_TBS} TB/s (measured before: "
         "permute-copy 1.7 TB/s, plain copy 4.2 TB/s).\n\n" + markdown_table(local, [
             ("op", "op", ""), ("what", "what", ""), ("bytes_rw", "bytes r+w", "d"), ("status", "status", ""),
             ("median_ms", "median ms", ".4f"), ("tb_per_s", "TB/s", ".3f"), ("vs_copy", "vs copy", ".2f"),
             ("meets_target", ">= 3 TB/s", ""), ("reason", "reason", "")])),
        (f"All-to-all ({label})", "GB/s = bytes each rank sends to OTHER ranks / median time of the "
         "slowest rank (wall clock with a device sync, ranks aligned by a barrier before each call). "
         "`vs raw` = raw all_to_all_single time of the same bytes / this time (1.0 = no cost beyond the "
         "collective).\n\n" + markdown_table(comm, [
             ("op", "op", ""), ("what", "what", ""), ("send_bytes", "send bytes", "d"),
             ("bytes_to_others", "to others", "d"), ("status", "status", ""), ("median_ms", "median ms", ".3f"),
             ("gb_per_s", "GB/s", ".2f"), ("vs_raw", "vs raw", ".3f"), ("reason", "reason", "")])
         + f"\n\nParity (packed path == separate path, bit-exact, per rank): "
           f"`{writer.payload.get('parity_packed_vs_separate')}`"),
    ]


def _plot(writer: ResultWriter):
    def draw(plt):
        local = [r for r in writer.rows if r.get("section") == "local" and r.get("tb_per_s")]
        comm = [r for r in writer.rows if r.get("section") == "a2a" and r.get("median_ms")]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        ax1.bar([r["op"] for r in local], [r["tb_per_s"] for r in local], color="tab:blue")
        if writer.gpu != "cpu":
            ax1.axhline(PACK_TARGET_TBS, color="tab:red", ls="--", label=f"pack target {PACK_TARGET_TBS} TB/s")
            ax1.legend(fontsize=8)
        ax1.set_ylabel("TB/s (read + write)")
        ax1.set_title(f"pack / unpack, {writer.gpu}")
        ax1.tick_params(axis="x", rotation=30)
        ax2.bar([r["op"] for r in comm], [r["median_ms"] for r in comm], color="tab:orange")
        ax2.set_ylabel("ms (slowest rank, median)")
        ax2.set_title(f"all-to-all, {writer.payload['config']['world']} ranks\n"
                      f"{writer.payload['config']['comm_label']}", fontsize=9)
        ax2.tick_params(axis="x", rotation=30)
        fig.tight_layout()
    return draw


if __name__ == "__main__":
    main()
