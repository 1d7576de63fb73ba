# SPDX-License-Identifier: Apache-2.0
"""GPU checks of the benchmark harness on one CUDA device (no sageattention needed).

Skipped on machines without CUDA, with the reason shown.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
]


def test_device_timeline_ms_counts_the_gpu_idle_between_kernels():
    """benchmarks.harness.device_timeline_ms: busy and idle from one profiled run. A host pause
    between two launches (after a sync) is idle time; back-to-back launches leave almost none."""
    import time

    from benchmarks.harness import device_timeline_ms

    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)

    def paused():
        a @ a
        torch.cuda.synchronize()
        time.sleep(0.005)
        a @ a

    for _ in range(2):
        paused()
    busy, idle = device_timeline_ms(paused, dev, calls=3)
    assert busy > 0 and idle > 4.0, (busy, idle)
    busy2, idle2 = device_timeline_ms(lambda: [a @ a for _ in range(8)], dev, calls=3)
    assert busy2 > busy and idle2 < 0.5, (busy2, idle2)
