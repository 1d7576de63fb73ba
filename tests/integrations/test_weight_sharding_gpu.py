# SPDX-License-Identifier: Apache-2.0
"""Sharded weights on a GPU (FSDP2 over NCCL, one rank): the served tiny H3 with torchao's FP8
linears and the fused kernels, materialised and sharded block by block (torchao's output
projection turned into Fp8Linear on the same codes), against the replica built and quantized as
before, eager and compiled. Skipped without CUDA compute capability >= 8.9 and torchao."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("needs a CUDA GPU of compute capability >= 8.9", allow_module_level=True)
pytest.importorskip("torchao")

# bf16 blocks, FP8 GEMMs: the replica's torchao output projection quantizes its activation with
# torchao's quantizer, the sharded one with dist_attn's (the same recipe): at most one e4m3 step
# on some codes, so the outputs may differ by a rounding, not by a bug (a wrong shard: O(1))
RTOL = 2e-2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.fixture
def one_rank(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("compiled", [False, True])
def test_sharded_fp8_model_serves_the_replicas_outputs(one_rank, compiled):
    from dist_attn.models.h3.serve.config import apply_overrides, load_config
    from dist_attn.models.h3.serve.h3.model import (build_h3, compile_blocks, meta_h3, parallelize,
                                                    shard_h3)
    from tests.integrations.test_fp8_h3 import _inputs

    device = torch.device("cuda", 0)
    cfg = apply_overrides(load_config(None), {"model.linear_precision": "fp8"})
    inputs = {k: v.to(device) if torch.is_tensor(v) else v
              for k, v in _inputs(cfg, torch.bfloat16).items()}
    replica = build_h3(cfg.model, device=device, dtype=torch.bfloat16)
    parallelize(replica, backend="sdpa")
    sharded = meta_h3(cfg.model, device=device, dtype=torch.bfloat16)
    parallelize(sharded, backend="sdpa")
    summary = shard_h3(sharded, cfg.model, device=device, dtype=torch.bfloat16)
    assert summary.torchao_linears >= cfg.model.num_layers  # at least each block's to_out
    if compiled:
        compile_blocks(replica)
        compile_blocks(sharded)
    with torch.no_grad():
        want, got = replica(**inputs), sharded(**inputs)
    bitwise = all(torch.equal(a, b) for a, b in zip(got, want))
    print(f"compiled={compiled}: bit-identical {bitwise}, rel-L2 "
          f"{[round(_rel(a, b), 6) for a, b in zip(got, want)]}")
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and _rel(a, b) <= RTOL
