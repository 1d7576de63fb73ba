# SPDX-License-Identifier: Apache-2.0
"""The pack of a Ulysses forward: one call for a run of chunks writes what one call per chunk
writes, checked against a reference built head by head."""

from __future__ import annotations

import pytest
import torch

from dist_attn.comm import strided_run, pack_qkv, pack_qkv_chunks
from dist_attn.plan import KernelWaves, make_plan


def _reference_send(q, k, v, chunks) -> torch.Tensor:
    """The send blocks of ``chunks`` back to back: per chunk, per rank j, ``[S_local, 3, w_j, D]``
    of the folded heads j receives, one head at a time."""
    num_heads = q.shape[2]
    blocks = []
    for c in chunks:
        for a, b in c.head_ranges:
            heads = [torch.stack([t[f // num_heads, :, f % num_heads] for t in (q, k, v)], dim=1)
                     for f in range(a, b)]  # each [S_local, 3, D]
            blocks.append(torch.stack(heads, dim=2).reshape(-1))  # [S_local, 3, w_j, D]
    return torch.cat(blocks)


@pytest.mark.parametrize("batch, heads, world, chunks, waves", [
    (1, 56, 4, 4, KernelWaves(594, 396)),  # H3 at W = 4: runs (2) and (4, 4, 4)
    (1, 56, 4, 4, None),  # (4), (4), (3, 3)
    (1, 12, 4, 1, None),
    (1, 18, 3, 3, None),  # (2), (2, 2)
    (1, 7, 3, 2, None),  # uneven heads: every chunk by the loop
    (2, 6, 4, 2, None),  # two samples folded: heads of a chunk cross samples
    (2, 8, 2, 3, None),
])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv-views"])
@pytest.mark.parametrize("dtype, d", [(torch.bfloat16, 8), (torch.bfloat16, 5), (torch.float32, 3)],
                         ids=["bf16-widened", "bf16-odd", "fp32-odd"])  # odd: no 8-byte words
def test_pack_runs_write_what_the_reference_does(batch, heads, world, chunks, waves, fused, dtype, d):
    s_local = 5
    gen = torch.Generator().manual_seed(heads * 10 + world)
    if fused:  # q, k, v as strided views of one projection output [B, S_local, 3 * H, D]
        qkv = torch.randn(batch, s_local, 3 * heads, d, generator=gen).to(dtype)
        q, k, v = qkv.split(heads, dim=2)
    else:
        q, k, v = (torch.randn(batch, s_local, heads, d, generator=gen).to(dtype) for _ in range(3))
    before = [t.clone() for t in (q, k, v)]
    for rank in range(world):
        plan = make_plan(world=world, rank=rank, s_local=s_local, folded_heads=batch * heads,
                         head_dim=d, overlap_chunks=chunks, waves=waves)
        want = _reference_send(q, k, v, plan.chunks)
        per_chunk = torch.full_like(want, float("nan"))
        for c in plan.chunks:
            pack_qkv(q, k, v, per_chunk[c.in_send[0]:c.in_send[1]], c.head_ranges)
        runs = torch.full_like(want, float("nan"))
        for a, b in plan.pack_runs:
            run = plan.chunks[a:b]
            out = pack_qkv_chunks(q, k, v, runs[run[0].in_send[0]:run[-1].in_send[1]],
                                  [c.head_ranges for c in run])
            assert out.data_ptr() == runs.data_ptr() + run[0].in_send[0] * runs.element_size()
        assert torch.equal(per_chunk, want) and torch.equal(runs, want)
    assert all(torch.equal(t, b) for t, b in zip((q, k, v), before))  # nothing the caller passed changes


def test_a_run_whose_chunks_do_not_follow_one_another_is_packed_chunk_by_chunk():
    """Chunks 0 and 2 of an even split: equally wide, but chunk 2 does not start where chunk 0
    ends, so no single strided view covers them; the loop packs each in turn."""
    s_local, d = 3, 4
    q, k, v = (torch.randn(1, s_local, 8, d) for _ in range(3))
    plan = make_plan(world=2, rank=0, s_local=s_local, folded_heads=8, head_dim=d, overlap_chunks=4)
    picked = [plan.chunks[0], plan.chunks[2]]
    send = torch.empty(sum(c.in_send[1] - c.in_send[0] for c in picked))
    pack_qkv_chunks(q, k, v, send, [c.head_ranges for c in picked])
    assert torch.equal(send, _reference_send(q, k, v, picked))


def test_h3s_run_of_three_chunks_is_packed_without_the_per_chunk_loop(monkeypatch):
    """The (4, 4, 4) run of H3's waves split goes through the one-view path: with the per-chunk
    loop (pack_qkv) made to fail, the run still packs, and packs what the reference does."""
    from dist_attn import comm

    plan = make_plan(world=4, rank=0, s_local=3, folded_heads=56, head_dim=8, overlap_chunks=4,
                     waves=KernelWaves(594, 396))
    q, k, v = (torch.randn(1, 3, 56, 8).to(torch.bfloat16) for _ in range(3))
    run = plan.chunks[1:4]
    want = _reference_send(q, k, v, run)

    def loop(*args):
        raise AssertionError("the per-chunk loop packed a run the strided view covers")
    monkeypatch.setattr(comm, "pack_qkv", loop)
    send = torch.full_like(want, float("nan"))
    comm.pack_qkv_chunks(q, k, v, send, [c.head_ranges for c in run])
    assert torch.equal(send, want)


def test_h3s_chunks_after_the_first_are_one_strided_view():
    """H3 at W = 4 with sage8's waves: the runs (2) and (4, 4, 4) each read as one strided view per
    role (three copies a call), the reason the runs exist; a batch of 2 needs the loop."""
    plan = make_plan(world=4, rank=0, s_local=5, folded_heads=56, head_dim=128, overlap_chunks=4,
                     waves=KernelWaves(594, 396))
    assert plan.pack_runs == ((0, 1), (1, 4))
    for a, b in plan.pack_runs:
        ranges = [c.head_ranges for c in plan.chunks[a:b]]
        first = plan.chunks[a]
        assert strided_run((1, 5, 56, 128), ranges) == (4, 14, first.head_ranges[0][0], first.local_heads(0))
        assert strided_run((2, 5, 28, 128), ranges) is None
