# SPDX-License-Identifier: Apache-2.0
"""enable_parallel_decode: diffusers' H3 video VAE decoded over 1-4 gloo ranks against diffusers'
own single-process decode (float32, tiny VAE), the collectives counted, the refusals."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (pip install -e '.[diffusers]')")

import torch.distributed as dist  # noqa: E402

from dist_attn.integrations.diffusers import enable_parallel_decode, supported_vaes  # noqa: E402
from tests._multirank import run_ranks  # noqa: E402

# float32 on CPU: the batched decoder calls run other GEMM shapes than diffusers' one tile a
# call, so sums round differently (seen: 7e-7); one tile a call on one rank is bit-identical.
ATOL = 1e-5

# (latent frames, latent height, latent width): several clips (H3's 5 + 2 latent frames a clip),
# trailing latent frames that need padding (12, 17), a single clip (7), odd tile counts (5 x 10
# latents = 2 x 3 tiles of 4 latents, overlaps widened by diffusers), tiles that do not divide evenly.
CASES = [(12, 5, 10), (17, 4, 6), (7, 3, 3), (9, 2, 5)]


def tiny_vae():
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(0)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=8, block_out_channels=[8] * 6, layers_per_block=1, norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=8,
        decoder_num_register_tokens=1, latents_mean=(0.0,) * 8, latents_std=(1.0,) * 8).eval()
    # the class starts its block scales and register tokens at zero: the blocks would add
    # nothing and a wrong tile order could still pass; draw them
    for p in vae.parameters():
        if not p.abs().sum():
            p.data.normal_(0, 0.3)
    # 64-pixel tiles with 16 of overlap: 4 x 4 latents with 1 of overlap
    vae.enable_tiling(64, 64, 16, 16)
    return vae


def _latents(case, batch=1):
    return torch.randn(batch, 8, *case, generator=torch.Generator().manual_seed(sum(case)))


_COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce",
                "all_to_all", "all_to_all_single", "barrier", "broadcast", "gather",
                "reduce_scatter", "reduce_scatter_tensor", "scatter")


class _CountCollectives:
    """Counts every torch.distributed collective called inside (CommDebugMode's module hooks do
    not survive the decoder's stand-ins)."""

    def __enter__(self):
        self.count, self.saved = 0, {}
        for name in _COLLECTIVES:
            fn = self.saved[name] = getattr(dist, name)

            def wrapped(*a, _fn=fn, **k):
                self.count += 1
                return _fn(*a, **k)
            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


def _decode_on_ranks(rank, world, cases, tiles_per_call):
    vae = tiny_vae()
    results = []
    for case in cases:
        z = _latents(case)
        with torch.no_grad():
            ref = vae.decode(z).sample
            before = z.clone()
            handle = enable_parallel_decode(vae, tiles_per_call=tiles_per_call)
            streamed = []
            with _CountCollectives() as comm, handle.stream(lambda start, f: streamed.append((start, f.clone()))):
                out = vae.decode(z).sample
            handle.remove()
        starts = [s for s, _ in streamed]
        results.append({
            "case": case, "err": float((out - ref).abs().max()), "shape": tuple(out.shape),
            "ref_shape": tuple(ref.shape), "unmodified": torch.equal(z, before),
            "stream_in_order": starts == sorted(starts) and starts[0] == 0,
            "stream_equal": torch.equal(torch.cat([f for _, f in streamed], 2), out),
            "collectives": comm.count, "stats": handle.last,
            "checksum": float(out.double().sum()), "restored": "_decode" not in vae.__dict__})
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parallel_decode_matches_diffusers_on_every_rank(world, tmp_path):
    tiles_per_call = 2
    per_rank = run_ranks(_decode_on_ranks, world, tmp_path, CASES, tiles_per_call, timeout=240)
    for i, case in enumerate(CASES):
        rows = [per_rank[r][i] for r in range(world)]
        for r, row in enumerate(rows):
            assert row["shape"] == row["ref_shape"], (case, r, row)
            assert row["err"] <= ATOL, (case, r, row["err"])
            assert row["unmodified"] and row["restored"], (case, r)
            assert row["stream_in_order"] and row["stream_equal"], (case, r)
            stats = row["stats"]
            waves = -(-stats.calls // (world * tiles_per_call))
            assert stats.waves == waves
            # one all-gather of the latents' fingerprint, one per wave, one last flag exchange
            # (none on one rank)
            assert row["collectives"] == (2 + waves if world > 1 else 0), (case, r, row)
        # every rank stitched the same tiles: the same video, bit for bit
        assert len({row["checksum"] for row in rows}) == 1, (case, rows)
        # the calls are dealt over the whole video: shares differ by at most one, and the
        # remainder goes to the highest ranks (rank 0 also does the audio and the MP4)
        shares = [row["stats"].my_calls for row in rows]
        assert sum(shares) == rows[0]["stats"].calls
        assert max(shares) - min(shares) <= 1 and shares == sorted(shares), shares


def test_one_tile_a_call_is_bit_identical_to_diffusers():
    vae = tiny_vae()
    z = _latents((12, 5, 10), batch=2)
    with torch.no_grad():
        ref = vae.decode(z).sample
        with enable_parallel_decode(vae, tiles_per_call=1) as handle:
            out = vae.decode(z).sample
    assert torch.equal(out, ref)
    assert handle.last.calls == 2 * 6 and handle.last.clips == 2 and handle.last.tiles_per_clip == 6


def test_without_tiling_one_call_per_clip():
    vae = tiny_vae()
    vae.disable_tiling()
    z = _latents((12, 3, 4))
    with torch.no_grad():
        ref = vae.decode(z).sample
        with enable_parallel_decode(vae, tiles_per_call=4) as handle:
            out = vae.decode(z).sample
    assert (out - ref).abs().max() <= ATOL
    assert handle.last.tiles_per_clip == 1 and handle.last.calls == 2


def _mismatch(rank, world, what):
    vae = tiny_vae()
    z = _latents((12, 5, 7))
    if rank == 1 and what == "contents":
        z = z + 1
    if rank == 1 and what == "shape":
        z = z[:, :, :7]
    if rank == 1 and what == "ndim":  # it fails to plan there, so its settings differ too
        z = z[0]
    if rank == 1 and what == "tiling":
        vae.enable_tiling(128, 128, 16, 16)
    calls = []
    vae.decoder.register_forward_hook(lambda *a: calls.append(1))
    handle = enable_parallel_decode(vae, tiles_per_call=2)
    try:
        with torch.no_grad():
            vae.decode(z)
    except ValueError as e:
        return {"error": str(e), "decoder_calls": len(calls)}
    finally:
        handle.remove()
    return {"error": None, "decoder_calls": len(calls)}


@pytest.mark.parametrize("what,words", [("contents", "different contents on rank 1"),
                                        ("shape", "shape [1, 8, 7, 5, 7] on rank 1"),
                                        ("ndim", "z differs across the W=2 ranks: shape [8, 12"),
                                        ("tiling", "decode's settings differ on rank 1")])
def test_a_rank_with_other_latents_raises_on_every_rank_before_decoding(what, words, tmp_path):
    rows = run_ranks(_mismatch, 2, tmp_path, what, timeout=120)
    for row in rows:
        assert row["error"] is not None and words in row["error"], row
        assert row["decoder_calls"] == 0, row


def test_refusals_name_the_argument():
    vae = tiny_vae()
    with pytest.raises(TypeError, match="AutoencoderKLMiniMaxH3"):
        enable_parallel_decode(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="tiles_per_call=0"):
        enable_parallel_decode(vae, tiles_per_call=0)
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        enable_parallel_decode(vae, memory_budget_bytes=-1)
    with pytest.raises(ValueError, match="group="):
        enable_parallel_decode(vae, group=object())
    handle = enable_parallel_decode(vae)
    with pytest.raises(ValueError, match="already"):
        enable_parallel_decode(vae)
    with pytest.raises(TypeError, match="sink"):
        with handle.stream(42):
            pass
    handle.remove()
    handle.remove()  # twice: a no-op
    assert "_decode" not in vae.__dict__
    assert supported_vaes() == ("AutoencoderKLMiniMaxH3",)


def test_default_batch_follows_the_memory_budget():
    vae = tiny_vae()
    z = _latents((12, 5, 10))
    with torch.no_grad(), enable_parallel_decode(vae, memory_budget_bytes=1) as small:
        vae.decode(z)
    assert small.tiles_per_call is None and small.last.tiles_per_call == 1
    with torch.no_grad(), enable_parallel_decode(vae) as big:
        vae.decode(z)
    assert big.last.tiles_per_call == 8  # the tiny decoder: far under 8 GiB a tile, capped at 8
    assert not dist.is_initialized()


def _failures(rank, world):
    """Failures on one rank only, each followed by a good decode: every rank raises at the same
    point, and the next decode's collectives still line up (nobody was left in an exchange)."""
    vae = tiny_vae()
    z = _latents((12, 5, 10))
    calls = [0]
    real_decoder = vae.decoder.forward

    def flaky_decoder(x):
        calls[0] += 1
        if rank == 1 and calls[0] == 2:  # rank 1's second batched call: wave 2 of 3
            raise RuntimeError("CUDA out of memory (injected)")
        return real_decoder(x)

    results = {}
    handle = enable_parallel_decode(vae, tiles_per_call=2)

    def attempt(name, sink=None, autocast=False):
        try:
            with torch.no_grad(), (handle.stream(sink) if sink else _null()), \
                    torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                vae.decode(z)
            results[name] = "ok"
        except Exception as e:  # noqa: BLE001 - each rank raises its own error or its peers'

            results[name] = f"{type(e).__name__}: {e}"

    vae.decoder.forward = flaky_decoder
    attempt("decoder fails on rank 1")
    vae.decoder.forward = real_decoder
    attempt("then")

    def bad_sink(start, frames):
        if rank == 0 and start > 0:  # after the first clip's frames: between two exchanges
            raise OSError("the encoder died (injected)")
    attempt("sink fails on rank 0", sink=bad_sink)
    attempt("then again")
    attempt("autocast on rank 0 only", autocast=rank == 0)
    attempt("and then")
    handle.remove()
    return results


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_failure_on_one_rank_raises_on_every_rank_and_leaves_no_rank_waiting(tmp_path):
    rows = run_ranks(_failures, 2, tmp_path, timeout=180)
    for rank, res in enumerate(rows):
        assert res["then"] == res["then again"] == res["and then"] == "ok", (rank, res)
        assert "decode's settings differ on rank 1" in res["autocast on rank 0 only"], res
    assert "injected" in rows[1]["decoder fails on rank 1"]
    assert "failed on rank(s) [1] of 2 (wave 2 of 3)" in rows[0]["decoder fails on rank 1"]
    assert "injected" in rows[0]["sink fails on rank 0"]
    assert "failed on rank(s) [0] of 2" in rows[1]["sink fails on rank 0"]
