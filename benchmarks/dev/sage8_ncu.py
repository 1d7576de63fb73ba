# SPDX-License-Identifier: Apache-2.0
"""Runs one sage8 attention loop three times at h3-ref x 14 heads with one launch config, for a
profiler to pick one launch (``ncu --kernel-name <loop's kernel> --launch-skip 2 --launch-count 1``).

    python3 -m benchmarks.dev.sage8_ncu '{"pv_accum": "running"}'            # the Gluon loop
    DIST_ATTN_SAGE8_CUTE=1 python3 -m benchmarks.dev.sage8_ncu '{"p_smem": true}' cute  # the CuTe loop
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from dist_attn.kernels.sage8 import launch, sage8_dense

__all__ = ["main"]


def main(argv=None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    over = json.loads(args[0] if args else "{}")
    impl = args[1] if len(args) > 1 else "gluon"
    cfg = dataclasses.replace(launch.default_config(impl), **over)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, 38016, 14, 128), generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    for _ in range(3):
        sage8_dense(q, k, v, impl=impl, config=cfg)
    torch.cuda.synchronize()
    print("ran", impl, cfg)


if __name__ == "__main__":
    main()
