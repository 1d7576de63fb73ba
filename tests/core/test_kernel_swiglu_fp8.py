# SPDX-License-Identifier: Apache-2.0
"""The fused SwiGLU + FP8 row quantization kernel (dist_attn.models.h3.fp8.swiglu_kernel) on CPU.

The Triton kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set
before triton decorates the kernel) and must equal, bit for bit, diffusers' eager bf16 SwiGLU
followed by the recipe's row quantization (:func:`dist_attn.models.h3.fp8.linear.quantize_rows_e4m3`):
every code and every scale, over rows chosen to hit the roundings (normal and subnormal e4m3
values, an all-zero row, an outlier row, a non-power-of-two width). The same check at H3's width
with the GPU's libdevice ``expf`` is in tests/integrations/test_fp8_gpu.py.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.core._interp import run_interpreted

__all__: list[str] = []

_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from dist_attn.models.h3.fp8.linear import (ACTIVATION_AMAX_FLOOR, EmulatedFp8Linear,
                                                Fp8SwiGLUFeedForward, quantize_rows_e4m3,
                                                quantize_weight_e4m3)
    from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows

    g = torch.Generator().manual_seed(0)
    for inner in (96, 100):
        h = torch.randn(40, 2 * inner, generator=g)
        h[:10] *= 4.0
        h[10:20] *= 1e-3      # products deep in e4m3's subnormal range after scaling by the row
        h[20, 3] = 300.0      # one outlier: the rest of its row lands on subnormal codes
        h[21] = 0.0           # an all-zero row: the floor's scale, zero codes, no NaN
        h[22, inner:] = 0.0   # zero gates: y = value * 0, -0 where the value is negative
        h[22, :inner] = -h[22, :inner].abs()
        h[23, 5] = float("nan")  # a NaN: a NaN scale and every code NaN, as the recipe
        h[24, 7] = float("inf")  # an inf value: scale inf, its code NaN, the others 0
        h = h.to(torch.bfloat16)
        before = h.clone()
        value, gate = h.chunk(2, dim=-1)
        y = value * F.silu(gate)  # diffusers' SwiGLU, eager bf16
        want_codes, want_scales = quantize_rows_e4m3(y, amax_floor=ACTIVATION_AMAX_FLOOR)
        codes, scales = swiglu_e4m3_rows(h.view(4, 10, 2 * inner))  # leading dims are flattened
        assert torch.equal(h.view(torch.int16), before.view(torch.int16)), "h was modified"
        assert codes.shape == (40, inner) and scales.shape == (40, 1), (codes.shape, scales.shape)
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        # the NaN and inf rows: their scales here (the interpreter's fp8 cast turns a NaN into a
        # number, so their NaN codes are checked on the GPU, tests/integrations/test_fp8_gpu.py)
        special = torch.tensor([23, 24])
        assert torch.isnan(scales[23]).all() and torch.isnan(want_scales[23]).all()
        assert scales[24].item() == want_scales[24].item() == float("inf")
        finite = ~torch.isnan(want_codes[24].float())
        assert torch.equal(codes[24][finite].float(), want_codes[24][finite].float())
        keep = torch.ones(40, dtype=torch.bool)
        keep[special] = False
        assert torch.equal(scales[keep], want_scales[keep]), (scales - want_scales).abs().max()
        bad = int((codes[keep].view(torch.uint8) != want_codes[keep].view(torch.uint8)).sum())
        assert bad == 0, f"{bad} codes differ at inner={inner}"
        assert int((codes[22].view(torch.uint8) == 0x80).sum()) > 0, "no -0 codes: the -0 row proves nothing"
        assert int((codes[21].float() != 0).sum()) == 0
        sub = (codes.float().abs() < 2 ** -6) & (codes.float() != 0)
        print(f"inner={inner} codes equal, {int(sub.sum())} subnormal codes")

    # the module: the fused kernel + torch._scaled_mm equals the emulated down projection
    proj = torch.nn.Linear(64, 192, bias=False).bfloat16()
    down = torch.nn.Linear(96, 48, bias=False).bfloat16()
    w_codes, w_scales = quantize_weight_e4m3(down.weight.detach())
    ff = Fp8SwiGLUFeedForward(proj, w_codes, w_scales, fast_accum=False)
    x = torch.randn(3, 7, 64, generator=g).bfloat16()
    with torch.no_grad():
        got = ff(x)
        value, gate = proj(x).chunk(2, dim=-1)
        want = EmulatedFp8Linear(w_codes, w_scales, None)(value * F.silu(gate))
    assert got.shape == (3, 7, 48) and got.dtype == torch.bfloat16
    # the codes are checked bit for bit above; the GEMMs may sum in another order (CPU
    # torch._scaled_mm runs threaded), so the outputs agree to a bf16 rounding
    err = (got.float() - want.float()).abs()
    assert bool((err <= want.float().abs() * 2 ** -7 + 1e-6).all()), err.max()

    # inference only: the forward runs with grad on, a backward names the option to turn off
    h = torch.randn(6, 192, generator=g).bfloat16().requires_grad_()
    codes, scales = swiglu_e4m3_rows(h)
    assert torch.equal(codes.view(torch.uint8), swiglu_e4m3_rows(h.detach())[0].view(torch.uint8))
    try:
        scales.sum().backward()
        raise AssertionError("the backward ran")
    except RuntimeError as exc:
        assert "has no backward" in str(exc) and "torch.no_grad()" in str(exc), exc
        assert "fuse_swiglu=False" in str(exc), exc
    print("OK")
    """
)


def test_interp_swiglu_e4m3_is_the_recipe_bit_for_bit():
    lines = run_interpreted("-c", _SCRIPT)
    assert all(int(line.split()[3]) > 0 for line in lines if line.startswith("inner=")), lines


@pytest.mark.parametrize("shape, dtype, match", [
    ((4, 96), torch.float16, "h.dtype"),
    ((4, 97), torch.bfloat16, "must be even"),
    ((4, 2 * 16384 + 2), torch.bfloat16, "at most"),
])
def test_swiglu_e4m3_rejects_bad_h(shape, dtype, match):
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows

    with pytest.raises(ValueError, match=match):
        swiglu_e4m3_rows(torch.zeros(shape, dtype=dtype))


def test_swiglu_e4m3_rejects_a_strided_last_dim():
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows

    with pytest.raises(ValueError, match="contiguous"):
        swiglu_e4m3_rows(torch.zeros(96, 4, dtype=torch.bfloat16).t())


def test_fused_ffn_cast_after_quantizing_names_the_fusion():
    """A model cast after quantize_linears hands the fused FFN another dtype: the error names the
    fusion and the cast, raised before the kernel (whose own message names neither)."""
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.linear import Fp8SwiGLUFeedForward, quantize_weight_e4m3

    down = torch.nn.Linear(96, 48, bias=False).bfloat16()
    ff = Fp8SwiGLUFeedForward(torch.nn.Linear(64, 192, bias=False).bfloat16(),
                              *quantize_weight_e4m3(down.weight.detach()), fast_accum=False).half()
    with pytest.raises(ValueError, match=r"the FFN's projection gave torch.float16: an FFN fused by "
                                         r"quantize_linears\(fuse_swiglu=True or 'auto'\) takes "
                                         r"bfloat16; was the model cast after quantize_linears"):
        ff(torch.zeros(2, 64, dtype=torch.float16))
