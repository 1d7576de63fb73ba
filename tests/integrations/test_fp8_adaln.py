# SPDX-License-Identifier: Apache-2.0
"""quantize_linears(fuse_adaln=...): H3 blocks whose two AdaLN inputs are quantized by the pass
that computes them (dist_attn.models.h3.fp8.adaln_kernel), on CPU: the kernel's torch reference inside the
served tiny model (emulated FP8 linears, bf16 blocks) against the unfused FP8 model and float64;
through enable_ulysses on 1 and 2 ranks and compiled; torchao's weights shared by the swapped
linears; the refusals, raised before anything changes."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers", reason="the diffusers extra is not installed")
pytest.importorskip("triton", reason="the kernel module imports triton")

from dist_attn.models.h3.fp8.linear import EmulatedFp8Linear, Fp8Linear  # noqa: E402
from dist_attn.models.h3.fp8 import quantize_linears  # noqa: E402
from dist_attn.models.h3.serve.config import load_config  # noqa: E402
from dist_attn.models.h3.serve.h3.model import build_h3  # noqa: E402

from tests._multirank import run_ranks  # noqa: E402
from tests._torch_caps import require_cpu_rowwise_scaled_mm  # noqa: E402
from tests.integrations.test_fp8_h3 import (OUTPUT_FP8, _forward, _inputs, _rel,  # noqa: E402
                                            assert_ulysses_and_compiled_equal, two_rank_worker)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def served():
    cfg = load_config(None)
    model = build_h3(cfg.model, device=CPU, dtype=torch.bfloat16)
    return cfg, model, copy.deepcopy(model).double()


def _counting(monkeypatch):
    """Records the fused kernels' calls (the blocks import them at call time): (name, x's shape)."""
    import dist_attn.models.h3.fp8.adaln_kernel as mod

    calls = []
    for name in ("adaln_e4m3_rows", "residual_adaln_e4m3_rows"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, name=name, real=real: calls.append((name, a[0].shape))
                            or real(*a))
    return calls


def test_fused_adaln_blocks_against_unfused_and_float64(served, monkeypatch):
    """Same weights, same GEMMs: the fused blocks differ from the unfused FP8 model only by the
    roundings before the quantization (one here, four in diffusers' eager ops), so both sit at
    the same distance from float64 (measured 5.10e-3 / 4.65e-3 fused, 5.13e-3 / 4.80e-3 unfused)
    and ~2.5e-3 apart; every block ran the one-pass kernel, then the residual one, and nothing
    else changed."""
    cfg, bf16, f64 = served
    plain, fused = copy.deepcopy(bf16), copy.deepcopy(bf16)
    quantize_linears(plain, "fp8", emulate=True)
    summary = quantize_linears(fused, "fp8", emulate=True, fuse_adaln=True)
    n = cfg.model.num_layers
    assert summary.fused_adaln == tuple(f"transformer_blocks.{i}" for i in range(n))
    assert "AdaLN modulation fused with their quantization in 2 blocks" in summary.describe()
    assert summary.layers == quantize_linears(copy.deepcopy(bf16), "fp8", emulate=True).layers
    for block in fused.transformer_blocks:
        assert "forward" in vars(block)  # the fused forward, on the instance
        assert isinstance(block.attn.to_q, EmulatedFp8Linear)  # emulated linears take rows as they are
    for block in plain.transformer_blocks:
        assert "forward" not in vars(block)
    # the forward pickles with its block (a bound method would not), bound to the copy
    import io

    buf = io.BytesIO()
    torch.save(fused.transformer_blocks[0], buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert loaded.forward.args[0] is loaded

    inputs = _inputs(cfg, torch.bfloat16)
    calls = _counting(monkeypatch)
    got = _forward(fused, inputs)
    shape = calls[0][1]  # [B, S, hidden] of the packed sequence
    assert shape[-1] == cfg.model.hidden_size, shape
    assert calls == [("adaln_e4m3_rows", shape), ("residual_adaln_e4m3_rows", shape)] * n, calls
    want = _forward(plain, inputs)
    ref = _forward(f64, _inputs(cfg, torch.float64))
    for a, b, r in zip(got, want, ref):
        assert a.dtype == torch.float32 and bool(a.isfinite().all())
        assert 1e-4 <= _rel(a, b) <= 1e-2, _rel(a, b)  # not a no-op, not another recipe
        assert _rel(a, r) <= OUTPUT_FP8 and _rel(a, r) <= 1.1 * _rel(b, r), (_rel(a, r), _rel(b, r))

    # enable_ulysses (one rank): the same result bit for bit; compiled fullgraph, again
    assert_ulysses_and_compiled_equal(fused, inputs, got)


def test_fused_adaln_on_two_ranks_equals_one(tmp_path):
    """Each rank's blocks see their own rows and their own adaln_indices (cut by the hooks): the
    kernel's per-row work is what one process does (measured: identical)."""
    for diffs in run_ranks(two_rank_worker, 2, tmp_path, True, timeout=240):
        assert max(diffs) <= 1e-6, diffs


def test_torchao_weights_are_shared_by_the_swapped_linears(served, monkeypatch):
    """The GPU path's swap, on CPU with torchao's hardware gate lifted: q/k/v and the FFN's input
    projection become Fp8Linear on torchao's own codes and scales (the same tensors, no copy);
    the output projection and the FFN's down projection stay torchao's; the model's output is the
    emulated fused model's up to float32 summation order."""
    pytest.importorskip("torchao", reason="torchao is not installed (the fp8 extra)")
    require_cpu_rowwise_scaled_mm()
    import dist_attn.models.h3.fp8.quantize as lp

    monkeypatch.setattr("torchao.quantization.quant_api._check_hardware_support", lambda g: None)
    monkeypatch.setattr(lp, "fp8_unsupported_reason", lambda device: None)
    from dist_attn.models.h3.fp8.block import fuse_adaln_blocks

    cfg, bf16, _ = served
    tao, emulated = copy.deepcopy(bf16), copy.deepcopy(bf16)
    quantize_linears(tao, "fp8", fuse_swiglu=False, fuse_adaln=False)  # SwiGLU's kernel: CUDA only
    names = ("attn.to_q", "attn.to_k", "attn.to_v", "ff.net.0.proj")
    before = [{n: (b.get_submodule(n).weight.qdata.data_ptr(), b.get_submodule(n).weight.scale.data_ptr())
               for n in names} for b in tao.transformer_blocks]
    fused = fuse_adaln_blocks(list(enumerate(tao.transformer_blocks)), fast_accum=False)
    quantize_linears(emulated, "fp8", emulate=True, fuse_adaln=True)
    assert len(fused) == cfg.model.num_layers
    for i, block in enumerate(tao.transformer_blocks):
        for name in names:
            lin = block.get_submodule(name)
            assert isinstance(lin, Fp8Linear) and lin.weight_codes.dtype == torch.float8_e4m3fn
            assert (lin.weight_codes.data_ptr(), lin.weight_scales.data_ptr()) == before[i][name], name
        for name in ("attn.to_out.0", "ff.net.2"):
            assert hasattr(block.get_submodule(name).weight, "qdata"), name
    inputs = _inputs(cfg, torch.bfloat16)
    for a, b in zip(_forward(tao, inputs), _forward(emulated, inputs)):
        assert _rel(a, b) <= 2e-3, _rel(a, b)


def test_fuse_adaln_refusals_come_before_any_change(served):
    cfg, bf16, _ = served
    model = copy.deepcopy(bf16)
    last = cfg.model.num_layers - 1
    model.transformer_blocks[last].norm2 = nn.LayerNorm(cfg.model.hidden_size).to(torch.bfloat16)
    with pytest.raises(TypeError, match=rf"fuse_adaln=True: transformer_blocks.{last}: norm2 is "
                                        r"LayerNorm\(shape=\(\d+,\), eps=1e-05\), not an nn.RMSNorm "
                                        r".*fuse_adaln='auto' or False"):
        quantize_linears(model, "fp8", emulate=True, fuse_adaln=True)
    assert type(model.transformer_blocks[0].attn.to_q) is nn.Linear  # nothing half-done
    assert "forward" not in vars(model.transformer_blocks[0])
    with pytest.raises(TypeError, match=r"fuse_adaln='yes' must be True, False or 'auto'"):
        quantize_linears(model, "fp8", emulate=True, fuse_adaln="yes")
    # the default ("auto") fuses on CUDA with torchao only: emulated, nothing
    assert quantize_linears(copy.deepcopy(bf16), "fp8", emulate=True).fused_adaln == ()
    assert quantize_linears(copy.deepcopy(bf16), "fp8", emulate=True, fuse_adaln="auto").fused_adaln == ()
    # a bias on a projection the fused forward feeds
    biased = copy.deepcopy(bf16)
    lin = biased.transformer_blocks[0].attn.to_k
    biased.transformer_blocks[0].attn.to_k = nn.Linear(lin.in_features, lin.out_features).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"transformer_blocks.0: attn.to_k has a bias"):
        quantize_linears(biased, "fp8", emulate=True, fuse_adaln=True)
    # a forward already replaced on the instance (as diffusers' hooks do) is not overwritten
    hooked = copy.deepcopy(bf16)
    block = hooked.transformer_blocks[0]
    block.forward = block.forward  # what a hook leaves: an instance attribute
    with pytest.raises(TypeError, match=r"transformer_blocks.0: its forward is already replaced on "
                                        r"the instance .*quantize before registering hooks"):
        quantize_linears(hooked, "fp8", emulate=True, fuse_adaln=True)
    assert type(block.attn.to_q) is nn.Linear


def test_fused_blocks_run_forward_only_and_in_bfloat16(served):
    """With grad on and parameters that require it (a model as diffusers builds it; the served
    one turns that off) the fused blocks give the no-grad
    output; a backward raises saying what to do instead (run under no_grad, train the bf16 model),
    not torch's "no autograd formula".
    A model cast after quantizing is refused at its first fused block, naming the fusion; the
    emulated unfused path has a backward (emulation only: torchao's FP8 linears have none)."""
    cfg, bf16, _ = served
    fused, plain = copy.deepcopy(bf16), copy.deepcopy(bf16)
    quantize_linears(fused, "fp8", emulate=True, fuse_adaln=True)
    quantize_linears(plain, "fp8", emulate=True)
    fused.requires_grad_(True), plain.requires_grad_(True)
    inputs = _inputs(cfg, torch.bfloat16)
    out = fused(**inputs)[0]
    assert out.requires_grad and torch.equal(out, _forward(fused, inputs)[0])
    with pytest.raises(RuntimeError, match=r"dist_attn::(residual_)?adaln_e4m3_rows has no backward: the "
                                           r"fused kernels are for inference. Run inference under "
                                           r"torch.no_grad\(\).*train the bf16 model and quantize "
                                           r"it after; quantize_linears\(fuse_adaln=False\) removes"):
        out.float().square().sum().backward()
    plain(**inputs)[0].float().square().sum().backward()
    assert plain.transformer_blocks[0].norm1.weight.grad is not None

    cast = copy.deepcopy(fused).half()
    half = {k: v.half() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    with pytest.raises(ValueError, match=r"hidden_states.dtype=torch.float16: an H3 block fused by "
                                         r"quantize_linears\(fuse_adaln=True or 'auto'\) takes bfloat16.*"
                                         r"cast after quantize_linears"):
        _forward(cast, half)
