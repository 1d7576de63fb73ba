# SPDX-License-Identifier: Apache-2.0
"""Backend selection rules on CPU: constraints of "auto", explicit refusals, the log-sum-exp."""

from __future__ import annotations

import pytest
import torch

from dist_attn import AttentionBackend, BackendUnavailableError, get_backend, resolve_backend


def test_auto_exact_only_never_picks_an_8bit_kernel():
    q = torch.zeros(4, 2, 64)
    assert resolve_backend("auto", q, exact_only=True).exact


def test_explicit_8bit_backend_refused_when_exact_only():
    class Fake8bit(type(get_backend("sdpa"))):
        name, exact = "fake8", False

    from dist_attn import register_backend, unregister_backend

    register_backend(Fake8bit(), replace=True)
    try:
        with pytest.raises(BackendUnavailableError, match=r"backend='fake8' cannot run: .*8 bits"):
            resolve_backend("fake8", torch.zeros(4, 2, 64), exact_only=True)
        assert resolve_backend("fake8", torch.zeros(4, 2, 64)).name == "fake8"
    finally:
        unregister_backend("fake8")


def test_require_lse_refuses_backends_without_it():
    class NoLse(type(get_backend("sdpa"))):
        name = "nolse"
        dense_lse = AttentionBackend.dense_lse  # the interface's default: not implemented

    from dist_attn import register_backend, unregister_backend

    register_backend(NoLse(), replace=True)
    try:
        assert not get_backend("nolse").supports_lse and get_backend("sdpa").supports_lse
        with pytest.raises(BackendUnavailableError, match=r"backend='nolse' cannot run: .*log-sum-exp"):
            resolve_backend("nolse", torch.zeros(4, 2, 8), require_lse=True)
        assert resolve_backend("auto", torch.zeros(4, 2, 8), require_lse=True).supports_lse
    finally:
        unregister_backend("nolse")


def test_fa3_on_cpu_says_why_and_how():
    with pytest.raises(BackendUnavailableError, match=r"backend='fa3' cannot run: .*(fa3-fwd|CUDA).*sdpa"):
        resolve_backend("fa3", torch.zeros(4, 2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_lse_matches_float64(dtype, atol):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 12, 3, 16, generator=g).to(dtype) for _ in range(3))
    out, lse = get_backend("sdpa").dense_lse(q, k, v, softmax_scale=0.25)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.25  # [B, H, Tq, Tk]
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 12)
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() <= atol
    ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.double())
    assert (out.double() - ref).abs().max() <= atol


def test_auto_chooses_only_accurate_kernels(caplog):
    """An 8-bit kernel first in "auto"'s order and runnable is passed over (and the log says why)
    until its accuracy is verified; named explicitly, it runs."""
    import logging

    from dist_attn import register_backend, unregister_backend
    from dist_attn.backends import auto_refusal, registry

    class Fast8bit(type(get_backend("sdpa"))):
        name, exact, accuracy_verified = "sage8", False, False

    real = get_backend("sage8")
    register_backend(Fast8bit(), replace=True)
    registry._AUTO_LOGGED.clear()
    try:
        q = torch.zeros(4, 2, 64)
        assert "not verified" in auto_refusal(get_backend("sage8"))
        with caplog.at_level(logging.DEBUG, logger="dist_attn.backends.registry"):  # the reasons
            chosen = resolve_backend("auto", q)
        assert chosen.name != "sage8" and (chosen.exact or chosen.accuracy_verified)
        assert "sage8: it quantizes to 8 bits and its accuracy" in caplog.text
        assert resolve_backend("sage8", q).name == "sage8"  # an explicit name is the caller's choice
        Fast8bit.accuracy_verified = True
        registry._AUTO_LOGGED.clear()
        assert auto_refusal(get_backend("sage8")) is None
        assert resolve_backend("auto", q).name == "sage8"
    finally:
        register_backend(real, replace=True)
        registry._AUTO_LOGGED.clear()


def test_every_registered_backend_declares_its_accuracy():
    """Exact kernels pass the rule by nature; an 8-bit one needs the GPU accuracy tests behind it
    (tests/core/test_kernel_accuracy.py asserts the targets for every backend that claims it)."""
    from dist_attn import available_backends
    from dist_attn.backends import auto_refusal

    for name in available_backends():
        if name == "auto":
            continue
        be = get_backend(name)
        assert isinstance(be.accuracy_verified, bool)
        assert (auto_refusal(be) is None) == (be.exact or be.accuracy_verified), name
