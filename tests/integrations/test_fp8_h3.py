# SPDX-License-Identifier: Apache-2.0
"""FP8 linear layers in diffusers' MiniMaxH3Transformer3DModel, on CPU through the float32
emulation of the GPU recipe (dist_attn.models.h3.fp8.linear): the served tiny model (configs/tiny.toml, its
own init, bf16 blocks with the class's fp32 modules) against the same model in float64, layer by
layer and at the output; what stays unquantized; enable_ulysses on 1 and 2 ranks; torch.compile
fullgraph; the refusals."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from dist_attn.models.h3.fp8.linear import EmulatedFp8Linear  # noqa: E402
from dist_attn.integrations.diffusers import enable_ulysses  # noqa: E402
from dist_attn.models.h3.fp8 import quantize_linears  # noqa: E402
from dist_attn.models.h3.serve.config import load_config  # noqa: E402
from dist_attn.models.h3.serve.h3.engine import initial_state  # noqa: E402
from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, fp32_module_names  # noqa: E402

from tests._multirank import run_ranks  # noqa: E402
from tests._torch_caps import require_cpu_rowwise_scaled_mm  # noqa: E402

CPU = torch.device("cpu")

# Bounds, rel-L2 against the same weights in float64 (measured on this model, 2 blocks, 274 rows):
# - each of the 12 FP8 linears on the activations it receives: 3.6e-2 .. 4.0e-2 (e4m3 keeps 3
#   mantissa bits: ~2.5% per rounded operand, two operands); its bf16 twin: 1.6e-3 .. 1.7e-3.
#   FP8 must land in [1.5e-2, 6e-2] (too low: not FP8; too high: a wrong scale), bf16 <= 4e-3.
# - the velocity outputs: bf16 4.9e-3, FP8 5.1e-3 (the blocks of an own-init H3 add ~2% to the
#   residual stream, which stays bf16, so the output error is mostly bf16's); FP8 <= 1e-2, and it
#   must differ from the bf16 path by >= 1.5e-3 (measured 3.2e-3; a no-op would give 0).
LINEAR_FP8 = (1.5e-2, 6e-2)
LINEAR_BF16 = 4e-3
OUTPUT_FP8 = 1e-2
FP8_VS_BF16 = 1.5e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(cfg, dtype):
    """The served engine's inputs of the default request (274 rows) at one mid-denoise step."""
    layout = cfg.layout(frames=cfg.request.frames, height=cfg.request.height, width=cfg.request.width)
    video, audio, text = initial_state(cfg, layout, 0, CPU, torch.float32)
    timestep, indices = layout.timestep_rows(0.3, 0.4)
    floats = dtype if dtype == torch.float64 else torch.float32
    return dict(hidden_states=video[None].to(floats), audio_hidden_states=audio[None].to(floats),
                encoder_hidden_states=text.to(dtype), timestep=timestep.to(floats),
                timestep_indices=indices, return_dict=False, **layout.rows())


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)


@pytest.fixture(scope="module")
def served():
    """(config, the bf16 model, its float64 copy): the float64 reference has the bf16 model's
    weights exactly, so the differences are the arithmetic alone."""
    cfg = load_config(None)
    model = build_h3(cfg.model, device=CPU, dtype=torch.bfloat16)
    return cfg, model, copy.deepcopy(model).double()


def test_fp8_h3_against_float64(served):
    cfg, bf16, f64 = served
    fp8 = copy.deepcopy(bf16)
    before = {k: v.clone() for k, v in fp8.state_dict().items()}
    summary = quantize_linears(fp8, "fp8", emulate=True)

    # what was quantized: the 6 block linears of every block, nothing else
    per_block = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.net.0.proj", "ff.net.2"]
    want = [f"transformer_blocks.{i}.{n}" for i in range(cfg.model.num_layers) for n in per_block]
    assert list(summary.layers) == want and summary.count == 6 * cfg.model.num_layers
    assert summary.kernel == "emulated" and not summary.fast_accum
    swapped = {n for n, m in fp8.named_modules() if isinstance(m, EmulatedFp8Linear)}
    assert swapped == set(want)
    # 2 bytes -> 1 byte per weight element, plus one float32 scale per output channel
    elements = sum(bf16.get_submodule(n).weight.numel() for n in want)
    channels = sum(bf16.get_submodule(n).weight.shape[0] for n in want)
    assert summary.bytes_before == 2 * elements and summary.bytes_after == elements + 4 * channels
    assert "GB" in summary.describe() or "MB" in summary.describe()

    # the float32 modules and the other linears are untouched: same tensors, same dtypes
    assert list(summary.kept_fp32) == fp32_module_names(bf16) and summary.cast_fp32 == ()
    after = fp8.state_dict()
    for key, value in before.items():
        if not any(key.startswith(n + ".") for n in want):
            assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    for name in fp32_module_names(bf16):
        assert all(p.dtype == torch.float32 for p in fp8.get_submodule(name).parameters()), name
    for name in ("context_embedder", "token_refiner.refiner_blocks.0.attn.to_q",
                 "transformer_blocks.0.adaln_proj.linear", "norm_out.linear", "proj_out"):
        assert type(fp8.get_submodule(name)) is nn.Linear, name

    # every FP8 linear, on the activations the model hands it, against its float64 twin
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [fp8.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: seen.__setitem__(n, (args[0], out))) for n in want]
    out8 = _forward(fp8, _inputs(cfg, torch.bfloat16))
    for h in hooks:
        h.remove()
    for name, (x, y) in seen.items():
        w = bf16.get_submodule(name).weight
        ref = x.double() @ w.double().t()
        e8, e16 = _rel(y, ref), _rel(torch.nn.functional.linear(x, w), ref)
        assert LINEAR_FP8[0] <= e8 <= LINEAR_FP8[1] and e16 <= LINEAR_BF16, (name, e8, e16)

    # the velocity outputs
    ref = _forward(f64, _inputs(cfg, torch.float64))
    out16 = _forward(bf16, _inputs(cfg, torch.bfloat16))
    for a8, a16, r in zip(out8, out16, ref):
        assert a8.dtype == torch.float32 and bool(a8.isfinite().all())
        assert _rel(a8, r) <= OUTPUT_FP8, _rel(a8, r)
        assert _rel(a8, a16) >= FP8_VS_BF16, _rel(a8, a16)


def test_fp8_through_enable_ulysses_and_compiled(served):
    """One rank: enable_ulysses' processor with FP8 linears gives diffusers' own result bit for
    bit; compile_blocks (fullgraph: a graph break would raise) gives it again."""
    cfg, bf16, _ = served
    fp8 = copy.deepcopy(bf16)
    quantize_linears(fp8, "fp8", emulate=True)
    inputs = _inputs(cfg, torch.bfloat16)
    assert_ulysses_and_compiled_equal(fp8, inputs, _forward(fp8, inputs))


def assert_ulysses_and_compiled_equal(model, inputs, plain) -> None:
    """Under enable_ulysses (one rank, sdpa) ``model`` gives ``plain`` bit for bit; with its
    blocks compiled (fullgraph: a graph break would raise), again up to float32 rounding."""
    with enable_ulysses(model, backend="sdpa"):
        ours = _forward(model, inputs)
        # aot_eager: the graph is traced fullgraph; inductor's C++ builds cost ~40 s on 2 cores
        compile_blocks(model, backend="aot_eager")
        compiled = _forward(model, inputs)
    for a, b, c in zip(plain, ours, compiled):
        assert torch.equal(a, b)
        assert _rel(c, a) <= 1e-6, _rel(c, a)


def two_rank_worker(rank, world, fuse_adaln=False):
    """The served tiny FP8 model (emulated) on two gloo ranks against one process: the largest
    difference of each output, relative to its largest value."""
    cfg = load_config(None)
    model = build_h3(cfg.model, device=CPU, dtype=torch.bfloat16)
    quantize_linears(model, "fp8", emulate=True, fuse_adaln=fuse_adaln)
    inputs = _inputs(cfg, torch.bfloat16)
    one = _forward(model, inputs)
    with enable_ulysses(model, backend="sdpa"):
        two = _forward(model, inputs)
    return [float((a.double() - b.double()).abs().max() / b.double().abs().max()) for a, b in zip(two, one)]


def test_fp8_on_two_ranks_equals_one(tmp_path):
    """Activation scales are per row, so each rank quantizes its rows exactly as one process
    does: 2 gloo ranks (137 rows each) give the single-process FP8 output (measured: identical;
    float32 GEMMs over fewer rows may reorder sums, hence the 1e-6 allowance)."""
    for diffs in run_ranks(two_rank_worker, 2, tmp_path, timeout=240):
        assert max(diffs) <= 1e-6, diffs


def test_refusals_and_bf16_noop(served):
    cfg, bf16, _ = served
    model = copy.deepcopy(bf16)
    summary = quantize_linears(model, "bf16")
    assert summary.count == 0 and summary.kernel == "none" and "no linear quantized" in summary.describe()
    assert type(model.transformer_blocks[0].attn.to_q) is nn.Linear
    with pytest.raises(ValueError, match=r"precision='int8' must be one of 'bf16', 'fp8'"):
        quantize_linears(model, "int8")
    with pytest.raises(RuntimeError, match=r"device cpu has no FP8 matrix multiply .*emulate=True"):
        quantize_linears(model, "fp8")
    # "no" is truthy: it was accepted and turned fast accumulation on
    with pytest.raises(TypeError, match=r"fast_accum='no' must be True or False"):
        quantize_linears(model, "fp8", emulate=True, fast_accum="no")
    with pytest.raises(TypeError, match=r"emulate='yes' must be True or False"):
        quantize_linears(model, "fp8", emulate="yes")
    assert type(model.transformer_blocks[0].attn.to_q) is nn.Linear  # nothing half-done
    quantize_linears(model, "fp8", emulate=True)
    with pytest.raises(ValueError, match=r"transformer_blocks.0.attn.to_q is already quantized"):
        quantize_linears(model, "fp8", emulate=True)
    fp32 = build_h3(cfg.model, device=CPU, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"attn.to_q.weight is torch.float32; FP8 linears take "
                                         r"bfloat16 blocks"):
        quantize_linears(fp32, "fp8", emulate=True)
    from tests.integrations._tiny_models import tiny_wan

    with pytest.raises(TypeError, match=r"no FP8 plan for WanTransformer3DModel; supported: "
                                        r"MiniMaxH3Transformer3DModel"):
        quantize_linears(tiny_wan(2), "fp8", emulate=True)


def test_summary_says_what_the_model_holds(caplog):
    """A model cast whole to bf16 (diffusers warns) has no float32 modules left: the summary names
    them as cast instead of calling them float32; fast_accum under emulation is marked as having
    no effect; at bf16 the options passed as True are named as unused."""
    from tests.integrations._tiny_models import tiny_h3

    summary = quantize_linears(tiny_h3(2).to(torch.bfloat16), "fp8", emulate=True, fast_accum=True,
                               fuse_adaln=True)
    assert summary.kept_fp32 == () and "proj_in (bfloat16)" in summary.cast_fp32
    text = summary.describe()
    assert "kept float32: none; the class's float32 modules found cast (never quantized): proj_in (bfloat16)" in text
    assert "fast_accum=True (no effect: emulated)" in text and "run the emulated GEMM on those codes" in text
    with caplog.at_level(logging.INFO, logger="dist_attn.models.h3.fp8.quantize"):
        quantize_linears(tiny_h3(2).to(torch.bfloat16), "bf16", fast_accum=True, fuse_swiglu=True,
                         fuse_adaln=True)
    assert "(fast_accum=True, fuse_swiglu=True, fuse_adaln=True: no effect without FP8)" in caplog.text


def test_torchao_path_on_cpu_with_the_hardware_gate_lifted(served, monkeypatch):
    """The GPU code path itself, run on CPU: torchao refuses a CPU (its hardware assertion, and
    our device rule), so both are lifted here; CPU's torch._scaled_mm then runs torchao's
    Float8Tensor linears. Weight codes and scales equal the emulation's bit for bit, outputs
    agree up to the order of float32 roundings (CPU dequantizes before its GEMM; measured 5.7e-4),
    enable_ulysses gives the same result, and compile_blocks traces the tensor subclass fullgraph."""
    pytest.importorskip("torchao", reason="torchao is not installed (the fp8 extra)")
    require_cpu_rowwise_scaled_mm()
    import dist_attn.models.h3.fp8.quantize as lp

    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda g: None)
    monkeypatch.setattr(lp, "fp8_unsupported_reason", lambda device: None)
    cfg, bf16, _ = served
    emulated, tao = copy.deepcopy(bf16), copy.deepcopy(bf16)
    quantize_linears(emulated, "fp8", emulate=True)
    summary = quantize_linears(tao, "fp8", fuse_swiglu=False)  # the fused FFN's kernel needs CUDA
    assert summary.kernel == "torchao" and summary.count == 6 * cfg.model.num_layers
    for name in summary.layers:
        w, e = tao.get_submodule(name).weight, emulated.get_submodule(name)
        assert type(w).__name__ == "Float8Tensor" and w.dtype == torch.bfloat16
        assert torch.equal(w.qdata.view(torch.uint8), e.weight_codes.view(torch.uint8))
        assert torch.equal(w.scale, e.weight_scales)
    inputs = _inputs(cfg, torch.bfloat16)
    want, got = _forward(emulated, inputs), _forward(tao, inputs)
    for a, b in zip(got, want):
        assert _rel(a, b) <= 2e-3, _rel(a, b)
    assert_ulysses_and_compiled_equal(tao, inputs, got)


def test_fuse_swiglu_refuses_another_ffn_before_changing_anything(served, monkeypatch):
    """quantize_linears(fuse_swiglu=True) checks every block's FFN is diffusers' bias-free SwiGLU
    before torchao touches a weight (the device and torchao gates are lifted: no GPU here)."""
    import dist_attn.models.h3.fp8.quantize as lp

    monkeypatch.setattr(lp, "fp8_unsupported_reason", lambda device: None)
    monkeypatch.setattr(lp, "torchao_fp8_config", lambda fast_accum: None)
    _, bf16, _ = served
    model = copy.deepcopy(bf16)
    model.transformer_blocks[-1].ff.net[2] = nn.Sequential(model.transformer_blocks[-1].ff.net[2])
    last = len(model.transformer_blocks) - 1
    with pytest.raises(TypeError, match=rf"transformer_blocks.{last}.ff is not diffusers' bias-free "
                                        r"SwiGLU FeedForward .*fuse_swiglu='auto' or False"):
        quantize_linears(model, "fp8", fuse_swiglu=True)
    assert type(model.transformer_blocks[0].attn.to_q) is nn.Linear  # nothing half-done
    assert not hasattr(model.transformer_blocks[0].attn.to_q.weight, "qdata")
    # the FFNs are fine but the weights are on the CPU: True refuses, "auto" fuses nothing
    fine = copy.deepcopy(bf16)
    with pytest.raises(ValueError, match=r"fuse_swiglu=True needs torchao on a CUDA device .*weights on cpu"):
        quantize_linears(fine, "fp8", fuse_swiglu=True)
    assert not hasattr(fine.transformer_blocks[0].attn.to_q.weight, "qdata")
    with pytest.raises(TypeError, match=r"fuse_swiglu='yes' must be True, False or 'auto'"):
        quantize_linears(fine, "fp8", fuse_swiglu="yes")
    assert quantize_linears(copy.deepcopy(bf16), "fp8", emulate=True).fused_ffns == ()
