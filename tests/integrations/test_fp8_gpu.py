# SPDX-License-Identifier: Apache-2.0
"""FP8 linears on a CUDA GPU (compute capability >= 8.9, torchao installed): torchao's path
against the float32 emulation the CPU tests pin, at a real H3 GEMM shape and in the served tiny
H3; compiled fullgraph with inductor; the served engine. Run on the H200:

    python -m pytest -q tests/integrations/test_fp8_gpu.py

Skipped elsewhere with the reason shown.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from dist_attn.models.h3.fp8.linear import (ACTIVATION_AMAX_FLOOR, fp8_linear_emulated,  # noqa: E402
                                            fp8_unsupported_reason, quantize_rows_e4m3,
                                            quantize_weight_e4m3, torchao_fp8_config)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the H200)"),
    pytest.mark.skipif(torch.cuda.is_available() and fp8_unsupported_reason("cuda") is not None,
                       reason="needs compute capability >= 8.9"),
    pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                       reason="needs torchao (pip install -e '.[fp8]')"),
]

BF16_ULP = 2.0 ** -7


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _quantized_linear(w: torch.Tensor, fast_accum: bool) -> torch.nn.Module:
    from torchao.quantization import quantize_

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(w)
    seq = torch.nn.Sequential(lin)
    quantize_(seq, torchao_fp8_config(fast_accum=fast_accum))
    return seq[0]


@pytest.mark.parametrize("rows, k, n", [(4096, 5376, 7168), (1024, 14336, 5376)])
def test_torchao_is_the_emulated_recipe_at_h3_shapes(rows, k, n):
    """Weight codes and scales bit for bit; outputs at most one bf16 rounding apart (the GEMM's
    float32 sums are ordered differently); an all-zero activation row gives zeros, not NaN."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, k, device="cuda", generator=g)
    x[:, [3, k // 2]] *= 20  # outlier channels
    x[7] = 0  # an exactly-zero row, as padding rows of an attention output are
    x = x.to(torch.bfloat16)
    w = ((torch.rand(n, k, device="cuda", generator=g) * 2 - 1) / k ** 0.5).to(torch.bfloat16)
    lin = _quantized_linear(w, fast_accum=False)
    codes, scales = quantize_weight_e4m3(w)
    assert torch.equal(lin.weight.qdata.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(lin.weight.scale, scales)
    with torch.no_grad():
        got = lin(x)
    want = fp8_linear_emulated(x, codes, scales)
    assert bool(got.isfinite().all()) and bool((got[7] == 0).all())
    # Not element for element: on the H200 (2026-12-04) a few elements differed by 2^-6 at
    # |x| < 2, two bf16 roundings, where the sums cancel (the outlier channels) and cuBLAS's
    # FP8 GEMM orders and promotes its float32 partial sums its own way. Against the FP8
    # error itself (3.6e-2) the two must agree far closer: a wrong scale or rounding mode
    # moves rel-L2 by >= 1e-2.
    diff = (got.float() - want.float()).abs()
    worst = float((diff / (want.float().abs() * BF16_ULP + 1e-6)).max())
    print(f"[{rows}x{k}x{n}] torchao vs emulation: rel-L2 {_rel(got, want):.2e}, worst element "
          f"{worst:.2f} bf16 roundings of |want|")
    assert _rel(got, want) <= 2e-3, _rel(got, want)
    ref = x.double() @ w.double().t()
    assert 1.5e-2 <= _rel(got, ref) <= 6e-2  # the CPU tests' per-linear band
    fast = _quantized_linear(w, fast_accum=True)
    with torch.no_grad():
        fast_err = _rel(fast(x), ref)
    # Hopper's fast accumulation keeps fewer bits over K; it must stay an FP8-sized error
    assert fast_err <= 6e-2, fast_err
    print(f"[{rows}x{k}x{n}] rel-L2 vs float64: fp32-accumulated {_rel(got, ref):.4e}, "
          f"fast-accumulated {fast_err:.4e}")


def test_activation_codes_match_torchao():
    from torchao.quantization.quant_primitives import _choose_scale_float8, _quantize_affine_float8

    x = torch.randn(512, 5376, device="cuda").to(torch.bfloat16)
    s = _choose_scale_float8(x, block_size=[1, 5376], float8_dtype=torch.float8_e4m3fn,
                             hp_value_lb=ACTIVATION_AMAX_FLOOR)
    c = _quantize_affine_float8(x, s, torch.float8_e4m3fn)
    codes, scales = quantize_rows_e4m3(x, amax_floor=ACTIVATION_AMAX_FLOOR)
    assert torch.equal(scales, s) and torch.equal(codes.view(torch.uint8), c.view(torch.uint8))


def _code_steps(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many e4m3 steps apart two code tensors are, element by element (same-sign codes are
    ordered by their bits; +0 and -0 are one value)."""
    def ordinal(c):
        b = c.view(torch.uint8).to(torch.int32)
        return torch.where(b >= 128, -(b - 128), b)
    return (ordinal(got) - ordinal(want)).abs()


def _rows_apart(what: str, codes, scales, want_codes, want_scales) -> tuple[int, float, float, int]:
    """How far a kernel's quantized rows are from the wanted ones, printed and returned: (rows
    whose scale differs, the largest scale ratio - 1, the fraction of the other rows' codes that
    differ, the most e4m3 steps one of them moved)."""
    rows_off = int((scales != want_scales).sum())
    ratio = (scales / want_scales).sub(1).abs().max().item()
    same = (scales == want_scales).squeeze(1)
    steps = _code_steps(codes[same], want_codes[same])
    frac = (steps > 0).float().mean().item()
    most = int(steps.max()) if steps.numel() else 0
    print(f"{what}: {rows_off} of {len(scales)} row scales differ (max ratio - 1 {ratio:.2e}); "
          f"{frac:.2e} of the other rows' codes differ, by at most {most} step")
    return rows_off, ratio, frac, most


def test_swiglu_kernel_is_the_recipe_at_h3_width():
    """The fused kernel on the GPU at H3's inner size 14,336 against torch's eager bf16 SwiGLU +
    the recipe's row quantization: the fast exponential and division may move a bf16 rounding, so
    a code may sit one e4m3 step away, rarely; a scale may move by one bf16 step, rarely. (The CPU
    test runs the interpreter, exact, and checks every bit.)"""
    import torch.nn.functional as F

    from dist_attn.models.h3.fp8.swiglu_kernel import swiglu_e4m3_rows

    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(2048, 2 * 14336, device="cuda", generator=g)
    h[:256] *= 8
    h[256:512] *= 1e-3
    h[600, 17] = 500.0
    h[601] = 0
    h[602, 3] = float("nan")  # a NaN: the row's scale and codes NaN, as the recipe's
    h[603, 9] = float("inf")  # an inf value: scale inf, its code NaN, the row's others 0
    h = h.to(torch.bfloat16)
    value, gate = h.chunk(2, dim=-1)
    codes, scales = quantize_rows_e4m3(value * F.silu(gate), amax_floor=ACTIVATION_AMAX_FLOOR)
    got_codes, got_scales = swiglu_e4m3_rows(h)
    assert torch.isnan(got_scales[602]).all() and torch.isnan(got_codes[602].float()).all()
    assert got_scales[603].item() == float("inf") and torch.isnan(got_codes[603, 9].float())
    assert int((got_codes[603].float().nan_to_num() != 0).sum()) == 0
    keep = torch.ones(len(h), dtype=torch.bool, device="cuda")
    keep[602:604] = False
    assert not torch.isnan(got_codes[keep].float()).any()
    h, codes, scales, got_codes, got_scales = h[keep], codes[keep], scales[keep], got_codes[keep], got_scales[keep]
    rows_off, ratio, frac, most = _rows_apart("swiglu kernel vs eager", got_codes, got_scales, codes, scales)
    # the division is exact, so only silu's fast exponential can move a bf16 rounding: measured
    # none on an H100 (the fast division of the first version moved 4.1e-5 of the codes)
    assert rows_off <= len(scales) // 1000 and ratio <= 2 ** -7, (rows_off, ratio)
    assert frac <= 1e-5 and most <= 1, (frac, most)
    assert int((got_codes[601].float() != 0).sum()) == 0 and got_scales[601].item() > 0


def test_fused_swiglu_ffn_matches_torchao_ffn():
    """Fp8SwiGLUFeedForward built from a torchao-quantized diffusers FeedForward: eagerly the same
    output to rounding, and compiled with inductor's emulate_precision_casts too; compiled by
    default, as accurate against float64 as torchao's own FFN. (By default compiled and eager FP8
    differ from each other by ~3% rel-L2 at this size, torchao's FFN alone too: inductor computes
    the activation scales without the bf16 rounding of the eager recipe, which re-rounds every
    code; each is as far from float64 as the other.) Fast accumulation is passed through."""
    from diffusers.models.attention import FeedForward
    from torchao.quantization import quantize_

    from dist_attn.models.h3.fp8.linear import Fp8SwiGLUFeedForward

    torch.manual_seed(0)
    for fast in (False, True):
        ff = FeedForward(5376, inner_dim=14336, activation_fn="swiglu", bias=False).cuda()
        ff = ff.to(torch.bfloat16).eval().requires_grad_(False)
        exact_ff = copy.deepcopy(ff).double()
        quantize_(ff, torchao_fp8_config(fast_accum=fast))
        down = ff.net[2].weight
        fused = Fp8SwiGLUFeedForward(ff.net[0].proj, down.qdata, down.scale, fast_accum=fast)
        x = torch.randn(2, 1500, 5376, device="cuda").to(torch.bfloat16)
        with torch.no_grad():
            exact = exact_ff(x.double())
            want = ff(x)
            got = fused(x)
            compiled = torch.compile(fused, fullgraph=True)(x)
            torch._dynamo.reset()
            # with the eager roundings kept, the compiled FFN is the eager one to rounding
            with torch._inductor.config.patch(emulate_precision_casts=True):
                kept = torch.compile(fused, fullgraph=True)(x)
            torch._dynamo.reset()
        err = {name: _rel(t, exact) for name, t in (("torchao", want), ("fused", got), ("fused compiled", compiled))}
        print(f"fast_accum={fast}: fused vs torchao eager {_rel(got, want):.2e}, compiled with the eager "
              f"roundings {_rel(kept, want):.2e}; vs float64 {err}")
        # measured equal (0.0) on an H100: the same codes, scales and GEMM
        assert _rel(got, want) <= 1e-4 and _rel(kept, want) <= 1e-4, (fast, _rel(got, want), _rel(kept, want))
        assert max(err["fused"], err["fused compiled"]) <= 1.05 * err["torchao"], (fast, err)


def test_adaln_kernel_is_its_reference_at_h3_width():
    """The fused norm + AdaLN + quantization kernel on the GPU at H3's hidden size 5,376 against
    its torch reference (the CPU test checks every bit under the interpreter): the GPU's rsqrt and
    the order of the row's sum may move a bf16 rounding of the modulated value, so a code may sit
    one e4m3 step away, rarely, and a row's scale one bf16 step; compiled (an opaque custom op in
    the graph), the same output."""
    from dist_attn.models.h3.fp8.adaln_kernel import adaln_e4m3_rows, adaln_e4m3_rows_reference

    k, t, s = 5376, 6, 4096
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2, s, k, device="cuda", generator=g)
    x[0, :256] *= 30
    x[1, 7] = 0
    x[1, 9, 5] = float("nan")  # a NaN: the row's scale and codes NaN, as the reference's
    x = x.to(torch.bfloat16)
    table = (torch.randn(t, 6 * k, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    shift, scale = table.chunk(6, dim=-1)[:2]
    weight = (torch.rand(k, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    index = torch.randint(0, t, (s,), device="cuda", generator=g)
    codes, scales = adaln_e4m3_rows(x, weight, 1e-5, scale, shift, index)
    want_codes, want_scales = adaln_e4m3_rows_reference(x.reshape(-1, k), weight, 1e-5, scale, shift, index)
    codes, scales = codes.reshape(-1, k), scales.reshape(-1, 1)
    nan_row = s + 9
    assert torch.isnan(scales[nan_row]).all() and torch.isnan(codes[nan_row].float()).all()
    assert torch.isnan(want_scales[nan_row]).all()
    keep = torch.ones(len(scales), dtype=torch.bool, device="cuda")
    keep[nan_row] = False
    codes, scales, want_codes, want_scales = codes[keep], scales[keep], want_codes[keep], want_scales[keep]
    rows_off, ratio, frac, most = _rows_apart("adaln kernel vs reference", codes, scales, want_codes, want_scales)
    assert rows_off <= len(scales) // 100 and ratio <= 2 ** -7, (rows_off, ratio)
    assert frac <= 1e-3 and most <= 1, (frac, most)
    compiled = torch.compile(adaln_e4m3_rows, fullgraph=True)(x, weight, 1e-5, scale, shift, index)
    torch._dynamo.reset()
    assert torch.equal(compiled[0].view(torch.uint8).reshape(-1, k)[keep], codes.view(torch.uint8))
    assert torch.equal(compiled[1].reshape(-1, 1)[keep], scales)
    # the residual step fused in front (the block's second norm): h is diffusers' bf16 ops bit for
    # bit, and its codes are the one-pass kernel's on h
    from dist_attn.models.h3.fp8.adaln_kernel import residual_adaln_e4m3_rows

    gate = (torch.randn(t, 3 * k, device="cuda", generator=g) * 0.3).to(torch.bfloat16)[:, k:2 * k]
    update = (torch.randn(2, s, k + 64, device="cuda", generator=g) * 3).to(torch.bfloat16)[..., :k]
    assert gate.stride(0) != scale.stride(0) and update.stride(1) != x.stride(1)  # strides apart
    h, r_codes, r_scales = residual_adaln_e4m3_rows(x, gate, update, weight, 1e-5, scale, shift, index)
    h_want = x + gate.index_select(0, index) * update
    rows = lambda t: t.reshape(-1, t.shape[-1])[keep]  # noqa: E731
    ulps = (rows(h).view(torch.int16).int() - rows(h_want).view(torch.int16).int()).abs()
    # until 2026-12-07 the kernel compiled with contraction: one fma.rn.bf16x2, one step off here
    assert int((ulps > 0).sum()) == 0, (f"{int((ulps > 0).sum())} of {ulps.numel()} h values differ, "
                                        f"by at most {int(ulps.max())} bf16 steps")
    assert torch.isnan(r_scales.reshape(-1)[nan_row])
    h_codes, h_scales = adaln_e4m3_rows(h_want, weight, 1e-5, scale, shift, index)
    # the same arithmetic on the same values; bounded as above, in case the two compilations of
    # the kernel contract or order a float32 step differently (the print says if they did)
    off, _, frac, most = _rows_apart("residual adaln kernel vs the one-pass kernel on h", rows(r_codes),
                                     rows(r_scales), rows(h_codes), rows(h_scales))
    assert off <= len(scales) // 100 and frac <= 1e-3 and most <= 1, (off, frac, most)
    compiled = torch.compile(residual_adaln_e4m3_rows, fullgraph=True)(x, gate, update, weight, 1e-5, scale,
                                                                       shift, index)
    torch._dynamo.reset()
    assert torch.equal(rows(compiled[0]).view(torch.int16), rows(h).view(torch.int16))
    assert torch.equal(rows(compiled[1]).view(torch.uint8), rows(r_codes).view(torch.uint8))
    assert torch.equal(rows(compiled[2]), rows(r_scales))


def _served(precision: str, **model):
    import dataclasses

    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.model import build_h3

    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, linear_precision=precision,
                                                             **model))
    return cfg, build_h3(cfg.model, device=torch.device("cuda"), dtype=torch.bfloat16)


def test_quantize_linears_fuses_the_h3_ffns_and_names_every_linear():
    """fuse_swiglu="auto" on CUDA: every H3 block's FFN fused, and every name in the summary's
    layers resolves in the model (the fused FFN's projection at ff.proj, its down weight in ff)."""
    from dist_attn.models.h3.fp8.linear import Fp8Linear, Fp8SwiGLUFeedForward
    from dist_attn.models.h3.fp8 import quantize_linears

    cfg, model = _served("bf16")
    summary = quantize_linears(model, "fp8", fuse_adaln=False)
    assert len(summary.fused_ffns) == cfg.model.num_layers and summary.count == 6 * cfg.model.num_layers
    assert summary.fused_adaln == () and not any(isinstance(m, Fp8Linear) for m in model.modules())
    for name in summary.layers:
        m = model.get_submodule(name)
        assert isinstance(m, Fp8SwiGLUFeedForward) or hasattr(m.weight, "qdata"), name
    assert "SwiGLU fused" in summary.describe()
    # the default (fuse_adaln="auto") on CUDA: every block, its q/k/v and FFN projection Fp8Linear
    _, fused = _served("bf16")
    summary = quantize_linears(fused, "fp8")
    assert len(summary.fused_adaln) == cfg.model.num_layers
    for name in summary.layers:
        m = fused.get_submodule(name)
        assert isinstance(m, (Fp8SwiGLUFeedForward, Fp8Linear)) or hasattr(m.weight, "qdata"), name
    assert "AdaLN modulation fused" in summary.describe()


def _inputs(cfg):
    from dist_attn.models.h3.serve.h3.engine import initial_state

    layout = cfg.layout(frames=cfg.request.frames, height=cfg.request.height, width=cfg.request.width)
    video, audio, text = initial_state(cfg, layout, 0, torch.device("cuda"), torch.bfloat16)
    t, idx = layout.timestep_rows(0.3, 0.4)
    return dict(hidden_states=video[None], audio_hidden_states=audio[None], encoder_hidden_states=text,
                timestep=t.cuda(), timestep_indices=idx.cuda(), return_dict=False,
                **{k: v.cuda() for k, v in layout.rows().items()})


@pytest.mark.parametrize("fuse_adaln", [False, "auto"])
def test_served_fp8_model_torchao_vs_emulated_and_compiled(fuse_adaln):
    """quantize_linears(fuse_adaln=False) on CUDA: torchao weights in the 12 block linears; its
    output vs the emulated model (same bf16 weights) and compiled fullgraph (inductor) vs eager.
    With the default fuse_adaln="auto" (what build_h3 serves): the fused kernel, then
    torch._scaled_mm, against the emulated fused model (the same kernel, then float32 GEMMs)."""
    from dist_attn.models.h3.fp8.linear import Fp8Linear, Fp8SwiGLUFeedForward
    from dist_attn.integrations.diffusers import enable_ulysses
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.h3.model import compile_blocks

    cfg, bf16 = _served("bf16")
    emulated = copy.deepcopy(bf16)
    quantize_linears(emulated, "fp8", emulate=True, fuse_adaln=bool(fuse_adaln))
    fp8 = copy.deepcopy(bf16)
    quantize_linears(fp8, "fp8", fuse_adaln=fuse_adaln)
    n = cfg.model.num_layers
    # fuse_swiglu="auto": the FFN's down projection in the fused FFN; the other 5 linears a block
    # torchao's, or with fuse_adaln q/k/v and the FFN's projection Fp8Linear (they take the codes)
    assert sum(hasattr(m.weight, "qdata") for m in fp8.modules()
               if isinstance(m, torch.nn.Linear)) == (1 if fuse_adaln else 5) * n
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == (4 * n if fuse_adaln else 0)
    assert sum(isinstance(m, Fp8SwiGLUFeedForward) for m in fp8.modules()) == n
    inputs = _inputs(cfg)
    with torch.no_grad():
        want = emulated(**inputs)
        got = fp8(**inputs)
        for a, b in zip(got, want):
            assert _rel(a, b) <= 2e-3, _rel(a, b)
        with enable_ulysses(fp8, backend="sdpa"):
            eager = fp8(**inputs)
            compile_blocks(fp8)  # inductor, fullgraph: a graph break raises
            compiled = fp8(**inputs)
    for a, b in zip(compiled, eager):
        assert _rel(a, b) <= 5e-3, _rel(a, b)


def test_served_engine_and_launch_check_with_fp8():
    from dist_attn import PhaseTimer
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.fp8.linear import Fp8Linear, Fp8SwiGLUFeedForward
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.h3.model import parallelize
    from dist_attn.models.h3.serve.jobs.requests import parse_request
    from dist_attn.models.h3.serve.launch.checks import linear_precision_failures

    cfg, model = _served("fp8")
    # model.fp8_fused_kernels (default true): every block's FFN and AdaLN fused
    n = cfg.model.num_layers
    assert sum(isinstance(m, Fp8SwiGLUFeedForward) for m in model.modules()) == n
    assert sum(isinstance(m, Fp8Linear) for m in model.modules()) == 4 * n
    # model.fp8_fused_kernels=false: torchao's six linears a block, diffusers' FFN and forward
    _, plain = _served("fp8", fp8_fused_kernels=False)
    assert not any(isinstance(m, (Fp8Linear, Fp8SwiGLUFeedForward)) for m in plain.modules())
    assert sum(hasattr(m.weight, "qdata") for m in plain.modules()
               if isinstance(m, torch.nn.Linear)) == 6 * n
    assert not any("forward" in vars(b) for b in plain.transformer_blocks)
    del plain
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), backend=None,
                  shared_gpu=False)
    assert linear_precision_failures(cfg, env) == []
    timer = PhaseTimer(env.device)
    handle = parallelize(model, backend="sdpa", timer=timer)
    result = Engine(cfg, env, model, timer, backend="sdpa").run(parse_request({"steps": 2}, cfg))
    handle.remove()
    assert len(result.step_latency_ms) == 2 and result.checksum.l2 > 0
