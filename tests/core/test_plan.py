# SPDX-License-Identifier: Apache-2.0
"""The Ulysses plan's chunk widths: even without wave information, wave-aligned with it."""

from __future__ import annotations

import itertools

import pytest

from dist_attn.plan import MAX_SEARCH_STEPS, KernelWaves, chunk_widths, heads_per_rank, make_plan

# H3 at Ulysses 4 on an H100 / H200: 14 heads a rank, 594 query tiles of 64 rows a head
# (37,980 rows), 3 sage8 programs on each of 132 SMs
H3 = KernelWaves(tiles_per_head=594, slots=396)


def _compositions(total: int, parts: int):
    """Every way to write ``total`` as ``parts`` positive ints, in order."""
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def test_without_waves_the_split_is_the_even_one():
    for heads, chunks in [(14, 4), (7, 3), (5, 5), (9, 2)]:
        assert chunk_widths(heads, chunks) == heads_per_rank(heads, chunks)


def test_h3_at_ulysses_4_takes_one_wave_fewer():
    assert chunk_widths(14, 4, H3) == (2, 4, 4, 4)
    assert sum(map(H3.waves, chunk_widths(14, 4, H3))) == 21
    assert sum(map(H3.waves, chunk_widths(14, 4))) == 22  # (4, 4, 3, 3): 6 + 6 + 5 + 5 waves
    assert chunk_widths(14, 2, H3) == (6, 8)
    assert chunk_widths(14, 7, H3) == (2,) * 7
    # 8 chunks of 14 heads: two must be odd; the rest whole waves
    assert chunk_widths(14, 8, H3) == (1, 1, 2, 2, 2, 2, 2, 2)
    # 593 tiles a head share no factor with 396 slots, and a split still saves a wave
    odd = KernelWaves(tiles_per_head=593, slots=396)
    assert sum(map(odd.waves, chunk_widths(14, 4, odd))) == 21 < sum(map(odd.waves, (4, 4, 3, 3)))
    # every split takes whole waves: the most even one, narrowest first
    assert chunk_widths(14, 4, KernelWaves(tiles_per_head=396, slots=132)) == (3, 3, 4, 4)


@pytest.mark.parametrize("tiles,slots", [(594, 396), (593, 396), (3, 2), (5, 3), (7, 4), (10, 4), (1, 6),
                                         (594, 342)])
def test_wave_aware_widths_take_the_fewest_waves_then_the_most_even(tiles, slots):
    waves = KernelWaves(tiles_per_head=tiles, slots=slots)
    for heads in range(1, 15):
        for chunks in range(1, heads + 1):
            widths = chunk_widths(heads, chunks, waves)
            assert len(widths) == chunks and sum(widths) == heads and min(widths) >= 1
            assert list(widths) == sorted(widths), widths
            best = min((sum(map(waves.waves, c)), sum(w * w for w in c))
                       for c in _compositions(heads, chunks))
            assert (sum(map(waves.waves, widths)), sum(w * w for w in widths)) == best, (heads, chunks, widths)


def test_a_search_too_large_keeps_the_even_split():
    heads = 1 + int((MAX_SEARCH_STEPS / 8) ** 0.5)
    assert chunk_widths(heads, 8, H3) == heads_per_rank(heads, 8)


def test_plan_uses_the_widths_on_every_rank():
    # 15 heads on 4 ranks: (4, 4, 4, 3); 3 tiles a head on 2 slots: even widths are whole waves,
    # so (2, 2) on the ranks of 4 heads and (1, 2) on the last
    for rank in range(4):
        plan = make_plan(world=4, rank=rank, s_local=8, folded_heads=15, head_dim=4, overlap_chunks=2,
                         waves=KernelWaves(tiles_per_head=3, slots=2))
        widths = [[b - a for a, b in c.head_ranges] for c in plan.chunks]
        assert widths == [[2, 2, 2, 1], [2, 2, 2, 2]]
        assert [c.local_heads(rank) for c in plan.chunks] == [widths[0][rank], widths[1][rank]]
        # the chunks tile each rank's heads in order
        for j in range(4):
            assert plan.chunks[0].head_ranges[j][1] == plan.chunks[1].head_ranges[j][0]


@pytest.mark.parametrize("field,value", [("tiles_per_head", 0), ("slots", -1), ("slots", True),
                                         ("tiles_per_head", 2.0)])
def test_kernel_waves_refuses_what_is_not_a_positive_int(field, value):
    kw = {"tiles_per_head": 4, "slots": 4, field: value}
    with pytest.raises(ValueError, match=f"KernelWaves.{field}="):
        KernelWaves(**kw)


def test_sage8_resident_programs_at_the_shipped_config():
    attn_triton = pytest.importorskip("dist_attn.kernels.sage8.attn_triton")
    cfg = attn_triton.TritonConfig()
    # sm_90: 64K registers, 228 KB of shared memory, 2,048 threads an SM
    sm90 = dict(regs_per_sm=65536, smem_per_sm=233472, threads_per_sm=2048)
    assert attn_triton.resident_ctas(cfg, 128, **sm90) == 3
    # 3 stages no longer fit three programs' shared memory
    assert attn_triton.resident_ctas(attn_triton.TritonConfig(num_stages=3), 128, **sm90) == 2
    assert attn_triton.resident_ctas(attn_triton.TritonConfig(maxnreg=None), 128, **sm90) is None


@pytest.mark.parametrize("folded, world, chunks, waves, runs", [
    (56, 4, 4, H3, ((0, 1), (1, 4))),  # widths 2, 4, 4, 4: the narrow chunk alone, then one call
    (56, 4, 4, None, ((0, 1), (1, 2), (2, 4))),  # 4, 4, 3, 3
    (56, 4, 1, None, ((0, 1),)),
    (7, 3, 2, None, ((0, 1), (1, 2))),  # counts (3, 2, 2): widths (2, 1, 1) then (1, 1, 1)
    (8, 4, 2, None, ((0, 1), (1, 2))),  # two one-head chunks: the first still goes alone
    (18, 3, 3, None, ((0, 1), (1, 3))),
])
def test_pack_runs_send_the_first_chunk_alone_then_join_equal_widths(folded, world, chunks, waves, runs):
    for rank in range(world):
        plan = make_plan(world=world, rank=rank, s_local=5, folded_heads=folded, head_dim=8,
                         overlap_chunks=chunks, waves=waves)
        assert plan.pack_runs == runs
        for a, b in runs:  # a run: chunks as wide as one another on every rank
            assert len({tuple(y - x for x, y in c.head_ranges) for c in plan.chunks[a:b]}) == 1


@pytest.mark.parametrize("seq_len, world, bucket, padded", [
    (29, 3, 16, 36),          # W does not divide the bucket: multiples of 3 * ceil(16 / 3) = 18
    (27, 2, 16, 32), (33, 2, 16, 48),
    (37980, 4, 512, 38400),   # H3 at h3-ref under the server's compiled bucket
    (37980, 4, 1, 37980),     # no bucket: a multiple of W only
    (7, 8, 1, 8),
])
def test_a_bucket_pads_to_a_multiple_of_w_times_its_rows_per_rank(seq_len, world, bucket, padded):
    """The one padding formula the runtime (plan_shard's multiple_of) and the server's counts
    (serve.config.tokens.padded_rows) share."""
    from dist_attn.models.h3.serve.config.tokens import padded_rows
    from dist_attn.sharding import bucket_multiple, padded_length

    assert padded_length(seq_len, world, bucket_multiple(bucket, world)) == padded
    assert padded_rows(seq_len, world, bucket) == padded
    assert padded % world == 0 and padded >= max(seq_len, bucket if seq_len <= bucket else 0)


@pytest.mark.parametrize("call, needle", [
    (lambda f: f["padded_length"](5, 0), "world=0 must be a positive int"),
    (lambda f: f["padded_length"](0, 2), "seq_len=0 must be a positive int"),
    (lambda f: f["bucket_multiple"](-3, 2), "bucket=-3 must be a positive int"),
    (lambda f: f["bucket_multiple"](16, True), "world=True must be a positive int"),
])
def test_padding_helpers_name_a_bad_argument(call, needle):
    from dist_attn.sharding import bucket_multiple, padded_length

    with pytest.raises(ValueError, match=needle):
        call({"padded_length": padded_length, "bucket_multiple": bucket_multiple})
