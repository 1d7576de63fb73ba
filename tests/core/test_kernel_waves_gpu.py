"""sage8's kernel_waves on a Hopper GPU: the resident-program count it computes from the launch
config is the one the compiled kernel's registers and shared memory give.

Skipped without CUDA or without what the sage8 Triton loop needs, with the reason shown.
"""

from __future__ import annotations

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
    regs_per_sm = getattr(props, "regs_per_multiprocessor", 65536)
    # what the compiled kernel takes: registers per warp in units of 256, its shared memory + the reserve
    regs = -(-kern.n_regs * 32 // 256) * 256 * cfg.num_warps
    smem = kern.metadata.shared + attn_triton.RESERVED_SMEM_PER_CTA
    compiled = min(regs_per_sm // regs, props.shared_memory_per_multiprocessor // smem,
                   props.max_threads_per_multi_processor // (32 * cfg.num_warps))
    assert kern.n_regs <= cfg.maxnreg and kern.n_spills == 0, (kern.n_regs, kern.n_spills)
    computed = attn_triton.resident_ctas(cfg, d, regs_per_sm=regs_per_sm,
                                         smem_per_sm=props.shared_memory_per_multiprocessor,
                                         threads_per_sm=props.max_threads_per_multi_processor)
    assert computed == compiled, (computed, compiled, kern.n_regs, kern.metadata.shared)
    waves = Sage8Backend().kernel_waves(segment_layout([0, 37980, 38016], total=38016, valid_len=37980), q)
    assert waves.tiles_per_head == 594 and waves.slots == computed * props.multi_processor_count, waves
