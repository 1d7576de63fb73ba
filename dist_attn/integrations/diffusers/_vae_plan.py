# SPDX-License-Identifier: Apache-2.0
"""The geometry of one video's parallel decode, decided by diffusers' own code (see
:mod:`dist_attn.integrations.diffusers._vae_decode`): which latents each (clip, tile) decoder
call reads, how many tiles one batched call takes, how the decoded tiles are stitched, and which
decoded clip frames make each output frame (a copy, or diffusers' cross-fade with its own
weights); :class:`Assembly` puts the video together as the tiles arrive."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["DEFAULT_DECODE_BUDGET_BYTES", "Assembly", "Plan", "Run", "Stand", "deal_wave",
           "decoder_tile_bytes", "plan_decode", "stitch_clip", "temporal_runs", "tiles_per_call", "tiles_within_budget",
           "write_run"]

# Planning figure for the batch cap: bytes of activations one decoder tile holds at its peak, per
# token, as multiples of the model width: the float32 residual stream and its norm (2 x 4 B), the
# SwiGLU's doubled up-projection and its product (3 x ffn_mult x elt), q/k/v/out (4 x elt).
_FLOAT32_STREAM_WIDTHS = 8
#: The activation budget of one batched decoder call when ``tiles_per_call`` is None.
DEFAULT_DECODE_BUDGET_BYTES = 8 << 30
# at most 8 tiles a call: more did not decode H3's video faster (within 1.5% from 4 to 28 tiles a
# call in benchmarks/vae_decode.py; docs/benchmarks.md) and each tile adds to the peak
_MAX_TILES_PER_CALL = 8


class Stand:
    """The VAE as diffusers' own methods see it, with some attributes replaced (``self.decoder``,
    ``self._decode_clip``, ...): every other attribute is the VAE's."""

    def __init__(self, vae: nn.Module, **overrides: Any) -> None:
        self.__dict__["_vae"] = vae
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_vae"], name)


@dataclass(kw_only=True)
class Plan:
    """One video's decoder calls and how their outputs make the video (same on every rank)."""

    clips: list[torch.Tensor]
    """Per temporal clip, the ``[B, C, t, h, w]`` latents diffusers' ``_decode`` gives
    ``_decode_clip``, in order."""
    boxes: list[tuple[slice, slice]]
    """Per spatial tile of a clip, in diffusers' call order: its (rows, columns) of latents."""
    tile_out: tuple[int, ...]
    """Shape of one decoded tile ``[B, C_out, T_out, H_tile, W_tile]``."""
    frames: int
    """Output frames of the whole video."""
    latent_frames: int
    """Latent frames of ``z``."""

    @property
    def calls(self) -> int:
        return len(self.clips) * len(self.boxes)

    def latents(self, call: int) -> torch.Tensor:
        """``[B, C, t, h_tile, w_tile]`` the latents of decoder call ``call`` (clip-major)."""
        rows, cols = self.boxes[call % len(self.boxes)]
        return self.clips[call // len(self.boxes)][..., rows, cols]


def decoder_tile_bytes(tokens: int, *, width: int, ffn_mult: int | float, elt: int) -> int:
    """One decoder tile's peak activations in bytes (a planning figure; the decode's batch and the
    server's memory pre-flight both use it): ``tokens`` tokens, GEMMs in ``elt``-byte dtype."""
    return int(tokens * width * (_FLOAT32_STREAM_WIDTHS + (3 * ffn_mult + 4) * elt))


def tiles_within_budget(tile_bytes: int, budget: int = DEFAULT_DECODE_BUDGET_BYTES) -> int:
    """The decode's batch when ``tiles_per_call`` is None: tiles of ``tile_bytes`` within ``budget``, 1 to 8."""
    return max(1, min(_MAX_TILES_PER_CALL, budget // max(1, tile_bytes)))


def tiles_per_call(vae: nn.Module, plan: Plan, given: int | None, budget: int) -> int:
    """The batch: ``given``, or when None what ``budget`` bytes allow for this video's tiles."""
    if given is not None:
        return given
    cfg = vae.config
    tokens = math.prod(plan.clips[0].shape[2:3]) * math.prod(plan.tile_out[3:]) \
        // vae.spatial_compression_ratio ** 2
    blocks = vae.decoder.transformer_blocks
    elt = blocks[0].attn.to_q.weight.element_size() if len(blocks) else 4  # the GEMMs' dtype
    tile = decoder_tile_bytes(tokens, width=cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim,
                              ffn_mult=cfg.decoder_ffn_mult, elt=elt)
    return tiles_within_budget(tile, budget)


def plan_decode(vae: nn.Module, z: torch.Tensor) -> Plan:
    """Runs diffusers' ``_decode`` and ``_decode_clip`` on stand-ins that record what they would
    decode; nothing is computed (the recorded outputs live on the meta device)."""
    cls = type(vae)
    ratio_t, ratio_s = vae.temporal_compression_ratio, vae.spatial_compression_ratio
    clips: list[torch.Tensor] = []

    def record_clip(zc: torch.Tensor) -> torch.Tensor:
        clips.append(zc)
        return torch.empty(zc.shape[0], 1, zc.shape[2] * ratio_t, 1, 1, device="meta")

    out = cls._decode(Stand(vae, _decode_clip=record_clip), z)
    if any(c.shape != clips[0].shape for c in clips):
        raise RuntimeError(f"{cls.__name__}._decode cut clips of unequal shapes "
                           f"{[tuple(c.shape) for c in clips]}; the parallel decode plans one "
                           "tile layout for every clip")
    probe = torch.empty(clips[0].shape, device="meta")  # contiguous: offsets give positions
    boxes: list[tuple[slice, slice]] = []
    tile_out: list[tuple[int, ...]] = []

    def record_tile(tile: torch.Tensor) -> torch.Tensor:
        # diffusers hands post_quant_conv a view of the clip's latents: its offset is the tile's
        # corner (batch, channel and time start at 0 in every tile)
        y0, x0 = divmod(tile.storage_offset(), probe.stride(-2))
        boxes.append((slice(y0, y0 + tile.shape[-2]), slice(x0, x0 + tile.shape[-1])))
        return tile

    def record_decoder(tile: torch.Tensor) -> torch.Tensor:
        b, _, t, h, w = tile.shape
        tile_out.append((b, vae.decoder.out_channels, t * ratio_t, h * ratio_s, w * ratio_s))
        return torch.empty(tile_out[-1], device="meta")

    cls._decode_clip(Stand(vae, post_quant_conv=record_tile, decoder=record_decoder), probe)
    if len(set(tile_out)) != 1:
        raise RuntimeError(f"{cls.__name__}._decode_clip decodes tiles of unequal shapes "
                           f"{sorted(set(tile_out))}; the parallel decode batches equal tiles")
    return Plan(clips=clips, boxes=boxes, tile_out=tile_out[0], frames=out.shape[2],
                 latent_frames=z.shape[2])


def deal_wave(n_calls: int, lo: int, per_wave: int, world: int) -> tuple[list[int], list[int]]:
    """``(counts, starts)``: how many of the wave's calls from ``lo`` (clip-major) each rank
    runs, and its first; the last wave's remainder goes to the highest ranks (rank 0 also
    decodes the audio and encodes the MP4 in the served job)."""
    n = min(n_calls, lo + per_wave) - lo
    counts = [n // world + (r >= world - n % world) for r in range(world)]
    return counts, [lo + sum(counts[:r]) for r in range(world)]


@dataclass(kw_only=True)
class Run:
    """Output frames ``[f0, f0 + n)``: a copy of one clip's frames, or a cross-fade of two."""

    f0: int
    n: int
    terms: list[tuple[int, int, torch.Tensor | None]]
    """``(clip, first frame, weights [n] or None for a copy)``, the earlier clip first."""

    @property
    def last_clip(self) -> int:
        return max(c for c, _, _ in self.terms)

    @property
    def first_clip(self) -> int:
        return min(c for c, _, _ in self.terms)


def temporal_runs(vae: nn.Module, plan: Plan, dtype: torch.dtype,
                   device: torch.device) -> list[Run]:
    """diffusers' ``_decode`` over one-hot clips: its output is the linear map from decoded clip
    frames to output frames, its cross-fade weights computed by diffusers' ``_blend`` in the
    decode dtype on the decode device; cut into runs of consecutive frames."""
    n_clips = len(plan.clips)
    t_out = plan.tile_out[2]
    n = n_clips * t_out
    count = [0]

    def one_hot(zc: torch.Tensor) -> torch.Tensor:
        i = count[0]
        count[0] += 1
        e = torch.zeros(1, n, t_out, 1, 1, dtype=dtype, device=device)
        t = torch.arange(t_out, device=device)
        e[0, i * t_out + t, t] = 1
        return e

    # _decode reads only the frame axis of z
    head = torch.zeros(1, 1, plan.latent_frames, 1, 1, dtype=dtype, device=device)
    m = type(vae)._decode(Stand(vae, _decode_clip=one_hot), head)[0, :, :, 0, 0].t()  # [F, n]
    if count[0] != n_clips or m.shape[0] != plan.frames:
        raise RuntimeError(f"{type(vae).__name__}._decode is not deterministic in its geometry: "
                           f"{count[0]} clips and {m.shape[0]} frames, planned {n_clips} and "
                           f"{plan.frames}")
    host = m.float().cpu()
    runs: list[Run] = []
    for f in range(host.shape[0]):
        src = torch.nonzero(host[f]).flatten().tolist()  # ascending: the earlier clip first
        if not src:
            raise RuntimeError(f"output frame {f} has no source in {type(vae).__name__}._decode")
        terms = [(j // t_out, j % t_out) for j in src]
        copy = len(src) == 1 and host[f, src[0]] == 1
        last = runs[-1] if runs else None
        if last is not None and (last.terms[0][2] is None) == copy and \
                [c for c, _, _ in last.terms] == [c for c, _ in terms] and \
                all(t == lt + last.n for (_, t), (_, lt, _) in zip(terms, last.terms)):
            last.n += 1
            continue
        runs.append(Run(f0=f, n=1, terms=[(c, t, None if copy else m) for c, t in terms]))
    for run in runs:  # the weights of a cross-fade, as diffusers computed them
        if run.terms[0][2] is not None:
            run.terms = [(c, t, m[run.f0:run.f0 + run.n, c * t_out + t:c * t_out + t + run.n]
                          .diagonal().reshape(1, 1, run.n, 1, 1)) for c, t, _ in run.terms]
    return runs


def write_run(out: torch.Tensor, run: Run, clips: dict[int, torch.Tensor]) -> None:
    """``out[:, :, run]`` from its clips: a copy, or ``a * w_a + b * w_b`` as diffusers' _blend."""
    dst = out[:, :, run.f0:run.f0 + run.n]
    c, t, w = run.terms[0]
    if w is None:
        dst.copy_(clips[c][:, :, t:t + run.n])
        return
    acc = clips[c][:, :, t:t + run.n] * w
    for c, t, w in run.terms[1:]:
        acc = acc + clips[c][:, :, t:t + run.n] * w
    dst.copy_(acc)


def stitch_clip(vae: nn.Module, plan: Plan, clip: int, tiles: list[torch.Tensor]) -> torch.Tensor:
    """Clip ``clip`` from its decoded ``tiles`` (diffusers' call order), stitched and blended
    by diffusers' ``_decode_clip`` itself, its decoder handing back the tiles in order."""
    it = iter(tiles)
    stand = Stand(vae, post_quant_conv=lambda t: t, decoder=lambda _t: next(it))
    return type(vae)._decode_clip(stand, torch.empty(plan.clips[clip].shape, device="meta"))


@dataclass
class Assembly:
    """One video put together as its decoded tiles arrive, in any order: each clip is stitched once
    all its tiles are in, each frame run written once all its clips are stitched, and a clip is
    dropped once no later run reads it."""

    vae: nn.Module
    plan: Plan
    runs: list[Run]
    decoded: dict[int, torch.Tensor] = field(default_factory=dict)
    """Decoder call (clip-major) -> its decoded tile ``[B, C_out, T_out, H_tile, W_tile]``."""
    stitched: dict[int, torch.Tensor] = field(default_factory=dict)
    next_clip: int = 0
    next_run: int = 0
    out: torch.Tensor | None = None
    """``[B, C_out, F, H, W]``, made when the first clip is stitched."""

    def advance(self, sink: Callable[[int, torch.Tensor], None] | None) -> None:
        """Stitches the clips and writes the frame runs that the tiles so far complete, then hands
        the frames written now to ``sink(start, frames)`` (a view of :attr:`out`)."""
        plan, runs, n_tiles = self.plan, self.runs, len(self.plan.boxes)
        while self.next_clip < len(plan.clips) and all(
                self.next_clip * n_tiles + j in self.decoded for j in range(n_tiles)):
            tiles = [self.decoded.pop(self.next_clip * n_tiles + j) for j in range(n_tiles)]
            self.stitched[self.next_clip] = stitch_clip(self.vae, plan, self.next_clip, tiles)
            self.next_clip += 1
        if self.out is None and self.stitched:
            first = self.stitched[min(self.stitched)]
            self.out = torch.empty(first.shape[0], first.shape[1], plan.frames, *first.shape[3:],
                                   dtype=first.dtype, device=first.device)
        f_start = runs[self.next_run].f0 if self.next_run < len(runs) else plan.frames
        while self.next_run < len(runs) and runs[self.next_run].last_clip < self.next_clip:
            write_run(self.out, runs[self.next_run], self.stitched)
            self.next_run += 1
        f_end = runs[self.next_run].f0 if self.next_run < len(runs) else plan.frames
        keep = runs[self.next_run].first_clip if self.next_run < len(runs) else len(plan.clips)
        for i in [i for i in self.stitched if i < keep]:
            del self.stitched[i]
        if sink is not None and f_end > f_start:
            sink(f_start, self.out[:, :, f_start:f_end])

    def clear(self) -> None:
        """Drops the tiles and clips held (after a failure on this rank)."""
        self.decoded.clear()
        self.stitched.clear()

    def video(self) -> torch.Tensor:
        """:attr:`out` once every frame run is written; RuntimeError before."""
        if self.next_run != len(self.runs) or self.out is None:
            raise RuntimeError(f"the parallel decode wrote {self.next_run} of {len(self.runs)} "
                               "frame runs")
        return self.out
