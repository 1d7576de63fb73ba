# SPDX-License-Identifier: Apache-2.0
"""enable_ulysses on diffusers' WanTransformer3DModel and LTXVideoTransformer3DModel: parity with
diffusers' own single-process output on 2 and 4 gloo ranks, and the ways it refuses bad input on
every rank alike."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install -e '.[diffusers]')")

from tests._multirank import run_ranks  # noqa: E402
from tests.integrations._tiny_models import (build, ltx_inputs, tiny_ltx, tiny_wan,  # noqa: E402
                                             wan_inputs)

# float32, max |difference| against diffusers' unmodified model on the full inputs, run in the
# same process: the ranks compute every row with the same kernels on fewer rows (GEMMs over
# S_local instead of S rows, SDPA over [S, h, D] instead of [B, H, S, D]), which may change
# summation order and so the last bit or two of O(1) values (~1e-7), carried through 2 blocks.
# Measured here: 0.0 (bit-identical) in every case. The bound sits far below the two mistakes
# it must catch, measured on wan_odd_S45_cfg_b2 with the adapter broken on purpose: padding keys
# attended 1.6e-2, every rank using rank 0's RoPE rows 1.3e-2.
ATOL = 1e-5

# name: (model, heads, batch, frames, height, width, variant); Wan's S = frames*(height/2)*(width/2)
# (patch 1x2x2), LTX's S = frames*height*width; variant: "t2v" (one timestep per sample),
# "per_token" ([B, S] timestep: Wan 2.2 TI2V, LTX's conditioning pipelines), "i2v" (Wan 2.1 I2V's
# image tokens in cross-attention). LTX cases mask the last sample's last two caption tokens.
CASES_2 = {
    "wan_even_S16_b1": ("wan", 4, 1, 2, 4, 8, "t2v"),
    "wan_odd_S45_cfg_b2": ("wan", 4, 2, 3, 6, 10, "t2v"),
    "wan_odd_S9_per_token_timestep": ("wan", 4, 1, 1, 6, 6, "per_token"),
    "wan_i2v_odd_S15_b2": ("wan", 4, 2, 1, 6, 10, "i2v"),
    "ltx_odd_S45_cfg_b2": ("ltx", 4, 2, 3, 3, 5, "t2v"),
}
CASES_4 = {
    "wan_heads6_odd_S45_cfg_b2": ("wan", 6, 2, 3, 6, 10, "t2v"),
    "wan_heads6_even_S16_b1": ("wan", 6, 1, 2, 4, 8, "t2v"),
    "wan_heads2_b2_odd_S15": ("wan", 2, 2, 1, 6, 10, "t2v"),  # B*H = 4 = W: heads alone are too few
    "ltx_heads6_odd_S15_per_token_b2": ("ltx", 6, 2, 1, 3, 5, "per_token"),
}


def _parity(cases):
    """Per case: (max |dist - reference|, inputs unmodified, output shape)."""
    from dist_attn.integrations.diffusers import enable_ulysses

    results = {}
    for name, case in cases.items():
        model, inputs = build(*case)
        with torch.no_grad():
            ref = model(**inputs, return_dict=False)[0]
        before = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        handle = enable_ulysses(model, backend="sdpa")
        with torch.no_grad():
            out = model(**inputs, return_dict=False)[0]
        handle.remove()
        unmodified = all(torch.equal(before[k], v) if torch.is_tensor(v) else before[k] == v
                         for k, v in inputs.items())
        results[name] = (float((out - ref).abs().max()), unmodified, tuple(out.shape) == tuple(ref.shape))
    return results


def _worker_2(rank, world):
    from dist_attn.integrations.diffusers import enable_ulysses

    from torch.distributed.tensor.debug import CommDebugMode

    results = {"parity": _parity(CASES_2)}
    model = tiny_wan(4)
    inputs = wan_inputs(2, 3, 6, 10)
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    originals = [b.attn1.processor for b in model.blocks]
    with enable_ulysses(model, backend="sdpa"):
        comm = CommDebugMode()
        with torch.no_grad(), comm:
            model(**inputs)
        results["collectives"] = {str(op): n for op, n in comm.get_comm_counts().items()}
        # A rank with another seed: same shapes, other contents.
        other = wan_inputs(2, 3, 6, 10, seed=1 + rank)
        try:
            with torch.no_grad():
                model(**other)
            results["other_seed"] = None
        except ValueError as exc:
            results["other_seed"] = str(exc)
        # A rank with another resolution: an all-to-all would otherwise crash on sizes.
        other = wan_inputs(2, 3, 6, 10 + 2 * rank)
        try:
            with torch.no_grad():
                model(**other)
            results["other_shape"] = None
        except ValueError as exc:
            results["other_shape"] = str(exc)
        # Bad on rank 1 only (4-D latents): refused on both ranks, rank 0 does not hang.
        bad = dict(inputs, hidden_states=inputs["hidden_states"][:, :, 0]) if rank == 1 else inputs
        try:
            with torch.no_grad():
                model(**bad)
            results["bad_on_one_rank"] = None
        except ValueError as exc:
            results["bad_on_one_rank"] = str(exc)
        from diffusers import FirstBlockCacheConfig

        model.enable_cache(FirstBlockCacheConfig(threshold=0.2))
        try:
            with torch.no_grad():
                model(**inputs)
            results["first_block_cache"] = None
        except ValueError as exc:
            results["first_block_cache"] = str(exc)
        model.disable_cache()
        try:
            model(**inputs)  # grad mode with trainable parameters
            results["grad_mode"] = None
        except RuntimeError as exc:
            results["grad_mode"] = str(exc)
        try:  # grad mode on rank 1 only: it raised there alone and left rank 0 in the check
            with torch.set_grad_enabled(rank == 1):
                model(**inputs)
            results["grad_one_rank"] = None
        except RuntimeError as exc:
            results["grad_one_rank"] = str(exc)
        with torch.no_grad():  # the failures above leave nothing behind
            after_errors = model(**inputs, return_dict=False)[0]
    results["after_errors"] = float((after_errors - ref).abs().max())
    with torch.no_grad():
        restored = model(**inputs, return_dict=False)[0]
    results["restored_bitwise"] = torch.equal(restored, ref)
    results["processors_restored"] = all(b.attn1.processor is p for b, p in zip(model.blocks, originals))
    results["hooks_left"] = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    # LTX places its tokens by num_frames/height/width and the RoPE scale, Python values the
    # check did not compare: height and width swapped on rank 1 (same S) mixed silently.
    ltx = tiny_ltx(2)
    x = ltx_inputs(1, 1, 3, 5)
    for key, theirs in (("height", dict(height=5, width=3)),
                        ("rope_interpolation_scale", dict(rope_interpolation_scale=(1 / 24, 32, 32))),
                        # diffusers types it tuple[Tensor, float, float]: a tensor inside counts
                        ("rope_tensor", dict(rope_interpolation_scale=(torch.tensor(1 / 24), 32, 32))),
                        ("height_str", dict(height="3"))):
        with enable_ulysses(ltx, backend="sdpa"), torch.no_grad():
            try:
                ltx(**(dict(x, **theirs) if rank == 1 else x))
                results[f"ltx_{key}"] = None
            except ValueError as exc:
                results[f"ltx_{key}"] = str(exc)
    return results


def _worker_4(rank, world):
    from dist_attn.integrations.diffusers import enable_ulysses

    import torch.distributed as dist

    results = {"parity": _parity(CASES_4)}
    # Two Ulysses groups of 2 ranks, each with its own inputs (a CFG-parallel layout): the input
    # comparison and the attention stay inside each group.
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    model, inputs = build("wan", 6, 1, 3, 6, 10, "t2v")
    inputs = wan_inputs(1, 3, 6, 10, seed=10 + rank // 2)
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    with enable_ulysses(model, mine, backend="sdpa"), torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    results["subgroup"] = float((out - ref).abs().max())
    model = tiny_wan(2)
    enable_ulysses(model)
    try:  # B*H = 2 folded heads for 4 ranks: refused before any collective
        with torch.no_grad():
            model(**wan_inputs(1, 1, 4, 4))
        results["too_few_heads"] = None
    except ValueError as exc:
        results["too_few_heads"] = str(exc)
    return results


def _check_parity(results, cases):
    for rank, res in enumerate(results):
        for name in cases:
            err, unmodified, shape_ok = res["parity"][name]
            assert shape_ok, f"rank {rank} {name}: output shape differs from the reference"
            assert unmodified, f"rank {rank} {name}: the caller's inputs were modified"
            assert err <= ATOL, f"rank {rank} {name}: max |diff| {err:.3g} > {ATOL}"


def test_two_ranks_parity_and_errors(tmp_path):
    results = run_ranks(_worker_2, 2, tmp_path, timeout=180)
    _check_parity(results, CASES_2)
    for rank, res in enumerate(results):
        # Per forward of 2 blocks with a CFG batch of 2: two all-gathers (the input check, the
        # output) and one all-to-all pair per self-attention for the whole batch; nothing else.
        kinds = {"alltoall": 0, "allgather": 0}
        for op, n in res["collectives"].items():
            kind = next((k for k in kinds if k in op), op)
            kinds[kind] = kinds.get(kind, 0) + n
        assert kinds == {"alltoall": 4, "allgather": 2}, res["collectives"]
        assert res["other_seed"] and "different contents on rank 1" in res["other_seed"], res["other_seed"]
        assert res["other_shape"] and "hidden_states differs across the W=2 ranks" in res["other_shape"]
        assert "(2, 4, 3, 6, 12) on rank 1" in res["other_shape"], res["other_shape"]
        assert res["bad_on_one_rank"] and "shape (2, 4, 6, 10) on rank 1, shape (2, 4, 3, 6, 10) " \
            "on rank 0" in res["bad_on_one_rank"], res["bad_on_one_rank"]
        assert res["first_block_cache"] and "FirstBlockCacheConfig cache" in res["first_block_cache"]
        assert res["grad_mode"] and "torch.no_grad()" in res["grad_mode"], res["grad_mode"]
        assert res["grad_one_rank"] and "grad mode is on for rank(s) [1]" in res["grad_one_rank"], \
            res["grad_one_rank"]
        for key in ("height", "rope_interpolation_scale"):
            got = res[f"ltx_{key}"]
            assert got and f"{key} has different contents on rank 1 and rank 0" in got, (key, got)
        got = res["ltx_rope_tensor"]
        assert got and "rope_interpolation_scale has different contents on rank 1" in got, got
        got = res["ltx_height_str"]
        assert got and "height on rank(s) [1] is neither a tensor nor Python numbers" in got, got
        assert res["after_errors"] <= ATOL, res["after_errors"]
        assert res["restored_bitwise"], f"rank {rank}: output after remove() is not diffusers' own"
        assert res["processors_restored"], f"rank {rank}: remove() left dist_attn's processors"
        assert res["hooks_left"] == 0, f"rank {rank}: remove() left {res['hooks_left']} hooks"


def test_four_ranks_uneven_heads_odd_length_batch_and_subgroups(tmp_path):
    results = run_ranks(_worker_4, 4, tmp_path, timeout=240)
    _check_parity(results, CASES_4)
    for res in results:
        assert res["subgroup"] <= ATOL, res["subgroup"]
        assert res["too_few_heads"] and "batch=1 samples x num_heads=2 = 2 folded heads, fewer " \
            "than the W=4 ranks" in res["too_few_heads"], res["too_few_heads"]
        # the rule and its fix: fewer ranks, or a mesh whose Ulysses size the heads cover
        assert "at most 2 ranks (fewer ranks, or Ulysses x Ring" in res["too_few_heads"], res["too_few_heads"]
