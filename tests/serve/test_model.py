# SPDX-License-Identifier: Apache-2.0
"""The served DiT is diffusers' MiniMaxH3Transformer3DModel: its config is the class's, its rows are
packed as H3's pipeline packs them, its weights are the class's own seeded initialisation, and the
engine's denoise loop is diffusers' model stepped by MiniMaxH3Scheduler."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

pytest.importorskip("diffusers", reason="the served DiT needs the diffusers extra")

from dist_attn.models.h3.serve.config import ModelConfig, load_config  # noqa: E402
from dist_attn.models.h3.serve.config.tokens import TokenConfig, request_layout  # noqa: E402
from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, fp32_module_names, parallelize  # noqa: E402

from tests.conftest import ROOT  # noqa: E402
from tests.integrations._tiny_models import h3_layout_functions  # noqa: E402

H3_TOML = os.path.join(ROOT, "configs", "h3.toml")
CPU = torch.device("cpu")


def test_h3_config_is_the_class_default_and_h3_toml():
    from diffusers import MiniMaxH3Transformer3DModel

    defaults = {name: p.default for name, p in
                inspect.signature(MiniMaxH3Transformer3DModel.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}
    assert ModelConfig().diffusers_config() == defaults
    assert load_config(H3_TOML).model == ModelConfig()
    assert load_config(None).model.diffusers_config().keys() == defaults.keys()


# (frames, height, width, text rows): H3's default 124 x 768 x 1344 (38,222 rows), the tiny default,
# frames that need aligning (100 -> 107), a portrait canvas, the shortest (5 frames: 2 latents).
REQUESTS = [(124, 768, 1344, 512), (22, 128, 192, 32), (100, 512, 896, 40), (22, 192, 96, 7),
            (5, 64, 64, 3)]


@pytest.mark.parametrize("frames, height, width, text", REQUESTS)
def test_packed_rows_are_h3_pipelines_rows(frames, height, width, text):
    """Every row of the layout, bit for bit, against diffusers' modular pipeline
    (``before_denoise.py``: build_packed_sequence and build_row_timesteps; modular_pipeline.py:
    align_num_frames, video_latent_num_frames, audio_latent_num_frames)."""
    build_packed_sequence, build_row_timesteps = h3_layout_functions()
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as mp

    lay = request_layout(TokenConfig(text_tokens=text, min_duration_s=0.0), (1, 2, 2),
                         frames=frames, height=height, width=width)
    aligned = mp.align_num_frames(frames, 17, 5)
    assert lay.frames == aligned
    assert lay.latent_shape == (mp.video_latent_num_frames(aligned, 17, 5), height // 16, width // 16)
    assert lay.audio_latents == mp.audio_latent_num_frames(aligned)
    ref = build_packed_sequence(torch.ones(text, dtype=torch.long), *lay.latent_shape,
                                lay.audio_latents, (1, 2, 2), 2, 2, 0, ())
    rows = lay.rows()
    for i, name in enumerate(("position_ids", "token_tags", "video_indices", "audio_indices",
                              "text_indices")):
        assert rows[name].dtype == ref[i].dtype and torch.equal(rows[name], ref[i]), name
    for video_t, audio_t in ((0.0, 0.0), (0.25, 0.5), (0.9, 0.6)):
        got = lay.timestep_rows(video_t, audio_t)
        want = build_row_timesteps(ref[2], ref[3], 0, 0, text, video_t, audio_t, 0.999, 1.0)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), (video_t, audio_t)
    if (frames, height, width) == (124, 768, 1344):
        assert (lay.text, lay.audio, lay.video, lay.used) == (512, 414, 37_296, 38_222)


def test_request_rules_name_the_field():
    tok = TokenConfig()
    with pytest.raises(ValueError, match=r"request.height=100 must be a multiple of 32 \(the video "
                                         r"VAE's 16x compression times the transformer's 2x2 patch\)"):
        request_layout(tok, (1, 2, 2), frames=124, height=100, width=1344)
    with pytest.raises(ValueError, match=r"request.frames=346 gives 362 frames once aligned to 17 n "
                                         r"\+ 5 \(15.083 s at 24 fps\), outside \[5.0, 15.0\] s"):
        request_layout(tok, (1, 2, 2), frames=346, height=768, width=1344)
    with pytest.raises(ValueError, match=r"request.frames=22 gives 22 frames .* outside \[5.0, 15.0\]"):
        request_layout(tok, (1, 2, 2), frames=22, height=768, width=1344)


def _tiny(**overrides):
    return ModelConfig(**{**load_config(None).model.__dict__, **overrides})


def test_own_init_is_seeded_alike_and_keeps_the_fp32_modules():
    cfg = _tiny(num_layers=1)
    a, b = (build_h3(cfg, device=CPU, dtype=torch.float32) for _ in range(2))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    other = build_h3(_tiny(num_layers=1, weight_seed=1), device=CPU, dtype=torch.float32)
    assert not torch.equal(other.proj_in.weight, a.proj_in.weight)
    before = torch.get_default_dtype()
    half = build_h3(cfg, device=CPU, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == before
    fp32 = fp32_module_names(half)
    assert fp32 == ["proj_in", "audio_proj_in", "time_embedder", "rope", "proj_out", "audio_proj_out"]
    for name, p in half.named_parameters():
        want = torch.float32 if name.split(".")[0] in fp32 else torch.bfloat16
        assert p.dtype == want, (name, p.dtype)
    assert half.rope.inv_freq.dtype == torch.float32 and not half.training
    assert not any(p.requires_grad for p in half.parameters())


def _hand_loop(model, cfg, layout, seed, steps):
    """H3's denoise loop written out with diffusers alone (no dist_attn): the reference."""
    from diffusers import MiniMaxH3Scheduler

    from dist_attn.models.h3.serve.h3.engine import initial_state

    video, audio, text = initial_state(cfg, layout, seed, CPU, torch.float32)
    rows = layout.rows()
    scheds = [MiniMaxH3Scheduler(shift=s) for s in (12.0, 3.0)]
    for s in scheds:
        s.set_timesteps(steps + 1)
    with torch.no_grad():
        for t_v, t_a in zip(scheds[0].timesteps, scheds[1].timesteps):
            timestep, indices = layout.timestep_rows(float(t_v), float(t_a))
            v_video, v_audio = model(video[None], audio[None], text, timestep, indices, return_dict=False,
                                     **{k: rows[k] for k in ("token_tags", "position_ids", "video_indices",
                                                             "audio_indices", "text_indices")})
            video = scheds[0].step(v_video[0], t_v, video, return_dict=False)[0]
            audio = scheds[1].step(v_audio[0], t_a, audio, return_dict=False)[0]
    return video, audio


def test_engine_is_diffusers_model_stepped_by_minimax_h3_scheduler():
    import torch._dynamo

    from dist_attn import PhaseTimer
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.h3.engine import Engine
    from dist_attn.models.h3.serve.jobs.requests import parse_request

    cfg = load_config(None)
    model = build_h3(cfg.model, device=CPU, dtype=torch.float32)
    req = parse_request({"steps": 3, "seed": 4}, cfg)
    ref_video, ref_audio = _hand_loop(model, cfg, req.layout(cfg), 4, 3)
    timer = PhaseTimer()
    handle = parallelize(model, backend="sdpa", timer=timer)
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=CPU, backend=None, shared_gpu=False)
    engine = Engine(cfg, env, model, timer, backend="sdpa", output_dir="unused")
    result = engine.run(req)
    # one process, SDPA in both: dist_attn's single-rank path is bit-identical to diffusers'
    assert torch.equal(result.latent["video"], ref_video) and torch.equal(result.latent["audio"], ref_audio)
    assert len(result.step_latency_ms) == 3 and result.tokens.used == 274
    assert timer.counts().get("kernel", 0) == 3 * cfg.model.num_layers  # every block, every step
    # --compile: every block under torch.compile(fullgraph=True) (aot_eager here: inductor's
    # code generation is what the 2-rank integration test exercises)
    with torch._dynamo.config.patch(recompile_limit=8):  # compile_blocks raises it: not for later tests
        compile_blocks(model, backend="aot_eager")
    compiled = engine.run(req)
    err = max(float((compiled.latent[k] - result.latent[k]).abs().max()) for k in ("video", "audio"))
    assert err <= 1e-5, err
    handle.remove()


def _engines(cfg, *compile_kwargs, rank=0, world=1, sequence_bucket=1):
    """One served engine per entry: None = eager, a dict = compile_blocks(**it)."""
    from dist_attn import PhaseTimer
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.h3.engine import Engine

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, device=CPU,
                  backend="gloo" if world > 1 else None, shared_gpu=False)
    engines = []
    for kwargs in compile_kwargs:
        model = build_h3(cfg.model, device=CPU, dtype=torch.float32)
        timer = PhaseTimer()
        parallelize(model, backend="sdpa", timer=timer, sequence_bucket=sequence_bucket)
        if kwargs is not None:
            compile_blocks(model, **kwargs)
        engines.append(Engine(cfg, env, model, timer, backend="sdpa", output_dir="unused"))
    return engines


def test_compiled_blocks_serve_several_geometries_within_dynamos_recompile_limit():
    """Found 2026-12-06: compiled, enable_ulysses' input hooks on the blocks were Dynamo frames of
    their own, one shared code object specialised on each hook's closure (hidden_states at
    argument 0, adaln_indices at 2) and on the step's timestep count (1 at the first step, 2
    after): four entries a geometry, so the second geometry hit recompile_limit (8) and, under
    fullgraph, raised. The hooks now run eagerly between the compiled blocks: three geometries
    fit torch's default limit, and the compiled engine computes what the eager one does."""
    import torch._dynamo

    from dist_attn.models.h3.serve.jobs.requests import parse_request

    torch._dynamo.reset()
    cfg = load_config(None)
    with torch._dynamo.config.patch(recompile_limit=8):  # restored at the end
        eager, compiled = _engines(cfg, None, {"backend": "eager"})  # Dynamo's guards, no code generation
        torch._dynamo.config.recompile_limit = 8  # torch's default, not the server's
        for frames, height, width in [(17, 64, 64), (17, 128, 64), (33, 64, 128)]:
            req = parse_request({"frames": frames, "height": height, "width": width, "steps": 2, "seed": 1},
                                cfg)
            want, got = eager.run(req).latent, compiled.run(req).latent
            for key in ("video", "audio"):
                assert torch.equal(got[key], want[key]), (frames, height, width, key)
    torch._dynamo.reset()


def test_warm_up_leaves_nothing_to_compile_for_a_job_of_a_warmed_geometry():
    """The launch's warm-up runs two steps: the first step's shapes (one distinct timestep) and
    every later step's (two). A 3-step job of that geometry afterwards compiles nothing; one step
    (the warm-up until 2026-12-06) left the job's second step to compile. compile_blocks raises
    Dynamo's recompile limit to the server's (two entries a geometry)."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from dist_attn.models.h3.serve.config import apply_overrides
    from dist_attn.models.h3.serve.h3.model import SERVED_RECOMPILE_LIMIT
    from dist_attn.models.h3.serve.jobs.requests import parse_request
    from dist_attn.models.h3.serve.launch.warmup import warm_up

    torch._dynamo.reset()
    cfg = apply_overrides(load_config(None), {"runtime.warmup_shapes": [[17, 64, 128]]})
    counter = CompileCounter()
    with torch._dynamo.config.patch(recompile_limit=8):  # restored at the end
        (engine,) = _engines(cfg, {"backend": counter})
        assert torch._dynamo.config.recompile_limit == SERVED_RECOMPILE_LIMIT
        (run,) = warm_up(engine, cfg)
        warmed = counter.frame_count
        assert warmed > 0 and run.seconds > 0
        engine.run(parse_request({"frames": 17, "height": 64, "width": 128, "steps": 3, "seed": 2}, cfg))
        assert counter.frame_count == warmed
    torch._dynamo.reset()


def _entries_worker(rank, world):
    """Dynamo cache entries of the H3 block's code after each of two geometries, served compiled
    on ``world`` gloo ranks."""
    import torch._dynamo
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3TransformerBlock
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from dist_attn.models.h3.serve.jobs.requests import parse_request

    torch._dynamo.reset()
    cfg = load_config(None)
    (engine,) = _engines(cfg, {"backend": "eager"}, rank=rank, world=world)
    counts = []
    for frames, height, width in [(17, 64, 64), (17, 128, 64)]:
        engine.run(parse_request({"frames": frames, "height": height, "width": width, "steps": 2, "seed": 1},
                                 cfg))
        counts.append(len(_debug_get_cache_entry_list(MiniMaxH3TransformerBlock.forward.__code__)))
    return counts


def test_every_rank_takes_two_cache_entries_a_geometry(tmp_path):
    """Found in review, 2026-12-06: on two ranks block 0's input, the rank's cut of the sequence,
    was a narrow view whose size-1 batch stride differed from the next blocks' contiguous input,
    and torch.compile kept one more entry for it: four a geometry, half the geometries the raised
    limit was meant to cover. The cut is now a copy with standard strides."""
    from tests._multirank import run_ranks

    for counts in run_ranks(_entries_worker, 2, tmp_path, timeout=300):
        assert counts == [2, 4], counts


def test_the_warm_up_covers_every_prompt_length_up_to_its_bound():
    """Found 2026-12-06: a video job's sequence holds its prompt's tokens, so each new prompt
    length compiled the blocks on its first request (the attention's valid_len was a constant of
    the graph) and the warm-up could not cover it. Compiled, the sequence is now padded to a
    bucket of runtime.sequence_bucket rows and the warm-up runs each bucket a geometry reaches
    with prompts of 1 to runtime.warmup_prompt_tokens tokens: afterwards jobs of any prompt
    length in that range compile nothing, and one past it compiles (the counter can tell). The
    refiner blocks, whose rows are the prompt's, stay eager."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    from dist_attn.integrations.diffusers import ulysses_handle
    from dist_attn.models.h3.serve.config import apply_overrides
    from dist_attn.models.h3.serve.jobs.requests import parse_request
    from dist_attn.models.h3.serve.launch.warmup import warm_up

    torch._dynamo.reset()
    cfg = apply_overrides(load_config(None), {
        "runtime.compile": True, "runtime.sequence_bucket": 64, "runtime.warmup_prompt_tokens": 100,
        "runtime.warmup_shapes": [[17, 64, 128]]})
    assert cfg.runtime.bucket("cpu") == 64
    counter = CompileCounter()
    with torch._dynamo.config.patch(recompile_limit=8):  # restored at the end
        (engine,) = _engines(cfg, {"backend": counter}, sequence_bucket=64)
        refiner = engine.model.token_refiner.refiner_blocks
        assert all(b._compiled_call_impl is None for b in refiner)  # eager
        assert all(b._compiled_call_impl is not None for b in engine.model.transformer_blocks)
        runs = warm_up(engine, cfg)
        # 17 frames -> 22 -> 7 latent frames x (64/32 x 128/32) = 56 video rows + 2 x 37 audio
        # rows = 130; + 1..100 text rows -> padded to 192 or 256 rows: two runs, each with the
        # longest text of its bucket (the stand-in's 32 text rows fall in the first)
        assert [(r.text_rows, r.padded_rows) for r in runs] == [(62, 192), (100, 256)]
        warmed = counter.frame_count
        rt = ulysses_handle(engine.model).runtime
        planned, plan = [], rt.plan
        def recording(n):  # what the forward padded to
            planned.append(plan(n).total_len)
            return rt.shard

        rt.plan = recording
        req = parse_request({"frames": 17, "height": 64, "width": 128, "steps": 3, "seed": 2}, cfg)
        for text in (1, 7, 32, 99):
            result = engine.run(req, text_rows=text)
            assert planned[-3:] == [-(-(130 + text) // 64) * 64] * 3 == [result.tokens.total] * 3
        assert counter.frame_count == warmed
        engine.run(req, text_rows=140)  # past warmup_prompt_tokens: 270 rows, the 320-row bucket
        assert counter.frame_count > warmed
    torch._dynamo.reset()
    # a job reports the padding its model ran, not the config's: here an eager model, unpadded
    (eager,) = _engines(cfg, None, sequence_bucket=1)
    assert eager.run(req, text_rows=7).tokens.total == 137
