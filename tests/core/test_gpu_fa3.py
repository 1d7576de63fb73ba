# SPDX-License-Identifier: Apache-2.0
"""FlashAttention-3 backend on a Hopper GPU: exactness, LSE, "auto" among exact kernels, and the
Ulysses path (4 ranks sharing the GPU over gloo, strided receive-buffer views)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests._multirank import run_ranks
from tests.reference import cosine, reference_attention

_HAS_FA3 = any(importlib.util.find_spec(m) is not None for m in ("flash_attn_interface", "fa3_fwd_interface"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
    pytest.mark.skipif(not _HAS_FA3, reason="needs FlashAttention-3 (pip install fa3-fwd)"),
]


def _inputs(rows, heads, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(rows, heads, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def test_fa3_matches_float64_and_is_auto_exact_choice():
    from dist_attn import resolve_backend, sage_varlen

    q, k, v = _inputs(4_096, 4)
    assert resolve_backend("auto", q, exact_only=True).name == "fa3"
    out = sage_varlen(q, k, v, [0, 1_000, 4_000, 4_096], None, valid_len=4_000, backend="fa3")
    ref = reference_attention(q, k, v, (0, 1_000, 4_000, 4_096), 4_000, device="cuda")
    # bf16 output of an exact kernel: cosine of an fp32-accumulating kernel is ~1 - 1e-5
    assert cosine(out, ref) >= 0.99999
    assert torch.count_nonzero(out[4_000:]).item() == 0


def test_fa3_lse_matches_float64():
    from dist_attn import get_backend

    q, k, v = (t[None] for t in _inputs(1_024, 2, seed=1))
    out, lse = get_backend("fa3").dense_lse(q, k, v, softmax_scale=0.088)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.088
    assert lse.shape == (1, 2, 1_024) and lse.dtype == torch.float32
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max().item() <= 1e-3


def _ulysses_worker(rank, world):
    from dist_attn import UlyssesSageAttention

    torch.cuda.set_device(0)
    q, k, v = _inputs(8_192, 8, seed=2)
    rows = slice(rank * 2_048, (rank + 1) * 2_048)
    out = UlyssesSageAttention(8, 128, backend="fa3")(q[rows], k[rows], v[rows], valid_len=8_000)
    return out.float().cpu().numpy()


def test_fa3_through_ulysses_four_ranks_one_gpu(tmp_path):
    per_rank = run_ranks(_ulysses_worker, 4, tmp_path, timeout=300)
    q, k, v = _inputs(8_192, 8, seed=2)
    ref = reference_attention(q, k, v, (0, 8_192), 8_000, device="cuda")
    out = torch.cat([torch.from_numpy(r) for r in per_rank]).cuda()
    assert cosine(out, ref) >= 0.99999
    assert torch.count_nonzero(out[8_000:]).item() == 0
