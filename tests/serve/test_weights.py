# SPDX-License-Identifier: Apache-2.0
"""--checkpoint: a diffusers-format MiniMaxH3Transformer3DModel directory loaded with
from_pretrained (fp32 modules kept), its architecture checked against the serving config; output
latents through the safetensors package."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers", reason="the served DiT needs the diffusers extra")

from dist_attn.models.h3.serve.config import ModelConfig, load_config  # noqa: E402
from dist_attn.models.h3.serve.h3.model import build_h3  # noqa: E402
from dist_attn.models.h3.serve.h3.weights import (WeightsError, check_checkpoint,  # noqa: E402
                                                  load_checkpoint, load_output, prune_outputs,
                                                  save_output)

CPU = torch.device("cpu")


def _tiny(**overrides) -> ModelConfig:
    return ModelConfig(**{**load_config(None).model.__dict__, "num_layers": 1, **overrides})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint written by diffusers' own save_pretrained, from a model of other weights."""
    pytest.importorskip("accelerate", reason="--checkpoint loads through accelerate (the serve extra)")
    model = build_h3(_tiny(weight_seed=7), device=CPU, dtype=torch.float32)
    path = tmp_path_factory.mktemp("ckpt") / "transformer"
    model.save_pretrained(path)
    return path, model.state_dict()


def test_checkpoint_loads_with_from_pretrained_keeping_fp32_modules(checkpoint):
    path, saved = checkpoint
    cfg = _tiny()  # weight_seed differs: the checkpoint's weights, not the own init, are served
    model = build_h3(cfg, device=CPU, dtype=torch.float32, checkpoint=str(path))
    got = model.state_dict()
    assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved)
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    half = load_checkpoint(path, cfg, device=CPU, dtype=torch.bfloat16)
    assert half.proj_in.weight.dtype == half.time_embedder.linear_1.weight.dtype == torch.float32
    assert half.audio_proj_out.weight.dtype == torch.float32
    assert half.transformer_blocks[0].attn.to_q.weight.dtype == torch.bfloat16
    assert torch.equal(half.proj_out.weight, saved["proj_out.weight"])  # fp32 kept exactly


def test_checkpoint_architecture_mismatch_lists_every_field(checkpoint):
    path, _ = checkpoint
    with pytest.raises(WeightsError) as info:
        check_checkpoint(path, _tiny(num_layers=2, ffn_dim=256))
    msg = str(info.value)
    assert "does not match the serving config's [model] (2 field(s)" in msg
    assert "num_layers: checkpoint 1 vs config 2" in msg and "ffn_dim: checkpoint 512 vs config 256" in msg


def test_bad_checkpoint_directories_are_named(tmp_path):
    with pytest.raises(WeightsError, match=r"not a directory"):
        check_checkpoint(tmp_path / "absent", _tiny())
    with pytest.raises(WeightsError, match=r"no config.json \(not a diffusers-format checkpoint\)"):
        check_checkpoint(tmp_path, _tiny())
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanTransformer3DModel"}))
    with pytest.raises(WeightsError, match=r"_class_name='WanTransformer3DModel', expected "
                                           r"'MiniMaxH3Transformer3DModel'"):
        check_checkpoint(tmp_path, _tiny())
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(WeightsError, match=r"cannot be read as JSON"):
        check_checkpoint(tmp_path, _tiny())


def test_output_latents_round_trip_through_safetensors(tmp_path):
    from safetensors import safe_open

    video, audio = torch.randn(168, 16), torch.randn(74, 8)
    path = tmp_path / "out.safetensors"
    save_output({"video": video, "audio": audio}, path, metadata={"request": '{"steps": 2}'})
    got = load_output(path)
    assert torch.equal(got["video"], video) and torch.equal(got["audio"], audio)
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"request": '{"steps": 2}'}


def test_prune_outputs_keeps_the_newest_served_files(tmp_path):
    """/v1/generate wrote one file per request forever (issue 24): the newest `keep` served files
    stay (by modification time, then name), other files are never touched."""
    import os

    for i, name in enumerate(["req-000003-c.safetensors", "req-000001-a.safetensors",
                              "req-000002-b.safetensors", "once-5.safetensors", "jobs.sqlite3"]):
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, ns=(i * 10**9, i * 10**9))
    assert prune_outputs(tmp_path, keep=2) == ["req-000003-c.safetensors"]  # the oldest mtime
    assert sorted(os.listdir(tmp_path)) == ["jobs.sqlite3", "once-5.safetensors",
                                            "req-000001-a.safetensors", "req-000002-b.safetensors"]
    assert prune_outputs(tmp_path, keep=2) == []
    with pytest.raises(ValueError, match=r"keep=0 must be a positive integer"):
        prune_outputs(tmp_path, keep=0)
