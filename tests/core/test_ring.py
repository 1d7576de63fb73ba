# SPDX-License-Identifier: Apache-2.0
"""Ulysses x Ring (USP) over a ("ring", "ulysses") DeviceMesh on CPU gloo ranks: parity against
the float64 reference, exact placement, collective counts and validation.

Process start-up dominates on CI's 2 cores (8 spawned ranks take ~30 s), so ONE 8-rank spawn
runs every mesh shape: each shape is a DeviceMesh over a subset of the 8 ranks, the others idle.
Meshes deliberately use global ranks that do not start at 0 (and a ring whose global ranks
descend) so the test checks that placement follows the mesh coordinate, not the global rank.
"""

from __future__ import annotations

import pytest
import torch

from tests._multirank import run_ranks
from tests.reference import reference_attention

SEQ = 48  # divisible by every U*R tested (2, 4, 6, 8)
D = 8
# name -> (U, R, heads, batch, global ranks of the [R, U] mesh)
MESHES = {
    "U1xR2": (1, 2, 4, 1, [[5], [3]]),  # ring order differs from global-rank order
    "U2xR2": (2, 2, 4, 1, [[4, 5], [6, 7]]),
    "U1xR4": (1, 4, 3, 1, [[0], [1], [2], [3]]),
    "U3xR2": (3, 2, 7, 1, [[2, 3, 4], [5, 6, 7]]),  # 7 heads on 3 ranks: (3, 2, 2)
    "U4xR2": (4, 2, 4, 1, [[0, 1, 2, 3], [4, 5, 6, 7]]),
}
# name -> (bounds, max_seqlen, valid_len)
LAYOUTS = {
    "trailing_padding": ((0, 37, SEQ), 37, 37),
    "one_segment": ((0, SEQ), SEQ, None),
    "three_documents": ((0, 10, 30, SEQ), 20, None),  # (10, 30) and (30, 48) cross ring chunks
    "empty_segments": ((0, 0, 16, 16, 40, SEQ), 24, None),
    "documents_padded": ((0, 7, 29, SEQ), 22, 41),  # the last document clipped at valid_len
    "mostly_padding": ((0, SEQ), SEQ, 11),  # whole ring chunks are padding
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Max abs error against float64 on O(1) outputs:
#  fp32: the CPU SDPA kernel and the fp32 merge -> ~1e-6; 1e-5 leaves headroom.
#  bf16: each partial output is rounded to bf16 (2^-9 relative) before the fp32 merge, and the
#        final output again -> ~1e-2.
ATOL = {"fp32": 1e-5, "bf16": 2.5e-2}
# Logits in the hundreds: fp32 rounds each score by ~|s| * 6e-8, ~2e-5 in the exponent at |s| ~ 300,
# whichever kernel runs; the check is that nothing overflows and the merge stays that close.
ATOL_LARGE_LOGITS = 1e-4

# (layout, dtype, host bounds, batch, q scale, overlap_chunks)
CASES = [(lay, dt, host, 1, 1.0, 1) for lay in LAYOUTS for dt in DTYPES for host in (True, False)]
# logits in the hundreds: a naive exp would overflow, the log-sum-exp merge must not
CASES.append(("three_documents", "fp32", True, 1, 60.0, 1))
CASES.append(("documents_padded", "fp32", True, 2, 1.0, 1))  # batched [B, S_local, H, D]
CASES.append(("three_documents", "fp32", True, 2, 1.0, 2))  # head chunks, one ring per chunk


def _case_id(case):
    lay, dt, host, batch, scale, chunks = case
    return f"{lay}-{dt}-{'host' if host else 'nohost'}-b{batch}-x{scale:g}-c{chunks}"


def _inputs(heads, batch, dtype, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(batch, SEQ, heads, D, generator=g) for _ in range(3))
    return [t.to(DTYPES[dtype]) for t in (q * scale, k, v)]


def _mesh(ranks):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.tensor(ranks), mesh_dim_names=("ring", "ulysses"))


def _parity(mesh, u_size, r_size, heads):
    from dist_attn import UlyssesSageAttention
    from dist_attn.mesh import shard_index

    shard = shard_index(mesh)
    s_local = SEQ // (u_size * r_size)
    rows = slice(shard * s_local, (shard + 1) * s_local)
    results = {}
    for i, case in enumerate(CASES):
        lay, dt, host, batch, scale, chunks = case
        bounds, max_seqlen, valid_len = LAYOUTS[lay]
        q, k, v = (t[:, rows].clone() for t in _inputs(heads, batch, dt, scale, seed=i))
        if batch == 1:
            q, k, v = q[0], k[0], v[0]  # the [S_local, H, D] call
        before = [t.clone() for t in (q, k, v)]
        attn = UlyssesSageAttention(heads, D, mesh=mesh, backend="sdpa", overlap_chunks=chunks)
        out = attn(q, k, v, torch.tensor(bounds, dtype=torch.int32), max_seqlen,
                   list(bounds) if host else None, valid_len=valid_len)
        unmodified = all(torch.equal(a, b) for a, b in zip(before, (q, k, v)))
        aliases = any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in (q, k, v))
        results[_case_id(case)] = (out.float().numpy(), str(out.dtype), tuple(out.shape), unmodified, aliases)
    return shard, results


# ---- exact placement: values encode (role, global row, head, dim); small enough that the
# merge of R equal partials (weights 1/R, not exact in binary) still rounds back exactly
def _encode(role, heads):
    r = torch.arange(SEQ).view(SEQ, 1, 1)
    h = torch.arange(heads).view(1, heads, 1)
    d = torch.arange(D).view(1, 1, D)
    return (((role * 64 + r) * 8 + h) * D + d).float()  # < 2^13


def _probe_backend():
    from dist_attn.backends import AttentionBackend

    class Probe(AttentionBackend):
        """Records what each call saw; returns q with lse 0, so the merged output must be q."""

        name = "ring_probe"
        seen: list

        def unsupported_reason(self, q):
            return None

        def dense(self, q, k, v, *, softmax_scale, k_is_scratch, out=None):
            raise AssertionError("ring attention must call dense_lse")

        def dense_lse(self, q, k, v, *, softmax_scale):
            self.seen.append((q.clone(), k.clone(), v.clone()))
            lse = torch.zeros(q.shape[0], q.shape[2], q.shape[1])  # [B, H, Tq]
            return q.clone(), lse

    probe = Probe()
    probe.seen = []
    return probe


def _placement(mesh, u_size, r_size, heads):
    from dist_attn import register_backend, unregister_backend, ulysses_attention
    from dist_attn.mesh import parallel_groups
    from dist_attn.plan import head_offsets, heads_per_rank

    groups = parallel_groups(mesh=mesh)
    r, u = groups.ring_rank, groups.ulysses_rank
    probe = _probe_backend()
    register_backend(probe, replace=True)
    try:
        s_local = SEQ // (u_size * r_size)
        rows = slice(groups.shard * s_local, (groups.shard + 1) * s_local)
        q, k, v = (_encode(role, heads)[rows].clone() for role in range(3))
        out = ulysses_attention(q, k, v, mesh=mesh, backend="ring_probe")
    finally:
        unregister_backend("ring_probe")
    first = head_offsets(heads_per_rank(heads, u_size))[u]
    hs = slice(first, first + heads_per_rank(heads, u_size)[u])
    chunk = SEQ // r_size
    ok_q = ok_k = ok_v = len(probe.seen) == r_size
    for step, (sq, sk, sv) in enumerate(probe.seen):  # step t holds K/V of chunk r - t
        src = (r - step) % r_size
        ok_q &= torch.equal(sq[0], _encode(0, heads)[r * chunk:(r + 1) * chunk, hs])
        ok_k &= torch.equal(sk[0], _encode(1, heads)[src * chunk:(src + 1) * chunk, hs])
        ok_v &= torch.equal(sv[0], _encode(2, heads)[src * chunk:(src + 1) * chunk, hs])
    return dict(calls=len(probe.seen), q_ok=ok_q, k_ok=ok_k, v_ok=ok_v,
                out_ok=torch.equal(out.round(), q), out_err=float((out - q).abs().max()))


def _counts(mesh, u_size, r_size, heads, chunks):
    """(all-to-alls seen by CommDebugMode, [ops per batch_isend_irecv call]) of one forward.
    CommDebugMode does not track point-to-point ops, so batch_isend_irecv is wrapped."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    from dist_attn import ulysses_attention

    batches = []
    real = dist.batch_isend_irecv

    def counting(ops):
        batches.append(sorted(op.op.__name__ for op in ops))
        return real(ops)

    s_local = SEQ // (u_size * r_size)
    q = torch.randn(s_local, heads, D)
    dist.batch_isend_irecv = counting
    calls = []
    try:
        for _ in range(2):  # a layout no other call of the worker uses: the first call agrees on it
            batches.clear()
            with CommDebugMode() as mode:
                ulysses_attention(q, q, q, [0, 35, SEQ], cu_seqlens_host=[0, 35, SEQ], valid_len=35,
                                  mesh=mesh, backend="sdpa", overlap_chunks=chunks)
            calls.append((mode.get_total_counts(), {str(key): n for key, n in mode.get_comm_counts().items()},
                          list(batches)))
    finally:
        dist.batch_isend_irecv = real
    return calls


def _compiled_op(mesh, u_size, r_size, heads):
    """The torch.compile custom op (called directly) carries the mesh and matches eager."""
    from dist_attn import ulysses_attention
    from dist_attn.mesh import shard_index
    from dist_attn.distributed import register_for_compile

    s_local = SEQ // (u_size * r_size)
    rows = slice(shard_index(mesh) * s_local, (shard_index(mesh) + 1) * s_local)
    q, k, v = (t[0, rows] for t in _inputs(heads, 1, "fp32", 1.0, seed=99))
    eager = ulysses_attention(q, k, v, [0, 10, 30, SEQ], valid_len=41, mesh=mesh, backend="sdpa")
    op = torch.ops.dist_attn.ulysses_attention(q, k, v, None, [0, 10, 30, SEQ], None, 41,
                                               register_for_compile(mesh=mesh), "sdpa", None, heads, D, 1)
    return torch.equal(eager, op)


def _no_bound_reads(mesh, u_size, r_size, heads):
    """With host bounds the call never reads the bounds tensor (``tolist`` / ``item`` of a CUDA
    tensor is a device-to-host sync); the Python-level readers are replaced by ones that raise."""
    from dist_attn import ulysses_attention

    q = torch.randn(SEQ // (u_size * r_size), heads, D)
    cu = torch.tensor([0, 10, 30, SEQ], dtype=torch.int32)
    saved = torch.Tensor.tolist, torch.Tensor.item

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read on the host")

    torch.Tensor.tolist = torch.Tensor.item = refuse
    try:
        ulysses_attention(q, q, q, cu, 20, [0, 10, 30, SEQ], valid_len=41, mesh=mesh, backend="sdpa")
        return None
    except AssertionError as exc:
        return str(exc)
    finally:
        torch.Tensor.tolist, torch.Tensor.item = saved


def _ring_worker(rank, world):
    out = {}
    for name, (u_size, r_size, heads, _, ranks) in MESHES.items():
        mesh = _mesh(ranks)  # every rank builds every mesh (its sub-groups need all ranks)
        if mesh.get_coordinate() is None:
            continue
        res = {"parity": _parity(mesh, u_size, r_size, heads),
               "placement": _placement(mesh, u_size, r_size, heads),
               "counts": {c: _counts(mesh, u_size, r_size, heads, c) for c in (1, 2)}}
        if name == "U2xR2":
            res["compiled_op"] = _compiled_op(mesh, u_size, r_size, heads)
            res["bound_reads"] = _no_bound_reads(mesh, u_size, r_size, heads)
        out[name] = res
    out["validation"] = _validation_worker(rank)
    return out


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    return run_ranks(_ring_worker, 8, tmp_path_factory.mktemp("ring"), timeout=400)


def _mesh_ranks(name):
    return [g for row in MESHES[name][4] for g in row]


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_parity_against_float64(ring_run, mesh_name):
    u_size, r_size, heads, _, _ = MESHES[mesh_name]
    shards = dict(ring_run[g][mesh_name]["parity"] for g in _mesh_ranks(mesh_name))
    assert sorted(shards) == list(range(u_size * r_size)), "every shard index r*U+u exactly once"
    s_local = SEQ // (u_size * r_size)
    for i, case in enumerate(CASES):
        lay, dt, host, batch, scale, chunks = case
        bounds, _, valid_len = LAYOUTS[lay]
        ref = reference_attention(*_inputs(heads, batch, dt, scale, seed=i), bounds, valid_len)
        got = [shards[s][_case_id(case)] for s in range(u_size * r_size)]
        out = torch.cat([torch.from_numpy(g[0]).reshape(batch, s_local, heads, D) for g in got], dim=1)
        for _, dtype, shape, unmodified, aliases in got:
            assert dtype == str(DTYPES[dt]) and shape == ((s_local, heads, D) if batch == 1 else
                                                         (batch, s_local, heads, D))
            assert unmodified, f"{mesh_name} {_case_id(case)}: the caller's q/k/v changed"
            assert not aliases, f"{mesh_name} {_case_id(case)}: the output aliases an input"
        assert torch.isfinite(out).all(), f"{mesh_name} {_case_id(case)}: non-finite output"
        err = (out.double() - ref).abs().max().item()
        atol = ATOL[dt] if scale == 1.0 else ATOL_LARGE_LOGITS
        assert err <= atol, f"{mesh_name} {_case_id(case)}: max abs error {err:.3g} > {atol}"
        if valid_len is not None:
            assert torch.count_nonzero(out[:, valid_len:]) == 0, \
                f"{mesh_name} {_case_id(case)}: padding rows must be exactly zero"


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_exact_placement_round_trip(ring_run, mesh_name):
    _, r_size, _, _, _ = MESHES[mesh_name]
    for g in _mesh_ranks(mesh_name):
        res = ring_run[g][mesh_name]["placement"]
        assert res["calls"] == r_size, f"rank {g}: one kernel call per ring step: {res}"
        assert res["q_ok"], f"rank {g}: the kernel saw the wrong query rows/heads: {res}"
        assert res["k_ok"] and res["v_ok"], f"rank {g}: step t must hold K/V of chunk r - t: {res}"
        assert res["out_ok"], f"rank {g}: output rows/heads not returned to their place: {res}"


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_collectives_per_forward(ring_run, mesh_name):
    u_size, r_size, heads, _, _ = MESHES[mesh_name]
    for g in _mesh_ranks(mesh_name):
        for chunks, calls in ring_run[g][mesh_name]["counts"].items():
            for i, (total, by_op, batches) in enumerate(calls):
                _check_counts(u_size, r_size, heads, chunks, i, total, by_op, batches)


def _check_counts(u_size, r_size, heads, chunks, i, total, by_op, batches):
    # head chunks are capped by the smallest rank's share; each chunk has its own
    # all-to-all pair and its own ring; one Ulysses rank has no all-to-all to overlap
    eff = 1 if u_size == 1 else min(chunks, heads // u_size)
    a2a = 0 if u_size == 1 else 2 * eff  # one Ulysses rank: nothing to exchange
    # the first call of a layout agrees on it with one all-reduce over each dim of the
    # mesh that has more than one rank; the second makes none
    agree = (u_size > 1) + (r_size > 1) if i == 0 else 0
    assert sum(n for op, n in by_op.items() if "alltoall" in op) == a2a, (chunks, i, by_op)
    assert by_op.get("c10d.allreduce_", 0) == agree and total == a2a + agree, (chunks, i, by_op)
    assert len(batches) == eff * (r_size - 1), f"chunks={chunks}: {len(batches)} ring steps"
    assert all(b == ["irecv", "isend"] for b in batches), "K and V: one send + one recv a step"


def test_host_bounds_mean_no_host_reads(ring_run):
    for g in _mesh_ranks("U2xR2"):
        assert ring_run[g]["U2xR2"]["bound_reads"] is None, ring_run[g]["U2xR2"]["bound_reads"]


def test_compiled_op_carries_the_mesh(ring_run):
    for g in _mesh_ranks("U2xR2"):
        assert ring_run[g]["U2xR2"]["compiled_op"], f"rank {g}: custom op differs from eager"


# ---------------------------------------------------------------------------------------------
def _validation_worker(rank):
    """Bad calls on the 4x2 mesh: each must raise on every rank, before any collective (a rank
    that entered one would hang its peers; run_ranks' deadline turns that into a failure)."""
    import torch.distributed as dist

    from dist_attn import register_backend, ulysses_attention, unregister_backend, UlyssesSageAttention
    from dist_attn.backends import AttentionBackend, SdpaBackend

    class NoLse(SdpaBackend):
        name = "no_lse"
        dense_lse = AttentionBackend.dense_lse  # the interface's own: no log-sum-exp

    mesh = _mesh(MESHES["U4xR2"][4])
    q = torch.randn(SEQ // 8, 4, D)
    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - recorded and asserted by the test
            errors[name] = f"{type(exc).__name__}: {exc}"

    register_backend(NoLse(), replace=True)
    try:
        attempt("no_lse", lambda: ulysses_attention(q, q, q, mesh=mesh, backend="no_lse"))
    finally:
        unregister_backend("no_lse")
    attempt("mesh_and_group", lambda: ulysses_attention(q, q, q, mesh=mesh, group=dist.group.WORLD,
                                                        backend="sdpa"))
    attempt("module_mesh_and_group", lambda: UlyssesSageAttention(4, D, mesh=mesh, group=dist.group.WORLD))
    attempt("bounds_total", lambda: ulysses_attention(q, q, q, [0, SEQ // 2], mesh=mesh, backend="sdpa"))
    attempt("heads_below_u", lambda: ulysses_attention(q[:, :2], q[:, :2], q[:, :2], mesh=mesh,
                                                       backend="sdpa"))
    attempt("not_a_mesh", lambda: ulysses_attention(q, q, q, mesh="ring", backend="sdpa"))
    flat = _flat_mesh()
    attempt("one_dim_mesh", lambda: ulysses_attention(q, q, q, mesh=flat, backend="sdpa"))
    swapped = _swapped_mesh()
    attempt("dims_swapped", lambda: ulysses_attention(q, q, q, mesh=swapped, backend="sdpa"))
    descending = _mesh([[3, 2, 1, 0], [7, 6, 5, 4]])
    attempt("ulysses_descending", lambda: ulysses_attention(q, q, q, mesh=descending, backend="sdpa"))
    from dist_attn.mesh import parallel_groups
    from dist_attn.ring import check_ring_transport

    # gloo moves CPU tensors only: a CUDA tensor on this (gloo) ring must be refused up front;
    # only the device type is read, so a CPU machine can ask
    ring_group = parallel_groups(mesh=mesh).ring_group
    attempt("gloo_ring_cuda", lambda: check_ring_transport(
        ring_size=2, comm_backend=dist.get_backend(ring_group), device=torch.device("cuda")))
    # the ranks are still in step after the refused calls
    attempt("ok_after", lambda: ulysses_attention(q, q, q, mesh=mesh, backend="sdpa"))
    return errors


def _flat_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(8), mesh_dim_names=("ulysses",))


def _swapped_mesh():
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(8).view(4, 2), mesh_dim_names=("ulysses", "ring"))


VALIDATION = {
    "no_lse": ["BackendUnavailableError", "'no_lse'", "log-sum-exp", "backend='sdpa'"],
    "mesh_and_group": ["ValueError", "mesh= and group= were both given"],
    "module_mesh_and_group": ["ValueError", "mesh= and group= were both given"],
    "bounds_total": ["ValueError", "cu_seqlens[-1]=24", "S_local*U*R = 6*4*2 = 48"],
    "heads_below_u": ["ValueError", "num_heads=2", "Ulysses world size 4"],
    "not_a_mesh": ["TypeError", "mesh='ring'", "DeviceMesh"],
    "one_dim_mesh": ["ValueError", "expected 2 dims named ('ring', 'ulysses')"],
    "dims_swapped": ["ValueError", "('ulysses', 'ring')"],
    "ulysses_descending": ["ValueError", "must ascend along the 'ulysses' dim"],
    "gloo_ring_cuda": ["ValueError", "gloo backend, which cannot send cuda tensors", "NCCL"],
}


@pytest.mark.parametrize("name", list(VALIDATION))
def test_validation_errors_on_every_rank(ring_run, name):
    for g, res in enumerate(ring_run):
        msg = res["validation"][name]
        assert msg is not None, f"rank {g}: {name} did not raise"
        for part in VALIDATION[name]:
            assert part in msg, f"rank {g}: {name}: {part!r} not in {msg!r}"
    assert all(res["validation"]["ok_after"] is None for res in ring_run)


def test_registered_sage8_is_refused_under_a_ring():
    """sage8's log-sum-exp needs equal query and key lengths, which ring steps do not have."""
    from dist_attn.backends import BackendUnavailableError, get_backend
    from dist_attn.ring import check_ring_backend

    for name in ("sage8", "sage8_gluon"):
        with pytest.raises(BackendUnavailableError, match="equal length"):
            check_ring_backend(get_backend(name), requested=name, ring_size=2)


def test_lse_rule_names_the_fix():
    """The rule itself, in-process: only a ring needs the log-sum-exp, and an 8-bit kernel that
    lacks it is told where it comes from."""
    from dist_attn.backends import AttentionBackend, BackendUnavailableError
    from dist_attn.ring import check_ring_backend

    class Sage8WithoutLse(AttentionBackend):
        name = "sage8"

    with pytest.raises(BackendUnavailableError, match="sage8's kernels return it only for queries and keys of equal"):
        check_ring_backend(Sage8WithoutLse(), requested="auto", ring_size=2)
    with pytest.raises(BackendUnavailableError, match="backend='auto' chose 'sage8'"):
        check_ring_backend(Sage8WithoutLse(), requested="auto", ring_size=2)
    check_ring_backend(Sage8WithoutLse(), requested="sage8", ring_size=1)  # no ring, no LSE needed


def _auto_under_ring_worker(rank, world):
    """An LSE-less kernel first in "auto"'s order: on a ring, auto passes it over."""
    from dist_attn import AttentionBackend, get_backend, register_backend, ulysses_attention
    from dist_attn.mesh import init_usp_mesh

    class RunnableNoLse(AttentionBackend):
        name, exact = "sage8", False

        def unsupported_reason(self, q):
            return None

    real = get_backend("sage8")
    register_backend(RunnableNoLse(), replace=True)
    try:
        mesh = init_usp_mesh(world, 1)
        q = torch.randn(1, 8, 2, D)
        out = ulysses_attention(q, q, q, valid_len=15, mesh=mesh, backend="auto")
        return tuple(out.shape)
    finally:
        register_backend(real, replace=True)


def test_auto_under_a_ring_chooses_a_kernel_with_lse(tmp_path):
    assert run_ranks(_auto_under_ring_worker, 2, tmp_path, timeout=120) == [(1, 8, 2, D)] * 2
