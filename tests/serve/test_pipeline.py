# SPDX-License-Identifier: Apache-2.0
"""The H3 pipeline on one CPU rank with the tiny random checkpoint: built once into a cache (no
download), loaded with each class's own from_pretrained, run through diffusers' blocks; the
packed length is what the request rules said, a cancel stops between steps, the MP4 is right."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("transformers")

from dist_attn.distributed import DistEnv  # noqa: E402
from dist_attn.models.h3.serve.config import load_config  # noqa: E402
from dist_attn.models.h3.serve.jobs.mp4 import probe_mp4  # noqa: E402
from dist_attn.models.h3.serve.jobs.videos import parse_video_request  # noqa: E402
from dist_attn.models.h3.serve.wire import Abort  # noqa: E402

ENV = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from dist_attn.models.h3.serve.h3.pipeline import H3Runner

    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("DIST_ATTN_CACHE")
    os.environ["DIST_ATTN_CACHE"] = str(cache)
    try:
        yield H3Runner.build(load_config(None), ENV, dtype=torch.float32, backend="sdpa",
                             checkpoint=None)
    finally:
        if old is None:
            os.environ.pop("DIST_ATTN_CACHE")
        else:
            os.environ["DIST_ATTN_CACHE"] = old


def test_the_tiny_checkpoint_is_built_once_of_the_real_classes(runner):
    from dist_attn.models.h3.serve.h3.tiny import (MARKER, ensure_tiny_checkpoint,
                                                   tiny_checkpoint_path)

    path = tiny_checkpoint_path()
    assert os.environ["DIST_ATTN_CACHE"] in path and os.path.isfile(os.path.join(path, MARKER))
    stamp = os.path.getmtime(os.path.join(path, "transformer", "config.json"))
    assert ensure_tiny_checkpoint(None) == path  # present: not rebuilt
    assert os.path.getmtime(os.path.join(path, "transformer", "config.json")) == stamp
    c = runner.pipe.comps
    names = {type(m).__name__ for m in (c.transformer, c.vae, c.audio_vae, c.text_encoder,
                                        c.scheduler, c.tokenizer)}
    assert names == {"MiniMaxH3Transformer3DModel", "AutoencoderKLMiniMaxH3",
                     "AutoencoderKLMiniMaxH3Audio", "Qwen3VLForConditionalGeneration",
                     "MiniMaxH3Scheduler", "Qwen2Tokenizer"}  # transformers 5: the fast one
    assert c.tokenizer.is_fast
    assert c.scheduler.config.shift == 12.0 and c.audio_scheduler.config.shift == 3.0
    # the fp32 modules the class declares stay fp32 (here everything is fp32; the check is that
    # from_pretrained ran with them, which needs accelerate)
    assert c.transformer.proj_in.weight.dtype == torch.float32


def test_a_second_build_is_bit_identical(tmp_path):
    from dist_attn.models.h3.serve.h3.tiny import build_tiny_checkpoint

    a = build_tiny_checkpoint(str(tmp_path / "a"))
    b = build_tiny_checkpoint(str(tmp_path / "b"))
    for part in ("transformer", "text_encoder", "vae", "audio_vae"):
        files = sorted(f for f in os.listdir(os.path.join(a, part)) if f.endswith(".safetensors"))
        assert files, part
        for f in files:
            with open(os.path.join(a, part, f), "rb") as x, open(os.path.join(b, part, f), "rb") as y:
                assert x.read() == y.read(), (part, f)


def test_a_job_packs_the_rows_the_rules_said_and_writes_the_mp4(runner, tmp_path):
    seen = {}

    def grab(_module, _args, kwargs):
        seen["rows"] = sum(kwargs[k].shape[1] for k in ("hidden_states", "audio_hidden_states",
                                                         "encoder_hidden_states"))
        seen["batch"] = kwargs["hidden_states"].shape[0]

    req = parse_video_request({"prompt": "a cat on a piano", "steps": 3, "seed": 4}, runner.rules)
    assert req.rows == len("a cat on a piano") + 2 * 207 + 37 * 2 * 2  # bytes + audio + video
    steps = []
    handle = runner.pipe.comps.transformer.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        out = runner.lead(req, mp4_path=str(tmp_path / "a.mp4"), png_path=str(tmp_path / "a.png"),
                          on_step=lambda k, s: steps.append(k) or Abort.NONE)
    finally:
        handle.remove()
    assert out.error is None and out.aborted is Abort.NONE
    assert seen == {"rows": req.rows, "batch": 1}  # one document, no CFG pair
    assert steps == [1, 2, 3] and len(out.step_s) == 3
    assert set(out.timings) == {"text_encode", "denoise", "decode_video", "decode_audio", "mux",
                                "after_denoise"}
    back = probe_mp4(out.file.path)
    assert (back.frames, back.width, back.height, back.fps) == (124, 64, 64, 24.0)
    assert back.sample_rate == 32_000 and back.audio_channels == 2
    assert abs(back.audio_samples - 124 / 24 * 32_000) < 2048  # 5.17 s of sound, AAC-framed
    assert os.path.getsize(tmp_path / "a.png") > 0


def test_same_seed_same_latents_and_a_cancel_stops_between_steps(runner):
    req = parse_video_request({"prompt": "rain", "steps": 4, "seed": 9}, runner.rules)
    embeds, tags, _ = runner.pipe.encode(req.prompt)
    a = runner.pipe.run_denoise(req, embeds, tags, lambda k, n: Abort.NONE)
    b = runner.pipe.run_denoise(req, embeds, tags, lambda k, n: Abort.NONE)
    assert torch.equal(a["latents"], b["latents"]) and torch.equal(a["audio_latents"],
                                                                  b["audio_latents"])
    other = parse_video_request({"prompt": "rain", "steps": 4, "seed": 10}, runner.rules)
    c = runner.pipe.run_denoise(other, embeds, tags, lambda k, n: Abort.NONE)
    assert not torch.equal(a["latents"], c["latents"])
    stopped = runner.pipe.run_denoise(req, embeds, tags,
                                      lambda k, n: Abort.CANCELLED if k == 2 else Abort.NONE)
    assert stopped["aborted"] is Abort.CANCELLED and stopped["steps_done"] == 2


def test_the_text_only_processor_marks_tokens_as_transformers_does(runner):
    tok = runner.pipe.comps.tokenizer
    proc = runner.pipe.comps.processor
    ids = tok("hi", add_special_tokens=False)["input_ids"] + [tok.convert_tokens_to_ids(
        "<|image_pad|>"), tok.convert_tokens_to_ids("<|video_pad|>")]
    assert proc.create_mm_token_type_ids([ids]) == [[0, 0, 1, 2]]


def test_rules_come_from_the_pipeline(runner):
    r = runner.rules
    assert (r.canvas_multiple, r.frames_per_chunk, r.latents_per_chunk, r.fps) == (32, 17, 5, 24)
    assert r.text_rows("héllo") == len("héllo".encode())  # byte-level BPE, no merges
    assert r.frames_ok(124) is None and "nearest: 124 or 141" in r.frames_ok(130)


def test_a_deeper_text_encoder_loads_only_the_layers_h3_reads(runner, tmp_path):
    """hidden_states[50] does not depend on layers 51+: a 53-layer encoder loads 51 layers and
    gives the same conditioning as the full stack."""
    from transformers import Qwen3VLForConditionalGeneration

    from dist_attn.models.h3.serve.h3.text import load_text_encoder

    full_cfg = runner.pipe.comps.text_encoder.config
    cfg = full_cfg.__class__.from_dict(full_cfg.to_dict())
    cfg.text_config.num_hidden_layers = 53
    torch.manual_seed(0)
    deep = Qwen3VLForConditionalGeneration(cfg).eval()
    deep.save_pretrained(str(tmp_path / "te"))
    cut = load_text_encoder(Qwen3VLForConditionalGeneration, str(tmp_path / "te"),
                             dtype=torch.float32, device=torch.device("cpu"))
    assert len(cut.model.language_model.layers) == 51
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
              mm_token_type_ids=torch.zeros_like(ids), use_cache=False, output_hidden_states=True)
    with torch.no_grad():
        want = deep.model(**kw).hidden_states[50]
        got = cut.model(**kw).hidden_states[50]
    assert torch.equal(got, want)
