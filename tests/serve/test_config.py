# SPDX-License-Identifier: Apache-2.0
"""Config loading and self-validation: every error names the field, its value and the rule."""

from __future__ import annotations

import dataclasses
import os
import tomllib

import pytest

from dist_attn.models.h3.serve.config import (DEFAULT_CONFIG_PATH, Config, ModelConfig,
                                              RuntimeConfig, ServeConfig, apply_overrides,
                                              load_config, parse_config)
from dist_attn.models.h3.serve.config.jobs import JobsConfig
from dist_attn.models.h3.serve.config.tokens import TokenConfig

from tests.conftest import ROOT

TINY_TOML = os.path.join(ROOT, "configs", "tiny.toml")


def test_h3_config_is_h3s_default_request():
    cfg = load_config(os.path.join(ROOT, "configs", "h3.toml"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim, m.ffn_dim, m.rope_freq_dim) == (
        50, 5376, 56, 128, 14336, 16)
    r = cfg.request
    layout = cfg.layout(frames=r.frames, height=r.height, width=r.width)
    # H3's pipeline default: 124 frames at 768 x 1344 -> latent 37 x 48 x 84 = 37,296 video rows,
    # 207 audio latents x 2 channels, and the 512 text rows of the reference workload.
    assert layout.latent_shape == (37, 48, 84) and layout.grid == (37, 24, 42)
    assert (layout.text, layout.audio, layout.video, layout.used) == (512, 414, 37_296, 38_222)
    cfg.check_world(4)


def test_shipped_configs_load_by_name_and_a_missing_one_is_named():
    """An installed server has no clone's configs/: the shipped ones load by name (package data,
    tests/test_packaging.py installs them), and a path that does not exist is one message, not
    a FileNotFoundError traceback."""
    assert load_config("h3") == load_config(os.path.join(ROOT, "configs", "h3.toml"))
    assert load_config("tiny") == load_config(None)
    with pytest.raises(ValueError, match=r"config 'configs/nope.toml' does not exist \(the shipped "
                                         r"configs, by name: 'tiny', 'h3'\)"):
        load_config("configs/nope.toml")


def test_default_config_is_the_tiny_file():
    # the clone's configs/ points into the package, where the one copy of each config lives
    assert str(DEFAULT_CONFIG_PATH) == os.path.realpath(TINY_TOML)
    assert os.path.realpath(TINY_TOML).endswith(os.path.join("dist_attn", "models", "h3", "serve", "configs", "tiny.toml"))
    cfg = load_config(None)
    assert cfg == load_config(TINY_TOML)
    r = cfg.request
    layout = cfg.layout(frames=r.frames, height=r.height, width=r.width)
    assert layout.used == 274  # "a few hundred rows", divisible by none of 3 and 4
    assert cfg.model.head_dim == 64
    for world in (1, 2, 3, 4):
        cfg.check_world(world)


def test_heads_vs_ulysses_degree():
    # Uneven heads are valid, as in the core (4 heads on 3 ranks: 2, 1, 1) ...
    load_config(None).check_world(3)
    # ... but every rank needs one head: the core's rule, with the config field named and the
    # fix in the launch's terms (the rule alone left the user to work out what to change)
    with pytest.raises(ValueError) as err:
        load_config(None).check_world(8)
    assert str(err.value) == (
        "model.num_attention_heads=4 cannot be split over the Ulysses degree 8: every rank needs "
        "at least one head; launch at most 4 ranks (--nproc-per-node), or raise "
        "parallel.ring_degree so that the Ulysses degree (world size / ring_degree) is at most 4")


def test_ulysses_times_ring_times_tp_is_world():
    cfg = apply_overrides(load_config(None), {"parallel.ulysses_degree": 2})
    cfg.check_world(2)
    with pytest.raises(ValueError, match=r"parallel.ulysses_degree=2 .* must equal the "
                                         r"world size 4"):
        cfg.check_world(4)


def test_overlap_chunks_field_reaches_enable_ulysses():
    assert load_config(None).parallel.overlap_chunks == 1
    assert apply_overrides(load_config(None), {"parallel.overlap_chunks": 4}).parallel.overlap_chunks == 4
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match=rf"parallel.overlap_chunks={bad!r} must be an "
                                             r"int >= 1"):
            apply_overrides(load_config(None), {"parallel.overlap_chunks": bad})
    pytest.importorskip("diffusers")
    import torch

    from dist_attn.models.h3.serve.h3.model import build_h3, parallelize

    cfg = load_config(None)
    model = build_h3(dataclasses.replace(cfg.model, num_layers=1), device=torch.device("cpu"),
                     dtype=torch.float32)
    handle = parallelize(model, backend="sdpa", overlap_chunks=3)
    try:
        assert handle.runtime.overlap_chunks == 3
    finally:
        handle.remove()


def test_head_dim_vs_backend():
    with pytest.raises(ValueError, match=r"model.attention_head_dim=80 is not supported by "
                                         r"backend 'sage' \(accepts head_dim in \[64, 96, 128\]\)"):
        apply_overrides(load_config(None), {"model.attention_head_dim": 80,
                                            "runtime.backend": "sage"})
    # sdpa takes any head_dim
    apply_overrides(load_config(None), {"model.attention_head_dim": 80, "runtime.backend": "sdpa"})


def test_quality_values_listed_and_lossless_rejects_sage():
    with pytest.raises(ValueError, match=r"quality='medium' is not a quality tier; valid values: "
                                         r"'lossless', 'high' \(absent: no constraint\)"):
        RuntimeConfig(quality="medium")
    with pytest.raises(ValueError, match=r"backend='sage' is an 8-bit backend, not allowed under "
                                         r"quality='lossless'"):
        RuntimeConfig(quality="lossless", backend="sage")
    with pytest.raises(ValueError, match=r"'sage8' is an 8-bit backend"):
        RuntimeConfig(quality="lossless", backend="sage8")
    assert RuntimeConfig(quality="lossless", backend="sdpa").quality == "lossless"
    assert RuntimeConfig(quality="high", backend="sage").backend == "sage"


@pytest.mark.parametrize("cls, kwargs, match", [
    (ModelConfig, {"num_attention_heads": 0}, r"model.num_attention_heads=0 must be a "
                                               r"positive integer"),
    (ModelConfig, {"rope_freq_dim": 22}, r"model.rope_freq_dim=22 rotates 2 \* 3 \* 22 = 132 "
                                         r"channels, more than attention_head_dim=128"),
    (ModelConfig, {"patch_size": [1, 2]}, r"model.patch_size=\[1, 2\] must be three positive "
                                          r"integers"),
    (ModelConfig, {"hidden_size": 2.5}, r"model.hidden_size=2.5 must be a positive integer"),
    (TokenConfig, {"min_duration_s": 20.0}, r"tokens.min_duration_s=20.0 must be >= 0 and at "
                                            r"most max_duration_s=15.0"),
    (TokenConfig, {"video_shift": 0}, r"tokens.video_shift=0 must be > 0"),
    (ServeConfig, {"drain_timeout_s": 40.0}, r"serve.drain_timeout_s=40.0 must be > 0 and "
                                             r"at most 25.0 s \(torchrun kills ranks 30.0 s after "
                                             r"its SIGTERM"),
    (ServeConfig, {"idle_timeout_s": 0}, r"serve.idle_timeout_s=0 must be > 0"),
    (ServeConfig, {"max_json_depth": 0}, r"serve.max_json_depth=0 must be a positive "
                                         r"integer"),
    (ServeConfig, {"backlog": -1}, r"serve.backlog=-1 must be a positive integer"),
    (JobsConfig, {"latents_kept": 0}, r"jobs.latents_kept=0 must be a positive integer"),
    (JobsConfig, {"videos_kept": 0}, r"jobs.videos_kept=0 must be a positive integer"),
    (JobsConfig, {"videos_max_age_s": -1.0}, r"jobs.videos_max_age_s=-1.0 must be a finite "
                                             r"number of seconds >= 0 \(0: no age limit\)"),
    (JobsConfig, {"videos_max_age_s": float("inf")}, r"jobs.videos_max_age_s=inf must be"),
])
def test_field_rules(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_heartbeat_must_be_well_below_timeout():
    with pytest.raises(ValueError, match=r"runtime.heartbeat_s=20.0 must be > 0 and below "
                                         r"pg_timeout_s/2=15.0"):
        RuntimeConfig(pg_timeout_s=30.0, heartbeat_s=20.0)


def test_unknown_fields_and_sections_are_named(tmp_path):
    with open(TINY_TOML, encoding="utf-8") as f:
        tiny = f.read()
    data = tomllib.loads(tiny)
    data["model"]["num_head"] = 4
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_head'\] in \[model\]"):
        parse_config(data)
    bad = tmp_path / "bad.toml"
    bad.write_text(tiny + "\n[modle]\nx = 1\n")
    with pytest.raises(ValueError, match=r"bad.toml: unknown config section\(s\) \['modle'\]"):
        load_config(bad)


def test_a_misspelt_override_or_field_suggests_the_one_meant():
    """--set runtime.backnd=sdpa named the rule only; the nearest field or section is offered."""
    from dist_attn.models.h3.serve.launch import cli as launcher

    args = launcher.build_parser().parse_args(["--set", "runtime.backnd=sdpa"])
    with pytest.raises(ValueError) as err:
        launcher.config_from_args(args)
    assert "override 'runtime.backnd': no such config field (did you mean 'runtime.backend'?" \
        in str(err.value), str(err.value)
    with pytest.raises(ValueError, match=r"override 'runtim.backend': no such config field \(did you "
                                         r"mean 'runtime.backend'\?"):
        apply_overrides(load_config(None), {"runtim.backend": "sdpa"})
    data = tomllib.loads(open(TINY_TOML, encoding="utf-8").read())
    data["model"]["num_head"] = 4
    with pytest.raises(ValueError, match=r"\['num_head'\] in \[model\] \(did you mean "
                                         r"'num_attention_heads'\?\)"):
        parse_config(data)
    data = {"modle": {}}
    with pytest.raises(ValueError, match=r"\['modle'\] \(did you mean 'model'\?\)"):
        parse_config(data)


def test_request_geometry_rules():
    cfg = load_config(None)
    with pytest.raises(ValueError, match=r"request.height=250 must be a multiple of 32"):
        cfg.layout(frames=22, height=250, width=256)
    assert cfg.layout(frames=6, height=64, width=64).frames == 22  # up to the next 17 n + 5
    assert TokenConfig().text_tokens == 512


def test_default_request_must_fit_max_tokens():
    with pytest.raises(ValueError, match=r"request.frames=124 gives 3998 rows, above "
                                         r"serve.max_tokens=2048"):
        apply_overrides(load_config(None), {"request.frames": 124, "request.height": 256,
                                            "request.width": 384, "serve.max_tokens": 2048})
    with pytest.raises(ValueError, match=r"the default request \(\[request\]\) is invalid: "
                                         r"request.width=100 must be a multiple of 32"):
        apply_overrides(load_config(None), {"request.width": 100})
    # --check-only passed request.steps=1000 under serve.max_steps=50; every request that left
    # steps out would then have been answered 413.
    with pytest.raises(ValueError, match=r"^request.steps=1000 exceeds serve.max_steps=50$"):
        apply_overrides(load_config(None), {"request.steps": 1000, "serve.max_steps": 50})
    assert apply_overrides(load_config(None), {"request.steps": 50,
                                               "serve.max_steps": 50}).request.steps == 50


def test_command_line_flags_override_config_fields():
    from dist_attn.models.h3.serve.launch import cli as launcher

    args = launcher.build_parser().parse_args(
        ["--config", os.path.join(ROOT, "configs", "h3.toml"), "--layers", "1", "--backend",
         "sdpa", "--port", "0", "--frames", "200", "--set", "serve.max_steps=7", "--set",
         "request.steps=5",
         "--set", "model.name=\"h3-1layer\"", "--quality", "high"])
    cfg = launcher.config_from_args(args)
    assert isinstance(cfg, Config)
    assert cfg.model.num_layers == 1 and cfg.model.name == "h3-1layer"
    assert cfg.runtime.backend == "sdpa" and cfg.runtime.quality == "high"
    assert cfg.serve.port == 0 and cfg.serve.max_steps == 7
    assert cfg.request.frames == 200
    assert cfg.model.hidden_size == 5376  # untouched fields keep the file's values
    args = launcher.build_parser().parse_args(["--quality", "medium"])
    with pytest.raises(ValueError, match=r"valid values: 'lossless', 'high' \(absent: no "
                                         r"constraint\)"):
        launcher.config_from_args(args)
    args = launcher.build_parser().parse_args(["--set", "model.nope=1"])
    with pytest.raises(ValueError, match=r"override 'model.nope': no such config field"):
        launcher.config_from_args(args)



def test_health_timeout_must_exceed_heartbeat():
    with pytest.raises(ValueError, match=r"runtime.health_timeout_s=1.0 must exceed "
                                         r"heartbeat_s=2.0"):
        RuntimeConfig(heartbeat_s=2.0, health_timeout_s=1.0)
    with pytest.raises(ValueError, match=r"runtime.compile='yes' must be true, false or "
                                         r'"auto"'):
        RuntimeConfig(compile="yes")


def test_compile_auto_compiles_on_cuda_only():
    auto = RuntimeConfig()
    assert auto.compile == "auto"
    assert auto.compiled("cuda") and not auto.compiled("cpu")
    assert RuntimeConfig(compile=True).compiled("cpu")
    assert not RuntimeConfig(compile=False).compiled("cuda")


def test_sequence_bucket_is_512_when_compiled_and_its_rules():
    """runtime.sequence_bucket: "auto" pads to 512 rows exactly where the blocks compile; an
    explicit bucket is a positive int, refused under lossless (padding changes each rank's rows),
    and a warm-up that could compile more than half the lengths the raised recompile limit
    holds is refused where the blocks may compile."""
    assert (RuntimeConfig().bucket("cuda"), RuntimeConfig().bucket("cpu")) == (512, 1)
    assert RuntimeConfig(compile=True).bucket("cpu") == 512
    assert RuntimeConfig(quality="lossless", backend="sdpa").bucket("cuda") == 1
    assert RuntimeConfig(sequence_bucket=128).bucket("cpu") == 128
    for bad in (0, -4, True, 1.5, "big"):
        with pytest.raises(ValueError, match=rf"runtime.sequence_bucket={bad!r} must be a positive "
                                             r'integer \(rows\) or "auto"'):
            RuntimeConfig(sequence_bucket=bad)
    with pytest.raises(ValueError, match=r"runtime.sequence_bucket=64 pads each rank's rows, .* "
                                         r"quality='lossless' serves the eager bf16 path bit for bit"):
        RuntimeConfig(quality="lossless", backend="sdpa", sequence_bucket=64)
    def warm(**runtime):
        return apply_overrides(load_config(None), {f"runtime.{k}": v for k, v in runtime.items()})

    shapes = [[17, 64, 64]] * 4
    with pytest.raises(ValueError, match=r"runtime.warmup_prompt_tokens=512 with 4 warmup_shapes, "
                                         r"buckets of 64 rows and tokens.text_tokens=32, may compile "
                                         r"up to 36 padded lengths at launch, more than 16: half"):
        warm(compile=True, sequence_bucket=64, warmup_shapes=shapes)
    with pytest.raises(ValueError, match=r"with 9 warmup_shapes, buckets of 512 rows .* up to 18 "):
        warm(compile=True, warmup_shapes=[[17, 64, 64]] * 9)  # "auto": 512 rows when compiled
    assert warm(compile=True, warmup_shapes=[[17, 64, 64]] * 8).runtime.warmup_shapes  # 16: fits
    # the stand-in's text rows outside 1..warmup_prompt_tokens add a length a geometry
    over = {"runtime.compile": True, "runtime.warmup_shapes": [[17, 64, 64]] * 6,
            "runtime.warmup_prompt_tokens": 20, "tokens.text_tokens": 40}
    with pytest.raises(ValueError, match=r"tokens.text_tokens=40, may compile up to 18 padded"):
        apply_overrides(load_config(None), over)
    assert apply_overrides(load_config(None), {**over, "tokens.text_tokens": 20}).runtime.compile
    # eager configs compile nothing: no bound (the warm-up runs one length a geometry)
    assert warm(sequence_bucket=1, compile=False, warmup_shapes=shapes).runtime.sequence_bucket == 1
    assert warm(quality="lossless", backend="sdpa", sequence_bucket=1,
                warmup_shapes=shapes).runtime.sequence_bucket == 1
    with pytest.raises(ValueError, match=r"runtime.warmup_prompt_tokens=0 must be a positive integer"):
        RuntimeConfig(warmup_prompt_tokens=0)
    assert apply_overrides(load_config(None), {"runtime.sequence_bucket": 256}).runtime.bucket("cpu") == 256


def test_lossless_serves_the_eager_bf16_path():
    """quality="lossless" stays bit-identical to the bf16 path: eager under compile="auto", an
    explicit compile refused, FP8 linears refused (each naming the field and the rule)."""
    lossless = RuntimeConfig(quality="lossless", backend="sdpa")
    assert not lossless.compiled("cuda") and not lossless.compiled("cpu")
    with pytest.raises(ValueError, match=r"runtime.compile=True compiles the blocks, whose "
                                         r"fused kernels round differently"):
        RuntimeConfig(quality="lossless", backend="sdpa", compile=True)
    assert RuntimeConfig(quality="high", backend="sage8").compiled("cuda")


def test_errors_name_the_section_the_loader_reads():
    """field_error names a field as the TOML file and --set write it: its class-to-section map
    must be the loader's, inverted (a class added to one and not the other would raise)."""
    from dist_attn.models.h3.serve.config import load
    from dist_attn.models.h3.serve.config.fields import SECTIONS

    assert SECTIONS == {cls.__name__: name for name, cls in load._SECTIONS.items()}


def test_an_integer_too_long_for_python_names_its_field(tmp_path):
    """tomllib's int() refuses more than 4300 digits (Python's limit); its ValueError named no
    field, from --set or from the file."""
    from dist_attn.models.h3.serve.launch import cli as launcher

    long = "9" * 5000
    args = launcher.build_parser().parse_args(["--set", f"serve.port={long}"])
    with pytest.raises(ValueError, match=r"^--set serve.port=<an integer of 5000 digits>: "
                                         r"Exceeds the limit \(4300 digits\)"):
        launcher.config_from_args(args)
    with open(TINY_TOML, encoding="utf-8") as f:
        tiny = f.read()
    bad = tmp_path / "long.toml"
    bad.write_text(tiny.replace("max_int_digits = 20", f"max_int_digits = {long}"))
    line = bad.read_text().splitlines().index(f"max_int_digits = {long}") + 1
    with pytest.raises(ValueError, match=rf"long.toml: \[serve\] max_int_digits \(line {line}\) "
                                         r"holds an integer of 5000 digits: Exceeds the limit"):
        load_config(bad)


def test_tiny_tomls_duration_comment_says_which_route_it_governs():
    """The comment said "the CPU default generates a second", but /v1/videos keeps H3's 5-15 s
    whatever [tokens] says (its VideoRules); only /v1/generate and --once read min_duration_s."""
    from dist_attn.models.h3.serve.jobs.videos import VideoRules

    with open(TINY_TOML, encoding="utf-8") as f:
        (line,) = [ln for ln in f if ln.startswith("min_duration_s")]
    comment = line.split("#", 1)[1]
    assert "/v1/generate" in comment and "/v1/videos" in comment and "5-15 s" in comment, line
    rules = VideoRules()
    assert (rules.min_duration_s, rules.max_duration_s) == (5.0, 15.0)
    assert rules.frames_ok(22) and rules.frames_ok(124) is None  # the tiny request's 22 frames: refused
