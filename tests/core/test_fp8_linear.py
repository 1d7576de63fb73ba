# SPDX-License-Identifier: Apache-2.0
"""The FP8 linear recipe (dist_attn.models.h3.fp8.linear) on CPU: its emulation is torchao's
quantizer bit for bit and torch._scaled_mm's arithmetic up to float32 rounding; zero rows stay
finite; a CPU or a missing torchao is refused by name; the core imports without torchao; its
modules are what the library's weight sharding takes (quantized names, the torchao swap)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from dist_attn.models.h3.fp8.linear import (ACTIVATION_AMAX_FLOOR, E4M3_MAX, FP8_EXTRA,
                                            EmulatedFp8Linear, Fp8Linear, Fp8SwiGLUFeedForward,
                                            fp8_linear_emulated, fp8_unsupported_reason,
                                            quantize_rows_e4m3, quantize_weight_e4m3,
                                            require_torchao)

from tests.conftest import ROOT, subprocess_env

__all__: list[str] = []

BF16_ULP = 2.0 ** -7  # spacing of bf16 values in [1, 2): one rounding of the output


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _operands(m=96, k=320, n=64, seed=0):
    """Activations with three outlier channels (x20, as LLM/DiT activations have) and a
    kaiming-uniform weight, both bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, [5, k // 4, k - 7]] *= 20
    w = (torch.rand(n, k, generator=g) * 2 - 1) / k ** 0.5
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def test_codes_and_scales_follow_torchaos_recipe():
    """Per row: scale = bf16(max|x| / 448) then float32, codes = e4m3(x / scale) saturated."""
    x, _ = _operands()
    codes, scales = quantize_rows_e4m3(x)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert codes.shape == x.shape and scales.shape == (x.shape[0], 1)
    amax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.equal(scales, (amax / 448.0).float())
    # the bf16 division is deliberate (torchao's _choose_scale_float8 divides in the input dtype):
    # it differs from a float32 division on some rows, and so would every code of those rows
    assert not torch.equal(scales, amax.float() / 448.0)
    assert torch.equal(codes.float(), (x.float() / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    # every row reaches (about) the top of e4m3; dequantized values are within e4m3's half step
    assert float(codes.float().abs().amax(dim=-1).min()) >= 416  # 448 / (1 + 2^-8) rounded down
    err = (codes.float() * scales - x.float()).abs() / x.float().abs().clamp(min=1e-3)
    assert float(err[x.float().abs() > scales * 2 ** -6].max()) <= 2 ** -4 + 1e-6  # 3 mantissa bits


def test_quantizer_is_torchaos_bit_for_bit():
    """The same codes and scales as torchao's own float8 primitives (what its Float8Tensor.from_hp
    calls when no MSLK kernel is installed), activations with the floor and weights without."""
    pytest.importorskip("torchao", reason="torchao is not installed (the fp8 extra)")
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    x, w = _operands()
    for t, floor in ((x, ACTIVATION_AMAX_FLOOR), (w, None)):
        want_s = _choose_scale_float8(t, block_size=[1, t.shape[-1]], float8_dtype=torch.float8_e4m3fn,
                                      hp_value_lb=floor)
        want_c = _quantize_affine_float8(t, want_s, torch.float8_e4m3fn)
        codes, scales = quantize_rows_e4m3(t, amax_floor=floor)
        assert torch.equal(scales, want_s)
        assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8))


def test_emulation_is_scaled_mm_math():
    """fp8_linear_emulated against torch._scaled_mm with per-row scales (CPU's oneDNN path). The
    CPU kernel dequantizes before a float32 GEMM, the GPU one scales in the epilogue after the
    float32 accumulation (as the emulation does): equal up to float32 rounding (~1e-7 relative),
    i.e. at most one bf16 rounding apart in bf16."""
    x, w = _operands()
    w_codes, w_scales = quantize_weight_e4m3(w)
    x_codes, x_scales = quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR)
    try:
        got32 = torch._scaled_mm(x_codes, w_codes.t(), x_scales, w_scales.t(), out_dtype=torch.float32)
        got16 = torch._scaled_mm(x_codes, w_codes.t(), x_scales, w_scales.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch._scaled_mm with row-wise scales does not run here: {e}")
    emu32 = fp8_linear_emulated(x, w_codes, w_scales, out_dtype=torch.float32)  # no output rounding
    ref = (x_codes.double() @ w_codes.double().t()) * x_scales.double() * w_scales.double().t()
    scale = ref.abs().amax()
    assert float((emu32.double() - ref).abs().max() / scale) < 1e-6
    assert float((got32.double() - ref).abs().max() / scale) < 1e-6
    emu16 = fp8_linear_emulated(x, w_codes, w_scales)
    assert emu16.dtype == torch.bfloat16
    diff = (emu16.float() - got16.float()).abs()
    assert bool((diff <= got16.float().abs() * BF16_ULP + 1e-30).all())
    assert float((emu16.float() != got16.float()).float().mean()) < 0.05  # rare ties only


def test_fp8_differs_from_bf16_and_is_close_to_float64():
    """The recipe's error on outlier activations: 1-3% rel-L2, far above bf16's (a test that an
    FP8 path really ran can tell them apart)."""
    x, w = _operands()
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    ref = x.double() @ w.double().t()
    fp8 = EmulatedFp8Linear.from_linear(lin)
    with torch.no_grad():
        e8, e16 = _rel(fp8(x), ref), _rel(lin(x), ref)
    assert e16 < 4e-3 and 5e-3 < e8 < 5e-2, (e16, e8)
    assert fp8.weight_codes.dtype == torch.float8_e4m3fn and not hasattr(fp8, "weight")


def test_zero_rows_stay_finite():
    """An all-zero activation row (padding rows of an attention output are exactly zero) and an
    all-zero weight row: scale 0 would make 0/0 = NaN codes; the floor and fix_zero_rows give 0."""
    x, w = _operands(m=8, k=64, n=32)
    x[3] = 0
    w[7] = 0
    naked, _ = quantize_rows_e4m3(x)  # no floor: what torchao alone does to the zero row
    assert bool(naked[3].float().isnan().all())
    w_codes, w_scales = quantize_weight_e4m3(w)
    assert float(w_scales[7]) == 1.0 and not bool(w_codes.float().isnan().any())
    y = fp8_linear_emulated(x, w_codes, w_scales)
    assert bool(y.isfinite().all())
    assert bool((y[3] == 0).all()) and bool((y[:, 7] == 0).all())


def test_bias_leading_dims_and_dtype():
    x, w = _operands(m=12, k=64, n=32)
    lin = nn.Linear(64, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    fp8 = EmulatedFp8Linear.from_linear(lin)
    x3 = x.reshape(3, 4, 64)  # [B, S, K] -> [B, S, N]
    y = fp8(x3)
    assert y.shape == (3, 4, 32) and y.dtype == torch.bfloat16
    assert torch.equal(y.reshape(12, 32), fp8(x))
    f32 = {"out_dtype": torch.float32}  # compare before the bf16 output rounding
    with_bias = fp8_linear_emulated(x, fp8.weight_codes, fp8.weight_scales, fp8.bias, **f32)
    no_bias = fp8_linear_emulated(x, fp8.weight_codes, fp8.weight_scales, **f32)
    assert torch.allclose(with_bias - no_bias, lin.bias.float().expand(12, 32), atol=1e-6)
    assert E4M3_MAX == 448.0


def test_dtype_casts_keep_the_codes_and_scales():
    """``model.to(torch.float16)`` / ``.bfloat16()`` (diffusers users cast whole pipelines) moves
    the e4m3 codes and float32 scales but never re-rounds them; a bias follows the cast."""
    x, w = _operands(m=8, k=64, n=32)
    lin = nn.Linear(64, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    emulated = EmulatedFp8Linear.from_linear(lin)
    codes, scales = quantize_weight_e4m3(w)
    fused = Fp8Linear(codes, scales, fast_accum=False)
    ffn = Fp8SwiGLUFeedForward(Fp8Linear(codes, scales, fast_accum=False), codes[:, :16].clone(),
                               scales, fast_accum=False)
    y = emulated(x)
    for module in (emulated, fused, ffn):
        saved = {name: buf.clone() for name, buf in module.named_buffers()}
        module.to(torch.float16).bfloat16().to("cpu", torch.float64)
        for name, buf in module.named_buffers():
            assert buf.dtype == saved[name].dtype, name
            assert torch.equal(buf.float(), saved[name].float()), name  # e4m3 -> float32 is exact
    assert emulated.bias.dtype == torch.float64
    assert torch.equal(emulated.to(torch.bfloat16)(x), y)


def test_cpu_is_refused_by_name():
    reason = fp8_unsupported_reason(torch.device("cpu"))
    assert reason and "device cpu" in reason and "compute capability >= 8.9" in reason


def test_missing_torchao_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao -> ImportError
    with pytest.raises(ImportError, match=r"torchao is not installed .*pip install -e '\.\[fp8\]'"):
        require_torchao()
    assert FP8_EXTRA == "pip install -e '.[fp8]' (in a clone of the repository)"


_BLOCK_TORCHAO = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchao" or name.startswith("torchao."):
            raise ImportError("torchao blocked by the test")
sys.meta_path.insert(0, _Block())
"""


def test_core_and_server_import_without_torchao():
    """With torchao unimportable: the core, the server's config/checks/cli and the diffusers
    integration import, a bf16 config validates, and an fp8 config still validates (the device
    and torchao are launch checks); nothing imported torchao on the way."""
    code = _BLOCK_TORCHAO + """
import dist_attn, dist_attn.models.h3.fp8.linear, dist_attn.models.h3.serve.config, dist_attn.models.h3.serve.launch.checks
import dist_attn.models.h3.serve.launch.cli, dist_attn.models.h3.serve.h3.model
from dist_attn.models.h3.serve.config import apply_overrides, load_config
cfg = apply_overrides(load_config(None), {"model.linear_precision": "fp8"})
assert cfg.model.linear_precision == "fp8"
try:
    import diffusers  # noqa: F401
except ImportError:
    pass
else:
    import dist_attn.integrations.diffusers
assert not any(m == "torchao" or m.startswith("torchao.") for m in sys.modules), "torchao imported"
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_the_modules_hold_what_weight_sharding_takes(monkeypatch):
    """The library's protocol, implemented here: every FP8 module names its codes and scales, and
    Fp8Linear is the registered replacement of a torchao FP8 linear (its codes shared); with no
    module registered, shard_module's swap says what is missing."""
    from dist_attn import weight_codes as wc, weight_sharding as ws

    x, w = _operands(n=32)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(w)
    emulated = EmulatedFp8Linear.from_linear(linear)
    assert isinstance(emulated, ws.HoldsQuantizedTensors)
    assert ws.quantized_names(emulated) == ("weight_codes", "weight_scales")
    assert ws.quantized_names(linear) == ()
    codes, scales = quantize_weight_e4m3(w)
    root = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    root[0].weight.qdata, root[0].weight.scale = codes, scales  # what torchao's Float8Tensor holds
    assert wc.torchao_to_fp8_linear(root) == 1
    assert type(root[0]) is Fp8Linear and root[0].weight_codes is codes
    assert ws.quantized_names(root[0]) == ("weight_codes", "weight_scales")
    assert wc.fp8_buffers_to_parameters(root) == 2
    assert {n for n, _ in root.named_parameters()} == {"0.weight_codes", "0.weight_scales"}
    monkeypatch.setattr(wc, "_FP8_LINEAR", [])
    root = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=False))
    root[0].weight.qdata, root[0].weight.scale = codes, scales
    with pytest.raises(ValueError, match=r"0: a torchao FP8 linear, and no FP8 linear module is "
                                         r"registered .*register_fp8_linear"):
        wc.torchao_to_fp8_linear(root)
    # with a group to shard over, shard_module refuses before it shards or swaps anything: the
    # model is left as it was (the mesh stands in for a process group's; fully_shard never runs)
    monkeypatch.setattr(ws, "_fsdp_mesh", lambda group, root, device: object())
    with pytest.raises(ValueError, match=r"no FP8 linear module is registered"):
        ws.shard_module(root, ["0"])
    assert type(root[0]) is nn.Linear and not ws.is_sharded(root) and root[0].weight.requires_grad
    # a bias is named first, registered module or not (the swap could not take it either way)
    biased = nn.Sequential(nn.Linear(w.shape[1], w.shape[0], bias=True))
    biased[0].weight.qdata, biased[0].weight.scale = codes, scales
    with pytest.raises(ValueError, match=r"0: a torchao FP8 linear with a bias"):
        wc.check_torchao_linears(biased)
