# SPDX-License-Identifier: Apache-2.0
"""Accuracy of the 8-bit kernels against float64 where v2 of sage8 was silently wrong.

GPU tests (Hopper; skipped on CPU with the reason), for both sage8 loops and for every registered
8-bit backend that declares ``accuracy_verified`` (which lets ``"auto"`` choose it):

* V with per-channel means U(0, 2) at 38,016 rows (the H3 length) and at 4,096 rows, and four
  documents of one packed axis with their own V means: the running P V sum inside Hopper's FP8
  MMA accumulator lost 0.37 / 0.063 rel-L2 here before the fix (N(0,1) V hid it);
* the q/k/v that the first block of diffusers' ``MiniMaxH3Transformer3DModel`` (56 heads x 128,
  the default hidden size, its own initialisation) computes on a 4,176-row packed layout;
* N(0,1) stays at its level (FP8 rounding of P and V sets ~4e-2 there, as for SageAttention 2).

CPU tests of the scheme itself (the torch reference, modelling the MMA accumulator) are in
``test_kernel_reference.py``. Each output is compared on a sample of query rows against all keys,
in float64 on the GPU. Bounds: <= 0.005 with V means (SageAttention 2: 0.0026-0.0042 on these
families), no worse than SageAttention 2 on real H3 activations; measured values in
benchmarks/KERNEL_NOTES.md v3.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

import dist_attn
from dist_attn.backends import available_backends, get_backend

__all__: list[str] = []


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the 8-bit kernels run on Hopper tensor cores)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs compute capability 9.0 (Hopper), this GPU is {torch.cuda.get_device_capability()}"
    return None


_REASON = _gpu_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

#: V with channel means at H3 length: the issue's target (v2 measured 0.367)
REL_VMEAN_LONG = 5e-3
#: the same at 4,096 rows and over four documents (v2: 0.063)
REL_VMEAN = 5e-3
#: zero-mean N(0,1) V: P and V in e4m3 set ~4e-2 for every Sage-type kernel (v2 0.0390 at 8k rows)
REL_NORMAL = 4.5e-2
#: real H3 first-block activations on this test's 4,176-row layout: no worse than SageAttention 2
#: on the same input (measured 0.0091 on the H200; sage8 0.0089, v2 0.09). At h3-ref the target is
#: 0.006 (SageAttention 2: 0.0059, sage8: 0.0052): benchmarks/accuracy.py, KERNEL_NOTES.md v3.
REL_H3 = 9.5e-3

_IMPLS = [("sage8", "triton"), ("sage8_gluon", "gluon")]


def _verified_8bit() -> list[str]:
    """Every registered backend that quantizes and declares its accuracy verified."""
    names = []
    for name in available_backends():
        if name == "auto":
            continue
        be = get_backend(name)
        if not be.exact and be.accuracy_verified:
            names.append(name)
    return names


def _kernels() -> list[str]:
    return sorted(set(_verified_8bit()) | {n for n, _ in _IMPLS})


kernels = pytest.mark.parametrize("backend", _kernels())


def _runnable(backend: str, q: torch.Tensor) -> None:
    reason = get_backend(backend).unsupported_reason(q)
    if reason is not None:
        pytest.skip(f"backend {backend!r} cannot run here: {reason}")


def _attend(backend, q, k, v, bounds):
    cu = torch.tensor(bounds, dtype=torch.int32, device=q.device)
    return dist_attn.sage_varlen(q, k, v, cu, max(b - a for a, b in zip(bounds, bounds[1:])),
                                 cu_seqlens_host=bounds, valid_len=bounds[-1], backend=backend)


def _rel_l2(out, q, k, v, bounds, n_rows=256, seed=0) -> float:
    """rel-L2 of ``out`` on ``n_rows`` random query rows of every segment (all of its keys) vs float64."""
    g = torch.Generator().manual_seed(seed)
    num = den = 0.0
    scale = 1.0 / math.sqrt(q.shape[-1])
    for a, b in zip(bounds, bounds[1:]):
        rows = a + torch.randperm(b - a, generator=g)[:n_rows].to(q.device)
        for h in range(q.shape[1]):
            p = torch.softmax(q[rows, h].double() @ k[a:b, h].double().T * scale, dim=-1)
            ref = p @ v[a:b, h].double()
            num += ((out[rows, h].double() - ref) ** 2).sum().item()
            den += (ref ** 2).sum().item()
    return math.sqrt(num / den)


def _data(rows, heads, mean_hi, seed, bounds=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn((rows, heads, 128), generator=g, device="cuda") for _ in range(3))
    bounds = bounds or [0, rows]
    for a, b in zip(bounds, bounds[1:]):  # each document its own channel means
        v[a:b] += torch.rand((heads, 128), generator=g, device="cuda") * mean_hi
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), bounds


@kernels
def test_v_channel_means_at_h3_length(backend):
    q, k, v, bounds = _data(38016, 4, 2.0, seed=1)
    _runnable(backend, q)
    rel = _rel_l2(_attend(backend, q, k, v, bounds), q, k, v, bounds)
    print(f"\n[accuracy] {backend} V means U(0,2) 38016 rows rel_l2={rel:.5f}")
    assert rel <= REL_VMEAN_LONG, (backend, rel)


@kernels
@pytest.mark.parametrize("layout", ["dense4k", "four_documents"])
def test_v_channel_means_short_and_segments(backend, layout):
    if layout == "dense4k":
        q, k, v, bounds = _data(4096, 4, 2.0, seed=2)
    else:
        q, k, v, bounds = _data(36000, 4, 2.0, seed=3, bounds=[0, 5000, 17000, 20000, 36000])
    _runnable(backend, q)
    rel = _rel_l2(_attend(backend, q, k, v, bounds), q, k, v, bounds, n_rows=128)
    print(f"\n[accuracy] {backend} V means U(0,2) {layout} rel_l2={rel:.5f}")
    assert rel <= REL_VMEAN, (backend, layout, rel)


@kernels
def test_zero_mean_v_stays_at_its_level(backend):
    q, k, v, bounds = _data(8192, 4, 0.0, seed=4)
    _runnable(backend, q)
    rel = _rel_l2(_attend(backend, q, k, v, bounds), q, k, v, bounds)
    print(f"\n[accuracy] {backend} N(0,1) 8192 rows rel_l2={rel:.5f}")
    assert rel <= REL_NORMAL, (backend, rel)


@pytest.fixture(scope="module")
def h3_first_block_qkv():
    """q/k/v of the first block of the real H3 class at its real attention shape (56 x 128,
    hidden 5376), its own initialisation, bf16, one layer, on a 4,176-row t2va layout."""
    if _REASON is not None:
        pytest.skip(_REASON)
    for mod in ("diffusers", "transformers"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod} (pip install -e '.[diffusers]' and transformers): the H3 "
                        "layout comes from diffusers' MiniMax-H3 pipeline")
    import dist_attn.models.h3.activations as h3

    model = h3.build_h3_model(device="cuda", num_layers=1, seed=0)
    layout = h3.H3Layout(text_rows=256, latent_frames=5, latent_height=64, latent_width=48, audio_latents=40)
    qkv = h3.first_block_qkv(model, h3.h3_inputs(model, layout, device="cuda", seed=0))
    del model
    torch.cuda.empty_cache()
    return qkv


@kernels
def test_real_h3_first_block_activations(backend, h3_first_block_qkv):
    q, k, v = h3_first_block_qkv
    assert q.shape == (4176, 56, 128) and q.dtype == torch.bfloat16
    _runnable(backend, q)
    bounds = [0, q.shape[0]]
    rel = _rel_l2(_attend(backend, q, k, v, bounds), q, k, v, bounds, n_rows=128)
    print(f"\n[accuracy] {backend} real H3 first block (4176 rows, 56 heads) rel_l2={rel:.5f}")
    assert rel <= REL_H3, (backend, rel)


def test_sage8_is_verified_only_with_the_block_accumulation():
    """The default launch configs are the accurate ones (v2's accumulation stays selectable for
    measurements only)."""
    from dist_attn.kernels.sage8 import launch

    for _, impl in _IMPLS:
        assert launch.default_config(impl).pv_accum == "block"
