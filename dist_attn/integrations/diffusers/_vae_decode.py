"""The video VAE's decode spread over the ranks: every (temporal clip, spatial tile) decoder call
of the whole video is dealt to one rank, each rank runs its calls as batched decoder calls, the
decoded tiles are exchanged with one all-gather per wave, and every rank stitches the same video.

diffusers decides the geometry; nothing of it is copied here:

- the temporal clips and their cross-fade come from running diffusers' own ``_decode`` twice on
  stand-ins: once on the real latents with a ``_decode_clip`` that records each clip's latents,
  and once with a ``_decode_clip`` that returns a one-hot basis per (clip, frame). The second
  run's output is the linear map from decoded clip frames to output frames, weights computed by
  diffusers' ``_blend`` in the decode dtype on the decode device, so applying it repeats
  diffusers' arithmetic (``a * w_a + b * w_b``, op for op);
- the spatial tiles come from running diffusers' ``_decode_clip`` with a recording
  ``post_quant_conv`` / ``decoder`` on the meta device (no compute), and the stitching is
  diffusers' ``_decode_clip`` again, whose ``decoder`` then hands back the decoded tiles in order.

Calls are dealt in clip-major order in waves of ``W x tiles_per_call``: in each wave every rank
runs one batched decoder call of (at most) ``tiles_per_call`` tiles, then one all-gather gives
every rank the wave's tiles. Output frames are written as soon as every clip they depend on is
stitched, and a sink (:meth:`ParallelDecodeHandle.stream`) receives them in order while later
waves still decode: the server encodes the MP4 from them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from dist_attn.distributed import group_size_and_rank

__all__ = ["DecodeStats", "FrameSink", "ParallelDecodeHandle", "enable_parallel_decode",
           "supported_vaes"]

logger = logging.getLogger(__name__)

#: ``sink(start, frames)``: output frames ``[start, start + n)`` as ``[B, C, n, H, W]`` (a view
#: of the output: copy what you keep), called in frame order, each frame once.
FrameSink = Callable[[int, torch.Tensor], None]

_HANDLE_ATTR = "_dist_attn_parallel_decode"
# Planning figure for the batch cap: bytes of activations one decoder tile holds at its peak, per
# token, as multiples of the model width: the float32 residual stream and its norm (2 x 4 B), the
# SwiGLU's doubled up-projection and its product (3 x ffn_mult x elt), q/k/v/out (4 x elt).
_FLOAT32_STREAM_WIDTHS = 8


def supported_vaes() -> tuple[str, ...]:
    """Names of the diffusers VAE classes :func:`enable_parallel_decode` accepts."""
    return ("AutoencoderKLMiniMaxH3",)


@dataclass(kw_only=True)
class DecodeStats:
    """What the last :meth:`vae.decode` did on this rank."""

    calls: int
    """Decoder calls of the whole video (clips x tiles)."""
    clips: int
    tiles_per_clip: int
    my_calls: int
    """Decoder calls this rank ran."""
    waves: int
    """Batched decoder calls per rank (each followed by one all-gather when W > 1)."""
    tiles_per_call: int
    collectives: int
    """Collectives this decode issued: one all-gather of input fingerprints, one per wave."""
    frames: int


@dataclass(eq=False)
class ParallelDecodeHandle:
    """What :func:`enable_parallel_decode` changed on one VAE; :meth:`remove` undoes it."""

    vae: nn.Module = field(repr=False)
    group: Any = None
    tiles_per_call: int = 1
    sink: FrameSink | None = field(default=None, repr=False)
    last: DecodeStats | None = None
    """Statistics of the last decode (None before the first)."""
    removed: bool = False

    @contextlib.contextmanager
    def stream(self, sink: FrameSink) -> Iterator["ParallelDecodeHandle"]:
        """Inside, every ``vae.decode`` also hands its output frames to ``sink`` as they become
        final (in frame order), while later tiles still decode."""
        if not callable(sink):
            raise TypeError(f"sink={sink!r} must be callable as sink(start, frames)")
        previous, self.sink = self.sink, sink
        try:
            yield self
        finally:
            self.sink = previous

    def remove(self) -> None:
        """Restores diffusers' decode; calling it twice is a no-op."""
        if self.removed:
            return
        if self.vae.__dict__.get("_decode") is not None:
            del self.vae.__dict__["_decode"]
        if getattr(self.vae, _HANDLE_ATTR, None) is self:
            delattr(self.vae, _HANDLE_ATTR)
        self.removed = True

    def __enter__(self) -> "ParallelDecodeHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _tile_bytes(vae: nn.Module, tokens: int) -> int:
    """Planning figure of one decoder tile's peak activations (see _FLOAT32_STREAM_WIDTHS)."""
    cfg = vae.config
    width = cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim
    elt = next(vae.decoder.transformer_blocks.parameters()).element_size() \
        if len(vae.decoder.transformer_blocks) else 4
    per_token = width * (_FLOAT32_STREAM_WIDTHS + (3 * cfg.decoder_ffn_mult + 4) * elt)
    return tokens * per_token


def enable_parallel_decode(vae: nn.Module, group=None, *, tiles_per_call: int | None = None,
                           memory_budget_bytes: int = 8 << 30) -> ParallelDecodeHandle:
    """Makes ``vae.decode`` run over the ranks of ``group``, in place.

    Afterwards every rank calls ``vae.decode(z)`` with the same ``z`` ``[B, C, T, h, w]`` and
    gets the same full output ``[B, 3, F, H, W]`` (diffusers' ``decode`` still casts ``z``,
    slices the batch and wraps the result; only its per-video ``_decode`` is replaced). A rank
    whose ``z`` (or tiling settings) differ raises on every rank before any decoder call.
    Without an initialised process group, or with one rank, the same batched path runs locally.

    Args:
        vae: a diffusers VAE of a class in :func:`supported_vaes`.
        group: process group of the decoding ranks (None = the default group).
        tiles_per_call: tiles in one batched decoder call per rank (the memory cap). None: as
            many as fit ``memory_budget_bytes`` by a planning figure of the decoder's
            activations (at most 8: more did not pay on an H200; one tile of H3's decoder at
            256 x 256 is ~1.8k tokens).
        memory_budget_bytes: the activation budget of one batched decoder call when
            ``tiles_per_call`` is None.

    Returns:
        A :class:`ParallelDecodeHandle`; ``handle.remove()`` restores diffusers' decode.

    Raises:
        TypeError: ``vae`` is not a supported class.
        ValueError: an argument is invalid, or the VAE is already enabled.
    """
    names = supported_vaes()
    if not isinstance(vae, nn.Module) or type(vae).__name__ not in names:
        raise TypeError(f"vae of type {type(vae).__module__}.{type(vae).__qualname__} is not "
                        f"supported by enable_parallel_decode; supported: {', '.join(names)}")
    if tiles_per_call is not None and (isinstance(tiles_per_call, bool)
                                       or not isinstance(tiles_per_call, int)
                                       or tiles_per_call < 1):
        raise ValueError(f"tiles_per_call={tiles_per_call!r} must be a positive int or None")
    if isinstance(memory_budget_bytes, bool) or not isinstance(memory_budget_bytes, int) \
            or memory_budget_bytes < 1:
        raise ValueError(f"memory_budget_bytes={memory_budget_bytes!r} must be a positive int")
    if getattr(vae, _HANDLE_ATTR, None) is not None:
        raise ValueError("this VAE already decodes in parallel (enable_parallel_decode was called "
                         "before); call handle.remove() first")
    group_size_and_rank(group)  # a group without torch.distributed raises here, naming it
    if tiles_per_call is None:
        tile = vae.tile_sample_min_height * vae.tile_sample_min_width
        t_lat = vae.tokens_chunk_size + vae.token_overlap
        tokens = t_lat * tile // vae.spatial_compression_ratio ** 2
        # at most 8: on an H200 the float16 decode of H3's 196 tiles took 5.88 / 5.86 / 5.79 /
        # 5.84 s at 4 / 8 / 16 / 28 tiles a call (vae-decode_h200_2026-12-04) while the peak
        # grew by ~0.16 GiB a tile; a tile of ~1.8k tokens already fills the GPU
        tiles_per_call = max(1, min(8, memory_budget_bytes // max(1, _tile_bytes(vae, tokens))))
    handle = ParallelDecodeHandle(vae=vae, group=group, tiles_per_call=tiles_per_call)

    def _decode(z: torch.Tensor) -> torch.Tensor:
        return _parallel_decode(handle, z)

    vae.__dict__["_decode"] = _decode  # shadows the class's _decode on this instance only
    setattr(vae, _HANDLE_ATTR, handle)
    _, world, _ = group_size_and_rank(group)
    logger.info("enable_parallel_decode: %s over %d rank(s), %d tile(s) per decoder call",
                type(vae).__name__, world, tiles_per_call)
    return handle


class _Stand:
    """The VAE as diffusers' own methods see it, with some attributes replaced (``self.decoder``,
    ``self._decode_clip``, ...): every other attribute is the VAE's."""

    def __init__(self, vae: nn.Module, **overrides: Any) -> None:
        self.__dict__["_vae"] = vae
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_vae"], name)


@dataclass(kw_only=True)
class _Plan:
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


def _plan(vae: nn.Module, z: torch.Tensor) -> _Plan:
    """Runs diffusers' ``_decode`` and ``_decode_clip`` on stand-ins that record what they would
    decode; nothing is computed (the recorded outputs live on the meta device)."""
    cls = type(vae)
    ratio_t, ratio_s = vae.temporal_compression_ratio, vae.spatial_compression_ratio
    clips: list[torch.Tensor] = []

    def record_clip(zc: torch.Tensor) -> torch.Tensor:
        clips.append(zc)
        return torch.empty(zc.shape[0], 1, zc.shape[2] * ratio_t, 1, 1, device="meta")

    out = cls._decode(_Stand(vae, _decode_clip=record_clip), z)
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

    cls._decode_clip(_Stand(vae, post_quant_conv=record_tile, decoder=record_decoder), probe)
    if len(set(tile_out)) != 1:
        raise RuntimeError(f"{cls.__name__}._decode_clip decodes tiles of unequal shapes "
                           f"{sorted(set(tile_out))}; the parallel decode batches equal tiles")
    return _Plan(clips=clips, boxes=boxes, tile_out=tile_out[0], frames=out.shape[2],
                 latent_frames=z.shape[2])


@dataclass(kw_only=True)
class _Run:
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


def _temporal_runs(vae: nn.Module, plan: _Plan, dtype: torch.dtype,
                   device: torch.device) -> list[_Run]:
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
    m = type(vae)._decode(_Stand(vae, _decode_clip=one_hot), head)[0, :, :, 0, 0].t()  # [F, n]
    if count[0] != n_clips or m.shape[0] != plan.frames:
        raise RuntimeError(f"{type(vae).__name__}._decode is not deterministic in its geometry: "
                           f"{count[0]} clips and {m.shape[0]} frames, planned {n_clips} and "
                           f"{plan.frames}")
    host = m.float().cpu()
    runs: list[_Run] = []
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
        runs.append(_Run(f0=f, n=1, terms=[(c, t, None if copy else m) for c, t in terms]))
    for run in runs:  # the weights of a cross-fade, as diffusers computed them
        if run.terms[0][2] is not None:
            run.terms = [(c, t, m[run.f0:run.f0 + run.n, c * t_out + t:c * t_out + t + run.n]
                          .diagonal().reshape(1, 1, run.n, 1, 1)) for c, t, _ in run.terms]
    return runs


def _agree(vae: nn.Module, z: torch.Tensor, tiles_per_call: int, group: Any,
           world: int) -> None:
    """One all-gather of the latents' fingerprint and the tiling settings; raises the same
    ValueError on every rank if any rank differs from rank 0 (before any decoder call)."""
    from dist_attn.integrations.diffusers._runtime import _SHAPE, _fingerprint

    settings = [float(vae.use_tiling), vae.tile_sample_min_height, vae.tile_sample_min_width,
                vae.tile_sample_min_overlap_height, vae.tile_sample_min_overlap_width,
                float(tiles_per_call)]
    mine = torch.cat((_fingerprint(z, z.device),
                      torch.tensor(settings, dtype=torch.float64, device=z.device)))
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine, group=group)
    every = torch.stack(rows).cpu()  # [W, fingerprint + settings]
    k = len(settings)
    shape, sums, sets = slice(0, _SHAPE), slice(_SHAPE, -k), slice(-k, None)

    def dims(row: torch.Tensor) -> list[int]:
        return [int(s) for s in row[2:2 + int(row[1])]]

    for r in range(1, world):
        if not torch.equal(every[r, sets], every[0, sets]):
            raise ValueError(f"the VAE's tiling settings or tiles_per_call differ on rank {r} "
                             f"({every[r, sets].tolist()}) and rank 0 ({every[0, sets].tolist()}: "
                             "use_tiling, tile height, width, overlaps, tiles_per_call); every "
                             "rank must decode with the same settings")
        if not torch.equal(every[r, shape], every[0, shape]):
            raise ValueError(f"z differs across the W={world} ranks: shape {dims(every[r])} on "
                             f"rank {r}, {dims(every[0])} on rank 0; every rank must pass the "
                             "same latents to vae.decode")
        if not torch.allclose(every[r, sums], every[0, sums], rtol=1e-5, atol=0.0,
                              equal_nan=True):
            raise ValueError(f"z has different contents on rank {r} and rank 0 (sum |z| "
                             f"{float(every[r, _SHAPE]):.6g} vs {float(every[0, _SHAPE]):.6g}); "
                             "every rank must pass the same latents (same seed, same prompt) to "
                             "vae.decode")


def _output_dtype(vae: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the decoder returns: its output projection's, or autocast's where enabled."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return vae.decoder.proj_out.weight.dtype


def _parallel_decode(handle: ParallelDecodeHandle, z: torch.Tensor) -> torch.Tensor:
    """``[B, C, T, h, w]`` latents -> ``[B, C_out, F, H, W]`` video, the same on every rank."""
    vae = handle.vae
    group, world, rank = group_size_and_rank(handle.group)
    per_call = handle.tiles_per_call
    collectives = 0
    if world > 1:
        _agree(vae, z, per_call, group, world)
        collectives += 1
    plan = _plan(vae, z)
    n_tiles, n_calls = len(plan.boxes), plan.calls
    dtype = _output_dtype(vae, z.device)
    runs = _temporal_runs(vae, plan, dtype, z.device)
    tile_numel = math.prod(plan.tile_out)
    b, c_out, _, h_tile, w_tile = plan.tile_out
    out: torch.Tensor | None = None
    decoded: dict[int, torch.Tensor] = {}
    stitched: dict[int, torch.Tensor] = {}
    next_clip = next_run = 0
    per_wave = world * per_call
    waves = math.ceil(n_calls / per_wave)
    mine_total = 0
    for w in range(waves):
        lo = w * per_wave
        n = min(n_calls, lo + per_wave) - lo
        counts = [n // world + (r < n % world) for r in range(world)]
        starts = [lo + sum(counts[:r]) for r in range(world)]
        mine = range(starts[rank], starts[rank] + counts[rank])
        mine_total += len(mine)
        local, error = None, None
        try:
            if len(mine):
                lat = torch.cat([plan.latents(i) for i in mine])  # [k*B, C, t, h, w]
                local = vae.decoder(vae.post_quant_conv(lat)).to(dtype)  # [k*B, C_out, ...]
        except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
            if world == 1:
                raise
            error = e
        if world == 1:
            for k, i in enumerate(mine):
                decoded[i] = local[k * b:(k + 1) * b]
        else:
            # one flat buffer per rank, padded to the wave's largest share; the last element
            # says whether this rank's decoder call failed, so every rank raises together
            most = max(counts)
            send = torch.zeros(most * tile_numel + 1, dtype=dtype, device=z.device)
            if local is not None and error is None:
                send[:len(mine) * tile_numel] = local.reshape(-1)
            send[-1] = float(error is not None)
            recv = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(recv, send, group=group)
            collectives += 1
            failed = [r for r in range(world) if float(recv[r][-1]) != 0.0]
            if failed:
                if error is not None:
                    raise error
                raise RuntimeError(f"the VAE decode failed on rank(s) {failed} of {world} (wave "
                                   f"{w} of {waves}); their logs say why")
            for r in range(world):
                for k in range(counts[r]):
                    decoded[starts[r] + k] = recv[r][k * tile_numel:(k + 1) * tile_numel].view(
                        plan.tile_out)
        # stitch every clip whose tiles are all here, with diffusers' _decode_clip
        while next_clip < len(plan.clips) and all(
                next_clip * n_tiles + j in decoded for j in range(n_tiles)):
            tiles = iter([decoded.pop(next_clip * n_tiles + j) for j in range(n_tiles)])
            stand = _Stand(vae, post_quant_conv=lambda t: t, decoder=lambda _t: next(tiles))
            stitched[next_clip] = type(vae)._decode_clip(
                stand, torch.empty(plan.clips[next_clip].shape, device="meta"))
            next_clip += 1
        if out is None and stitched:
            first = stitched[min(stitched)]
            out = torch.empty(first.shape[0], first.shape[1], plan.frames, *first.shape[3:],
                              dtype=first.dtype, device=first.device)
        f_start = runs[next_run].f0 if next_run < len(runs) else plan.frames
        while next_run < len(runs) and runs[next_run].last_clip < next_clip:
            _write(out, runs[next_run], stitched)
            next_run += 1
        f_end = runs[next_run].f0 if next_run < len(runs) else plan.frames
        keep = runs[next_run].first_clip if next_run < len(runs) else len(plan.clips)
        for i in [i for i in stitched if i < keep]:
            del stitched[i]
        if handle.sink is not None and f_end > f_start:
            handle.sink(f_start, out[:, :, f_start:f_end])
    if next_run != len(runs) or out is None:
        raise RuntimeError(f"the parallel decode wrote {next_run} of {len(runs)} frame runs")
    handle.last = DecodeStats(calls=n_calls, clips=len(plan.clips), tiles_per_clip=n_tiles,
                              my_calls=mine_total, waves=waves, tiles_per_call=per_call,
                              collectives=collectives, frames=plan.frames)
    return out


def _write(out: torch.Tensor, run: _Run, clips: dict[int, torch.Tensor]) -> None:
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
