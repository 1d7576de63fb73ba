# SPDX-License-Identifier: Apache-2.0
"""parallel.shard_weights: the served tiny H3 built on the meta device and materialised block by
block into FSDP2 shards (the class's own initialisation, a checkpoint, FP8 linears) serves what the
whole replica serves, bit for bit, on 3 gloo ranks; the denoise engine runs a request twice
(the second job too: every block gathered again)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("diffusers", reason="the served DiT needs the diffusers extra")

from tests._multirank import run_ranks  # noqa: E402

CPU = torch.device("cpu")


def _inputs(cfg, dtype):
    from tests.integrations.test_fp8_h3 import _inputs as served_inputs

    inputs = served_inputs(cfg, dtype)
    inputs.pop("return_dict")
    return inputs


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _replica(cfg, dtype, checkpoint=None):
    from dist_attn.models.h3.serve.h3.model import build_h3, parallelize

    model = build_h3(cfg.model, device=CPU, dtype=dtype, checkpoint=checkpoint)
    parallelize(model, backend="sdpa")
    return model


def _sharded(cfg, dtype, checkpoint=None):
    from dist_attn.models.h3.serve.h3.model import meta_h3, parallelize, shard_h3

    model = meta_h3(cfg.model, device=CPU, dtype=dtype, fp32_modules=checkpoint is not None)
    parallelize(model, backend="sdpa")
    summary = shard_h3(model, cfg.model, device=CPU, dtype=dtype, checkpoint=checkpoint)
    return model, summary


def _worker(rank, world, ckpt_root):
    import dist_attn.models.h3.fp8 as h3_fp8
    from dist_attn.models.h3.serve.config import apply_overrides, load_config

    cfg = load_config(None)
    res = {}
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the fp32 modules are drawn again
        inputs = _inputs(cfg, dtype)
        want = _forward(_replica(cfg, dtype), inputs)
        model, summary = _sharded(cfg, dtype)
        res[f"own_{dtype}"] = (_equal(_forward(model, inputs), want), summary.world,
                               len(summary.units), summary.bytes_per_rank / summary.bytes_total)
    # a checkpoint read block by block: the same model from_pretrained loads
    from dist_attn.models.h3.serve.h3.model import build_h3

    path = f"{ckpt_root}/rank{rank}"
    build_h3(cfg.model, device=CPU, dtype=torch.float32).save_pretrained(path)
    for dtype in (torch.float32, torch.bfloat16):  # float32: from_pretrained casts nothing
        inputs = _inputs(cfg, dtype)
        want = _forward(_replica(cfg, dtype, checkpoint=path), inputs)
        model, _ = _sharded(cfg, dtype, checkpoint=path)
        res[f"checkpoint_{dtype}"] = _equal(_forward(model, inputs), want)
    # FP8 linears (the recipe's float32 emulation on CPU), each block quantized before sharding
    fp8 = apply_overrides(cfg, {"model.linear_precision": "fp8"})
    real = h3_fp8.quantize_linears
    h3_fp8.quantize_linears = functools.partial(real, emulate=True)
    try:
        want = _forward(_replica(fp8, torch.bfloat16), inputs)
        model, summary = _sharded(fp8, torch.bfloat16)
    finally:
        h3_fp8.quantize_linears = real
    res["fp8"] = (_equal(_forward(model, inputs), want), summary.fp8_tensors)
    return res


@pytest.mark.parametrize("world", [3])  # uneven heads; tests/integrations covers 1-4 ranks
def test_sharded_build_serves_the_replicas_outputs(tmp_path, world):
    for res in run_ranks(_worker, world, tmp_path, str(tmp_path), timeout=300):
        for dtype in ("torch.float32", "torch.bfloat16"):
            equal, w, units, share = res[f"own_{dtype}"]
            assert equal and w == world and units == 4 and share <= 1 / world + 0.05, res
        assert res["checkpoint_torch.float32"] and res["checkpoint_torch.bfloat16"], res
        assert res["fp8"] == (True, 2 * 6 * 2), res  # 2 blocks x 6 linears x (codes, scales)


def _refusal_worker(rank, world, ckpt):
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.weights import WeightsError

    cfg = load_config(None)
    try:
        _sharded(cfg, torch.float32, checkpoint=ckpt)
    except WeightsError as e:
        return str(e)
    return None


def test_a_checkpoint_missing_a_tensor_fails_on_every_rank_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.model import build_h3

    cfg = load_config(None)
    path = tmp_path / "ckpt"
    build_h3(cfg.model, device=CPU, dtype=torch.float32).save_pretrained(path)
    file = path / "diffusion_pytorch_model.safetensors"
    tensors = load_file(file)
    del tensors["transformer_blocks.1.attn.to_k.weight"]
    save_file(tensors, file)
    for msg in run_ranks(_refusal_worker, 2, tmp_path, str(path), timeout=200):
        assert msg and "no tensor transformer_blocks.1.attn.to_k.weight" in msg, msg


def test_launched_server_serves_the_same_latents_sharded_or_not(tmp_path):
    """launch/serve.py --once on 2 gloo ranks with parallel.shard_weights = true and = false:
    the sharded build says so in its log and the latents' checksums are bit-identical (the
    server's restart with sharded weights: tests/serve/test_restart.py)."""
    import json

    from tests.serve._server import STARTUP_S, run, torchrun

    bits = {}
    for shard in ("true", "false"):
        res = run(torchrun(2, "--once", "--steps", "2", "--seed", "3", "--output-dir",
                           str(tmp_path / shard), "--set", f"parallel.shard_weights={shard}"),
                  STARTUP_S)
        assert res.returncode == 0, res.stderr[-3000:]
        assert ("weights sharded over 2 ranks with FSDP2" in res.stderr) == (shard == "true"), \
            res.stderr[-3000:]
        line = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        assert len(line) == 1, res.stdout
        bits[shard] = json.loads(line[0])["checksum"]["bits64"]
    assert bits["true"] == bits["false"], bits


def _checksum(model, cfg) -> str:
    from dist_attn.distributed import DistEnv
    from dist_attn.profiling import PhaseTimer
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.h3.model import parallelize
    from dist_attn.models.h3.serve.jobs.requests import parse_request

    env = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU, backend=None)
    timer = PhaseTimer(CPU)
    parallelize(model, backend="sdpa", timer=timer)
    req = parse_request({"frames": 22, "height": 128, "width": 192, "steps": 2, "seed": 1}, cfg,
                        request_id="x")
    return Engine(cfg, env, model, timer, backend="sdpa").run(req).checksum.bits64


def test_a_checkpoint_serves_what_its_own_init_serves_bit_for_bit(tmp_path):
    """float32 on CPU: from_pretrained leaves the weights in the file's memory, 8-byte aligned,
    where CPU matmuls round some small layers differently from fresh (64-byte aligned) memory,
    as the sharded build and the class's own init have; the replica loaded from a checkpoint
    must serve the same latents as the model it was saved from (a user found a one-step pixel
    difference between sharded and unsharded servers with --checkpoint)."""
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.model import build_h3

    cfg = load_config(None)
    build_h3(cfg.model, device=CPU, dtype=torch.float32).save_pretrained(str(tmp_path / "ckpt"))
    loaded = build_h3(cfg.model, device=CPU, dtype=torch.float32, checkpoint=str(tmp_path / "ckpt"))
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())
    own = build_h3(cfg.model, device=CPU, dtype=torch.float32)
    assert _checksum(loaded, cfg) == _checksum(own, cfg)
