# SPDX-License-Identifier: Apache-2.0
"""One Ulysses attention layer at h3-ref timed from two source trees, interleaved: does a
refactor of the core change the layer's time?

    python -m benchmarks.dev.layer_ab --old .pre47 [--new .] [--rounds 5] [--out DIR]

Each round runs one child process per tree (``PYTHONPATH`` = that tree), in alternating order.
A child is rank 0 of a fake process group of W = 4 (``torch.testing._internal.distributed.fake_pg``:
the pack, the all-to-all calls, the kernel at 14 heads and the unpack run; the all-to-alls move
nothing) and, as a second case, a single rank (W = 1, the single-rank branch); it times
``ulysses_attention`` on ``[S / W, 56, 128]`` bf16 shards with CUDA events and prints its medians
as JSON. The parent writes ``layer-ab_<gpu>_<date>.{json,md,png}``: per tree and case, the median
of the rounds' medians and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

__all__ = ["main"]

_CHILD = r"""
import json, statistics, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import dist_attn
from dist_attn import ulysses_attention
from dist_attn.buffers import default_staging_buffers
S, used, H, D, iters, warmup = (int(a) for a in sys.argv[1:7])
out = {"dist_attn": dist_attn.__file__}
for W in (4, 1):
    if W > 1:
        dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((S // W, H, D), generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    kw = dict(valid_len=used, cu_seqlens_host=[0, S], cu_seqlens=[0, S], max_seqlen=S, backend="sage8",
              overlap_chunks=4 if W > 1 else 1)
    for _ in range(max(warmup, 1)):
        ulysses_attention(q, k, v, **kw)
    # the fake all-to-alls write nothing: the staging buffers the kernel reads get random values
    for t in getattr(default_staging_buffers(), "_buffers", {}).values():
        t.normal_() if t.is_floating_point() else t.zero_()
    torch.cuda.synchronize()
    ms = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); ulysses_attention(q, k, v, **kw); b.record(); b.synchronize()
        ms.append(a.elapsed_time(b))
    out[f"W{W}"] = statistics.median(ms)
    if W > 1:
        dist.destroy_process_group()
print("RESULT " + json.dumps(out), flush=True)
"""


def _child(tree: str, args) -> dict:
    """One child run in ``tree`` (its working directory and the head of ``PYTHONPATH``, so that
    ``python -c`` imports that tree's dist_attn); SystemExit if it failed or imported another."""
    root = os.path.abspath(tree)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    res = subprocess.run([sys.executable, "-c", _CHILD, str(args.total), str(args.used), str(args.heads),
                          str(args.head_dim), str(args.iters), str(args.warmup)], env=env, cwd=root,
                         capture_output=True, text=True, timeout=300)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")]
    if res.returncode or not line:
        raise SystemExit(f"layer_ab: the child for {tree} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    out = json.loads(line[-1][len("RESULT "):])
    if not os.path.abspath(out.pop("dist_attn")).startswith(root + os.sep):
        raise SystemExit(f"layer_ab: the child for {tree} imported dist_attn from outside it")
    return out


def main(argv=None) -> int:
    import torch

    from benchmarks.harness import ResultWriter, add_common_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", required=True, help="the older source tree (a folder holding dist_attn/)")
    p.add_argument("--new", default=".", help="the newer source tree")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--total", type=int, default=38016)
    p.add_argument("--used", type=int, default=37980)
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--head-dim", type=int, default=128)
    add_common_args(p, iters=20, warmup=3, budget_s=0)
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    trees = {"old": args.old, "new": args.new}
    rounds: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
            rounds[name].append(_child(trees[name], args))
            print(name, rounds[name][-1], flush=True)
    writer = ResultWriter(theme="layer-ab", args=args, device=dev,
                          title="One Ulysses attention layer at h3-ref from two source trees",
                          config={"trees": trees, "total": args.total, "used": args.used, "heads": args.heads,
                                  "head_dim": args.head_dim, "iters": args.iters, "rounds": args.rounds,
                                  "backend": "sage8", "overlap_chunks": {"W4": 4, "W1": 1},
                                  "process_group": "fake (rank 0 of W = 4; all-to-alls move nothing)"})
    for case in ("W4", "W1"):
        for name in trees:
            vals = [x[case] for x in rounds[name]]
            writer.rows.append({"case": case, "tree": name, "path": trees[name], "median_ms": statistics.median(vals),
                                "rounds_ms": vals})
    cols = [("case", "case", "{}"), ("tree", "tree", "{}"), ("path", "path", "{}"),
            ("median_ms", "median ms", "{:.3f}"), ("rounds_ms", "rounds ms", "{}")]

    def plot(plt):
        for i, case in enumerate(("W4", "W1")):
            for j, name in enumerate(trees):
                row = next(x for x in writer.rows if x["case"] == case and x["tree"] == name)
                plt.bar(2 * i + 0.4 * j, row["median_ms"], width=0.4, label=f"{case} {name}")
        plt.ylabel("ms")
        plt.legend()

    from benchmarks.harness import markdown_table
    print(writer.finish(plot, [("layer", markdown_table(writer.rows, cols))]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
