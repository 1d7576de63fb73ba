# SPDX-License-Identifier: Apache-2.0
"""model.linear_precision and runtime.warmup_shapes in the served DiT: the config rules name the
field and value, quality="lossless" refuses FP8 and "high" admits it, a CPU launch refuses FP8
naming the device before the model is built, and the warm-up runs before the server starts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_attn.models.h3.serve.config import (ModelConfig, RuntimeConfig, apply_overrides,
                                              load_config)
from dist_attn.models.h3.serve.config.quality import (DeviceFacts, Topology, quality_failures,
                                                      tier_linear_rule)

__all__: list[str] = []


def test_linear_precision_field():
    assert ModelConfig().linear_precision == "bf16"
    assert apply_overrides(load_config(None), {"model.linear_precision": "fp8"}).model.linear_precision == "fp8"
    with pytest.raises(ValueError, match=r"model.linear_precision='int8' must be one of "
                                         r"'bf16', 'fp8'"):
        ModelConfig(linear_precision="int8")
    with pytest.raises(ValueError, match=r"model.linear_precision='fp8' needs bfloat16 blocks, "
                                         r"not runtime.dtype='float32'"):
        apply_overrides(load_config(None), {"model.linear_precision": "fp8", "runtime.dtype": "float32"})


def test_fp8_fast_accum_and_fused_kernels_fields(monkeypatch):
    assert ModelConfig().fp8_fast_accum is False
    cfg = apply_overrides(load_config(None), {"model.linear_precision": "fp8",
                                              "model.fp8_fast_accum": True})
    assert cfg.model.fp8_fast_accum is True
    with pytest.raises(ValueError, match=r"model.fp8_fast_accum=True needs "
                                         r"linear_precision='fp8', not 'bf16'"):
        apply_overrides(load_config(None), {"model.fp8_fast_accum": True})
    with pytest.raises(ValueError, match=r"model.fp8_fast_accum='yes' must be true or false"):
        ModelConfig(linear_precision="fp8", fp8_fast_accum="yes")
    with pytest.raises(ValueError, match=r"model.fp8_fast_accum=True needs linear_precision='fp8'"):
        apply_overrides(load_config(None), {"model.fp8_fast_accum": True, "runtime.quality": "lossless"})
    # build_h3 hands the field to quantize_linears (the GEMM flag itself: tests/integrations)
    pytest.importorskip("diffusers")
    import dist_attn.models.h3.fp8 as fp8
    from dist_attn.models.h3.serve.h3.model import build_h3

    calls = []
    monkeypatch.setattr(fp8, "quantize_linears",
                        lambda model, precision, **kw: calls.append((precision, kw)))
    tiny = dataclasses.replace(cfg.model, num_layers=1, hidden_size=64, num_attention_heads=2,
                               attention_head_dim=32, ffn_dim=128, text_dim=32,
                               time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=4,
                               num_refiner_layers=0)
    build_h3(tiny, device=torch.device("cpu"), dtype=torch.bfloat16)
    # fp8_fused_kernels (default true): quantize_linears' "auto" fusions, or none
    build_h3(dataclasses.replace(tiny, fp8_fused_kernels=False), device=torch.device("cpu"),
             dtype=torch.bfloat16)
    assert calls == [("fp8", {"fast_accum": True, "fuse_swiglu": "auto", "fuse_adaln": "auto"}),
                     ("fp8", {"fast_accum": True, "fuse_swiglu": False, "fuse_adaln": False})]
    assert ModelConfig().fp8_fused_kernels is True
    with pytest.raises(ValueError, match=r"model.fp8_fused_kernels='no' must be true or false"):
        ModelConfig(linear_precision="fp8", fp8_fused_kernels="no")


def test_lossless_refuses_fp8_and_high_admits_it():
    rule = (r"model.linear_precision='fp8' quantizes the blocks' linear layers to 8 bits "
            r"\(e4m3\), not allowed under quality='lossless' \(exact layers only; use 'bf16'\)")
    with pytest.raises(ValueError, match=rule):
        apply_overrides(load_config(None), {"model.linear_precision": "fp8",
                                            "runtime.quality": "lossless"})
    apply_overrides(load_config(None), {"model.linear_precision": "bf16", "runtime.quality": "lossless"})
    assert tier_linear_rule("high", "fp8") is None and tier_linear_rule(None, "fp8") is None
    facts = [DeviceFacts(rank=r, hostname="h", device_type="cuda", device_index=r,
                         device_uuid=f"GPU-{r}", gpu_name="NVIDIA H200", capability=(9, 0),
                         total_memory=150_000_000_000,
                         peer_access={j: True for j in range(4) if j != r}) for r in range(4)]
    topo = Topology(world_size=4, ulysses_degree=4)
    assert quality_failures("high", facts, topo, backend="sage8", linear_precision="fp8") == []
    failures = quality_failures("lossless", facts, topo, backend="sdpa", linear_precision="fp8")
    assert len(failures) == 1 and failures[0].startswith("linear layers: model.linear_precision='fp8'")


def test_warmup_steps_must_fit_serve_max_steps():
    """The warm-up runs two steps a geometry (the first step's shapes, then every later step's):
    a max_steps of 1 is refused when the config loads, not at the launch's warm-up."""
    with pytest.raises(ValueError, match=r"runtime.warmup_shapes=\[\[22, 128, 192\]\] are warmed for 2 "
                                         r"steps each, which exceeds serve.max_steps=1"):
        apply_overrides(load_config(None), {"runtime.warmup_shapes": [[22, 128, 192]], "serve.max_steps": 1,
                                            "request.steps": 1})
    # without warm-up shapes a max_steps of 1 stands
    assert apply_overrides(load_config(None), {"serve.max_steps": 1, "request.steps": 1}).serve.max_steps == 1


def test_warmup_shapes_rules():
    assert RuntimeConfig(warmup_shapes=[[22, 128, 192]]).warmup_shapes == ((22, 128, 192),)
    with pytest.raises(ValueError, match=r"runtime.warmup_shapes=\[\[22, 128\]\] must be a list "
                                         r"of \[frames, height, width\] triples"):
        RuntimeConfig(warmup_shapes=[[22, 128]])
    with pytest.raises(ValueError, match=r"runtime.warmup_shapes\[1\]=\[22, 100, 192\] is not a "
                                         r"valid request: request.height=100 must be a multiple of 32"):
        apply_overrides(load_config(None), {"runtime.warmup_shapes": [[22, 128, 192], [22, 100, 192]]})
    with pytest.raises(ValueError, match=r"warmup_shapes\[0\]=\[124, 768, 1344\] is not a valid "
                                         r"request: request has 37742 rows .* above serve.max_tokens=16384"):
        apply_overrides(load_config(None), {"runtime.warmup_shapes": [[124, 768, 1344]]})


def test_build_h3_fp8_on_cpu_names_the_device():
    pytest.importorskip("diffusers")
    from dist_attn.models.h3.serve.h3.model import build_h3

    cfg = dataclasses.replace(load_config(None).model, num_layers=1, linear_precision="fp8")
    with pytest.raises(RuntimeError, match=r"device cpu has no FP8 matrix multiply"):
        build_h3(cfg, device=torch.device("cpu"), dtype=torch.bfloat16)


@pytest.fixture
def launcher(launcher, monkeypatch):
    """The shared launcher pinned to the CPU launch (also where a GPU is visible)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return launcher


def test_launch_refuses_fp8_before_the_model(launcher, capsys):
    """On CPU: a launch check names the device; under lossless: the config rule. Neither builds."""
    pytest.importorskip("diffusers")
    assert launcher.main(["--check-only", "--set", "model.linear_precision=fp8"]) == 1
    err = capsys.readouterr().err
    assert "model.linear_precision='fp8' cannot run here: device cpu has no FP8 matrix multiply" in err
    assert launcher.main(["--once", "--steps", "1", "--set", "model.linear_precision=fp8"]) == 1
    err = capsys.readouterr().err
    assert "cannot run here: device cpu" in err and "built tiny" not in err
    assert launcher.main(["--check-only", "--quality", "lossless", "--set",
                          "model.linear_precision=fp8"]) == 1
    err = capsys.readouterr().err
    assert ("invalid config: model.linear_precision='fp8' quantizes the blocks' linear "
            "layers to 8 bits (e4m3), not allowed under quality='lossless'") in err


def test_warmup_runs_on_every_rank_before_the_server(launcher, monkeypatch, capsys):
    pytest.importorskip("diffusers")
    from dist_attn.models.h3.serve.launch import start

    events = []
    real_warm, real_serve = start.warm_up, start.serve

    def warm_spy(engine, cfg, **kwargs):
        runs = real_warm(engine, cfg, **kwargs)
        events.append(("warm_up", [(r.frames, r.height, r.width, r.rows) for r in runs]))
        return runs

    def serve_spy(*args, **kwargs):
        info = kwargs["info"]
        events.append(("serve", info["linear_precision"], info["block_linears"]))
        return real_serve(*args, **kwargs)

    # where the rank's start-up looks them up
    monkeypatch.setattr(start, "warm_up", warm_spy)
    monkeypatch.setattr(start, "serve", serve_spy)
    assert launcher.main(["--once", "--steps", "1", "--backend", "sdpa", "--set",
                          "runtime.warmup_shapes=[[22, 128, 192], [5, 64, 64]]"]) == 0
    # on the CPU "bf16" (not FP8) linears run in the blocks' float32, and /health says so
    assert events[0][0] == "warm_up" and events[1] == ("serve", "bf16", "float32")
    assert [shape[:3] for shape in events[0][1]] == [(22, 128, 192), (5, 64, 64)]
    assert events[0][1][0][3] == 274  # the default request's rows
    assert "warm-up 2/2: 5 frames 64x64" in capsys.readouterr().err


def test_launch_check_names_the_extra_without_torchao(monkeypatch):
    """On a capable GPU (stood in for: the device rule answers None) without torchao, the launch
    check names the extra; with linear_precision='bf16' it checks nothing."""
    import sys

    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.launch import checks

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    cfg = apply_overrides(load_config(None), {"model.linear_precision": "fp8"})
    assert "device cpu" in checks.linear_precision_failures(cfg, env)[0]
    monkeypatch.setattr(checks, "fp8_unsupported_reason", lambda device: None)
    monkeypatch.setitem(sys.modules, "torchao", None)
    (failure,) = checks.linear_precision_failures(cfg, env)
    assert failure.startswith("model.linear_precision='fp8' cannot run here: FP8 linear layers run "
                              "torchao's float8 inference, and torchao is not installed")
    assert "pip install -e '.[fp8]'" in failure
    assert checks.linear_precision_failures(load_config(None), env) == []
