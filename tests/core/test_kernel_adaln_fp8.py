# SPDX-License-Identifier: Apache-2.0
"""The fused norm + AdaLN modulation + FP8 row quantization kernel (dist_attn.models.h3.fp8.adaln_kernel)
on CPU.

The Triton kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (set before triton decorates
the kernel) and must equal its torch reference bit for bit (every code and scale) over rows
chosen to hit the roundings: large, tiny and all-zero rows, an outlier, strided modulation
tables, two leading indices, no norm weight, a non-power-of-two width. The reference itself is
pinned against float64 and against diffusers' eager bf16 ops; the GPU check is in
tests/integrations/test_fp8_gpu.py.
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
    from dist_attn.models.h3.fp8.adaln_kernel import (adaln_e4m3_rows, adaln_e4m3_rows_reference,
                                                      residual_adaln_e4m3_rows)

    g = torch.Generator().manual_seed(0)
    for k, with_weight in ((96, True), (100, False)):
        x = torch.randn(2, 20, k, generator=g)
        x[0, :5] *= 30.0
        x[0, 5:10] *= 1e-4
        x[1, 3] = 0.0          # an all-zero row: y = shift, no NaN
        x[1, 4, 7] = 500.0     # one outlier, and small values beside it: subnormal codes
        x[1, 4, :40] *= 1e-2
        x = x.to(torch.bfloat16)
        table = torch.randn(6, 6 * k, generator=g) * 0.3
        table[0] = 0.0         # entry 0: no modulation, so the outlier row keeps its small values
        table = table.to(torch.bfloat16)
        shift, scale = table.chunk(6, dim=-1)[:2]  # strided rows, as H3's adaln_proj returns
        weight = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16) if with_weight else None
        index = torch.randint(1, 6, (20,), generator=g)
        index[4] = 0
        before = x.clone()
        codes, scales = adaln_e4m3_rows(x, weight, 1e-5, scale, shift, index)
        assert torch.equal(x.view(torch.int16), before.view(torch.int16)), "x was modified"
        assert codes.shape == (2, 20, k) and scales.shape == (2, 20, 1), (codes.shape, scales.shape)
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
        want_codes, want_scales = adaln_e4m3_rows_reference(x.reshape(40, k), weight, 1e-5, scale,
                                                            shift, index)
        assert torch.equal(scales.reshape(40, 1), want_scales), (scales.reshape(40, 1) - want_scales).abs().max()
        bad = int((codes.reshape(40, k).view(torch.uint8) != want_codes.view(torch.uint8)).sum())
        assert bad == 0, f"{bad} codes differ at k={k}"
        sub = (codes.float().abs() < 2 ** -6) & (codes.float() != 0)
        print(f"k={k} codes equal, {int(sub.sum())} subnormal codes")
        # the residual step fused in front: h bit for bit diffusers' bf16 ops, then the same pass
        # strides apart: the gate from a table of another width than scale's, x a slice of wider rows
        g2 = torch.Generator().manual_seed(k)
        gate = (torch.randn(6, 3 * k, generator=g2) * 0.3).to(torch.bfloat16)[:, k:2 * k]
        update = (torch.randn(2, 20, k, generator=g2) * 3).to(torch.bfloat16)
        x = torch.cat([x, torch.ones(2, 20, 8, dtype=torch.bfloat16)], dim=-1)[..., :k]
        assert gate.stride(0) != scale.stride(0) and x.stride(1) != update.stride(1)
        update[1, 5] = (-x[1, 5].float() / gate[index[5]].float()).to(torch.bfloat16)  # x + g * u ~ 0
        h_want = x + gate.index_select(0, index) * update
        before_u = update.clone()
        h, codes, scales = residual_adaln_e4m3_rows(x, gate, update, weight, 1e-5, scale, shift, index)
        assert torch.equal(update.view(torch.int16), before_u.view(torch.int16)), "update was modified"
        assert h.dtype == torch.bfloat16 and h.shape == x.shape
        assert torch.equal(h.view(torch.int16), h_want.view(torch.int16)), (h.float() - h_want.float()).abs().max()
        c2, s2 = adaln_e4m3_rows(h_want, weight, 1e-5, scale, shift, index)
        assert torch.equal(scales, s2) and torch.equal(codes.view(torch.uint8), c2.view(torch.uint8))
        print(f"residual at k={k}: h and codes equal")
    print("OK")
    """
)


def test_interp_adaln_e4m3_is_its_reference_bit_for_bit():
    lines = run_interpreted("-c", _SCRIPT)
    assert all(int(line.split()[3]) > 0 for line in lines if line.startswith("k=")), lines


def _tables(k, t=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    table = (torch.randn(t, 6 * k, generator=g) * 0.3).to(torch.bfloat16)
    shift, scale = table.chunk(6, dim=-1)[:2]
    return g, shift, scale


def test_reference_against_float64_and_diffusers_eager_ops():
    """The reference's dequantized rows against the modulated norm in float64: e4m3's error
    (3 mantissa bits: ~2.5% rel-L2), not more; against diffusers' eager bf16 ops (which round
    four times), the same codes for most values and the same error to float64."""
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.linear import ACTIVATION_AMAX_FLOOR, quantize_rows_e4m3
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows_reference

    k = 512
    g, shift, scale = _tables(k)
    x = (torch.randn(300, k, generator=g) * 2).to(torch.bfloat16)
    norm = torch.nn.RMSNorm(k, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    index = torch.randint(0, 6, (300,), generator=g)
    codes, scales = adaln_e4m3_rows_reference(x, norm.weight, 1e-5, scale, shift, index)
    got = codes.double() * scales.double()
    xd = x.double()
    exact = (xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + 1e-5) * norm.weight.double()
             * (1 + scale.double()[index]) + shift.double()[index])
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    err = rel(got, exact)
    assert 1e-2 <= err <= 4e-2, err
    with torch.no_grad():
        eager = norm(x) * (1.0 + scale.index_select(0, index)) + shift.index_select(0, index)
    e_codes, e_scales = quantize_rows_e4m3(eager, amax_floor=ACTIVATION_AMAX_FLOOR)
    same = (e_codes.view(torch.uint8) == codes.view(torch.uint8)).float().mean().item()
    e_err = rel(e_codes.double() * e_scales.double(), exact)
    assert same >= 0.9, same
    assert err <= 1.02 * e_err, (err, e_err)


@pytest.mark.parametrize("change, match", [
    (dict(x=torch.zeros(2, 4, 64, dtype=torch.float16)), r"x.dtype=torch.float16"),
    (dict(x=torch.zeros(2, 64, 4, dtype=torch.bfloat16).transpose(1, 2)), r"last dim contiguous"),
    (dict(x=torch.zeros(4, 16385, dtype=torch.bfloat16)), r"K <= 16384"),
    (dict(weight=torch.ones(63)), r"weight has shape \(63,\) and strides \(1,\); it must be \(64,\) and contiguous"),
    (dict(weight=torch.ones(128)[::2]), r"weight has shape \(64,\) and strides \(2,\)"),
    (dict(scale=torch.zeros(3, 63)), r"scale has shape \(3, 63\)"),
    (dict(shift=torch.zeros(2, 64)), r"scale has 3 rows and shift 2; they must have the same rows"),
    (dict(index=torch.zeros(4, dtype=torch.long, device="meta")), r"index is on meta and x on cpu"),
    (dict(index=torch.zeros(3, dtype=torch.long)), r"index has shape \(3,\).*\(4,\) integers"),
    (dict(index=torch.zeros(4)), r"index has shape \(4,\) and dtype torch.float32"),
    (dict(eps=0.0), r"eps=0.0 must be a positive number"),
])
def test_adaln_e4m3_names_the_bad_argument(change, match):
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows

    args = dict(x=torch.zeros(2, 4, 64, dtype=torch.bfloat16), weight=torch.ones(64), eps=1e-5,
                scale=torch.zeros(3, 64), shift=torch.zeros(3, 64), index=torch.zeros(4, dtype=torch.long))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        adaln_e4m3_rows(**args)


@pytest.mark.parametrize("change, match", [
    (dict(gate=torch.zeros(3, 64)), r"gate has shape \(3, 64\), dtype torch.float32.*bfloat16 \[3, 64\]"),
    (dict(gate=torch.zeros(2, 64, dtype=torch.bfloat16)), r"gate has shape \(2, 64\)"),
    (dict(update=torch.zeros(2, 4, 64)), r"update has shape \(2, 4, 64\), dtype torch.float32"),
    (dict(update=torch.zeros(1, 4, 64, dtype=torch.bfloat16)), r"of x's shape \(2, 4, 64\)"),
    (dict(update=torch.zeros(2, 4, 64, dtype=torch.bfloat16, device="meta")), r"update is on meta"),
    (dict(eps=-1.0), r"eps=-1.0 must be a positive number"),
    (dict(eps=True), r"eps=True must be a positive number"),
])
def test_residual_adaln_names_the_bad_argument(change, match):
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.models.h3.fp8.adaln_kernel import residual_adaln_e4m3_rows

    args = dict(x=torch.zeros(2, 4, 64, dtype=torch.bfloat16), gate=torch.zeros(3, 64, dtype=torch.bfloat16),
                update=torch.zeros(2, 4, 64, dtype=torch.bfloat16), weight=torch.ones(64), eps=1e-5,
                scale=torch.zeros(3, 64), shift=torch.zeros(3, 64), index=torch.zeros(4, dtype=torch.long))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        residual_adaln_e4m3_rows(**args)


@pytest.mark.parametrize("has_res", [True, False])
def test_kernel_is_compiled_without_fma(has_res):
    """The kernel compiled for an H100 (sm_90; triton's own compiler, no GPU needed) holds no
    contracted FMA (only the exact division's own).
    With contraction on, LLVM narrowed the residual step's float32 ops on bf16 values to bf16 ones
    and the backend fused them into ``fma.rn.bf16x2``: ``x + gate * update`` rounded once, where
    diffusers' ops round twice (one bf16 step off in the GPU test, 2026-12-07). The options are the
    ones the launch passes, read from it, so dropping ``enable_fp_fusion=False`` fails here."""
    pytest.importorskip("triton", reason="the kernel module imports triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import dist_attn.models.h3.fp8.adaln_kernel as mod

    seen = {}

    class Grab:  # stands in for the kernel: records what the launch passes
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.update(kwargs, args=args)

    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    table = torch.zeros(2, 64, dtype=torch.bfloat16)
    real = mod._adaln_e4m3_kernel
    mod._adaln_e4m3_kernel = Grab()
    try:
        mod._launch(x, table if has_res else None, x if has_res else None, table[0], 1e-6, table, table,
                    torch.zeros(4, dtype=torch.int64))
    finally:
        mod._adaln_e4m3_kernel = real
    assert seen["enable_fp_fusion"] is False, seen
    # the signature of the launch's own arguments (a kernel whose parameters change stays covered)
    kinds = {torch.bfloat16: "*bf16", torch.int64: "*i64", torch.float8_e4m3fn: "*fp8e4nv",
             torch.float32: "*fp32"}
    signature = {name: kinds[a.dtype] if torch.is_tensor(a) else "i32" if isinstance(a, int) else "fp32"
                 for name, a in zip(real.arg_names, seen["args"])}
    constexprs = {n: seen[n] for n in real.arg_names[len(seen["args"]):]}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    constexprs.update(BLOCK=8192, INTERP=False)  # H3's width, compiled for the GPU
    options = {"num_warps": seen["num_warps"], "enable_fp_fusion": seen["enable_fp_fusion"]}
    try:
        compiled = triton.compile(ASTSource(fn=real, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", 90, 32), options=options)
    except Exception as exc:  # a triton build without the CUDA backend's tools
        pytest.skip(f"triton cannot compile for sm_90 here: {type(exc).__name__}: {exc}"[:300])
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.bf16" in ptx  # the roundings are there
    assert "fma.rn.bf16" not in ptx, [line.strip() for line in ptx.splitlines() if "fma.rn.bf16" in line][:4]
    # float32: only the exact division's two explicit tl.fma a value (swiglu_fp8._quantize_row)
    per_thread = 8192 // (32 * seen["num_warps"])
    assert ptx.count("fma.rn.f32") == 2 * per_thread, ptx.count("fma.rn.f32")
