# SPDX-License-Identifier: Apache-2.0
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

from dist_attn.agreement import FP_ROW, FP_SHAPE, fingerprint, fingerprints_differ, gather_rows
from dist_attn.distributed import group_size_and_rank
from dist_attn.integrations.diffusers._vae_plan import (Plan, plan_decode, stitch_clip,
                                                        temporal_runs, write_run)

__all__ = ["DEFAULT_DECODE_BUDGET_BYTES", "DecodeStats", "FrameSink", "ParallelDecodeHandle",
           "decoder_tile_bytes", "enable_parallel_decode", "supported_vaes", "tiles_within_budget"]

logger = logging.getLogger(__name__)

#: ``sink(start, frames)``: output frames ``[start, start + n)`` as ``[B, C, n, H, W]`` (a view
#: of the output: copy what you keep), called in frame order, each frame once per video (with
#: ``vae.use_slicing`` and a batch of several videos, diffusers decodes them one by one: the
#: frames start again at 0 for each).
FrameSink = Callable[[int, torch.Tensor], None]

_HANDLE_ATTR = "_dist_attn_parallel_decode"
# Planning figure for the batch cap: bytes of activations one decoder tile holds at its peak, per
# token, as multiples of the model width: the float32 residual stream and its norm (2 x 4 B), the
# SwiGLU's doubled up-projection and its product (3 x ffn_mult x elt), q/k/v/out (4 x elt).
_FLOAT32_STREAM_WIDTHS = 8
#: The activation budget of one batched decoder call when ``tiles_per_call`` is None.
DEFAULT_DECODE_BUDGET_BYTES = 8 << 30
# at most 8 tiles a call: more did not decode H3's video faster (within 1.5% from 4 to 28 tiles a
# call in benchmarks/vae_decode.py; docs/benchmarks.md) and each tile adds to the peak
_MAX_TILES_PER_CALL = 8


def decoder_tile_bytes(tokens: int, *, width: int, ffn_mult: int | float, elt: int) -> int:
    """One decoder tile's peak activations in bytes (a planning figure; the decode's batch and the
    server's memory pre-flight both use it): ``tokens`` tokens, GEMMs in ``elt``-byte dtype."""
    return int(tokens * width * (_FLOAT32_STREAM_WIDTHS + (3 * ffn_mult + 4) * elt))


def tiles_within_budget(tile_bytes: int, budget: int = DEFAULT_DECODE_BUDGET_BYTES) -> int:
    """The decode's batch when ``tiles_per_call`` is None: tiles of ``tile_bytes`` within ``budget``, 1 to 8."""
    return max(1, min(_MAX_TILES_PER_CALL, budget // max(1, tile_bytes)))


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
    """Rounds of at most one batched decoder call per rank, each followed by one all-gather
    when W > 1 (a rank may have no call in the last one)."""
    tiles_per_call: int
    collectives: int
    """Collectives this decode issued (W > 1): one all-gather of the inputs' fingerprints, one
    per wave, one last flag exchange; none on one rank."""
    frames: int


@dataclass(eq=False)
class ParallelDecodeHandle:
    """What :func:`enable_parallel_decode` changed on one VAE; :meth:`remove` undoes it."""

    vae: nn.Module = field(repr=False)
    group: Any = None
    tiles_per_call: int | None = None
    """As given (None: from ``memory_budget_bytes`` and each video's tiles)."""
    memory_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES
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


def enable_parallel_decode(vae: nn.Module, group=None, *, tiles_per_call: int | None = None,
                           memory_budget_bytes: int = DEFAULT_DECODE_BUDGET_BYTES) -> ParallelDecodeHandle:
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
    handle = ParallelDecodeHandle(vae=vae, group=group, tiles_per_call=tiles_per_call,
                                  memory_budget_bytes=memory_budget_bytes)

    def _decode(z: torch.Tensor) -> torch.Tensor:
        return _parallel_decode(handle, z)

    vae.__dict__["_decode"] = _decode  # shadows the class's _decode on this instance only
    setattr(vae, _HANDLE_ATTR, handle)
    _, world, _ = group_size_and_rank(group)
    logger.info("enable_parallel_decode: %s over %d rank(s), %s tile(s) per decoder call",
                type(vae).__name__, world, tiles_per_call or
                f"as many as {memory_budget_bytes / 2**30:.1f} GiB of activations allow (<= 8)")
    return handle


# The dtypes a decode may produce, as one number each in the agreement row (any other: -1).
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _agree(vae: nn.Module, z: torch.Tensor, settings: list[float], ok: bool, group: Any,
           world: int) -> list[int]:
    """One all-gather of the latents' fingerprint, the decode's settings and whether this rank
    is ready (its plan and buffers made); raises the same ValueError on every rank if a rank
    differs from rank 0 in latents or settings. Returns the ranks that are not ready."""
    mine = torch.cat((fingerprint(z, z.device),
                      torch.tensor([*settings, float(ok)], dtype=torch.float64, device=z.device)))
    every = gather_rows(mine, group, world)  # [W, fingerprint + settings + ready]
    sets = slice(FP_ROW, -1)

    def dims(row: torch.Tensor) -> list[int]:
        return [int(s) for s in row[2:2 + int(row[1])]]

    for r in range(1, world):
        what = fingerprints_differ(every[r, :FP_ROW], every[0, :FP_ROW])
        # z's shape first: a rank whose z is malformed also fails to plan, so its settings
        # differ too, and "settings differ" hid the cause
        if what == "shape":
            raise ValueError(f"z differs across the W={world} ranks: shape {dims(every[r])} on "
                             f"rank {r}, {dims(every[0])} on rank 0; every rank must pass the "
                             "same latents to vae.decode")
        if not torch.equal(every[r, sets], every[0, sets]):
            raise ValueError(f"the decode's settings differ on rank {r} "
                             f"({every[r, sets].tolist()}) and rank 0 ({every[0, sets].tolist()}: "
                             "use_tiling, tile height, width, overlaps, tiles_per_call, the "
                             "decoder's output dtype); every rank must decode with the same "
                             "VAE settings, dtype and autocast")
        if what:
            raise ValueError(f"z has different contents on rank {r} and rank 0 (sum |z| "
                             f"{float(every[r, FP_SHAPE]):.6g} vs {float(every[0, FP_SHAPE]):.6g}); "
                             "every rank must pass the same latents (same seed, same prompt) to "
                             "vae.decode")
    return [r for r in range(world) if every[r, -1] == 0]


def _output_dtype(vae: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype the decoder returns: its output projection's, or autocast's where enabled."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return vae.decoder.proj_out.weight.dtype


def _tiles_per_call(handle: ParallelDecodeHandle, plan: Plan) -> int:
    """The batch: as given, or what ``memory_budget_bytes`` allows for this video's tiles."""
    if handle.tiles_per_call is not None:
        return handle.tiles_per_call
    vae, cfg = handle.vae, handle.vae.config
    tokens = math.prod(plan.clips[0].shape[2:3]) * math.prod(plan.tile_out[3:]) \
        // vae.spatial_compression_ratio ** 2
    blocks = vae.decoder.transformer_blocks
    elt = blocks[0].attn.to_q.weight.element_size() if len(blocks) else 4  # the GEMMs' dtype
    tile = decoder_tile_bytes(tokens, width=cfg.decoder_num_attention_heads * cfg.decoder_attention_head_dim,
                              ffn_mult=cfg.decoder_ffn_mult, elt=elt)
    return tiles_within_budget(tile, handle.memory_budget_bytes)


def _detached(e: BaseException, where: str) -> BaseException:
    """Logs ``e`` with its traceback, then drops the traceback: it would keep the failed call's
    activations alive while this rank still joins its peers' exchanges."""
    logger.error("the parallel VAE decode failed on this rank (%s); the other ranks are told "
                 "at the next exchange", where, exc_info=e)
    return e.with_traceback(None)


def _parallel_decode(handle: ParallelDecodeHandle, z: torch.Tensor) -> torch.Tensor:
    """``[B, C, T, h, w]`` latents -> ``[B, C_out, F, H, W]`` video, the same on every rank.

    Failure on one rank: every exchange carries a flag per rank, and after a failure a rank
    still joins every exchange (with the flag set) until all ranks have seen it, so all raise at
    the same point; none is left waiting in a collective."""
    vae = handle.vae
    group, world, rank = group_size_and_rank(handle.group)
    dtype = _output_dtype(vae, z.device)
    error: BaseException | None = None
    plan = runs = arena = None
    per_call = handle.tiles_per_call or 0
    try:  # everything before the first exchange that could fail on one rank only
        plan = plan_decode(vae, z)
        per_call = _tiles_per_call(handle, plan)
        runs = temporal_runs(vae, plan, dtype, z.device)
        numel = math.prod(plan.tile_out)
        if world > 1:  # the exchange buffers, made once: a failed rank can always take part
            arena = (torch.empty(per_call * numel + 1, dtype=dtype, device=z.device),
                     torch.empty(world, per_call * numel + 1, dtype=dtype, device=z.device))
    except Exception as e:  # noqa: BLE001 - told to every rank by _agree
        if world == 1:
            raise
        error = _detached(e, "planning")
    collectives = 0
    if world > 1:
        code = float(_DTYPES.index(dtype)) if dtype in _DTYPES else -1.0
        settings = [float(vae.use_tiling), vae.tile_sample_min_height, vae.tile_sample_min_width,
                    vae.tile_sample_min_overlap_height, vae.tile_sample_min_overlap_width,
                    float(per_call), code]
        not_ready = _agree(vae, z, settings, error is None, group, world)
        collectives += 1
        if not_ready:
            if error is not None:
                raise error
            raise RuntimeError(f"the VAE decode could not start on rank(s) {not_ready} of "
                               f"{world}; their logs say why")
    assert plan is not None and runs is not None
    n_tiles, n_calls = len(plan.boxes), plan.calls
    b = plan.tile_out[0]
    numel = math.prod(plan.tile_out)
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
        # the last wave's remainder goes to the highest ranks: rank 0 also decodes the audio
        # and encodes the MP4 in the served job
        counts = [n // world + (r >= world - n % world) for r in range(world)]
        starts = [lo + sum(counts[:r]) for r in range(world)]
        mine = range(starts[rank], starts[rank] + counts[rank])
        mine_total += len(mine)
        local = None
        if error is None and len(mine):
            try:
                lat = torch.cat([plan.latents(i) for i in mine])  # [k*B, C, t, h, w]
                local = vae.decoder(vae.post_quant_conv(lat)).to(dtype)  # [k*B, C_out, ...]
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
                if world == 1:
                    raise
                error, local = _detached(e, f"decoder call, wave {w}"), None
        if world > 1:
            send, recv = arena
            if local is not None:
                send[:len(mine) * numel] = local.reshape(-1)
            del local
            send[-1] = float(error is not None)
            dist.all_gather(list(recv.unbind(0)), send, group=group)
            collectives += 1
            failed = [r for r in range(world) if float(recv[r, -1]) != 0.0]
            if failed:
                if error is not None:
                    raise error
                raise RuntimeError(f"the VAE decode failed on rank(s) {failed} of {world} (wave "
                                   f"{w + 1} of {waves}); their logs say why")
        try:  # a failure from here on is told to the other ranks at the next exchange
            for r in range(world):
                for k in range(counts[r]):
                    decoded[starts[r] + k] = (local[k * b:(k + 1) * b] if world == 1 else
                                              recv[r, k * numel:(k + 1) * numel]
                                              .view(plan.tile_out).clone())
            while next_clip < len(plan.clips) and all(
                    next_clip * n_tiles + j in decoded for j in range(n_tiles)):
                tiles = [decoded.pop(next_clip * n_tiles + j) for j in range(n_tiles)]
                stitched[next_clip] = stitch_clip(vae, plan, next_clip, tiles)
                next_clip += 1
            if out is None and stitched:
                first = stitched[min(stitched)]
                out = torch.empty(first.shape[0], first.shape[1], plan.frames, *first.shape[3:],
                                  dtype=first.dtype, device=first.device)
            f_start = runs[next_run].f0 if next_run < len(runs) else plan.frames
            while next_run < len(runs) and runs[next_run].last_clip < next_clip:
                write_run(out, runs[next_run], stitched)
                next_run += 1
            f_end = runs[next_run].f0 if next_run < len(runs) else plan.frames
            keep = runs[next_run].first_clip if next_run < len(runs) else len(plan.clips)
            for i in [i for i in stitched if i < keep]:
                del stitched[i]
            if handle.sink is not None and f_end > f_start:
                handle.sink(f_start, out[:, :, f_start:f_end])
        except Exception as e:  # noqa: BLE001
            if world == 1:
                raise
            if error is None:
                error = _detached(e, f"stitching or the frame sink, wave {w + 1}")
            decoded.clear()
            stitched.clear()
    if world > 1:  # one last flag exchange: a failure after the last wave's tiles arrived
        flag = torch.tensor([float(error is not None)], dtype=torch.float32, device=z.device)
        flags = gather_rows(flag, group, world)
        collectives += 1
        failed = [r for r in range(world) if float(flags[r]) != 0.0]
        if failed:
            if error is not None:
                raise error
            raise RuntimeError(f"the VAE decode failed on rank(s) {failed} of {world} after its "
                               "last wave; their logs say why")
    if next_run != len(runs) or out is None:
        raise RuntimeError(f"the parallel decode wrote {next_run} of {len(runs)} frame runs")
    handle.last = DecodeStats(calls=n_calls, clips=len(plan.clips), tiles_per_clip=n_tiles,
                              my_calls=mine_total, waves=waves, tiles_per_call=per_call,
                              collectives=collectives, frames=plan.frames)
    return out
