# SPDX-License-Identifier: Apache-2.0
"""launch/serve.py with a ring: --ring-degree 2 on 4 gloo ranks (Ulysses 2 x Ring 2) reproduces the
single-rank output, and the ring's config rules name the field, the value and the rule."""

from __future__ import annotations

import json
import sys

import pytest

from dist_attn.models.h3.serve.config import load_config, apply_overrides
from dist_attn.models.h3.serve.h3.weights import load_output
from tests.serve._server import SERVE, STARTUP_S, run, torchrun

# The ring merges two partial softmaxes per query row in fp32 (log-sum-exp weights) where one
# rank computes one softmax: different rounding (observed 6.5e-8 video, 5.7e-8 audio rel-L2 after 2 layers x 2
# steps of the tiny H3 on CPU float32, where pure Ulysses is bit-identical); 1e-5 is the float32
# allowance of the pure Ulysses --once test.
RTOL_F32 = 1e-5


def _result(stdout: str) -> dict:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, stdout  # one JSON line, from rank 0 only
    return json.loads(lines[0])


def test_once_ring_2_on_4_ranks_matches_a_single_rank(tmp_path):
    args = ["--once", "--steps", "2", "--seed", "7"]
    ring = run(torchrun(4, *args, "--ring-degree", "2", "--output-dir", str(tmp_path / "ring")),
               STARTUP_S)
    assert ring.returncode == 0, ring.stderr[-3000:]
    single = run([sys.executable, SERVE, *args, "--output-dir", str(tmp_path / "w1")], STARTUP_S)
    assert single.returncode == 0, single.stderr[-3000:]
    r4, r1 = _result(ring.stdout), _result(single.stdout)
    assert r4["world_size"] == 4 and r4["tokens"] == {**r1["tokens"], "total": 276}  # 274 padded
    assert r4["phase_ms"].get("ring_wait", 0) > 0, r4["phase_ms"]  # the ring ran
    a = load_output(str(tmp_path / "ring" / r4["output"]))  # names relative to --output-dir
    b = load_output(str(tmp_path / "w1" / r1["output"]))
    for name in ("video", "audio"):
        assert a[name].shape == b[name].shape
        err = float((a[name] - b[name]).norm() / b[name].norm())
        assert err < RTOL_F32, (name, err)


@pytest.mark.parametrize("overrides, world, match", [
    ({"parallel.ring_degree": 3}, 4, r"ulysses_degree=1 times ring_degree=3 times "
                                     r"tensor_parallel=1 must equal the world size 4"),
    ({"parallel.ring_degree": 2, "parallel.ulysses_degree": 4}, 4,
     r"ulysses_degree=4 times ring_degree=2 .* must equal the world size 4"),
])
def test_ring_config_errors_name_the_field(overrides, world, match):
    cfg = apply_overrides(load_config(None), overrides)
    with pytest.raises(ValueError, match=match):
        cfg.check_world(world)


def test_ring_degree_resolves_ulysses_from_the_world():
    cfg = apply_overrides(load_config(None), {"parallel.ring_degree": 2})
    cfg.check_world(4)
    assert cfg.parallel.resolved_ulysses(4) == 2
    assert cfg.parallel.resolved_ulysses(16) == 8  # 2 hosts x 8 GPUs: Ulysses 8 inside a host
