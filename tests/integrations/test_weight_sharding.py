# SPDX-License-Identifier: Apache-2.0
"""shard_weights: diffusers transformers' weights sharded over gloo ranks with FSDP2, composed with
enable_ulysses, FP8 linears (emulated on CPU) and compiled blocks. The outputs must be the
unsharded model's bit for bit: FSDP2 gathers the exact bytes of every shard, so any difference is
a bug (a unit gathered late, a wrong shard, an FP8 scale cast), not rounding."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed")

from tests._multirank import run_ranks  # noqa: E402
from tests.integrations._tiny_models import h3_inputs, tiny_h3, tiny_wan, wan_inputs  # noqa: E402


def _forward(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)


def _gathers(model, inputs) -> int:
    """All-gathers of one forward (FSDP2's unit gathers and enable_ulysses' own)."""
    from torch.distributed.tensor.debug import CommDebugMode

    comm = CommDebugMode()
    with torch.no_grad(), comm:
        model(**inputs, return_dict=False)
    return sum(n for op, n in comm.get_comm_counts().items() if "allgather" in str(op).replace("_", ""))


def _sharded_case(model, inputs, *, world, fp8_layers=()):
    """enable_ulysses alone, then with shard_weights: (outputs equal, twice; gathers added per
    forward; this rank's share of the bytes; FP8 params sharded as float8)."""
    from torch.distributed.tensor import DTensor

    from dist_attn.integrations.diffusers import enable_ulysses, shard_weights

    enable_ulysses(model, backend="sdpa")
    want = _forward(model, inputs)
    before = _gathers(model, inputs)
    summary = shard_weights(model)
    got, again = _forward(model, inputs), _forward(model, inputs)
    after = _gathers(model, inputs)
    # every parameter a DTensor whose local storage is at most one padded 1/W block of rows
    resharded = all(isinstance(p, DTensor) and p.to_local().numel()
                    <= -(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in model.parameters())
    fp8 = [model.get_submodule(n).weight_codes for n in fp8_layers]
    return {"equal": all(torch.equal(a, b) for a, b in zip(got, want)),
            "again": all(torch.equal(a, b) for a, b in zip(again, want)),
            "units": len(summary.units), "gathers_added": after - before,
            "share": summary.bytes_per_rank / summary.bytes_total, "resharded": resharded,
            "plain": not any(isinstance(p, DTensor) for p in model.parameters()),
            "log": summary.describe(),
            "fp8_sharded": all(isinstance(c, DTensor) and c.dtype == torch.float8_e4m3fn for c in fp8),
            "fp8_tensors": summary.fp8_tensors}


def _worker(rank, world):
    res = {"h3": _sharded_case(tiny_h3(4), h3_inputs(1), world=world),
           "wan": _sharded_case(tiny_wan(4), wan_inputs(2, 3, 6, 10), world=world)}
    if world in (2, 3):
        res["fp8"] = _fp8_case(world)
    if world == 2:
        res["compiled"] = _compiled_case()
        res["refusals"] = _refusals()
    return res


def _fp8_case(world):
    """The served tiny H3 (bf16 blocks, fp32 modules) with FP8 linears in the recipe's float32
    emulation and the fused norm + AdaLN forward (its torch reference on CPU)."""
    from dist_attn.models.h3.fp8 import quantize_linears
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.model import build_h3
    from tests.integrations.test_fp8_h3 import _inputs

    cfg = load_config(None)
    model = build_h3(cfg.model, device=torch.device("cpu"), dtype=torch.bfloat16)
    summary = quantize_linears(model, "fp8", emulate=True, fuse_adaln=True)
    inputs = _inputs(cfg, torch.bfloat16)
    inputs.pop("return_dict")
    return _sharded_case(model, inputs, world=world,
                         fp8_layers=summary.layers[:2])


def _compiled_case():
    """Blocks compiled after sharding (fullgraph, as the server compiles them; aot_eager on CPU):
    FSDP2's hooks stay outside the graphs, the outputs stay the eager ones, nothing recompiles."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dist_attn.integrations.diffusers import enable_ulysses, shard_weights

    model, inputs = tiny_h3(4), h3_inputs(1)
    enable_ulysses(model, backend="sdpa")
    want = _forward(model, inputs)
    shard_weights(model)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.transformer_blocks:
        block.compile(fullgraph=True, dynamic=False, backend=counter)
    first = _forward(model, inputs)
    frames = counter.frame_count
    second = _forward(model, inputs)
    return {"equal": all(torch.equal(a, b) for a, b in zip(first, want)),
            "again": all(torch.equal(a, b) for a, b in zip(second, want)),
            "compiled": frames > 0, "recompiled": counter.frame_count - frames}


def _refusals():
    from dist_attn.integrations.diffusers import enable_ulysses, shard_weights, weight_units
    from dist_attn.models.h3.fp8 import quantize_linears

    out = {}
    model = tiny_h3(2)
    out["units"] = weight_units(model)
    model.transformer_blocks[0].compile(backend="eager")
    for name, call in (("compiled", lambda: shard_weights(model)),):
        try:
            call()
        except ValueError as e:
            out[name] = str(e)
    model = tiny_h3(2)
    shard_weights(model)
    for name, call in (("twice", lambda: shard_weights(model)),
                       ("ulysses_after", lambda: enable_ulysses(model)),
                       ("quantize_after", lambda: quantize_linears(model, "fp8", emulate=True))):
        try:
            call()
        except ValueError as e:
            out[name] = str(e)
    try:
        from diffusers import CogVideoXTransformer3DModel  # noqa: F401 - any class without a plan

        shard_weights(torch.nn.Linear(2, 2))
    except TypeError as e:
        out["class"] = str(e)
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_weights_give_the_unsharded_outputs_bit_for_bit(tmp_path, world):
    """H3 (tiny: 2 refiner + 2 blocks, 4 heads: uneven on 3 ranks) and Wan (4 heads, a CFG batch
    of 2, 45 tokens) with sdpa on W gloo ranks: the same outputs as enable_ulysses alone, twice
    (every unit regathered); one gather per unit and one for the root each forward; each rank keeps
    ~1/W of the bytes; FP8 codes sharded as e4m3 (emulated recipe, fused AdaLN) on 2 and 3 ranks;
    a group of one rank is wrapped (the GPU test's FSDP2 path on one GPU) and its log says so."""
    for res in run_ranks(_worker, world, tmp_path, timeout=300):
        for name in ("h3", "wan", "fp8"):
            if name not in res:
                continue
            r = res[name]
            assert r["equal"] and r["again"], (name, r)
            if world > 1:
                assert r["gathers_added"] == r["units"] + 1, (name, r)
            # a group of one rank is wrapped too (every weight whole), as the log says
            assert r["resharded"] and not r["plain"], (name, r)
            assert ("over a group of one rank" in r["log"]) == (world == 1), (name, r)
            assert r["share"] <= 1 / world + 0.05, (name, r)
        assert res["h3"]["units"] == 4 and res["wan"]["units"] == 2
        if "fp8" in res:
            assert res["fp8"]["fp8_sharded"] and res["fp8"]["fp8_tensors"] == 2 * 6 * 2, res["fp8"]
    if world == 2:
        c, r = res["compiled"], res["refusals"]
        assert c["equal"] and c["again"] and c["compiled"] and c["recompiled"] == 0, c
        assert r["units"] == ["token_refiner.refiner_blocks.0", "token_refiner.refiner_blocks.1",
                              "transformer_blocks.0", "transformer_blocks.1"]
        assert "already compiled; shard the weights before compiling" in r["compiled"]
        assert "already sharded" in r["twice"]
        assert "call enable_ulysses first" in r["ulysses_after"]
        assert "call quantize_linears first" in r["quantize_after"]
        assert "shard_weights has no plan for Linear" in r["class"]


def test_without_a_process_group_nothing_is_sharded_and_the_model_stays_usable():
    """No process group (one process): shard_weights says nothing was sharded, leaves plain
    parameters, and enable_ulysses afterwards is not refused as 'already sharded' (a user met
    that); the outputs are the model's."""  # a group of one rank: the multi-rank test, W = 1
    from torch.distributed.tensor import DTensor

    from dist_attn.integrations.diffusers import enable_ulysses, shard_weights

    model, inputs = tiny_wan(4), wan_inputs(2, 3, 6, 10)
    with torch.no_grad():
        want = model(**inputs, return_dict=False)
    summary = shard_weights(model)
    assert summary.world == 1 and not summary.wrapped and "no process group" in summary.describe()
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    enable_ulysses(model, backend="sdpa")
    with torch.no_grad():
        got = model(**inputs, return_dict=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_model_on_the_meta_device_is_told_to_load_its_weights_first():
    """shard_weights on a transformer built on the meta device: one ValueError naming the
    parameters and what to do (its message once offered arguments shard_weights does not take)."""
    from dist_attn.integrations.diffusers import shard_weights

    with torch.device("meta"):
        model = tiny_wan(4)
    with pytest.raises(ValueError, match=r"shard_weights: \d+ of the transformer's parameters are "
                                         r"on the meta device \(.*\): load its weights first"):
        shard_weights(model)
