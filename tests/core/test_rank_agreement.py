# SPDX-License-Identifier: Apache-2.0
"""Ranks that disagree: every rank raises the same kind of error, none aborts, none hangs.

Under ``torchrun --nproc-per-node 2`` a call with another head count or dtype on one rank killed
a non-zero rank with SIGABRT (the all-to-all's sizes disagreed), and another ``cu_seqlens`` or
``valid_len`` on one rank returned different results with no error. The first call of each
layout now agrees on it with one all-reduce; later calls of that layout make none.
"""

from __future__ import annotations

import pytest
import torch

from tests._multirank import run_ranks

H, D, S_LOCAL = 4, 16, 8


def _call(rank, world, *, heads=H, dtype=torch.float32, bounds=None, valid_len=None, s_local=S_LOCAL,
          scale=None, module_heads=None, chunks=1):
    from dist_attn import UlyssesSageAttention, ulysses_attention

    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(s_local, heads, D, generator=g).to(dtype) for _ in range(3))
    if module_heads is not None:
        return UlyssesSageAttention(module_heads, D, backend="sdpa")(q, k, v, bounds, valid_len=valid_len)
    return ulysses_attention(q, k, v, bounds, valid_len=valid_len, backend="sdpa", softmax_scale=scale,
                             overlap_chunks=chunks)


#: case -> (what rank 0 passes, what the other ranks pass), as keywords of _call
CASES = {
    "heads": (dict(heads=4), dict(heads=2)),
    "dtype": (dict(dtype=torch.float32), dict(dtype=torch.bfloat16)),
    "cu_seqlens": (dict(bounds=[0, 5, 16]), dict(bounds=[0, 16])),
    "valid_len": (dict(valid_len=13), dict(valid_len=16)),
    "rows": (dict(s_local=8), dict(s_local=6)),
    "softmax_scale": (dict(scale=0.25), dict(scale=0.5)),
    "overlap_chunks": (dict(chunks=1, heads=8), dict(chunks=2, heads=8)),
    # a refusal on one rank only (its module expects 4 heads): the others must not wait for it
    "one_rank_refuses": (dict(), dict(module_heads=2)),
}


def _worker(rank, world):
    from torch.distributed.tensor.debug import CommDebugMode

    out = {}
    for name, (first, others) in CASES.items():
        try:
            _call(rank, world, **(first if rank == 0 else others))
            out[name] = None
        except Exception as exc:  # noqa: BLE001 - we report what was raised
            out[name] = (type(exc).__name__, str(exc))
    # still in step after every refusal; the first call of a layout agrees (one all-reduce),
    # the second does not
    counts = []
    for _ in range(2):
        with CommDebugMode() as mode:
            _call(rank, world, bounds=[0, 3, 8 * world], valid_len=8 * world - 1)
        counts.append({str(op): n for op, n in mode.get_comm_counts().items()})
    out["_counts"] = counts
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("agree"), timeout=120)


NEEDLES = {
    "heads": ["heads", "from 2 to 4"],
    "dtype": ["dtype", "torch.float32", "torch.bfloat16"],
    "cu_seqlens": ["cu_seqlens"],
    "valid_len": ["valid_len", "from 13 to 16"],
    "rows": ["rows", "from 6 to 8"],
    "softmax_scale": ["softmax_scale"],
    "overlap_chunks": ["overlap_chunks", "from 1 to 2"],
}


@pytest.mark.parametrize("case", list(NEEDLES))
def test_a_disagreement_raises_on_every_rank_naming_the_argument(per_rank, case):
    for rank, out in enumerate(per_rank):
        got = out[case]
        assert got is not None, f"rank {rank}: {case} differing across ranks did not raise"
        assert got[0] == "ValueError", (rank, got)
        assert "differ" in got[1] and "the default process group" in got[1], (rank, got)
        for needle in NEEDLES[case]:
            assert needle in got[1], (rank, needle, got[1])


def test_a_refusal_on_one_rank_is_raised_on_every_rank(per_rank):
    own, peer = per_rank[1]["one_rank_refuses"], per_rank[0]["one_rank_refuses"]
    assert own is not None and own[0] == "ValueError" and "num_heads=2" in own[1], own
    assert peer is not None and peer[0] == "RuntimeError", peer
    assert "rank 1 of the default process group refused" in peer[1], peer


def test_a_layout_is_agreed_once(per_rank):
    for rank, out in enumerate(per_rank):
        first, second = out["_counts"]
        assert sum(n for op, n in first.items() if "allreduce" in op) == 1, (rank, first)
        assert sum(n for op, n in first.items() if "alltoall" in op) == 2, (rank, first)
        assert all("alltoall" in op for op in second) and sum(second.values()) == 2, (rank, second)


# Collectives outside dist_attn.agreement that move data or vote, not ranks agreeing on their
# inputs: (module, the collective's call text) -> why it is not an agreement.
_NOT_AGREEMENT = {
    ("dist_attn/sharding.py", "all_gather_into_tensor"): "the sequence gather (data)",
    ("dist_attn/integrations/diffusers/_vae_decode.py", "dist.all_gather(list(recv"): "decoded tiles (data)",
    ("dist_attn/models/h3/serve/wire/abort.py", "dist.all_reduce(vote"): "the per-step abort vote (max wins)",
    ("dist_attn/models/h3/serve/wire/control.py", "dist.all_reduce(torch.ones"): "the heartbeat",
}


def test_cross_rank_agreement_has_one_owner():
    """The core, the diffusers adapter, the VAE decode and the launch checks agree through
    dist_attn.agreement; no other module gathers or reduces to compare ranks."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    call = re.compile(r"\b(?:dist\.)?(all_gather\w*|all_reduce|broadcast_object_list)\(")
    found = []
    for path in sorted((root / "dist_attn").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "dist_attn/agreement.py":
            continue
        for line in path.read_text().splitlines():
            code = line.split("#")[0]
            if call.search(code) and not code.lstrip().startswith(('"', "'")) and "`" not in code:
                if not any(rel == m and text in code for (m, text) in _NOT_AGREEMENT):
                    found.append(f"{rel}: {code.strip()}")
    assert not found, found
    from dist_attn import agreement
    from dist_attn.integrations.diffusers import _runtime, _vae_decode
    from dist_attn.models.h3.serve.config import quality
    from dist_attn.models.h3.serve.launch import checks, preflight

    assert _runtime.gather_rows is _vae_decode.gather_rows is agreement.gather_rows
    assert _runtime.fingerprint is _vae_decode.fingerprint is agreement.fingerprint
    assert checks.gather_objects is preflight.gather_objects is agreement.gather_objects
    assert "gather_objects" in quality.gather_device_facts.__code__.co_names
