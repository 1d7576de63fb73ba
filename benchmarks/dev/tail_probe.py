# SPDX-License-Identifier: Apache-2.0
"""Dev probe: the sage8 kernel's part-full last wave, and whether a second stream fills it (one GPU).

Rank 0 of Ulysses 4 at h3-ref attends 14 heads over 38,016 rows. Cut into overlap chunks, each
chunk's kernel ends on a wave that may be part-full (``dist_attn.plan.chunk_widths``). For each
cut this times the chunks' kernels back to back on one stream, and alternating over two streams
with nothing between them (what the best case of the pipelined core could reach if each chunk's
kernel were free to start while the previous one drains). Writes ``tail-probe.json`` to ``--out``.

    python3 -m benchmarks.dev.tail_probe --out $OUT
"""

from __future__ import annotations

import torch

from benchmarks.dev import probe_parser, write_probe_json

__all__ = ["main"]

_CUTS = {"C1": (14,), "C2 even": (7, 7), "C2 waves": (6, 8), "C4 even": (4, 4, 3, 3), "C4 waves": (2, 4, 4, 4)}


def main(argv: list[str] | None = None) -> int:
    args = probe_parser(__doc__, iters=20).parse_args(argv)
    from benchmarks.h3_block import h3_ref_layout, padded_total
    from benchmarks.harness import time_fn
    from dist_attn import backends
    from dist_attn.comm import unpack_qkv
    from dist_attn.varlen import attend_varlen, segment_layout

    dev = torch.device("cuda")
    used = h3_ref_layout().used
    total, D = padded_total(used), 128
    layout = segment_layout([0, used, total], total=total, valid_len=used)
    cu = torch.tensor([0, used, total], dtype=torch.int32, device=dev)
    be = backends.get_backend("sage8")
    calls = {}
    for w in sorted({w for cut in _CUTS.values() for w in cut}):
        recv = torch.randn(total * 3 * w * D, device=dev).to(torch.bfloat16)
        qv, kv, vv = unpack_qkv(recv, total, w, D)
        o = torch.empty(total, w, D, device=dev, dtype=torch.bfloat16)
        calls[w] = (lambda qv=qv, kv=kv, vv=vv, o=o: attend_varlen(
            be, qv[None], kv[None], vv[None], layout=layout, cu_seqlens=cu, softmax_scale=D ** -0.5,
            k_is_scratch=True, out=o[None]))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    main_stream = torch.cuda.current_stream()

    def serial(cut):
        for w in cut:
            calls[w]()

    def two_streams(cut):
        start = torch.cuda.Event()
        start.record(main_stream)
        for i, w in enumerate(cut):
            s = streams[i % 2]
            s.wait_event(start)
            with torch.cuda.stream(s):
                calls[w]()
        for s in streams:
            main_stream.wait_stream(s)

    def timed(fn, cut) -> float:
        return time_fn(lambda: fn(cut), device=dev, iters=args.iters, warmup=3).median_ms

    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "waves": str(be.kernel_waves(layout, torch.empty(1, 1, 1, D, device=dev, dtype=torch.bfloat16))),
           "cuts": {}}
    with torch.no_grad():
        for rnd in range(3):  # interleaved rounds; the median of each cut's three medians
            for name, cut in _CUTS.items():
                r = res["cuts"].setdefault(name, {"widths": list(cut), "serial_ms": [], "two_streams_ms": []})
                r["serial_ms"].append(timed(serial, cut))
                r["two_streams_ms"].append(timed(two_streams, cut))
    for r in res["cuts"].values():
        for key in ("serial_ms", "two_streams_ms"):
            r[key] = sorted(r[key])[1]
        print(r, flush=True)
    write_probe_json(args.out, "tail-probe.json", res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
