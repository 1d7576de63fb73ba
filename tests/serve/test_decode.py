# SPDX-License-Identifier: Apache-2.0
"""A served job's decode (dist_attn.models.h3.serve.h3.decode): the pixels are diffusers' decode step's, the
MP4 does not depend on the number of ranks, and random-weight builds get the dtypes
from_pretrained would give."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")
pytest.importorskip("transformers")

from dist_attn.distributed import DistEnv  # noqa: E402
from tests._multirank import run_ranks  # noqa: E402
from tests.integrations.test_vae_decode import tiny_vae  # noqa: E402

CPU = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
PIXEL_MEAN, PIXEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def test_served_pixels_are_those_of_diffusers_decode_step():
    from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3VideoDecodeStep

    from dist_attn.models.h3.serve.h3.decode import JobDecoder

    vae = tiny_vae()
    z = torch.randn(1, 8, 12, 5, 10, generator=torch.Generator().manual_seed(3))
    step = MiniMaxH3VideoDecodeStep().init_pipeline()
    step.update_components(vae=vae)
    with torch.no_grad():
        ref = np.asarray(step(latents=z, output_type="np", output="videos"))[0]  # [F, H, W, 3]
    want = (np.clip(ref, 0, 1) * 255).round().astype(np.uint8)  # as the MP4 writer converts
    decoder = JobDecoder(vae, None, CPU, pixel_mean=PIXEL_MEAN, pixel_std=PIXEL_STD, fps=24,
                         tiles_per_call=1)
    frames = []
    with torch.no_grad(), decoder.handle.stream(lambda s, f: frames.append(decoder.to_uint8(f))):
        vae.decode(z)
    got = torch.cat(frames).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got, want)


def _job(rank, world, cache, out_dir):
    """One served t2va job of the tiny pipeline on ``world`` gloo ranks; rank 0 returns the MP4's
    decoded frames."""
    import torch.distributed as dist

    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.h3.pipeline import H3Runner
    from dist_attn.models.h3.serve.jobs.videos import parse_video_request, VideoRequest
    from dist_attn.models.h3.serve.wire import Abort

    os.environ["DIST_ATTN_CACHE"] = cache
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"),
                  backend="gloo" if world > 1 else None)
    runner = H3Runner.build(load_config(None), env, dtype=torch.float32, backend="sdpa",
                            checkpoint=None)
    # H3's shortest video: 7 clips of one 64 x 64 tile each, dealt 2 / 2 / 3 over 3 ranks
    fields = {"prompt": "a red kite", "steps": 2, "seed": 11, "frames": 124}
    if rank == 0:
        req = parse_video_request(fields, runner.rules)
        out = runner.lead(req, mp4_path=os.path.join(out_dir, f"w{world}.mp4"), png_path=None,
                          on_step=lambda k, s: Abort.NONE)
        assert out.error is None, out.error
        with av.open(out.file.path) as container:
            return {"frames": np.stack([f.to_ndarray(format="rgb24")
                                        for f in container.decode(video=0)]),
                    "stats": runner.pipe.decoder.handle.last}
    runner.follow(VideoRequest(prompt="", frames=124, height=64, width=64, steps=2, seed=11))
    return {"stats": runner.pipe.decoder.handle.last}


def test_the_mp4_does_not_depend_on_the_number_of_ranks(tmp_path):
    from dist_attn.models.h3.serve.h3.tiny import ensure_tiny_checkpoint

    cache = str(tmp_path / "cache")
    os.environ["DIST_ATTN_CACHE"] = cache
    try:
        ensure_tiny_checkpoint(None)  # built once here, not by the ranks of both runs
    finally:
        os.environ.pop("DIST_ATTN_CACHE")
    one = run_ranks(_job, 1, tmp_path, cache, str(tmp_path), timeout=300)
    three = run_ranks(_job, 3, tmp_path, cache, str(tmp_path), timeout=300)
    a, b = one[0]["frames"], three[0]["frames"]
    assert a.shape == b.shape == (124, 64, 64, 3)
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 2
    # the three ranks each decoded a share of the clips
    assert [r["stats"].my_calls for r in three] == [2, 2, 3]  # rank 0 also muxes
    assert one[0]["stats"].my_calls == 7


def test_random_weights_get_the_dtypes_from_pretrained_gives(tmp_path):
    from diffusers import AutoencoderKLMiniMaxH3

    from dist_attn.models.h3.serve.h3.decode import cast_like_from_pretrained

    vae = tiny_vae()
    vae.save_pretrained(str(tmp_path / "vae"))
    loaded = AutoencoderKLMiniMaxH3.from_pretrained(str(tmp_path / "vae"),
                                                    torch_dtype=torch.float16)
    cast = cast_like_from_pretrained(tiny_vae(), torch.float16)
    want = {n: p.dtype for n, p in loaded.named_parameters()}
    got = {n: p.dtype for n, p in cast.named_parameters()}
    assert got == want
    assert {torch.float16, torch.float32} <= set(got.values())  # both kinds are there
