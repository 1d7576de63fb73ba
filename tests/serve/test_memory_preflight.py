# SPDX-License-Identifier: Apache-2.0
"""The memory pre-flight: parameter counts from the real classes on the meta device, the
estimator's arithmetic, misconfigurations refused with one message (the same on every rank,
naming what would fit) before any weight is read, layouts that fit accepted, and
parallel.shard_weights = "auto" decided from it."""

from __future__ import annotations

import json
import logging
import math
import os
import time

import pytest
import torch

pytest.importorskip("diffusers", reason="the served DiT needs the diffusers extra")
pytest.importorskip("transformers")

from dist_attn.models.h3.serve.config import apply_overrides, load_config  # noqa: E402
from dist_attn.models.h3.serve.h3.memory import Plan, estimate_peak, model_sizes  # noqa: E402
from dist_attn.models.h3.serve.launch.preflight import decide, largest_geometry  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from tests._multirank import run_ranks  # noqa: E402

H3_TOML = os.path.join(ROOT, "configs", "h3.toml")
GB = 1e9
H100 = int(79.2 * GB)  # what torch.cuda.mem_get_info reports free on an idle H100 80GB, about
H200 = int(140 * GB)


def _qwen3_vl_config(width: int = 5120, layers: int = 51):
    """Qwen3-VL's text tower at H3's width (the 51 decoder layers H3 reads; as
    benchmarks/serve_h3_gpu.py builds it) with a 27-block vision tower."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(hidden_size=width, intermediate_size=5 * width, num_hidden_layers=layers,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                         vocab_size=151936),
        vision_config=dict(out_hidden_size=width, depth=27, hidden_size=1152,
                           intermediate_size=4304, num_heads=16))


AUDIO = {"latents_mean": [0.0] * 32, "latents_std": [1.0] * 32}


@pytest.fixture(scope="module")
def h3_sizes():
    """The full-size served components, bf16 blocks and float16 video VAE, as on CUDA."""
    cfg = load_config(H3_TOML)
    return model_sizes(cfg.model, dtype=torch.bfloat16, vae_dtype=torch.float16,
                       text_config=_qwen3_vl_config(), vae_config={}, audio_vae_config=AUDIO)


def _cfg(**overrides):
    return apply_overrides(load_config(H3_TOML), overrides)


def _decide_everywhere(cfg, sizes, frees):
    """decide() as each of the len(frees) ranks runs it: (every rank's result)."""
    return [decide(cfg, sizes, frees, rank=r, device_type="cuda", elt=2) for r in range(len(frees))]


def _one_message(results) -> str | None:
    messages = {r.failure for r in results}
    assert len(messages) == 1, messages  # every rank holds the same one message
    assert len({r.shard for r in results}) == 1
    return messages.pop()


# ---------------------------------------------------------------------------------- sizes


def test_sizes_are_the_real_models_bytes(tmp_path):
    """Every count comes from the classes themselves: the tiny served transformer (float32 on
    CPU, and bf16 with FP8 linears against quantize_linears' own result), the tiny checkpoint's
    text encoder and VAEs against the loaded models."""
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.h3.components import load_components
    from dist_attn.models.h3.serve.h3.model import build_h3
    from dist_attn.models.h3.serve.h3.text import _cut_config
    from dist_attn.models.h3.serve.h3.tiny import build_tiny_checkpoint, tiny_spec
    from dist_attn.weight_sharding import parameter_bytes

    cfg = load_config(None)
    real = build_h3(cfg.model, device=torch.device("cpu"), dtype=torch.bfloat16)
    path = build_tiny_checkpoint(str(tmp_path / "ckpt"), tiny_spec(cfg.model.diffusers_config()))
    with open(os.path.join(path, "vae", "config.json")) as f:
        vae_cfg = json.load(f)
    with open(os.path.join(path, "audio_vae", "config.json")) as f:
        audio_cfg = json.load(f)
    sizes = model_sizes(cfg.model, dtype=torch.bfloat16, vae_dtype=torch.float32,
                        text_config=_cut_config(os.path.join(path, "text_encoder")),
                        vae_config=vae_cfg, audio_vae_config=audio_cfg)
    assert sizes.transformer(fp8=False) == parameter_bytes(real)
    assert len(sizes.transformer_units) == 4  # 2 refiner + 2 transformer blocks
    assert sizes.transformer_units[2] == parameter_bytes(real.transformer_blocks[0])
    quantize_linears(real, "fp8", emulate=True)
    assert sizes.transformer(fp8=True) == parameter_bytes(real)
    comps = load_components(path, device=torch.device("cpu"), dtype=torch.bfloat16, rank0=True,
                            transformer=real)
    assert sizes.text() == parameter_bytes(comps.text_encoder)
    assert len(sizes.text_units) == 51
    assert sizes.vae == parameter_bytes(comps.vae) and sizes.audio_vae == parameter_bytes(comps.audio_vae)


def test_full_size_h3_counts(h3_sizes):
    """H3's 33.1B-parameter transformer: 66.3 GB in bf16 with its float32 modules, 47.0 GB with
    FP8 block linears (385M of each block's 645M weights at one byte); Qwen3-VL's 51 layers at
    5,120 wide, ~54 GB; the video VAE ~5.6 GB (float16 decoder, float32 encoder)."""
    s = h3_sizes
    assert 66.0 * GB < s.transformer(fp8=False) < 66.6 * GB, s.transformer(fp8=False)
    assert 46.8 * GB < s.transformer(fp8=True) < 47.3 * GB, s.transformer(fp8=True)
    assert len(s.transformer_units) == 52 and 1.28 * GB < s.transformer_units[-1] < 1.3 * GB
    assert 53 * GB < s.text() < 55 * GB and 5 * GB < s.vae < 6 * GB


# ---------------------------------------------------------------------------- arithmetic


def test_the_estimate_is_its_terms(h3_sizes):
    cfg = load_config(H3_TOML)
    geo = largest_geometry(cfg, 4, "cuda")
    assert (geo.frames, geo.height, geo.width, geo.rows) == (124, 768, 1344, 38_400)
    e = estimate_peak(h3_sizes, geo, Plan(world=4, rank=0, shard=True, fp8=False, tiles_per_call=8))
    s = h3_sizes
    assert e.resident["transformer"] == sum(math.ceil(u / 4) for u in (*s.transformer_units, s.transformer_root))
    assert e.resident["text encoder"] == sum(math.ceil(u / 4) for u in (*s.text_units, s.text_root))
    assert e.phases["denoise"]["block activations"] == 9_600 * 2 * (2 * 5376 + 9 * 7168)
    assert e.phases["denoise"]["gathered"] == s.transformer_root + 3 * max(s.transformer_units)
    tensors = sum(e.resident.values()) + sum(e.phases[e.peak_phase].values())
    assert e.peak == tensors + e.slack + e.reserve
    # what each lever buys, rank 0 at W = 4: sharding, FP8, more ranks, and rank 0 holds the most
    replica = estimate_peak(s, geo, Plan(world=4, rank=0, shard=False, fp8=False, tiles_per_call=8))
    fp8 = estimate_peak(s, geo, Plan(world=4, rank=0, shard=True, fp8=True, tiles_per_call=8))
    w8 = estimate_peak(s, geo, Plan(world=8, rank=0, shard=True, fp8=False, tiles_per_call=8))
    other = estimate_peak(s, geo, Plan(world=4, rank=1, shard=True, fp8=False, tiles_per_call=8))
    assert replica.peak > 120 * GB > 55 * GB > e.peak > fp8.peak and w8.peak < 40 * GB
    assert other.peak < e.peak


# ---------------------------------------------------------------------- misconfigurations


def test_too_few_ranks_for_bf16_on_80_gb(h3_sizes, caplog):
    caplog.set_level("INFO", logger="dist_attn.models.h3.serve.launch.preflight")
    msg = _one_message(_decide_everywhere(_cfg(**{"parallel.shard_weights": True}), h3_sizes, [H100] * 2))
    assert msg.startswith("memory: rank 0 of 2:") and "exceeds 71.3 GB (79.2 GB free" in msg
    assert "ranks with parallel.shard_weights=true" in msg, msg
    # the estimate's log line says it is over, not "within" (a user read the two as contradicting)
    assert "OVER the budget of 71.3 GB" in caplog.text and "within 71.3" not in caplog.text, caplog.text


def test_a_replica_on_four_h100s_is_told_to_shard(h3_sizes):
    msg = _one_message(_decide_everywhere(_cfg(**{"parallel.shard_weights": False}), h3_sizes, [H100] * 4))
    assert "with parallel.shard_weights=false" in msg and "what would fit: parallel.shard_weights=true (" in msg


def test_a_decode_batch_too_large(h3_sizes):
    cfg = _cfg(**{"parallel.shard_weights": True, "decode.tiles_per_call": 300})
    msg = _one_message(_decide_everywhere(cfg, h3_sizes, [H100] * 4))
    assert "decode.tiles_per_call=300; what would fit:" in msg and "decode.tiles_per_call=" in msg.split("fit:")[1]


def test_too_many_frames_for_a_48_gb_gpu(h3_sizes):
    cfg = _cfg(**{"parallel.shard_weights": True, "model.linear_precision": "fp8",
                  "runtime.warmup_shapes": [[345, 768, 1344]], "serve.max_tokens": 120_000})
    msg = _one_message(_decide_everywhere(cfg, h3_sizes, [int(48 * GB)] * 4))
    assert "frames or fewer at 1344 x 768 in runtime.warmup_shapes and requests" in msg, msg


def test_one_gpu_is_told_it_needs_more_ranks(h3_sizes):
    msg = _one_message(_decide_everywhere(_cfg(), h3_sizes, [H100]))
    assert "with parallel.shard_weights=false" in msg and "ranks with parallel.shard_weights=true" in msg


def test_eight_h100s_and_four_h200s_fit_and_auto_shards(h3_sizes, caplog):
    with caplog.at_level(logging.INFO, logger="dist_attn.models.h3.serve.launch.preflight"):
        results = _decide_everywhere(_cfg(), h3_sizes, [H100] * 8)
    assert _one_message(results) is None and results[0].shard
    assert "parallel.shard_weights='auto': sharded (a replica's estimated peak exceeds" in caplog.text
    assert results[0].estimate.peak < 40 * GB
    results = _decide_everywhere(_cfg(), h3_sizes, [H200] * 4)
    assert _one_message(results) is None and results[0].shard
    # an explicit false on 4 x H200: a replica on rank 0 (transformer + whole text encoder) does not fit
    assert _one_message(_decide_everywhere(_cfg(**{"parallel.shard_weights": False}), h3_sizes, [H200] * 4))


def test_unequal_free_memory_reports_the_worst_rank(h3_sizes):
    frees = [H100, H100, int(30 * GB), H100]
    msg = _one_message(_decide_everywhere(_cfg(**{"parallel.shard_weights": True}), h3_sizes, frees))
    assert msg.startswith("memory: rank 2 of 4:"), msg


# ------------------------------------------------------------------------------- launch


def _launch_worker(rank, world, ckpt, overrides):
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.launch.preflight import memory_preflight

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo")
    cfg = apply_overrides(load_config(H3_TOML), overrides)
    t0 = time.perf_counter()
    pre = memory_preflight(cfg, env, torch.bfloat16, ckpt)
    return pre.failure, pre.shard, time.perf_counter() - t0


def test_launch_preflight_on_every_rank_before_any_weight(tmp_path):
    """The pre-flight as the launch runs it, on 2 gloo ranks: a pipeline checkpoint holding only
    config.json files (no weight at all, so none can be read), memory.device_gb planning two
    H200s: a replica refused with one message, the same on both ranks, in seconds; 'auto' shards
    on both."""
    ckpt = tmp_path / "h3"
    _qwen3_vl_config().save_pretrained(ckpt / "text_encoder")
    for name, data in (("vae", {}), ("audio_vae", AUDIO)):
        os.makedirs(ckpt / name)
        (ckpt / name / "config.json").write_text(json.dumps(data))
    bad = {"memory.device_gb": 140, "parallel.shard_weights": False}
    good = {"memory.device_gb": 140, "parallel.ulysses_degree": 0}
    results = run_ranks(_launch_worker, 2, tmp_path, str(ckpt), bad, timeout=120)
    assert len({r[0] for r in results}) == 1 and "what would fit: parallel.shard_weights=true" in results[0][0]
    assert all(r[2] < 10 for r in results), results
    results = run_ranks(_launch_worker, 2, tmp_path, str(ckpt), good, timeout=120)
    assert {r[:2] for r in results} == {(results[0][0], True)}


def test_check_only_plans_a_gpu_from_a_cpu(launcher, capsys):
    """--check-only with memory.device_gb: the launch checks report the pre-flight's message once;
    on the CPU without device_gb, preflight=true is refused the same way; the default plans
    nothing on the CPU."""
    args = ["--check-only", "--config", H3_TOML]
    assert launcher.main([*args, "--set", "memory.device_gb=80"]) == 1
    err = capsys.readouterr().err
    assert err.count("memory: rank 0 of 1:") == 1 and "what would fit:" in err
    assert launcher.main([*args, "--set", "memory.preflight=true"]) == 1
    assert "memory.preflight=True on cpu: there is no device memory to ask" in capsys.readouterr().err
    assert launcher.main(["--check-only"]) == 0


def test_memory_fields_are_checked():
    with pytest.raises(ValueError, match=r"memory.headroom_fraction=1.5 must be a number in \[0, 1\)"):
        _cfg(**{"memory.headroom_fraction": 1.5})
    with pytest.raises(ValueError, match=r"decode.tiles_per_call=0 must be a positive integer or \"auto\""):
        _cfg(**{"decode.tiles_per_call": 0})
    with pytest.raises(ValueError, match=r"parallel.shard_weights='yes' must be true, false or \"auto\""):
        _cfg(**{"parallel.shard_weights": "yes"})
    with pytest.raises(ValueError, match=r"parallel.shard_weights='auto' decides from the memory "
                                         r"pre-flight, which memory.preflight=false turns off"):
        _cfg(**{"memory.preflight": False})
