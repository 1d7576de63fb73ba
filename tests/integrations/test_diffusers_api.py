# SPDX-License-Identifier: Apache-2.0
"""enable_ulysses in one process (no process group = one rank): what it accepts, what it refuses
with which message, what remove() restores, and that diffusers stays an optional import."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install -e '.[diffusers]')")

import torch.distributed as dist  # noqa: E402

from dist_attn.integrations.diffusers import (  # noqa: E402
    disable_ulysses, enable_ulysses, supported_models,
)
from tests.conftest import subprocess_env  # noqa: E402
from tests.integrations._tiny_models import h3_inputs, tiny_h3, tiny_wan, wan_inputs  # noqa: E402


@pytest.fixture(autouse=True)
def _no_process_group():
    assert not dist.is_initialized(), "these tests are about running without a process group"


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_without_process_group_runs_as_one_rank_bit_identical():
    model = tiny_wan(4)
    inputs = wan_inputs(2, 3, 6, 10)  # S = 45, B = 2
    ref = _run(model, inputs)
    handle = enable_ulysses(model, backend="sdpa")
    out = _run(model, inputs)
    handle.remove()
    # One rank: same rows, same kernels (SDPA in both), so no rounding may differ.
    assert torch.equal(out, ref), float((out - ref).abs().max())
    assert torch.equal(_run(model, inputs), ref)


def test_h3_without_process_group_bit_identical_sample_and_audio_sample():
    model = tiny_h3(4)
    inputs = h3_inputs(2)  # S = 29 rows of text, keyframe, audio and video at three timesteps
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)
        with enable_ulysses(model, backend="sdpa"):
            out = model(**inputs)
    assert torch.equal(out.sample, ref[0]), float((out.sample - ref[0]).abs().max())
    assert torch.equal(out.audio_sample, ref[1]), float((out.audio_sample - ref[1]).abs().max())
    model.fuse_qkv_projections()  # the processor projects through one to_qkv
    assert model.transformer_blocks[0].attn.fused_projections
    with enable_ulysses(model, backend="sdpa"), torch.no_grad():
        fused = model(**inputs, return_dict=False)
    torch.testing.assert_close(fused, ref, rtol=0, atol=1e-5)


def test_h3_bad_inputs_name_the_argument():
    model = tiny_h3(2)
    enable_ulysses(model)
    inputs = h3_inputs(1)
    with pytest.raises(ValueError, match=r"audio_hidden_states of shape \(2, 6, 6\) has batch 2 but "
                                         r"hidden_states of shape \(1, 18, 16\) has batch 1"):
        _run(model, {**inputs, "audio_hidden_states": torch.zeros(2, 6, 6)})
    with pytest.raises(ValueError, match=r"position_ids=shape \(29,\) must be a \[S, 3\] tensor"):
        _run(model, {**inputs, "position_ids": inputs["position_ids"][:, 0]})
    with pytest.raises(ValueError, match=r"video_indices=shape \(17,\) must be a \[18\] tensor: one "
                                         r"packed position per row of hidden_states"):
        _run(model, {**inputs, "video_indices": inputs["video_indices"][:-1]})
    with pytest.raises(ValueError, match=r"timestep_indices=a NoneType must be a \[S\] tensor with S=29"):
        _run(model, {**inputs, "timestep_indices": None})
    with pytest.raises(RuntimeError, match=r"called outside the transformer's forward"):
        with torch.no_grad():
            model.transformer_blocks[0].attn(torch.zeros(1, 29, 32))
    _run(model, inputs)  # a good call after the failures works


def test_scalars_are_checked_once_by_enable_ulysses(monkeypatch):
    """enable_ulysses checks overlap_chunks once; the attention calls trust it (no check per
    call) and it cannot be changed behind the check."""
    import dist_attn.ulysses as ulysses

    model = tiny_wan(4)
    inputs = wan_inputs(1, 3, 6, 10)
    ref = _run(model, inputs)
    with pytest.raises(ValueError, match=r"overlap_chunks=0 must be an int >= 1"):
        enable_ulysses(model, backend="sdpa", overlap_chunks=0)
    handle = enable_ulysses(model, backend="sdpa", overlap_chunks=2)
    calls = []
    monkeypatch.setattr(ulysses, "check_scalars", lambda *a: calls.append(a))
    out = _run(model, inputs)
    handle.remove()
    assert calls == [] and torch.equal(out, ref)
    assert handle.runtime.overlap_chunks == 2
    with pytest.raises(AttributeError):
        handle.runtime.overlap_chunks = 0


def test_fused_projections_one_rank_bit_identical():
    model = tiny_wan(4)
    inputs = wan_inputs(1, 2, 4, 8)
    ref = _run(model, inputs)
    model.fuse_qkv_projections()  # attn1 then projects through one to_qkv
    assert model.blocks[0].attn1.fused_projections
    with enable_ulysses(model, backend="sdpa"):
        out = _run(model, inputs)
    # The fused GEMM computes the same dot products over the same inputs; on this CPU its
    # rows come out bit-identical, and any reordering would stay within float32 rounding.
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


def test_positional_arguments_and_a_wrapped_forward():
    model = tiny_wan(4)
    inputs = wan_inputs(1, 2, 4, 8)
    ref = _run(model, inputs)
    inner = model.forward
    # Offloading wrappers replace the instance's forward by a (*args, **kwargs) function.
    model.forward = lambda *args, **kwargs: inner(*args, **kwargs)
    with enable_ulysses(model, backend="sdpa"), torch.no_grad():
        out = model(inputs["hidden_states"], inputs["timestep"], inputs["encoder_hidden_states"],
                    return_dict=False)[0]
    assert torch.equal(out, ref)


def test_remove_restores_processors_and_hooks_and_disable_is_idempotent():
    model = tiny_wan(2)
    originals = [b.attn1.processor for b in model.blocks]
    cross = [b.attn2.processor for b in model.blocks]
    handle = enable_ulysses(model)
    assert all(type(b.attn1.processor).__name__ == "WanUlyssesProcessor" for b in model.blocks)
    assert all(b.attn2.processor is p for b, p in zip(model.blocks, cross)), "cross-attention must stay"
    disable_ulysses(model)
    assert handle.removed
    assert all(b.attn1.processor is p for b, p in zip(model.blocks, originals))
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    disable_ulysses(model)  # not enabled: a no-op
    handle.remove()  # twice: a no-op
    with enable_ulysses(model):  # the handle is a context manager
        assert model.blocks[0].attn1.processor is not originals[0]
    assert model.blocks[0].attn1.processor is originals[0]


def test_supported_models():
    assert supported_models() == ("WanTransformer3DModel", "LTXVideoTransformer3DModel",
                                  "MiniMaxH3Transformer3DModel")


def test_unsupported_models_are_refused_naming_the_supported_ones():
    from diffusers import CogVideoXTransformer3DModel, WanTransformer3DModel

    cog = CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                      out_channels=4, num_layers=1, sample_width=8, sample_height=8,
                                      sample_frames=5, text_embed_dim=16, time_embed_dim=8)
    with pytest.raises(TypeError, match=r"CogVideoXTransformer3DModel is not supported.*supported: .*"
                                        r"WanTransformer3DModel, LTXVideoTransformer3DModel, MiniMaxH3Transformer3DModel"):
        enable_ulysses(cog)
    with pytest.raises(TypeError, match=r"torch.nn.modules.linear.Linear is not supported"):
        enable_ulysses(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"transformer='str' must be a diffusers model"):
        enable_ulysses("WanTransformer3DModel")

    class MyWan(WanTransformer3DModel):
        pass

    with pytest.raises(TypeError, match=r"MyWan is not supported.*a subclass may change forward"):
        enable_ulysses(MyWan(num_attention_heads=2, attention_head_dim=12, in_channels=4,
                             out_channels=4, text_dim=16, freq_dim=16, ffn_dim=8, num_layers=1))


def test_bad_arguments_and_states_are_refused_before_anything_changes():
    model = tiny_wan(2)
    with pytest.raises(ValueError, match=r"backend='flash' must be one of \('auto'"):
        enable_ulysses(model, backend="flash")
    with pytest.raises(ValueError, match=r"group=.* was given but torch.distributed is not initialised"):
        enable_ulysses(model, group=object())
    model.blocks[1].attn1.set_processor(_CustomProcessor())
    with pytest.raises(ValueError, match=r"blocks.1.attn1 holds a _CustomProcessor processor"):
        enable_ulysses(model)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == 0
    model = tiny_wan(2)
    handle = enable_ulysses(model)
    with pytest.raises(ValueError, match=r"already sequence-parallel"):
        enable_ulysses(model)
    handle.remove()
    model._parallel_config = object()  # what diffusers' enable_parallelism leaves behind
    with pytest.raises(ValueError, match=r"diffusers' own context parallelism"):
        enable_ulysses(model)


class _CustomProcessor:
    def __call__(self, attn, hidden_states, *args, **kwargs):
        return hidden_states


def test_bad_inputs_and_grad_mode_raise_clear_errors():
    model = tiny_wan(2)
    enable_ulysses(model)
    inputs = wan_inputs(1, 2, 4, 4)
    with pytest.raises(ValueError, match=r"hidden_states=a Tensor of shape \(1, 4, 4, 4\) must be a "
                                         r"\[B, C, F, H, W\] tensor"):
        _run(model, {**inputs, "hidden_states": inputs["hidden_states"][:, :, 0]})
    with pytest.raises(ValueError, match=r"timestep of shape \(1, 5\) is per token but .* S=8 tokens"):
        _run(model, {**inputs, "timestep": torch.zeros(1, 5)})
    with pytest.raises(RuntimeError, match=r"forward only: call the transformer under torch.no_grad\(\)"):
        model(**inputs)
    with pytest.raises(RuntimeError, match=r"called outside the transformer's forward"):
        with torch.no_grad():
            model.blocks[0].attn1(torch.zeros(1, 8, 24))
    _run(model, inputs)  # a good call after the failures works


def test_import_dist_attn_does_not_import_diffusers(repo_root):
    code = "import sys, dist_attn; assert 'diffusers' not in sys.modules, 'diffusers was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root, env=subprocess_env(), timeout=60)


def test_missing_diffusers_gives_an_install_hint(repo_root):
    # sys.modules[name] = None makes `import name` raise ImportError, as if it were not installed.
    code = ("import sys; sys.modules['diffusers'] = None\n"
            "try:\n    import dist_attn.integrations.diffusers\n"
            "except ImportError as e:\n    print(e)\nelse:\n    raise SystemExit('imported')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root,
                         env=subprocess_env(), timeout=60)
    assert res.returncode == 0, res.stderr
    assert "pip install -e '.[diffusers]'" in res.stdout, res.stdout


def test_python_numbers_are_fingerprinted_by_value():
    """The cross-rank check compares LTX's Python-valued inputs by their float64 values: 5, 5.0
    and numpy's 5 agree (the model uses them as floats); a one-element tensor inside a tuple is
    read (diffusers types rope_interpolation_scale tuple[Tensor, float, float]); anything else
    is marked, so the check refuses it on every rank instead of skipping it as absent."""
    import numpy as np

    from dist_attn.agreement import UNCOMPARABLE as _UNCOMPARABLE
    from dist_attn.agreement import describe_fingerprint as _describe
    from dist_attn.agreement import fingerprint as _fingerprint

    cpu = torch.device("cpu")
    five = [_fingerprint(v, cpu) for v in (5, 5.0, np.int64(5), np.float32(5))]
    assert all(torch.equal(f, five[0]) for f in five) and _describe(five[0]) == "a Python number"
    a = _fingerprint((torch.tensor(0.5), 32, 32), cpu)
    assert torch.equal(a, _fingerprint((0.5, 32.0, 32), cpu)) and _describe(a) == "3 Python numbers"
    assert not torch.equal(a, _fingerprint((0.25, 32.0, 32), cpu))
    assert not torch.equal(_fingerprint((1, 2), cpu), _fingerprint((2, 1), cpu))  # order counts
    for odd in ("5", [1, [2]], 2**2000, {"a": 1}):
        assert _fingerprint(odd, cpu)[0] == _UNCOMPARABLE, odd
    assert _fingerprint(None, cpu)[0] == 0
