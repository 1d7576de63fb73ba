# SPDX-License-Identifier: Apache-2.0
"""The CuTe DSL sage8 loop's Python side on a CPU: the register renaming of P against V's key order,
argument checks, the backend's refusals and messages. Its GPU behaviour is in test_kernel_sage8.py
(parametrized over every impl) and benchmarks/dev/sage8_cute_check.py."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from dist_attn import backends
from dist_attn.kernels.sage8 import api, numerics, sage8_dense


def _prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32 (default mode): byte k of the result is byte (sel >> 4k) & 7 of b:a."""
    src = a | (b << 32)
    return sum(((src >> (8 * ((sel >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4))


@pytest.mark.parametrize("n", [32, 128])
def test_p_renamed_by_prmt_meets_v_in_mma_order(n):
    # For every lane t of a quad and row half r: the accumulator holds P's columns 8 i + 2 t + e
    # (word i: bytes (e, r) = (0,0), (1,0), (0,1), (1,1)); after the two PRMTs of each word pair,
    # A-operand word (r, h, k) byte b sits at operand column 32 k + 16 h + 4 t + b, which V^T's
    # "mma" order fills with key perm[column]. The key in that byte must be exactly that key.
    perm = numerics.mma_key_order(n)
    for t in range(4):
        # each byte encodes its key within the 32-key step and its row half: 1 + key % 32 + 64 row
        words = []
        for i in range(n // 8):
            cols = [(8 * i + 2 * t + e) % 32 for e in (0, 1)]
            bytes_ = [1 + cols[0], 1 + cols[1], 65 + cols[0], 65 + cols[1]]  # rows r=0 then r=1
            words.append(sum(v << (8 * k) for k, v in enumerate(bytes_)))
        out = []
        for m in range(0, len(words), 2):
            out += [_prmt(words[m], words[m + 1], sel) for sel in numerics.P8_PRMT]
        for w, word in enumerate(out):
            r, h, k = w % 2, (w // 2) % 2, w // 4
            for b in range(4):
                val = ((word >> (8 * b)) & 0xFF) - 1
                key, row = 32 * k + val % 64, val // 64
                column = 32 * k + 16 * h + 4 * t + b
                assert row == r and key == perm[column].item(), (t, w, b, key, row, perm[column].item())


def test_cute_impl_is_registered_and_says_what_it_needs_on_a_cpu():
    be = backends.get_backend("sage8_cute")
    assert be.impl == "cute" and not be.exact and be.supports_lse
    # not yet checked against float64 on a GPU: "auto" must not choose it
    assert not be.accuracy_verified and backends.get_backend("sage8").accuracy_verified
    assert "accuracy" in (backends.registry.auto_refusal(be) or "")
    q = torch.empty(1, 4, 2, 128, dtype=torch.bfloat16)
    reason = be.unsupported_reason(q)
    assert reason is not None and "sage8_cute" in reason and "CUDA GPU" in reason
    assert "cute" in api.IMPLS
    # the Triton and Gluon loops still do not return an LSE for unequal q/k lengths
    assert not backends.get_backend("sage8").supports_lse


@pytest.fixture(autouse=True)
def _opt_in(monkeypatch):
    # the GPU tests are what verify the experimental loop: they run it
    monkeypatch.setenv(api.CUTE_OPT_IN, "1")


def test_the_experimental_loop_needs_its_opt_in(monkeypatch):
    monkeypatch.delenv(api.CUTE_OPT_IN)
    msg = api._cute_missing()
    assert msg is not None and api.CUTE_OPT_IN in msg and "sage8" in msg


def test_missing_cute_dsl_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("cutlass") else real(name, *a))
    msg = api._cute_missing()
    assert msg is not None and "pip install -e '.[cute]'" in msg and "nvidia-cutlass-dsl" in msg


@pytest.mark.parametrize("kv_len,impl", [(0, "cute"), (9, "cute"), (4, "triton")])
def test_kv_len_is_checked_before_anything_runs(kv_len, impl):
    q = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises((ValueError, RuntimeError), match="kv_len|CUDA|interpreter") as err:
        sage8_dense(q, q, q, impl=impl, kv_len=kv_len)
    if impl == "triton":
        assert "kv_len" in str(err.value) or "interpreter" in str(err.value)


def test_unequal_lengths_without_the_cute_loop_say_which_backend_does():
    be = backends.get_backend("sage8")
    q = torch.zeros(1, 8, 2, 128)
    k = torch.zeros(1, 6, 2, 128)
    with pytest.raises(ValueError, match="sage8_cute"):
        be.dense_lse(q, k, k, softmax_scale=0.1)


def test_config_rules():
    # the config module imports no cutlass: its rules are checked on any machine
    from dist_attn.kernels.sage8.attn_cute_config import CuteConfig
    with pytest.raises(ValueError, match="stages"):
        CuteConfig(stages=1)
    with pytest.raises(ValueError, match="65,536"):
        CuteConfig(consumer_regs=256, producer_regs=256)
    for bad in (9, True, 2.5):
        with pytest.raises(ValueError, match=r"poly_exp2=.* must be an int in \[0, 8\]"):
            CuteConfig(poly_exp2=bad)
    with pytest.raises(ValueError, match="p_fence=True needs P in registers with overlap"):
        CuteConfig(p_fence=True, p_smem=True)
    with pytest.raises(ValueError, match="ks_ahead=True needs overlap=True"):
        CuteConfig(ks_ahead=True, overlap=False)
    with pytest.raises(ValueError, match="turns=False needs overlap=True"):
        CuteConfig(turns=False, overlap=False)


def _ref_lse(q, k, v, scale, kv_len=None):
    """float64 attention of [B, T, H, D] over keys [0, kv_len): (out [B, T, H, D], lse [B, H, T])."""
    kv_len = k.shape[1] if kv_len is None else kv_len
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k[:, :kv_len], v[:, :kv_len]))
    s = qd @ kd.transpose(-1, -2) * scale
    return (torch.softmax(s, -1) @ vd).transpose(1, 2), torch.logsumexp(s, -1)


def test_unequal_ring_pieces_are_padded_and_cut_back(monkeypatch):
    # The backend's side of a ring piece (Lq != Lk): q, k, v padded with zero rows to one length,
    # the kernel told to attend keys [0, Lk), the result cut to Lq rows. The kernel is replaced by
    # the float64 reference honouring kv_len (the real one needs a GPU: the GPU test below).
    from dist_attn.backends import sage8 as sage8_backend
    seen = {}

    def fake_kernel(q, k, v, scale, impl, kv_len):
        seen.update(T=q.shape[1], kv_len=kv_len, zero_tail=bool((k[:, kv_len:] == 0).all()))
        out, lse = _ref_lse(q, k, v, scale, kv_len)
        return out.to(q.dtype), lse.float()

    monkeypatch.setattr(sage8_backend.ops, "dense_lse_kv", fake_kernel)
    be = backends.get_backend("sage8_cute")
    g = torch.Generator().manual_seed(0)
    for lq, lk in ((7, 5), (5, 9)):
        q = torch.randn(2, lq, 3, 16, generator=g)
        k, v = torch.randn(2, lk, 3, 16, generator=g), torch.randn(2, lk, 3, 16, generator=g)
        out, lse = be.dense_lse(q, k, v, softmax_scale=0.25)
        ref, lref = _ref_lse(q, k, v, 0.25)
        assert out.shape == q.shape and lse.shape == (2, 3, lq)
        assert seen == {"T": max(lq, lk), "kv_len": lk, "zero_tail": True}
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), lref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU of compute capability 9.0")
@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL (the cute extra) is not installed")
@pytest.mark.parametrize("ring", [2, 3])
def test_ring_pieces_merged_by_their_lse_match_float64(ring):
    # A ring of R chunks on one GPU: every (query chunk, key chunk) piece through the backend's
    # dense_lse (chunks of unequal lengths), merged by ring.merge_partial. The
    # merged error against float64 stays within 10% of one sage8_cute call on the whole sequence.
    from dist_attn.ring import merge_partial
    be = backends.get_backend("sage8_cute")
    g = torch.Generator(device="cuda").manual_seed(ring)
    T, H, D = 2001, 4, 128
    q, k, v = (torch.randn(1, T, H, D, generator=g, device="cuda") for _ in range(3))
    k += 0.5
    v += torch.rand(H, D, generator=g, device="cuda")
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    scale = 1 / math.sqrt(D)
    ref, lref = _ref_lse(q, k, v, scale)
    whole, lwhole = be.dense_lse(q, k, v, softmax_scale=scale)
    # uneven chunks (1,100 / 901 rows; 750 / 650 / 601), so most pieces pair unequal lengths
    cuts = {2: [0, 1100, T], 3: [0, 750, 1400, T]}[ring]
    bounds = list(zip(cuts[:-1], cuts[1:]))
    acc = torch.zeros(1, T, H, D, device="cuda")
    acc_lse = torch.full((1, T, H), float("-inf"), device="cuda")
    for qa, qb in bounds:
        for ka, kb in bounds:
            part, lse = be.dense_lse(q[:, qa:qb], k[:, ka:kb], v[:, ka:kb], softmax_scale=scale)
            merge_partial(acc, acc_lse, part, lse, (qa, qb))
    err = lambda o: ((o.double() - ref).norm() / ref.norm()).item()
    assert acc.isfinite().all() and err(acc) <= 1.1 * err(whole) + 1e-4, (err(acc), err(whole))
    assert (acc_lse.transpose(1, 2).double() - lref).abs().max() < 0.05
    assert (lwhole.double() - lref).abs().max() < 0.05
