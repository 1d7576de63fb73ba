# SPDX-License-Identifier: Apache-2.0
"""Multi-rank (gloo, CPU) tests of UlyssesSageAttention: parity, placement, collectives, buffers."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests._multirank import run_ranks
from tests.reference import reference_attention

# Global packed length 48: divisible by every W tested (1, 2, 3, 4).
SEQ = 48
HEAD_DIM = 16
# name -> (bounds, max_seqlen, valid_len)
LAYOUTS = {
    "trailing_padding": ((0, 37, SEQ), 37, 37),
    "one_segment": ((0, SEQ), SEQ, None),
    "three_documents": ((0, 10, 30, SEQ), 20, None),
    "empty_segments": ((0, 0, 16, 16, 40, SEQ), 24, None),
    # A classifier-free-guidance pair: (0, S, 2S) with max_seqlen = S is TWO documents, never one
    # request padded at the end (the bounds cannot tell; only valid_len says padding).
    "two_equal_documents": ((0, SEQ // 2, SEQ), SEQ // 2, None),
}
HEADS = (4, 6, 7)  # 7 on 3 ranks and 6 on 4 ranks are uneven
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Tolerances against the float64 reference, max abs error on O(1) outputs:
#  fp32: the CPU math SDPA accumulates in fp32 -> ~1e-6; 1e-5 leaves headroom for reductions.
#  bf16: inputs are exact in the reference (it upcasts the same bf16 values); the output is rounded
#        to bf16 (2^-9 relative) and the kernel keeps bf16 intermediates -> ~1e-2.
ATOL = {"fp32": 1e-5, "bf16": 2.5e-2}
CHUNKS = (1, 2)

CASES = [
    dict(layout=lay, heads=h, dtype=dt, host=host, chunks=ch)
    for lay, h, dt, host, ch in itertools.product(LAYOUTS, HEADS, DTYPES, (True, False), CHUNKS)
]


def _case_id(c):
    return f"{c['layout']}-h{c['heads']}-{c['dtype']}-{'host' if c['host'] else 'nohost'}-c{c['chunks']}"


def _global_inputs(heads, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(SEQ, heads, HEAD_DIM, generator=g).to(DTYPES[dtype]) for _ in range(3)]


def _parity_worker(rank, world):
    from dist_attn import UlyssesSageAttention

    s_local = SEQ // world
    rows = slice(rank * s_local, (rank + 1) * s_local)
    results = {}
    for i, case in enumerate(CASES):
        bounds, max_seqlen, valid_len = LAYOUTS[case["layout"]]
        q, k, v = (t[rows].clone() for t in _global_inputs(case["heads"], case["dtype"], seed=i))
        before = [t.clone() for t in (q, k, v)]
        attn = UlyssesSageAttention(case["heads"], HEAD_DIM, backend="sdpa", overlap_chunks=case["chunks"])
        cu = torch.tensor(bounds, dtype=torch.int32)
        out = attn(q, k, v, cu, max_seqlen, list(bounds) if case["host"] else None, valid_len=valid_len)
        unmodified = all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
        aliases = any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (q, k, v))
        results[_case_id(case)] = (out.float().numpy(), str(out.dtype), tuple(out.shape), unmodified, aliases)
    return results


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def parity_run(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_parity_worker, world, tmp_path_factory.mktemp(f"parity{world}"), timeout=300)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_parity_against_float64(parity_run, case):
    world, per_rank = parity_run
    if case["heads"] < world:
        pytest.skip("fewer heads than ranks")  # never hit with HEADS >= 4
    i = CASES.index(case)
    bounds, max_seqlen, valid_len = LAYOUTS[case["layout"]]
    q, k, v = _global_inputs(case["heads"], case["dtype"], seed=i)
    ref = reference_attention(q, k, v, bounds, valid_len)
    shards = [per_rank[r][_case_id(case)] for r in range(world)]
    out = torch.cat([torch.from_numpy(s[0]) for s in shards]).double()
    for arr, dtype, shape, unmodified, aliases in shards:
        assert dtype == str(DTYPES[case["dtype"]])
        assert shape == (SEQ // world, case["heads"], HEAD_DIM)
        assert unmodified, "the caller's q/k/v changed"
        assert not aliases, "the output aliases an input"
    err = (out - ref).abs().max().item()
    assert err <= ATOL[case["dtype"]], f"max abs error {err:.3g} > {ATOL[case['dtype']]}"
    if case["layout"] == "trailing_padding":
        assert torch.count_nonzero(out[bounds[1]:]) == 0, "padding rows must be exactly zero"
    if case["layout"] == "two_equal_documents":  # the second document is attended, not zeroed
        assert out[bounds[1]:].abs().min(dim=-1).values.gt(0).float().mean() > 0.99


# ---------------------------------------------------------------------------------------------
# Exact placement: values encode (role, global row, global head, dim), exact in fp32.
PL_SEQ, PL_D = 24, 4


def _encode(role, seq, heads):
    r = torch.arange(seq).view(seq, 1, 1)
    h = torch.arange(heads).view(1, heads, 1)
    d = torch.arange(PL_D).view(1, 1, PL_D)
    return (((role * 64 + r) * 16 + h) * PL_D + d).float()  # < 2^24: exact in fp32


class _ProbeBackend:
    """Records what the kernel sees and returns v, so the output must equal the caller's v."""

    name = "probe"
    exact = True
    varlen = None

    def __init__(self):
        self.seen = []

    def unsupported_reason(self, q):
        return None

    def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
        self.seen.append((q.clone(), k.clone(), v.clone(), k_is_scratch))
        return v.clone()


def _placement_worker(rank, world, heads, chunks):
    from dist_attn import UlyssesSageAttention, register_backend, unregister_backend
    from dist_attn.plan import head_offsets, heads_per_rank

    probe = _ProbeBackend()
    register_backend(probe, replace=True)
    try:
        s_local = PL_SEQ // world
        rows = slice(rank * s_local, (rank + 1) * s_local)
        q, k, v = (_encode(role, PL_SEQ, heads)[rows].clone() for role in range(3))
        attn = UlyssesSageAttention(heads, PL_D, backend="probe", overlap_chunks=chunks)
        out = attn(q, k, v, torch.tensor([0, PL_SEQ]), PL_SEQ, [0, PL_SEQ])
        counts = heads_per_rank(heads, world)
        first = head_offsets(counts)[rank]
        # What this rank's kernel calls saw, concatenated over chunks along heads.
        seen_q = torch.cat([s[0][0] for s in probe.seen], dim=1)
        seen_k = torch.cat([s[1][0] for s in probe.seen], dim=1)
        seen_v = torch.cat([s[2][0] for s in probe.seen], dim=1)
        expect = [_encode(role, PL_SEQ, heads)[:, first:first + counts[rank]] for role in range(3)]
        return dict(
            q_ok=torch.equal(seen_q, expect[0]), k_ok=torch.equal(seen_k, expect[1]),
            v_ok=torch.equal(seen_v, expect[2]), out_ok=torch.equal(out, v),
            scratch=all(s[3] for s in probe.seen) if world > 1 else True,
            calls=len(probe.seen),
        )
    finally:
        unregister_backend("probe")


PLACEMENT = {2: [(4, 1), (5, 2)], 3: [(7, 1), (7, 2)], 4: [(6, 1), (8, 2)]}


class _WaveProbe(_ProbeBackend):
    """A probe whose kernel reports waves: 3 tiles a head, ``slots(rank)`` at once (None: unknown)."""

    def __init__(self, name, slots):
        super().__init__()
        self.name, self.slots = name, slots

    def kernel_waves(self, layout, q):
        from dist_attn.plan import KernelWaves

        slots = self.slots(torch.distributed.get_rank())
        return None if slots is None else KernelWaves(tiles_per_head=3, slots=slots)


def _waves_worker(rank, world):
    """Wave-aligned chunks: widths, placement, one agreement all-reduce, and refusals."""
    from torch.distributed.tensor.debug import CommDebugMode

    from dist_attn import UlyssesSageAttention, register_backend, unregister_backend

    heads = 6 * world  # 6 a rank; 3 tiles a head on 2 slots: even widths are whole waves, so (2, 4), not (3, 3)
    s_local = PL_SEQ // world
    rows = slice(rank * s_local, (rank + 1) * s_local)
    q, k, v = (_encode(role, PL_SEQ, heads)[rows].clone() for role in range(3))
    args = (torch.tensor([0, PL_SEQ]), PL_SEQ, [0, PL_SEQ])
    res = {}
    probes = {"wp_same": lambda r: 2, "wp_slots": lambda r: 2 + r, "wp_unknown": lambda r: None if r == 0 else 2,
              "wp_mixed": None}
    try:
        for name, slots in probes.items():
            # wp_mixed: one name, two kernels: rank 0's reports waves, the others' has no kernel_waves
            if slots is None:
                probe = _WaveProbe(name, lambda r: 2) if rank == 0 else _ProbeBackend()
                probe.name = name
            else:
                probe = _WaveProbe(name, slots)
            register_backend(probe, replace=True)
            attn = UlyssesSageAttention(heads, PL_D, backend=name, overlap_chunks=2)
            try:
                with CommDebugMode() as first:
                    out = attn(q, k, v, *args)
                with CommDebugMode() as second:
                    attn(q, k, v, *args)
                res[name] = dict(widths=[s[0].shape[2] for s in probe.seen[:2]], out_ok=torch.equal(out, v),
                                 first={str(o): n for o, n in first.get_comm_counts().items()},
                                 second={str(o): n for o, n in second.get_comm_counts().items()})
            except RuntimeError as exc:
                res[name] = dict(error=str(exc), calls=len(probe.seen))
            # the group is still in step: a plain call after a refused one
            res[name]["after"] = torch.equal(UlyssesSageAttention(heads, PL_D, backend=name)(q, k, v, *args), v)
    finally:
        for name in probes:
            unregister_backend(name)
    # "auto" resolving to different kernels on different ranks is named as such
    from types import SimpleNamespace

    from dist_attn.agreement import CallFacts, agree
    from dist_attn.mesh import parallel_groups
    from dist_attn.plan import KernelWaves

    facts = CallFacts(batch=1, rows=s_local, heads=heads, head_dim=PL_D, dtype=q.dtype, device_type="cpu",
                      bounds=(0, PL_SEQ), valid_len=PL_SEQ, softmax_scale=0.5, overlap_chunks=2,
                      qk_prologue=False, kernel=f"kernel{rank}")
    try:
        agree(facts, lambda: KernelWaves(tiles_per_head=3, slots=2) if rank == 0 else None,
              parallel_groups(), backend_arg="auto")
        res["resolved"] = None
    except RuntimeError as exc:
        res["resolved"] = str(exc)
    return res


def _misc_worker(rank, world):
    """Everything but parity for one world size, in one spawn (process start-up dominates)."""
    return dict(
        waves=_waves_worker(rank, world),
        placement={hc: _placement_worker(rank, world, *hc) for hc in PLACEMENT[world]},
        collectives={c: _collective_worker(rank, world, c) for c in (1, 2)},
        buffers=_buffer_worker(rank, world),
    )


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda w: f"W{w}")
def misc_run(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_misc_worker, world, tmp_path_factory.mktemp(f"misc{world}"), timeout=300)


def test_exact_placement_round_trip(misc_run):
    world, per_rank = misc_run
    for rank, res_by_case in enumerate(per_rank):
        for (heads, chunks), res in res_by_case["placement"].items():
            case = f"rank {rank} heads={heads} chunks={chunks}"
            assert res["q_ok"] and res["k_ok"] and res["v_ok"], f"{case} received misplaced q/k/v: {res}"
            assert res["out_ok"], f"{case}: output rows/heads not returned to their place"
            assert res["scratch"], "K in the receive buffer should be offered as scratch"
            assert res["calls"] == min(chunks, heads // world), f"{case}: one kernel call per chunk"


def test_wave_aligned_chunks(misc_run):
    world, per_rank = misc_run
    for rank, res in enumerate(per_rank):
        same = res["waves"]["wp_same"]
        assert same["widths"] == [2, 4], f"rank {rank}: chunks of {same['widths']} heads, not (2, 4)"
        assert same["out_ok"], f"rank {rank}: output misplaced with wave-aligned chunks"
        # the first call agrees on the waves (one all-reduce), the second reuses the answer
        assert sum(n for op, n in same["first"].items() if "allreduce" in op) == 1, same["first"]
        assert all("alltoall" in op for op in same["second"]), same["second"]
        assert sum(same["second"].values()) == 4, same["second"]
        for name, needle in (("wp_slots", f"slots from 2 to {1 + world}"), ("wp_unknown", "slots from -1 to 2"),
                             ("wp_mixed", "-1: a rank whose kernel cannot tell")):
            bad = res["waves"][name]
            assert "error" in bad, f"rank {rank}: {name} should be refused on every rank: {bad}"
            assert "disagree" in bad["error"] and needle in bad["error"], bad["error"]
            assert "overlap_chunks=2" in bad["error"] and bad["calls"] == 0, bad
            assert bad["after"], f"rank {rank}: the group fell out of step after refusing {name}"
        assert same["after"]
        assert "backend='auto' resolved to different kernels" in (res["waves"]["resolved"] or ""), res["waves"]


# ---------------------------------------------------------------------------------------------
def _collective_worker(rank, world, chunks):
    from torch.distributed.tensor.debug import CommDebugMode

    from dist_attn import UlyssesSageAttention

    s_local = SEQ // world
    q = torch.randn(s_local, 4, HEAD_DIM)
    attn = UlyssesSageAttention(4, HEAD_DIM, backend="sdpa", overlap_chunks=chunks)
    bounds = (0, 37, SEQ)
    calls = []
    for _ in range(2):
        with CommDebugMode() as mode:
            attn(q, q, q, torch.tensor(bounds), 37, list(bounds), valid_len=37)
        calls.append((mode.get_total_counts(), {str(k): v for k, v in mode.get_comm_counts().items()}))
    return calls


def test_collectives_per_forward(misc_run):
    world, per_rank = misc_run
    for res in per_rank:
        for chunks, calls in res["collectives"].items():
            # plain path: exactly one all-to-all in and one back; chunked: one pair per chunk,
            # chunks capped by the smallest rank's head count (4 heads on 3 ranks: (2, 1, 1) -> 1);
            # the first call of a layout also agrees on it (one all-reduce: the inputs and the
            # kernel's waves), the second does not
            n = min(chunks, 4 // world)
            for i, (total, by_op) in enumerate(calls):
                agree = 1 if i == 0 else 0
                assert total == 2 * n + agree, f"chunks={chunks} call {i}: {total} collectives ({by_op})"
                assert sum(v for op, v in by_op.items() if "alltoall" in op) == 2 * n, by_op
                assert sum(v for op, v in by_op.items() if "allreduce" in op) == agree, by_op


# ---------------------------------------------------------------------------------------------
def _buffer_worker(rank, world):
    from dist_attn import StagingBuffers, StagingCapacityError, UlyssesSageAttention

    heads = 6
    pool = StagingBuffers()
    attn = UlyssesSageAttention(heads, HEAD_DIM, backend="sdpa", buffers=pool)

    def call(s_local):
        seq = s_local * world
        q = torch.randn(s_local, heads, HEAD_DIM)
        return attn(q, q, q, torch.tensor([0, seq]), seq, [0, seq])

    call(8)
    ptrs1 = {key: b.data_ptr() for key, b in pool._buffers.items()}
    out_a = call(8)
    out_b = call(8)
    ptrs2 = {key: b.data_ptr() for key, b in pool._buffers.items()}
    buf_ptrs = {b.untyped_storage().data_ptr() for b in pool._buffers.values()}
    out_aliases = out_a.untyped_storage().data_ptr() in buf_ptrs or \
        out_a.untyped_storage().data_ptr() == out_b.untyped_storage().data_ptr()
    for s_local in (4, 16, 12, 2, 16, 8):  # varied request sizes; the largest is 16
        call(s_local)
    caps = {role: pool.capacity(role, torch.float32, "cpu") for role in
            ("in_send", "in_recv", "out_send", "out_recv")}
    n_buffers = len(pool._buffers)
    # Capacity limit: a pool too small for the request raises on every rank, before collectives.
    small = StagingBuffers(max_bytes=1024)
    err = None
    try:
        UlyssesSageAttention(heads, HEAD_DIM, backend="sdpa", buffers=small)(
            *(torch.randn(8, heads, HEAD_DIM),) * 3, torch.tensor([0, 8 * world]), 8 * world)
    except StagingCapacityError as exc:
        err = str(exc)
    ok_after = call(8).shape  # the group is still in step after the refused call
    pool.release()
    return dict(ptrs_stable=ptrs1 == ptrs2, caps=caps, n_buffers=n_buffers, out_aliases=out_aliases,
                err=err, ok_after=tuple(ok_after), released=pool.total_bytes(), small_held=small.total_bytes())


def test_buffers_reused_and_bounded(misc_run):
    world, per_rank = misc_run
    heads, s_max = 6, 16
    h_max = -(-heads // world)
    for res in (r["buffers"] for r in per_rank):
        assert res["ptrs_stable"], "staging buffers were reallocated for a repeated shape"
        assert not res["out_aliases"], "the output must be a fresh tensor"
        assert res["n_buffers"] == 4, "one buffer per role for one dtype/device"
        assert res["caps"] == {
            "in_send": s_max * 3 * heads * HEAD_DIM,
            "in_recv": s_max * world * 3 * h_max * HEAD_DIM,
            "out_send": s_max * world * h_max * HEAD_DIM,
            "out_recv": s_max * heads * HEAD_DIM,
        }, "capacity must equal what the largest request needs"
        assert res["err"] is not None and "max_bytes=1024" in res["err"]
        assert res["small_held"] == 0, "a refused request must not allocate"
        assert res["ok_after"] == (8, heads, HEAD_DIM)
        assert res["released"] == 0
