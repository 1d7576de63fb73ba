# SPDX-License-Identifier: Apache-2.0
"""sage8's kernel_waves on a Hopper GPU: the resident-program count it computes from the launch
config is the driver's for the compiled kernel (cuOccupancyMaxActiveBlocksPerMultiprocessor).

Skipped without CUDA or without what the sage8 Triton loop needs, with the reason shown.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)")]


def _reason() -> str | None:
    from dist_attn import kernels

    return kernels.unsupported_reason(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16),
                                      impl="triton")


def test_resident_programs_match_the_compiled_kernel():
    if (why := _reason()) is not None:
        pytest.skip(why)
    from dist_attn.backends import Sage8Backend
    from dist_attn.kernels.sage8 import attn_triton, launch
    from dist_attn.varlen import segment_layout

    dev = torch.device("cuda")
    rows, heads, d = 1000, 2, 128
    q, k, v = (torch.randn(1, rows, heads, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    cfg = launch.default_config("triton")
    lay = launch.dense_layout(1, rows)
    qz = launch.prepare(q, k, v, layout=lay, softmax_scale=d ** -0.5, impl="triton", config=cfg)
    kern = attn_triton.attention(qz, q, out, None, d ** -0.5, cfg)
    props = torch.cuda.get_device_properties(dev)
    # the driver's own count for this compiled kernel, its block size and dynamic shared memory
    libcuda = ctypes.CDLL("libcuda.so.1")
    blocks = ctypes.c_int(0)
    err = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(kern.function), ctypes.c_int(32 * cfg.num_warps),
        ctypes.c_size_t(kern.metadata.shared))
    assert err == 0, f"cuOccupancyMaxActiveBlocksPerMultiprocessor returned {err}"
    assert kern.n_regs <= cfg.maxnreg and kern.n_spills == 0, (kern.n_regs, kern.n_spills)
    computed = attn_triton.resident_ctas(cfg, d, regs_per_sm=getattr(props, "regs_per_multiprocessor", 65536),
                                         smem_per_sm=props.shared_memory_per_multiprocessor,
                                         threads_per_sm=props.max_threads_per_multi_processor)
    assert computed == blocks.value, (computed, blocks.value, kern.n_regs, kern.metadata.shared)
    waves = Sage8Backend().kernel_waves(segment_layout([0, 37980, 38016], total=38016, valid_len=37980), q)
    assert waves.tiles_per_head == 594 and waves.slots == computed * props.multi_processor_count, waves
    # other head dims, and segments of different tile counts: unknown
    assert Sage8Backend().kernel_waves(segment_layout([0, 37980], total=37980), q[..., :64]) is None
    assert Sage8Backend().kernel_waves(segment_layout([0, 1000, 37980], total=37980), q) is None
    two = Sage8Backend().kernel_waves(segment_layout([0, 1000, 2000], total=2000), q)
    assert two.tiles_per_head == 2 * 16, two
