# SPDX-License-Identifier: Apache-2.0
"""Which step of one sage8 CuTe call never returns on short segments (the hang at <= 128 keys).

    python -m benchmarks.dev.sage8_cute_hang T [k=v,...]     # one GPU; run under `timeout`

Each step is synchronized and printed before and after, so the last "start" line names the
kernel that hangs: the pre-pass in the CuTe loop's V order, the Triton loop, the CuTe loop with
the given CuteConfig fields. faulthandler prints the Python stack and exits if a step takes 25 s.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time

import torch


def main():
    T = int(sys.argv[1])
    text = sys.argv[2] if len(sys.argv) > 2 else ""
    os.environ.setdefault("DIST_ATTN_SAGE8_CUTE", "1")
    from benchmarks.dev.sage8_cute_check import _config
    from dist_attn.kernels.sage8 import sage8_dense
    from dist_attn.kernels.sage8.attn_cute import CuteConfig
    cfg = _config(CuteConfig, text)
    q, k, v = (torch.randn((1, T, 2, 128), device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def step(name, fn):
        print(f"start {name}", flush=True)
        faulthandler.dump_traceback_later(25, exit=True)  # a compile fits; a hang does not
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        faulthandler.cancel_dump_traceback_later()
        print(f"done  {name} {time.perf_counter() - t0:.2f}s", flush=True)
        return out

    step("triton loop", lambda: sage8_dense(q, k, v, impl="triton"))
    step(f"cute {cfg}", lambda: sage8_dense(q, k, v, impl="cute", config=cfg))
    step(f"cute {cfg} lse", lambda: sage8_dense(q, k, v, impl="cute", config=cfg, return_lse=True))
    print("no hang", flush=True)


if __name__ == "__main__":
    main()
