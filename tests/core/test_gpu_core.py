# SPDX-License-Identifier: Apache-2.0
"""GPU checks of the core on one CUDA device (an H200 for the numbers quoted in the README).

Skipped on machines without CUDA or without sageattention, with the reason shown.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from tests._multirank import run_ranks
from tests.reference import cosine, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
    pytest.mark.skipif(importlib.util.find_spec("sageattention") is None,
                       reason="needs sageattention (pip install -e '.[gpu]')"),
]

# h3-ref per-rank shape at Ulysses degree 4: all 38,016 rows, 56/4 = 14 heads of 128, bf16.
TOTAL, USED, HEADS, D = 38_016, 37_980, 14, 128


def _direct_sageattn():
    try:
        from sageattention import sageattn  # 2.x
    except ImportError:
        from sageattention.core import sageattn  # 1.0.6
    return sageattn


def _h3_inputs(seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(TOTAL, HEADS, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def test_fast_path_bit_identical_to_direct_sage_call():
    from dist_attn import sage_varlen

    q, k, v = _h3_inputs()
    k_before = k.clone()
    cu = torch.tensor([0, USED, TOTAL], dtype=torch.int32, device="cuda")
    out = sage_varlen(q, k, v, cu, USED, [0, USED, TOTAL], backend="sage")
    # The reference call: the kernel itself on rows [0, used), K cloned because 1.0.6 smooths it in place.
    direct = _direct_sageattn()(q[None, :USED], k[None, :USED].clone(), v[None, :USED],
                                tensor_layout="NHD", is_causal=False, sm_scale=1 / math.sqrt(D))[0]
    torch.cuda.synchronize()
    diff = (out[:USED].float() - direct.float()).abs()
    again = _direct_sageattn()(q[None, :USED], k[None, :USED].clone(), v[None, :USED],
                               tensor_layout="NHD", is_causal=False, sm_scale=1 / math.sqrt(D))[0]
    assert torch.equal(out[:USED], direct), (
        f"bridge output differs from the direct dense call: {int((diff > 0).sum())} elements, max "
        f"{diff.max().item():.3g}, nan out/direct {int(out.isnan().sum())}/{int(direct.isnan().sum())}, "
        f"direct call repeatable: {torch.equal(direct, again)}")
    assert torch.count_nonzero(out[USED:]).item() == 0, "padding rows must be exactly zero"
    assert torch.equal(k, k_before), "the caller's K was modified"
    assert out.dtype == torch.bfloat16 and out.shape == (TOTAL, HEADS, D)


@pytest.mark.parametrize("backend", ["sage", "auto"])
def test_fast_path_makes_no_host_sync(backend):
    from dist_attn import sage_varlen

    q, k, v = _h3_inputs(1)
    cu = torch.tensor([0, USED, TOTAL], dtype=torch.int32, device="cuda")
    sage_varlen(q, k, v, cu, USED, [0, USED, TOTAL], backend=backend)  # warm-up: Triton compiles here
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sage_varlen(q, k, v, cu, USED, [0, USED, TOTAL], backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


def test_sync_debug_mode_catches_a_sync():
    """Guards the test above: without cu_seqlens_host the bounds are read back, which must raise."""
    from dist_attn import sage_varlen

    q = torch.randn(256, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 200, 256], dtype=torch.int32, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            sage_varlen(q, q, q, cu, 200, None, backend="sage")
    finally:
        torch.cuda.set_sync_debug_mode("default")


# 4 ranks share the one GPU over gloo; global 8,192 rows, 8 heads of 128, bf16.
G_SEQ, G_HEADS = 8_192, 8
# name -> (bounds, max_seqlen, valid_len)
G_LAYOUTS = {"trailing_padding": ((0, 8_000, G_SEQ), 8_000, 8_000),
             "three_documents": ((0, 3_000, 5_000, G_SEQ), 3_192, None)}


def _gpu_worker(rank, world, backend, chunks):
    from dist_attn import UlyssesSageAttention

    torch.cuda.set_device(0)
    s_local = G_SEQ // world
    res = {}
    for name, (bounds, max_seqlen, valid_len) in G_LAYOUTS.items():
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(G_SEQ, G_HEADS, 128, generator=g).bfloat16() for _ in range(3))
        k[..., :] += 0.5  # per-channel key bias: what Sage's K smoothing is for
        shard = [t[rank * s_local:(rank + 1) * s_local].cuda() for t in (q, k, v)]
        before = [t.clone() for t in shard]
        attn = UlyssesSageAttention(G_HEADS, 128, backend=backend, overlap_chunks=chunks)
        out = attn(*shard, torch.tensor(bounds, device="cuda"), max_seqlen, list(bounds),
                   valid_len=valid_len)
        # numpy, not a tensor: a CPU tensor crosses the queue by a shared-memory handle that dies
        # with the rank process (seen on the H200 as ConnectionResetError in the parent)
        res[name] = (out.float().cpu().numpy(), all(torch.equal(a, b) for a, b in zip(before, shard)))
    return res


@pytest.mark.parametrize("backend,chunks", [("sage", 1), ("sage", 2), ("auto", 1), ("sage8", 2)])
def test_four_ranks_share_one_gpu_cosine(tmp_path, backend, chunks):
    world = 4
    per_rank = run_ranks(_gpu_worker, world, tmp_path, backend, chunks, timeout=300)
    for name, (bounds, max_seqlen, valid_len) in G_LAYOUTS.items():
        g = torch.Generator().manual_seed(7)
        q, k, v = (torch.randn(G_SEQ, G_HEADS, 128, generator=g).bfloat16() for _ in range(3))
        k[..., :] += 0.5
        ref = reference_attention(q, k, v, bounds, valid_len, device="cuda")
        out = torch.cat([torch.from_numpy(per_rank[r][name][0]) for r in range(world)]).cuda()
        cos = cosine(out, ref)
        assert cos >= 0.999, f"{name}: cosine {cos:.6f} < 0.999"
        assert all(per_rank[r][name][1] for r in range(world)), "inputs modified"
        if name == "trailing_padding":
            assert torch.count_nonzero(out[bounds[1]:]).item() == 0


def test_installed_sageattention_api_detected():
    """1.0.6 also exports ``sageattn`` at the top level; mistaking it for 2.x once let it smooth
    the caller's K in place (seen in the first H200 benchmark run)."""
    from dist_attn.backends import SageBackend

    be = SageBackend()
    assert be.unsupported_reason(torch.empty(1, 1, 128, device="cuda", dtype=torch.bfloat16)) is None
    assert be._v2 == (int(be.version.split(".")[0]) >= 2), (be.version, be._v2)

