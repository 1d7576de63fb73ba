# SPDX-License-Identifier: Apache-2.0
"""enable_ulysses on diffusers' MiniMaxH3Transformer3DModel: parity with diffusers' own
single-process forward and with diffusers' own context parallelism on 2, 3 and 4 gloo ranks, the
collectives per block (ours and diffusers'), refusals on every rank alike, and torch.compile of
the real blocks with attention as dist_attn's custom op."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install -e '.[diffusers]')")

from tests._multirank import run_ranks  # noqa: E402
from tests.integrations._tiny_models import h3_inputs, tiny_h3  # noqa: E402

# float32, max |difference| of `sample` and `audio_sample` against diffusers' unmodified model on
# the full inputs in the same process. The ranks run the same kernels on fewer rows (GEMMs over
# S_local rows, SDPA over [S, h, D] per folded head), which may change float32 summation order:
# ~1e-7 on O(1) outputs. Measured: 0.0 (bit-identical) in every case below; diffusers' own context
# parallelism against the same reference: 6.0e-8 (W=2), 1.8e-7 (W=3), 1.2e-7 (W=4). The bound sits
# far below the mistakes it must catch, measured at W=2 on heads4_S29_cfg_b2 with the adapter
# broken on purpose: padding keys attended 9.3e-4, RoPE rows [0, S_local) on every rank 3.3e-4,
# adaln_indices rows [0, S_local) on every rank 3.3e-2.
ATOL = 1e-5

LAYERS = 2
# name: (heads, batch, text rows); S = text + 6 keyframe + 6 audio + 12 video rows (h3_inputs),
# rows at three timesteps. S = 29 is divisible by none of 2, 3, 4.
CASES = {
    2: {"heads4_S29_cfg_b2": (4, 2, 5), "heads3_uneven_S29_b1": (3, 1, 5), "heads4_even_S30_b1": (4, 1, 6)},
    3: {"heads4_uneven_S29_cfg_b2": (4, 2, 5), "heads56_as_H3_S29_b1": (56, 1, 5)},
    4: {"heads7_as_H3_on_8_S29_b1": (7, 1, 5), "heads4_S29_cfg_b2": (4, 2, 5),
        "heads2_b2_S29": (2, 2, 5)},  # B*H = 4 = W: heads alone are too few
}
# Against diffusers' own enable_parallelism(ContextParallelConfig(ulysses_degree=W,
# ulysses_anything=True)): (heads, batch, text). Lengths divisible by W: with S % W != 0 its
# output gather (`_all_gather_anything`) calls dist.all_gather with tensors of unequal sizes, which
# gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"; NCCL accepts them). Heads its
# padding accepts: it pads H up to a multiple of W on the last rank only if the padding is smaller
# than the local head count (4 heads on 3 ranks fail its assertion; 56 heads on 3 pass).
DIFFUSERS_CP = {2: (4, 2, 6), 3: (56, 1, 6), 4: (7, 2, 8)}


def _outputs(model, inputs):
    with torch.no_grad():
        return model(**inputs, return_dict=False)


def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _comm_counts(fn) -> dict[str, int]:
    from torch.distributed.tensor.debug import CommDebugMode

    comm = CommDebugMode()
    with torch.no_grad(), comm:
        fn()
    return {str(op): n for op, n in comm.get_comm_counts().items()}


def _parity(cases: dict) -> dict:
    """Per case: (max |ours - diffusers|, inputs unmodified, shapes equal)."""
    from dist_attn.integrations.diffusers import enable_ulysses

    results = {}
    for name, (heads, batch, text) in cases.items():
        model, inputs = tiny_h3(heads, layers=LAYERS), h3_inputs(batch, text=text)
        ref = _outputs(model, inputs)
        before = {k: v.clone() for k, v in inputs.items()}
        with enable_ulysses(model, backend="sdpa"):
            out = _outputs(model, inputs)
        unmodified = all(torch.equal(before[k], v) for k, v in inputs.items())
        shapes = [tuple(t.shape) for t in out] == [tuple(t.shape) for t in ref]
        results[name] = (_max_diff(out, ref), unmodified, shapes)
    return results


def _against_diffusers_cp(world: int) -> dict:
    """Ours and diffusers' context parallelism on the same model and inputs: both against the
    single-process forward and against each other, and both collective counts per forward."""
    from diffusers import ContextParallelConfig

    from dist_attn.integrations.diffusers import enable_ulysses

    heads, batch, text = DIFFUSERS_CP[world]
    model, inputs = tiny_h3(heads, layers=LAYERS), h3_inputs(batch, text=text)
    ref = _outputs(model, inputs)
    with enable_ulysses(model, backend="sdpa"):
        ours = _outputs(model, inputs)
        ours_comm = _comm_counts(lambda: model(**inputs))
    # diffusers picks this rank's device as rank % torch.accelerator.device_count(), which is 0
    # without an accelerator (ZeroDivisionError); every rank computes on the CPU anyway.
    torch.accelerator.device_count = lambda: 1
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world, ulysses_anything=True))
    theirs = _outputs(model, inputs)
    theirs_comm = _comm_counts(lambda: model(**inputs))
    return {"ours": _max_diff(ours, ref), "theirs": _max_diff(theirs, ref),
            "ours_vs_theirs": _max_diff(ours, theirs), "ours_comm": ours_comm,
            "theirs_comm": theirs_comm}


def _kinds(counts: dict[str, int]) -> dict[str, int]:
    """Collective counts by kind (all-to-all / all-gather), whatever the op's c10d spelling."""
    kinds = {"alltoall": 0, "allgather": 0}
    for op, n in counts.items():
        key = "alltoall" if "all_to_all" in op or "alltoall" in op else "allgather" if (
            "allgather" in op or "all_gather" in op) else op
        kinds[key] = kinds.get(key, 0) + n
    return kinds


def _worker(rank, world):
    res = {"parity": _parity(CASES[world]), "cp": _against_diffusers_cp(world)}
    if world == 2:
        res.update(_errors_and_restore(rank))
        res["overlap"] = _overlapped()
    if world == 4:
        res["ring"] = _ring_and_timer()
    return res


def _ring_and_timer() -> dict:
    """Ulysses 2 x Ring 2 over a ("ring", "ulysses") mesh, with a PhaseTimer on the attention."""
    from dist_attn import PhaseTimer, init_usp_mesh
    from dist_attn.integrations.diffusers import enable_ulysses

    model, inputs = tiny_h3(4, layers=LAYERS), h3_inputs(2)
    ref = _outputs(model, inputs)
    timer = PhaseTimer()
    with enable_ulysses(model, mesh=init_usp_mesh(2, 2, device_type="cpu"), backend="sdpa", timer=timer):
        out = _outputs(model, inputs)
    return {"max_diff": _max_diff(out, ref), "phase_counts": timer.counts()}


def _overlapped() -> dict:
    """enable_ulysses(overlap_chunks=2): each attention call pipelines two head chunks (2 heads a
    rank at W = 2, one a chunk); a bad value is refused before the model is touched."""
    from dist_attn import PhaseTimer
    from dist_attn.integrations.diffusers import enable_ulysses

    model, inputs = tiny_h3(4, layers=LAYERS), h3_inputs(2)
    ref = _outputs(model, inputs)
    timer = PhaseTimer()
    with enable_ulysses(model, backend="sdpa", timer=timer, overlap_chunks=2):
        out = _outputs(model, inputs)
    try:
        enable_ulysses(model, backend="sdpa", overlap_chunks=0)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return {"max_diff": _max_diff(out, ref), "phase_counts": timer.counts(), "refused": refused,
            "untouched": not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())}


def _errors_and_restore(rank) -> dict:
    """Inputs that differ on one rank, or are bad on one rank, raise on every rank; a good call
    afterwards still matches; remove() leaves diffusers' model."""
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor

    from dist_attn.integrations.diffusers import enable_ulysses

    model, inputs = tiny_h3(4, layers=LAYERS), h3_inputs(2)
    ref = _outputs(model, inputs)
    out = {}

    def attempt(name, args):
        try:
            _outputs(model, args)
            out[name] = None
        except (ValueError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    with enable_ulysses(model, backend="sdpa"):
        attempt("other_seed", h3_inputs(2, seed=1 + rank))
        order = inputs["video_indices"].clone()
        if rank == 1:
            order[[0, 1]] = order[[1, 0]]  # the same rows, two of them swapped
        attempt("swapped_rows", {**inputs, "video_indices": order})
        bad = {**inputs, "position_ids": inputs["position_ids"][:, :2]} if rank == 1 else inputs
        attempt("bad_on_one_rank", bad)
        attempt("bad_everywhere", {**inputs, "token_tags": inputs["token_tags"][:-1]})
        try:
            model(**inputs)  # grad mode with trainable parameters
            out["grad_mode"] = None
        except RuntimeError as exc:
            out["grad_mode"] = str(exc)
        out["after_errors"] = _max_diff(_outputs(model, inputs), ref)
    out["restored_bitwise"] = all(torch.equal(a, b) for a, b in zip(_outputs(model, inputs), ref))
    out["processors_restored"] = all(type(b.attn.processor) is MiniMaxH3AttnProcessor
                                     for b in model.transformer_blocks)
    out["hooks_left"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return out


def _check(results, world):
    for rank, res in enumerate(results):
        for name in CASES[world]:
            err, unmodified, shapes = res["parity"][name]
            assert shapes, f"rank {rank} {name}: output shapes differ from diffusers'"
            assert unmodified, f"rank {rank} {name}: the caller's inputs were modified"
            assert err <= ATOL, f"rank {rank} {name}: max |diff| {err:.3g} > {ATOL}"
        cp = res["cp"]
        assert cp["ours"] <= ATOL and cp["theirs"] <= ATOL and cp["ours_vs_theirs"] <= ATOL, cp
        # Ours per forward: exactly one all-to-all pair per block self-attention; all-gathers: the
        # input check and the two output heads. The refiner runs locally, with no collective.
        assert _kinds(cp["ours_comm"]) == {"alltoall": 2 * LAYERS, "allgather": 3}, cp["ours_comm"]
        # diffusers 0.42.1 (pinned), recorded for the closing note: q, k, v and o each one
        # all-to-all and one size all-gather, in every attention INCLUDING the 2 refiner blocks
        # (their unsharded text goes through the all-to-all too); each output head gathers its
        # sizes and then its rows.
        attentions = LAYERS + 2
        assert _kinds(cp["theirs_comm"]) == {"alltoall": 4 * attentions,
                                             "allgather": 4 * attentions + 4}, cp["theirs_comm"]


def test_h3_two_ranks_parity_collectives_and_errors(tmp_path):
    results = run_ranks(_worker, 2, tmp_path, timeout=240)
    _check(results, 2)
    for rank, res in enumerate(results):
        assert "hidden_states has different contents on rank 1" in res["other_seed"], res["other_seed"]
        assert "video_indices has different contents on rank 1" in res["swapped_rows"] and \
            "compared exactly" in res["swapped_rows"], res["swapped_rows"]
        assert "position_ids differs across the W=2 ranks of the group: shape (29, 2) on rank 1, " \
            "shape (29, 3) on rank 0" in res["bad_on_one_rank"], res["bad_on_one_rank"]
        assert "token_tags=shape (28,) must be a [S] tensor with S=29" in res["bad_everywhere"], \
            res["bad_everywhere"]
        assert res["grad_mode"] and "torch.no_grad()" in res["grad_mode"], res["grad_mode"]
        assert res["after_errors"] <= ATOL, res["after_errors"]
        assert res["restored_bitwise"], f"rank {rank}: output after remove() is not diffusers' own"
        assert res["processors_restored"] and res["hooks_left"] == 0, res
        ov = res["overlap"]
        assert ov["max_diff"] <= ATOL, ov
        # one kernel per chunk, two chunks per block self-attention
        assert ov["phase_counts"]["kernel"] == 2 * LAYERS, ov
        assert ov["refused"] == "overlap_chunks=0 must be an int >= 1" and ov["untouched"], ov


def test_h3_three_ranks_uneven_heads_and_lengths(tmp_path):
    _check(run_ranks(_worker, 3, tmp_path, timeout=240), 3)


# The ring merges two partial softmaxes per query row by their log-sum-exp in float32 where one
# rank computes one softmax: other rounding. Measured here 6.0e-8 (Ulysses 2 x Ring 2).
ATOL_RING = 1e-5


def test_h3_four_ranks_seven_heads_cfg_batch_and_ring(tmp_path):
    results = run_ranks(_worker, 4, tmp_path, timeout=300)
    _check(results, 4)
    for res in results:
        assert res["ring"]["max_diff"] <= ATOL_RING, res["ring"]
        counts = res["ring"]["phase_counts"]
        # each block's attention: one all-to-all in, one out, and the ring's K/V rotation
        assert counts["a2a_in"] == counts["a2a_out"] == LAYERS and counts.get("ring_wait", 0) > 0, counts


@pytest.mark.parametrize("heads, world, split", [
    (56, 3, (19, 19, 18)), (56, 5, (12, 11, 11, 11, 11)), (56, 6, (10, 10, 9, 9, 9, 9)),
    (7, 4, (2, 2, 2, 1)),  # H3's 56 heads on 8 ranks, one rank's view: 7 heads on 4
])
def test_uneven_head_splits_of_h3(heads, world, split):
    """The one head-split rule every all-to-all follows (the first ``heads % W`` ranks take one
    head more); the 3- and 4-rank runs above execute 56 on 3 and 7 on 4 end to end."""
    from dist_attn.plan import heads_per_rank

    assert tuple(heads_per_rank(heads, world)) == split


# --------------------------------------------------------------------------- torch.compile

# Inductor fuses RMSNorm, RoPE, AdaLN and SwiGLU and may reorder float32 sums: measured 6e-8 on
# this model; 1e-5 is the float32 allowance used above.
ATOL_COMPILE = 1e-5


def _compile_worker(rank, world):
    from torch._dynamo.testing import CompileCounterWithBackend

    from dist_attn.integrations.diffusers import enable_ulysses

    model, inputs = tiny_h3(4, layers=LAYERS), h3_inputs(2)
    ref = _outputs(model, inputs)
    enable_ulysses(model, backend="sdpa")
    eager = _outputs(model, inputs)
    # aot_eager: Dynamo's full-graph capture, the custom op's fake implementation and AOTAutograd
    # are what can break; inductor's C++ code generation costs ~50 s of CI per run here and is
    # exercised on the GPU (benchmarks/h3_model.py's compiled rows)
    counter = CompileCounterWithBackend("aot_eager")
    # diffusers' own regional compilation: every MiniMaxH3TransformerBlock (and refiner block)
    # under torch.compile(fullgraph=True); enable_ulysses' hooks run eagerly between them.
    model.compile_repeated_blocks(fullgraph=True, backend=counter)
    first = _outputs(model, inputs)
    frames = counter.frame_count
    again = _outputs(model, inputs)
    attention_ops = sorted({str(n.target) for g in counter.graphs for n in g.graph.nodes
                            if n.op == "call_function" and "dist_attn" in str(n.target)})
    return {"compiled_vs_eager": _max_diff(first, eager), "eager_vs_diffusers": _max_diff(eager, ref),
            "recompiled": counter.frame_count - frames, "again_bitwise": all(
                torch.equal(a, b) for a, b in zip(first, again)), "attention_ops": attention_ops}


def test_h3_blocks_compiled_fullgraph_match_eager_on_two_ranks(tmp_path):
    for res in run_ranks(_compile_worker, 2, tmp_path, timeout=420):
        assert res["compiled_vs_eager"] <= ATOL_COMPILE, res
        assert res["eager_vs_diffusers"] <= ATOL, res
        assert res["attention_ops"] == ["dist_attn.ulysses_attention"], res["attention_ops"]
        assert res["recompiled"] == 0 and res["again_bitwise"], res  # the second call reuses the graphs


def _bucket_worker(rank, world):
    """Prompts of 3, 5 and 9 text rows (S = 27, 29, 33) with sequence_bucket=16: padded to 32, 32
    and 48 rows; the transformer blocks compiled as the server compiles them."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from dist_attn.integrations.diffusers import enable_ulysses

    torch._dynamo.reset()
    model = tiny_h3(4, layers=LAYERS)
    cases = {text: h3_inputs(1, text=text) for text in (3, 5, 9)}
    refs = {text: _outputs(model, inputs) for text, inputs in cases.items()}
    handle = enable_ulysses(model, backend="sdpa", sequence_bucket=16)
    seen = []
    probe = model.transformer_blocks[0].register_forward_pre_hook(
        lambda module, args: seen.append(args[0].shape[1]))
    eager = {text: _outputs(model, inputs) for text, inputs in cases.items()}
    with handle.sequence(27) as shard:
        planned = (shard.total_len, shard.local_len)
    counter = CompileCounterWithBackend("aot_eager")
    for block in model.transformer_blocks:  # as dist_attn.models.h3.serve.compile_blocks does
        block.compile(fullgraph=True, dynamic=False, backend=counter)
    frames = []
    compiled = {}
    for text, inputs in cases.items():
        compiled[text] = _outputs(model, inputs)
        frames.append(counter.frame_count)
    probe.remove()
    torch._dynamo.reset()
    # enabled under inference mode (the runtime's length tensor must not be an inference tensor),
    # then called outside it; and a bucket that differs on one rank, refused on every rank
    other = tiny_h3(4, layers=LAYERS)
    with torch.inference_mode():
        enable_ulysses(other, backend="sdpa", sequence_bucket=16)
    after_inference_mode = _max_diff(_outputs(other, cases[5]), refs[5])
    refused = {}
    for name, kwargs in (("bucket", {"sequence_bucket": 16 if rank == 0 else 8}),
                         ("chunks", {"overlap_chunks": 2 if rank == 0 else 1})):
        odd = tiny_h3(4, layers=LAYERS)
        enable_ulysses(odd, backend="sdpa", **kwargs)
        try:
            _outputs(odd, cases[5])
            refused[name] = None
        except ValueError as exc:
            refused[name] = str(exc)
    return {"eager_vs_diffusers": max(_max_diff(eager[t], refs[t]) for t in cases),
            "compiled_vs_eager": max(_max_diff(compiled[t], eager[t]) for t in cases),
            "rows_seen": seen, "planned": planned, "frames": frames,
            "after_inference_mode": after_inference_mode, "refused": refused}


def test_a_sequence_bucket_pads_and_prompt_lengths_in_it_compile_once(tmp_path):
    """enable_ulysses(sequence_bucket=16) on 2 ranks: each rank's rows are a multiple of 8, the
    output is diffusers' own (also when enabled under inference mode; a bucket or a chunk count
    that differs on one rank is refused on both, before the first all-to-all), and compiled blocks (dynamic=False, as served) compile for the
    first length of a bucket only: 27 and 29 rows share the 32-row graphs (the true length reaches
    the attention as a tensor, not a guarded int), 33 rows compile 48-row ones."""
    for res in run_ranks(_bucket_worker, 2, tmp_path, timeout=300):
        assert res["eager_vs_diffusers"] <= ATOL and res["compiled_vs_eager"] <= ATOL_COMPILE, res
        assert res["planned"] == (32, 16), res
        assert res["rows_seen"][:3] == [16, 16, 24], res  # block 0's rows on this rank, eager
        first, same_bucket, next_bucket = res["frames"]
        assert first > 0 and same_bucket == first and next_bucket > first, res
        assert res["after_inference_mode"] <= ATOL, res
        assert res["refused"] == {
            "bucket": "enable_ulysses(sequence_bucket=...) differs across the W=2 ranks of the "
                      "group: [16, 8] by rank; pass the same on every rank",
            "chunks": "enable_ulysses(overlap_chunks=...) differs across the W=2 ranks of the "
                      "group: [2, 1] by rank; pass the same on every rank"}, res


def test_an_8bit_backend_runs_q_k_norm_and_rope_as_one_kernel(monkeypatch):
    """enable_ulysses with a backend that is not exact gives H3's processor the fused q/k norm +
    RoPE (dist_attn.kernels.qk_norm_rope; on this CPU its torch reference, in float32 like the
    tiny model: diffusers' result to float32 summation order); an exact backend keeps diffusers'
    own ops, and so does "auto", whose kernel is not known until it runs."""
    pytest.importorskip("triton", reason="the fused kernel's module imports triton")
    import dist_attn.kernels.qk_norm_rope as qknr
    from dist_attn.backends import SdpaBackend, register_backend, unregister_backend
    from dist_attn.integrations.diffusers import enable_ulysses

    class Lossy(SdpaBackend):
        name, exact = "sdpa_as_8bit", False

    calls = []
    real = qknr.qk_norm_rope
    monkeypatch.setattr(qknr, "qk_norm_rope", lambda *a: calls.append(a[0].shape) or real(*a))
    register_backend(Lossy())
    try:
        for backend, fused in (("sdpa_as_8bit", True), ("sdpa", False), ("auto", False)):
            model, inputs = tiny_h3(4, layers=LAYERS), h3_inputs(2)
            ref = _outputs(model, inputs)
            calls.clear()
            with enable_ulysses(model, backend=backend) as handle:
                assert handle.runtime.fused_qk_norm_rope is fused, backend
                out = _outputs(model, inputs)
            assert len(calls) == (LAYERS if fused else 0), (backend, calls)
            assert _max_diff(out, ref) <= ATOL, (backend, _max_diff(out, ref))
            if not fused:
                assert all(torch.equal(a, b) for a, b in zip(out, ref)), backend
    finally:
        unregister_backend("sdpa_as_8bit")
