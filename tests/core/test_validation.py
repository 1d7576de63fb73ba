"""Every bad input raises a clear error on every rank, before any collective, within a time limit."""

from __future__ import annotations

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
        case("softmax_scale", "ValueError", ["softmax_scale=-1.0", "positive"], module=dict(softmax_scale=-1.0)),
        case("requires_grad", "RuntimeError", ["forward-only", "torch.no_grad()"],
             q=good().requires_grad_()),
        case("too_few_heads", "ValueError", ["num_heads=1", f"world size {world}"] if world > 1 else ["q.shape[1]=1"],
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


@pytest.mark.parametrize("scale", [float("nan"), 0, -1, float("inf"), True, "0.1"],
                         ids=["nan", "zero", "negative", "inf", "bool", "str"])
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
    assert str(varlen.value) == f"softmax_scale={scale!r} must be a positive finite number or None"
