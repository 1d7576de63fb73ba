# SPDX-License-Identifier: Apache-2.0
"""The compiled video decode (decode.compile): the decoder's repeated blocks under torch.compile
give eager's video within float32 rounding, batched tiles as served, on one and two gloo ranks;
the warm-up's decode leaves nothing to compile for a job of the same geometry."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from dist_attn.distributed import DistEnv  # noqa: E402
from tests._multirank import run_ranks  # noqa: E402
from tests.integrations.test_vae_decode import tiny_vae  # noqa: E402

PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# float32 on CPU: the compiled blocks run the same ops (inductor may fuse and reorder float32
# sums: ~1e-7 of O(1) pixels); measured 0.0 with aot_eager, 4.8e-7 with inductor
ATOL = 1e-5
LATENTS = (1, 8, 12, 5, 10)  # [B, C, T, h, w]: 2 clips x 6 tiles of the tiny VAE's tiling


def _decoders(env, backend):
    """(eager, compiled) JobDecoders over two copies of the same tiny VAE, 5 tiles a call (the
    last wave's remainder is a second batch shape)."""
    import dist_attn.integrations.diffusers as integration
    from dist_attn.models.h3.serve.h3.decode import JobDecoder

    real = integration.compile_vae_decoder
    integration.compile_vae_decoder = functools.partial(real, backend=backend)
    try:
        kw = dict(pixel_mean=PIXEL_MEAN, pixel_std=PIXEL_STD, fps=24, tiles_per_call=5)
        eager = JobDecoder(tiny_vae(), None, env, **kw)
        compiled = JobDecoder(tiny_vae(), None, env, compile=True, **kw)
    finally:
        integration.compile_vae_decoder = real
    return eager, compiled


def _video(decoder, z):
    frames = []
    with torch.no_grad(), decoder.handle.stream(lambda s, f: frames.append(f.clone())):
        decoder.vae.decode(z)
    return torch.cat(frames, dim=2)


def _compare(env, backend):
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    eager, compiled = _decoders(env, counter)
    z = torch.randn(*LATENTS, generator=torch.Generator().manual_seed(5))
    compiled.warm(LATENTS[2:])  # what the launch's warm-up does for a geometry
    frames = counter.frame_count
    got, want = _video(compiled, z), _video(eager, z)
    blocks = [b for b in compiled.vae.decoder.transformer_blocks]
    return {"diff": float((got - want).abs().max()), "frames_after_warm": frames,
            "compiled_in_job": counter.frame_count - frames, "shapes": compiled.handle.last.calls,
            "all_compiled": all(b._compiled_call_impl is not None for b in blocks)}


def test_compiled_decode_matches_eager_and_warms_every_batch_shape():
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    res = _compare(env, "aot_eager")
    assert res["all_compiled"] and res["diff"] <= ATOL, res
    # 12 calls in batches of 5: two full calls and one of 2, two shapes compiled by the warm-up
    assert res["shapes"] == 12 and res["frames_after_warm"] == 2 and res["compiled_in_job"] == 0, res


def _worker(rank, world):
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo")
    return _compare(env, "aot_eager")


def test_compiled_decode_on_two_ranks(tmp_path):
    for res in run_ranks(_worker, 2, tmp_path, timeout=200):
        assert res["diff"] <= ATOL and res["compiled_in_job"] == 0, res


def test_decode_compile_field():
    from dist_attn.models.h3.serve.config import apply_overrides, load_config

    cfg = load_config(None)
    assert cfg.decode.compiled("cuda", None) and not cfg.decode.compiled("cpu", None)
    assert not cfg.decode.compiled("cuda", "lossless")
    assert apply_overrides(cfg, {"decode.compile": True}).decode.compiled("cpu", None)
    with pytest.raises(ValueError, match=r"decode.compile='yes' must be true, false or \"auto\""):
        apply_overrides(cfg, {"decode.compile": "yes"})
