# SPDX-License-Identifier: Apache-2.0
"""Every bad input raises a clear error on every rank, before any collective, within a time limit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests._multirank import RankError, run_ranks

H, D = 4, 16


def _bad_calls(world):
    """(case id, expected exception type, substrings the message must contain, call kwargs)."""
    s_local = 8
    seq = s_local * world
    good = lambda: torch.randn(s_local, H, D)  # noqa: E731
    cu = torch.tensor([0, seq], dtype=torch.int32)
    base = dict(q=good(), k=good(), v=good(), cu_seqlens=cu, max_seqlen=seq, cu_seqlens_host=None)

    def case(name, exc, needles, module=None, **over):
        return name, exc, needles, module or {}, {**base, **over}

    return [
        case("q_ndim", "ValueError", ["q.ndim=2", "3 dims"], q=torch.randn(s_local, H * D)),
        case("shape_mismatch", "ValueError", ["shapes must be equal", f"k=({s_local + 1}"],
             k=torch.randn(s_local + 1, H, D)),
        case("num_heads", "ValueError", ["q.shape[1]=5", "num_heads=4"], q=torch.randn(s_local, 5, D),
             k=torch.randn(s_local, 5, D), v=torch.randn(s_local, 5, D)),
        case("head_dim", "ValueError", ["q.shape[2]=8", "head_dim=16"], q=torch.randn(s_local, H, 8),
             k=torch.randn(s_local, H, 8), v=torch.randn(s_local, H, 8)),
        case("dtype_unsupported", "ValueError", ["q.dtype=torch.float64", "not supported"],
             q=good().double(), k=good().double(), v=good().double()),
        case("dtype_mismatch", "ValueError", ["dtypes must be equal", "k=torch.bfloat16"],
             k=good().bfloat16()),
        case("device_mismatch", "ValueError", ["share a device", "v=meta"],
             v=torch.empty(s_local, H, D, device="meta")),
        case("cu_dtype", "ValueError", ["cu_seqlens.dtype=torch.float32"], cu_seqlens=cu.float()),
        case("cu_ndim", "ValueError", ["cu_seqlens.ndim=2"], cu_seqlens=cu.view(1, 2)),
        case("cu_start", "ValueError", ["cu_seqlens[0]=1", "start at 0"],
             cu_seqlens=torch.tensor([1, seq], dtype=torch.int32), max_seqlen=seq),
        case("cu_order", "ValueError", ["cu_seqlens[2]=3 < cu_seqlens[1]=5", "non-decreasing"],
             cu_seqlens=torch.tensor([0, 5, 3, seq], dtype=torch.int32)),
        case("cu_end", "ValueError", [f"cu_seqlens[-1]={seq + 2}", f"{s_local}*{world}"],
             cu_seqlens=torch.tensor([0, seq + 2], dtype=torch.int32), max_seqlen=seq + 2),
        case("host_len", "ValueError", ["len(cu_seqlens_host)=3", "cu_seqlens.numel()=2"],
             cu_seqlens_host=[0, 4, seq]),
        case("host_type", "TypeError", ["cu_seqlens_host must hold Python ints", "2.5"],
             cu_seqlens_host=[0, 2.5]),
        case("host_values", "ValueError", ["cu_seqlens_host[-1]=5", "end at"], cu_seqlens_host=[0, 5]),
        case("max_seqlen_zero", "ValueError", ["max_seqlen=0", "> 0"], max_seqlen=0),
        case("max_seqlen_short", "ValueError", ["max_seqlen=3", f"longest segment ({seq} rows"],
             max_seqlen=3),
        case("max_seqlen_type", "TypeError", ["max_seqlen=", "must be a Python int"],
             max_seqlen=float(seq)),
        case("valid_len_type", "TypeError", ["valid_len=3.0", "Python int"], valid_len=3.0),
        case("valid_len_range", "ValueError", [f"valid_len={seq + 1}", f"[1, {seq}]"], valid_len=seq + 1),
        case("cu_list_type", "TypeError", ["cu_seqlens must hold Python ints", "'a'"],
             cu_seqlens=[0, "a"]),
        case("padding_not_said", "ValueError", ["max_seqlen=2", "pass valid_len=2"],
             cu_seqlens=[0, 2, seq], max_seqlen=2),
        case("backend_unknown", "ValueError", ["backend='flash9'", "not one of"], module=dict(backend="flash9")),
        case("backend_sage_cpu", "BackendUnavailableError", ["backend='sage' cannot run", "sdpa"],
             module=dict(backend="sage")),
        case("softmax_scale", "ValueError", ["softmax_scale=-1.0", "must lie in (0, 1e+24]"],
             module=dict(softmax_scale=-1.0)),
        case("requires_grad", "RuntimeError", ["forward-only", "torch.no_grad()"],
             q=good().requires_grad_()),
        case("too_few_heads", "ValueError",
             ["num_heads=1", f"world size {world}", "at most 1 ranks (fewer ranks, or Ulysses x Ring",
              f"pad q, k and v with zero heads up to {world}"] if world > 1 else ["q.shape[1]=1"],
             q=torch.randn(s_local, 1, D), k=torch.randn(s_local, 1, D), v=torch.randn(s_local, 1, D)),
    ]


def _validation_worker(rank, world):
    from dist_attn import UlyssesSageAttention

    outcome = {}
    for name, _, _, module, kw in _bad_calls(world):
        heads = 1 if name == "too_few_heads" and world > 1 else H
        try:
            UlyssesSageAttention(heads, D, **{"backend": "sdpa", **module})(**kw)
            outcome[name] = None
        except Exception as exc:  # noqa: BLE001 - we report what was raised
            outcome[name] = (type(exc).__name__, str(exc))
    # After every refused call the ranks are still in step: a good call completes.
    s_local = 8
    q = torch.randn(s_local, H, D)
    out = UlyssesSageAttention(H, D, backend="sdpa")(q, q, q, torch.tensor([0, s_local * world]), s_local * world)
    outcome["_good_after"] = tuple(out.shape)
    return outcome


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"W{w}")
def validation_run(request, tmp_path_factory):
    world = request.param
    return world, run_ranks(_validation_worker, world, tmp_path_factory.mktemp(f"val{world}"), timeout=90)


@pytest.mark.parametrize("case", [c[0] for c in _bad_calls(2)])
def test_bad_input_raises_on_every_rank(validation_run, case):
    world, per_rank = validation_run
    name, exc_type, needles, _, _ = next(c for c in _bad_calls(world) if c[0] == case)
    for rank, outcome in enumerate(per_rank):
        got = outcome[name]
        assert got is not None, f"rank {rank}: {name} did not raise"
        assert got[0] == exc_type, f"rank {rank}: {name} raised {got[0]}: {got[1]}"
        for needle in needles:
            assert needle in got[1], f"rank {rank}: {name} message {got[1]!r} lacks {needle!r}"
        assert outcome["_good_after"] == (8, H, D)


def test_short_request_padding_longer_than_used_is_valid():
    """A 10-token request padded to 64 rows: the padding segment is longer than max_seqlen but
    never reaches a kernel, so the call must succeed (it once crashed the server)."""
    from dist_attn import sage_varlen

    q = torch.randn(64, 2, 16)
    out = sage_varlen(q, q, q, torch.tensor([0, 10, 64]), 10, [0, 10, 64], backend="sdpa")
    assert torch.count_nonzero(out[10:]) == 0 and torch.isfinite(out[:10]).all()


@pytest.mark.parametrize("scale", [float("nan"), 0, -1, float("inf"), True, "0.1", np.float32(0.1),
                                   torch.tensor(0.1)],
                         ids=["nan", "zero", "negative", "inf", "bool", "str", "numpy", "tensor"])
def test_sage_varlen_and_ulysses_refuse_the_same_softmax_scales(scale):
    """sage_varlen(..., softmax_scale=nan) returned all NaN (0 and -1 passed too) where
    ulysses_attention refused them: one rule (validation.check_softmax_scale) raised by both,
    with the same message, before any kernel runs."""
    from dist_attn import UlyssesSageAttention, sage_varlen

    q = torch.randn(8, H, D)
    with pytest.raises(ValueError) as varlen:
        sage_varlen(q, q, q, [0, 8], 8, backend="sdpa", softmax_scale=scale)
    with pytest.raises(ValueError) as ulysses:
        UlyssesSageAttention(H, D, backend="sdpa", softmax_scale=scale)
    assert str(varlen.value) == str(ulysses.value)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        assert str(varlen.value) == (f"softmax_scale={scale!r} must be a Python float or int (not a "
                                     f"{type(scale).__name__}; pass float(x) for a numpy or tensor "
                                     "scalar) or None")
    else:
        assert str(varlen.value).startswith(f"softmax_scale={scale!r} must lie in (0, 1e+24]")


@pytest.mark.parametrize("scale", [1e300, 1e40, 2e24], ids=["1e300", "1e40", "2e24"])
def test_a_scale_that_can_overflow_the_logits_is_refused_with_the_valid_range(scale):
    """sage_varlen(..., softmax_scale=1e300) passed the "positive finite" rule and returned all
    NaN (the scale is inf in float32, and inf - inf in the softmax). The one rule bounds it so
    that scale x q.k stays finite in float32 for inputs in float16's range, and says the range."""
    from dist_attn import UlyssesSageAttention, sage_varlen, ulysses_attention

    q = torch.randn(8, H, D)
    msg = (f"softmax_scale={scale!r} must lie in (0, 1e+24] (None: 1/sqrt(head_dim)): a larger "
           "scale can overflow the float32 logits scale x q.k")
    for call in (lambda: sage_varlen(q, q, q, [0, 8], 8, backend="sdpa", softmax_scale=scale),
                 lambda: ulysses_attention(q, q, q, backend="sdpa", softmax_scale=scale),
                 lambda: UlyssesSageAttention(H, D, backend="sdpa", softmax_scale=scale)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value).startswith(msg), str(err.value)
    # the bound itself is valid, and so is an unusual but harmless large scale
    for ok in (1e24, 1e3):
        assert torch.isfinite(sage_varlen(q, q, q, [0, 8], 8, backend="sdpa", softmax_scale=ok)).all()


@pytest.mark.parametrize("kw,exc,needle", [
    (dict(valid_len=True), TypeError, "valid_len=True must be a Python int"),
    (dict(valid_len=3.0), TypeError, "valid_len=3.0 must be a Python int"),
    (dict(softmax_scale=True), ValueError, "softmax_scale=True must be a Python float or int"),
    (dict(max_seqlen=True), TypeError, "max_seqlen=True must be a Python int"),
    (dict(num_heads=True), ValueError, "num_heads=True must be a positive int"),
], ids=["valid_len_bool", "valid_len_float", "scale_bool", "max_seqlen_bool", "num_heads_bool"])
def test_compiled_calls_refuse_what_eager_calls_refuse(kw, exc, needle):
    """The compiled op's schema types these int/float: valid_len=True crossed it as 1 (one valid
    row, every other row zero) and softmax_scale=True as 1.0, where eager refused both. They are
    checked before the boundary now, with eager's rule and message."""
    from dist_attn import ulysses_attention

    q = torch.randn(8, H, D)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: ulysses_attention(t, t, t, backend="sdpa", **kw), backend="eager")
    with pytest.raises(exc, match=needle):
        fn(q)
    with pytest.raises(exc, match=needle):
        ulysses_attention(q, q, q, backend="sdpa", **kw)


def _group_worker(rank, world):
    import torch.distributed as dist

    from dist_attn import UlyssesSageAttention, plan_shard, shard_sequence, ulysses_attention

    only_1 = dist.new_group([1])  # every rank must call new_group; rank 0 gets NON_GROUP_MEMBER
    q = torch.randn(8, H, D)
    calls = {
        "ulysses_attention": lambda g: ulysses_attention(q, q, q, group=g, backend="sdpa"),
        "UlyssesSageAttention": lambda g: UlyssesSageAttention(H, D, group=g, backend="sdpa"),
        "plan_shard": lambda g: plan_shard(9, g),
        "shard_sequence": lambda g: shard_sequence(torch.randn(2, 9, 3), g),
    }
    out = {}
    for name, call in calls.items():
        for label, g in (("str", "x"), ("non_member", only_1)):
            if label == "non_member" and rank == 1:
                continue  # rank 1 is a member
            try:
                call(g)
                out[f"{name}/{label}"] = None
            except Exception as exc:  # noqa: BLE001 - we report what was raised
                out[f"{name}/{label}"] = (type(exc).__name__, str(exc))
    dist.barrier()
    return out


def test_a_bad_or_foreign_group_is_refused_by_name(tmp_path):
    """group='x' raised AttributeError ('str' object has no attribute 'size'); a group this rank
    is not in (new_group's NON_GROUP_MEMBER, -100) gave world_size=-1 errors, or an empty shard
    and no error at all. Both are refused by name now, before any collective."""
    per_rank = run_ranks(_group_worker, 2, tmp_path, timeout=90)
    for rank, outcome in enumerate(per_rank):
        for key, got in outcome.items():
            assert got is not None, f"rank {rank}: {key} did not raise"
            if key.endswith("/str"):
                assert got == ("TypeError", "group='x' must be a torch.distributed.ProcessGroup "
                                            "or None (the default group)"), (rank, key, got)
            else:
                assert got[0] == "ValueError" and "not a member of the group" in got[1] \
                    and "global rank 0" in got[1], (rank, key, got)
    assert len(per_rank[0]) == 8 and len(per_rank[1]) == 4


def test_a_compiled_call_takes_a_new_scale_and_numpy_ints():
    """Under fullgraph, a scale that changes between calls is a symbolic float: the boundary
    checks its type only (the op checks its value), so the second scale compiles. numpy ints
    count as ints for num_heads, as they did before the check."""
    from dist_attn import ulysses_attention

    q = torch.randn(8, H, D)
    torch._dynamo.reset()
    fn = torch.compile(lambda t, s: ulysses_attention(t, t, t, backend="sdpa", softmax_scale=s),
                       fullgraph=True, backend="eager")
    for scale in (0.25, 0.5):
        assert torch.equal(fn(q, scale), ulysses_attention(q, q, q, backend="sdpa",
                                                           softmax_scale=scale))
    got = ulysses_attention(q, q, q, backend="sdpa", num_heads=np.int64(H), head_dim=np.int32(D))
    assert torch.equal(got, ulysses_attention(q, q, q, backend="sdpa"))


@pytest.mark.parametrize("valid_len,needle", [
    (torch.tensor(5.0), "torch.float32"),
    (torch.tensor([5, 6]), "shape (2,)"),
    (torch.empty((), dtype=torch.int64, device="meta"), "on meta"),
], ids=["float", "two_values", "not_cpu"])
def test_a_valid_len_tensor_must_be_one_integer_on_the_cpu(valid_len, needle):
    """valid_len may be a CPU integer tensor (read on the host); anything else that is a tensor is
    refused by name, eagerly and before the compiled op's boundary alike."""
    from dist_attn import ulysses_attention

    q = torch.randn(8, H, D)
    with pytest.raises(TypeError, match="must hold one int32/int64 value on the CPU") as eager:
        ulysses_attention(q, q, q, backend="sdpa", valid_len=valid_len)
    assert needle in str(eager.value)
    torch._dynamo.reset()
    fn = torch.compile(lambda t: ulysses_attention(t, t, t, backend="sdpa", valid_len=valid_len),
                       backend="eager")
    with pytest.raises(TypeError, match="must hold one int32/int64 value on the CPU"):
        fn(q)


def test_a_compiled_call_reads_a_valid_len_tensor_without_recompiling():
    """A compiled caller whose true length changes within one padded length (H3's prompt tokens
    under runtime.sequence_bucket), compiled with dynamic=False as the served blocks are: an int
    valid_len is a constant of the graph, so each value compiles again; a CPU tensor filled in place is a graph input, so one graph serves every
    value, each with the eager result for that int."""
    from torch._dynamo.testing import CompileCounter

    from dist_attn import ulysses_attention

    q = torch.randn(16, H, D)
    length = torch.zeros((), dtype=torch.int64)
    torch._dynamo.reset()
    by_tensor = CompileCounter()
    fn = torch.compile(lambda t: ulysses_attention(t, t, t, backend="sdpa", valid_len=length),
                       fullgraph=True, dynamic=False, backend=by_tensor)
    for n in (16, 9, 3):
        length.fill_(n)
        got = fn(q)
        want = ulysses_attention(q, q, q, backend="sdpa", valid_len=n)
        assert torch.equal(got, want) and not got[n:].any(), n
    assert by_tensor.frame_count == 1
    torch._dynamo.reset()
    by_int = CompileCounter()
    box = {"n": 16}
    fn = torch.compile(lambda t: ulysses_attention(t, t, t, backend="sdpa", valid_len=box["n"]),
                       fullgraph=True, dynamic=False, backend=by_int)  # as compile_blocks
    for n in (16, 9, 3):
        box["n"] = n
        fn(q)
    assert by_int.frame_count == 3
    torch._dynamo.reset()
