# SPDX-License-Identifier: Apache-2.0
"""Single-process tests of the varlen bridge, the backends and the staging pool."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

import dist_attn
from dist_attn import StagingBuffers, StagingCapacityError, sage_varlen, trailing_padding_used_len
from dist_attn.backends import SageBackend, resolve_backend
from tests.reference import reference_attention


@pytest.mark.parametrize(
    "bounds,max_seqlen,expected",
    [
        ((0, 37, 48), 37, 37),  # the H3 layout
        ((0, 48, 48), 48, None),  # no padding: used == total
        ((0, 37, 48), 40, None),  # max_seqlen != used
        ((0, 10, 30, 48), 20, None),  # three documents
        ((0, 48), 48, None),  # one segment
        ((1, 37, 48), 37, None),  # does not start at 0
        ((0, 37, 50), 37, None),  # does not end at total
        ((0, 0, 48), 0, None),  # used == 0
    ],
)
def test_trailing_padding_used_len(bounds, max_seqlen, expected):
    assert trailing_padding_used_len(total_tokens=48, max_seqlen=max_seqlen, bounds=bounds) == expected


@pytest.mark.parametrize("layout", [((0, 37, 48), 37), ((0, 48), 48), ((0, 10, 30, 48), 20),
                                    ((0, 0, 16, 16, 40, 48), 24), ((0, 37, 48), 40)])
@pytest.mark.parametrize("host", [True, False])
def test_sage_varlen_matches_reference(layout, host):
    bounds, max_seqlen = layout
    q, k, v = (torch.randn(48, 3, 32) for _ in range(3))
    before = [t.clone() for t in (q, k, v)]
    out = sage_varlen(q, k, v, torch.tensor(bounds), max_seqlen, list(bounds) if host else None,
                      backend="sdpa")
    # sage_varlen keeps SGLang's inference: (0, used, T) with used == max_seqlen is one padded request
    ref = reference_attention(q, k, v, bounds, trailing_padding_used_len(
        total_tokens=48, max_seqlen=max_seqlen, bounds=bounds))
    # fp32 math SDPA against float64: ~1e-6 absolute on O(1) outputs
    assert (out.double() - ref).abs().max() <= 1e-5
    assert all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
    if bounds == (0, 37, 48) and max_seqlen == 37:
        assert torch.count_nonzero(out[37:]) == 0
    if bounds == (0, 37, 48) and max_seqlen == 40:  # not the fast path: padding attends itself
        assert torch.count_nonzero(out[37:]) > 0


def test_sage_varlen_keywords_match_sglang():
    q = torch.randn(16, 2, 8)
    out = sage_varlen(q, q, q, cu_seqlens=torch.tensor([0, 16]), max_seqlen=16, cu_seqlens_host=[0, 16],
                      backend="sdpa", softmax_scale=0.5)
    ref = reference_attention(q, q, q, (0, 16), softmax_scale=0.5)
    assert (out.double() - ref).abs().max() <= 1e-5


def test_auto_logs_its_choice_once_in_one_short_info_line(caplog):
    """The CPU server's first INFO line was ~1,200 characters of why each backend was skipped,
    with TRITON_INTERPRET advice meant for developers. INFO now names the choice and what was
    skipped; the reasons go to DEBUG."""
    # head_dim 24 is used by no other test, so this (device, dtype, head_dim) was never logged
    q = torch.randn(4, 2, 24)
    with caplog.at_level(logging.DEBUG, logger="dist_attn"):
        first = resolve_backend("auto", q)
        resolve_backend("auto", q)
    assert first.name == "sdpa"  # CPU: sage/sage8 need CUDA
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 1 and "backend='auto' chose 'sdpa'" in info[0], info
    assert len(info[0]) <= 160 and "TRITON_INTERPRET" not in info[0], info[0]
    assert "skipped sage8, sage8_gluon" in info[0], info[0]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len(debug) == 1 and "sage8: " in debug[0] and "TRITON_INTERPRET" in debug[0], debug


def test_explicit_sage_on_cpu_says_why_and_how():
    with pytest.raises(dist_attn.BackendUnavailableError, match=r"backend='sage' cannot run: .*(pip install|CUDA).*sdpa"):
        sage_varlen(*(torch.randn(8, 2, 64),) * 3, torch.tensor([0, 8]), 8, backend="sage")


# -- sageattention 1.0.6's in-place K smoothing, reproduced by a fake module --------------------
def _fake_sage_v1(monkeypatch):
    """Installs a stand-in for sageattention 1.0.6: like the real one, the package exports
    ``sageattn`` (from ``core``) and it subtracts the key mean IN PLACE when smooth_k=True."""
    calls = []

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True, **kw):
        assert tensor_layout == "NHD"
        calls.append(dict(smooth_k=smooth_k, k_ptr=k.data_ptr()))
        if smooth_k:
            k -= k.mean(dim=1, keepdim=True)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=sm_scale)
        return o.transpose(1, 2)

    pkg = types.ModuleType("sageattention")
    core = types.ModuleType("sageattention.core")
    core.sageattn = sageattn
    pkg.sageattn = sageattn
    pkg.core = core
    monkeypatch.setitem(sys.modules, "sageattention", pkg)
    monkeypatch.setitem(sys.modules, "sageattention.core", core)
    return calls


def test_sage_v1_never_changes_the_callers_k(monkeypatch):
    calls = _fake_sage_v1(monkeypatch)
    be = SageBackend()
    be._load()
    assert not be._v2, "1.0.6 exports sageattn at the top level too: it must not pass for 2.x"
    q, k, v = (torch.randn(1, 32, 2, 64) + 0.5 for _ in range(3))
    k_before = k.clone()
    out = be.dense(q, k, v, softmax_scale=0.125, k_is_scratch=False)
    assert torch.equal(k, k_before), "the caller's K was modified"
    assert calls[-1]["k_ptr"] != k.data_ptr(), "the kernel must get a copy of the caller's K"
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.125).transpose(1, 2)
    assert (out - ref).abs().max() < 1e-5  # mean subtraction leaves softmax unchanged


def test_sage_v1_smooths_scratch_k_in_place_without_a_copy(monkeypatch):
    calls = _fake_sage_v1(monkeypatch)
    be = SageBackend()
    q, k, v = (torch.randn(1, 32, 2, 64) + 0.5 for _ in range(3))
    k_before = k.clone()
    be.dense(q, k, v, softmax_scale=0.125, k_is_scratch=True)
    assert calls[-1]["k_ptr"] == k.data_ptr(), "scratch K should be passed as is (no copy)"
    assert torch.allclose(k, k_before - k_before.mean(dim=1, keepdim=True))


def test_sage_v2_api_is_preferred(monkeypatch):
    seen = {}

    def sageattn(q, k, v, tensor_layout="HND", is_causal=False, sm_scale=None, **kw):
        seen.update(layout=tensor_layout, kw=kw)
        return q.clone()

    pkg = types.ModuleType("sageattention")
    pkg.sageattn = sageattn
    pkg.sageattn_qk_int8_pv_fp16_triton = sageattn  # a 2.x-only entry point
    monkeypatch.setitem(sys.modules, "sageattention", pkg)
    be = SageBackend()
    q = torch.randn(1, 8, 2, 64)
    be.dense(q, q, q, softmax_scale=0.1, k_is_scratch=False)
    assert be._v2 and seen["layout"] == "NHD" and "smooth_k" not in seen["kw"]


# -- staging pool -------------------------------------------------------------------------------
def test_staging_grows_only_to_the_largest_request():
    pool = StagingBuffers()
    a = pool.get("in_send", 100, torch.float32, "cpu")
    ptr = a.data_ptr()
    assert pool.get("in_send", 60, torch.float32, "cpu").data_ptr() == ptr  # smaller: reused
    for n in (10, 250, 40, 250, 7):
        pool.get("in_send", n, torch.float32, "cpu")
    assert pool.capacity("in_send", torch.float32, "cpu") == 250
    pool.get("in_send", 5, torch.bfloat16, "cpu")  # another dtype: its own buffer
    assert pool.capacity("in_send", torch.bfloat16, "cpu") == 5
    assert pool.total_bytes() == 250 * 4 + 5 * 2
    pool.release(["in_send"])
    assert pool.total_bytes() == 0


def test_staging_limit_refuses_before_allocating():
    pool = StagingBuffers(max_bytes=1000)
    pool.get("in_recv", 200, torch.float32, "cpu")  # 800 bytes
    with pytest.raises(StagingCapacityError, match=r"max_bytes=1000"):
        pool.reserve({"in_recv": 200, "out_send": 100}, torch.float32, "cpu")  # would be 1200
    assert pool.total_bytes() == 800 and pool.capacity("out_send", torch.float32, "cpu") == 0


def test_staging_limit_from_environment(monkeypatch):
    monkeypatch.setenv("DIST_ATTN_MAX_STAGING_BYTES", "64")
    assert StagingBuffers().max_bytes == 64
    monkeypatch.setenv("DIST_ATTN_MAX_STAGING_BYTES", "lots")
    with pytest.raises(ValueError, match=r"DIST_ATTN_MAX_STAGING_BYTES='lots'"):
        StagingBuffers()
    with pytest.raises(ValueError, match=r"role='bogus'"):
        StagingBuffers(max_bytes=8).get("bogus", 1, torch.float32, "cpu")


def test_sage_varlen_valid_len_overrides_the_sglang_inference():
    """(0, S, 2S) with max_seqlen = S: SGLang's inference reads one padded request; passing
    valid_len = 2S says both halves are documents, and valid_len = S says the tail is padding."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(32, 2, 16, generator=g) for _ in range(3))
    bounds = (0, 16, 32)
    two_docs = sage_varlen(q, k, v, list(bounds), 16, valid_len=32, backend="sdpa")
    assert (two_docs.double() - reference_attention(q, k, v, bounds)).abs().max() <= 1e-5
    assert torch.count_nonzero(two_docs[16:]) == two_docs[16:].numel()
    padded = sage_varlen(q, k, v, list(bounds), 16, valid_len=16, backend="sdpa")
    inferred = sage_varlen(q, k, v, list(bounds), 16, backend="sdpa")
    assert torch.equal(padded, inferred) and torch.count_nonzero(padded[16:]) == 0


def test_batched_sage_varlen_matches_reference():
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 20, 2, 8, generator=g) for _ in range(3))
    out = sage_varlen(q, k, v, [0, 5, 20], valid_len=18, backend="sdpa")
    ref = reference_attention(q, k, v, (0, 5, 20), 18)
    assert out.shape == q.shape and (out.double() - ref).abs().max() <= 1e-5
