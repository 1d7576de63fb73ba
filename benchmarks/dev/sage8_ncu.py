"""Runs the Gluon sage8 kernel three times at h3-ref x 14 heads with one launch config, for a
profiler to pick one launch (``ncu --kernel-name _attn_ws_kernel --launch-skip 2 --launch-count 1``).

    python3 -m benchmarks.dev.sage8_ncu '{"pv_accum": "running"}'
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from dist_attn.kernels.sage8 import launch, sage8_dense

__all__ = ["main"]


def main(argv=None) -> None:
    over = json.loads((argv or sys.argv[1:] or ["{}"])[0])
    cfg = dataclasses.replace(launch.default_config("gluon"), **over)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn((1, 38016, 14, 128), generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    for _ in range(3):
        sage8_dense(q, k, v, impl="gluon", config=cfg)
    torch.cuda.synchronize()
    print("ran", cfg)


if __name__ == "__main__":
    main()
