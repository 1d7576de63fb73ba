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
from dist_attn.integrations.diffusers._vae_plan import (DEFAULT_DECODE_BUDGET_BYTES, Assembly, Plan,
                                                        deal_wave, decoder_tile_bytes, plan_decode,
                                                        temporal_runs, tiles_per_call,
                                                        tiles_within_budget)

__all__ = ["DEFAULT_DECODE_BUDGET_BYTES", "DecodeStats", "FrameSink", "ParallelDecodeHandle",
           "decoder_tile_bytes", "enable_parallel_decode", "supported_vaes", "tiles_within_budget"]

logger = logging.getLogger(__name__)

#: ``sink(start, frames)``: output frames ``[start, start + n)`` as ``[B, C, n, H, W]`` (a view
#: of the output: copy what you keep), called in frame order, each frame once per video (with
#: ``vae.use_slicing`` and a batch of several videos, diffusers decodes them one by one: the
#: frames start again at 0 for each).
FrameSink = Callable[[int, torch.Tensor], None]

_HANDLE_ATTR = "_dist_attn_parallel_decode"


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


def _detached(e: BaseException, where: str) -> BaseException:
    """Logs ``e`` with its traceback, then drops the traceback: it would keep the failed call's
    activations alive while this rank still joins its peers' exchanges."""
    logger.error("the parallel VAE decode failed on this rank (%s); the other ranks are told "
                 "at the next exchange", where, exc_info=e)
    return e.with_traceback(None)


class _Failure:
    """This rank's first failure in one decode, ``with failure.caught(where):`` around each step.
    On one rank the exception propagates as it is; on several it is logged and kept without its
    traceback (:func:`_detached`), ``then`` runs, and the next exchange tells the other ranks."""

    def __init__(self, world: int) -> None:
        self.world, self.error = world, None
        self._where, self._then = "", None

    def caught(self, where: str, then: Callable[[], None] | None = None) -> "_Failure":
        self._where, self._then = where, then
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> bool:
        if not isinstance(e, Exception) or self.world == 1:
            return False
        if self.error is None:
            self.error = _detached(e, self._where)
        if self._then is not None:
            self._then()
        return True


def _raise_failed(failed: list[int], world: int, error: BaseException | None, what: str,
                  when: str = "") -> None:
    """Once any rank ``failed``: raises this rank's own ``error`` where it has one, else a
    RuntimeError naming the ranks that did."""
    if not failed:
        return
    if error is not None:
        raise error
    raise RuntimeError(f"the VAE decode {what} on rank(s) {failed} of {world}{when}; their logs "
                       "say why")


@dataclass
class _Setup:
    """What one decode makes before its first exchange; a step that failed leaves its field as it
    was (``per_call`` then the value the ranks compare)."""

    per_call: int
    plan: Plan | None = None
    runs: list | None = None
    arena: tuple[torch.Tensor, torch.Tensor] | None = None
    """W > 1: the send ``[per_call * tile + 1]`` and receive ``[W, per_call * tile + 1]``
    buffers of every exchange (the last element: the rank's failure flag)."""


def _set_up(s: _Setup, handle: ParallelDecodeHandle, z: torch.Tensor, dtype: torch.dtype,
            world: int) -> None:
    """Fills ``s`` step by step: the plan, the batch, the frame runs, and (W > 1) the exchange
    buffers, made once so that a failed rank can always take part."""
    s.plan = plan_decode(handle.vae, z)
    s.per_call = tiles_per_call(handle.vae, s.plan, handle.tiles_per_call, handle.memory_budget_bytes)
    s.runs = temporal_runs(handle.vae, s.plan, dtype, z.device)
    numel = math.prod(s.plan.tile_out)
    if world > 1:
        s.arena = (torch.empty(s.per_call * numel + 1, dtype=dtype, device=z.device),
                   torch.empty(world, s.per_call * numel + 1, dtype=dtype, device=z.device))


def _start(vae: nn.Module, z: torch.Tensor, per_call: int, dtype: torch.dtype,
           error: BaseException | None, group: Any, world: int) -> None:
    """W > 1, before any decoder call: the ranks compare latents and settings (:func:`_agree`)
    and all raise when one differs or could not set up."""
    code = float(_DTYPES.index(dtype)) if dtype in _DTYPES else -1.0
    settings = [float(vae.use_tiling), vae.tile_sample_min_height, vae.tile_sample_min_width,
                vae.tile_sample_min_overlap_height, vae.tile_sample_min_overlap_width,
                float(per_call), code]
    not_ready = _agree(vae, z, settings, error is None, group, world)
    _raise_failed(not_ready, world, error, "could not start")


def _decode_calls(vae: nn.Module, plan: Plan, calls: range, dtype: torch.dtype) -> torch.Tensor:
    """``[k*B, C_out, T_out, H_tile, W_tile]``: the k decoder ``calls``, as one batched call."""
    lat = torch.cat([plan.latents(i) for i in calls])  # [k*B, C, t, h, w]
    return vae.decoder(vae.post_quant_conv(lat)).to(dtype)  # [k*B, C_out, ...]


def _load(send: torch.Tensor, local: torch.Tensor | None, error: BaseException | None) -> None:
    """This rank's part of a wave into ``send``: its tiles (``local``; None: none, or it failed)
    and, last, its failure flag."""
    if local is not None:
        send[:local.numel()] = local.reshape(-1)
    send[-1] = float(error is not None)


def _exchange(arena: tuple[torch.Tensor, torch.Tensor], group: Any, world: int,
              error: BaseException | None, when: str) -> torch.Tensor:
    """One wave's all-gather of every rank's send buffer into ``recv`` ``[W, per_call * tile +
    1]``; all ranks raise when one's flag is set."""
    send, recv = arena
    dist.all_gather(list(recv.unbind(0)), send, group=group)
    _raise_failed([r for r in range(world) if float(recv[r, -1]) != 0.0], world, error, "failed", when)
    return recv


def _collect(asm: Assembly, counts: list[int], starts: list[int], local: torch.Tensor | None,
             recv: torch.Tensor | None, world: int) -> None:
    """The wave's tiles into ``asm.decoded``: this rank's own on one rank, else copies out of
    the receive buffer."""
    b, numel = asm.plan.tile_out[0], math.prod(asm.plan.tile_out)
    for r in range(world):
        for k in range(counts[r]):
            asm.decoded[starts[r] + k] = (local[k * b:(k + 1) * b] if world == 1 else
                                          recv[r, k * numel:(k + 1) * numel]
                                          .view(asm.plan.tile_out).clone())


def _parallel_decode(handle: ParallelDecodeHandle, z: torch.Tensor) -> torch.Tensor:
    """``[B, C, T, h, w]`` latents -> ``[B, C_out, F, H, W]`` video, the same on every rank.

    Failure on one rank: every exchange carries a flag per rank, and after a failure a rank
    still joins every exchange (with the flag set) until all ranks have seen it, so all raise at
    the same point; none is left waiting in a collective."""
    vae = handle.vae
    group, world, rank = group_size_and_rank(handle.group)
    dtype = _output_dtype(vae, z.device)
    failure, setup = _Failure(world), _Setup(per_call=handle.tiles_per_call or 0)
    with failure.caught("planning"):  # everything before the first exchange that could fail on one rank only
        _set_up(setup, handle, z, dtype, world)
    if world > 1:
        _start(vae, z, setup.per_call, dtype, failure.error, group, world)
    plan, per_call = setup.plan, setup.per_call
    assert plan is not None and setup.runs is not None
    asm = Assembly(vae, plan, setup.runs)
    per_wave = world * per_call
    waves = math.ceil(plan.calls / per_wave)
    mine_total = 0
    for w in range(waves):
        counts, starts = deal_wave(plan.calls, w * per_wave, per_wave, world)
        mine = range(starts[rank], starts[rank] + counts[rank])
        mine_total += len(mine)
        local = recv = None
        if failure.error is None and len(mine):
            with failure.caught(f"decoder call, wave {w}"):
                local = _decode_calls(vae, plan, mine, dtype)
        if world > 1:
            _load(setup.arena[0], local, failure.error)
            local = None  # its tiles live in the send buffer only: freed before the exchange
            recv = _exchange(setup.arena, group, world, failure.error, f" (wave {w + 1} of {waves})")
        # a failure from here on is told to the other ranks at the next exchange
        with failure.caught(f"stitching or the frame sink, wave {w + 1}", then=asm.clear):
            _collect(asm, counts, starts, local, recv, world)
            asm.advance(handle.sink)
    if world > 1:  # one last flag exchange: a failure after the last wave's tiles arrived
        flag = torch.tensor([float(failure.error is not None)], dtype=torch.float32, device=z.device)
        flags = gather_rows(flag, group, world)
        _raise_failed([r for r in range(world) if float(flags[r]) != 0.0], world, failure.error,
                      "failed", " after its last wave")
    out = asm.video()
    handle.last = DecodeStats(calls=plan.calls, clips=len(plan.clips), tiles_per_clip=len(plan.boxes),
                              my_calls=mine_total, waves=waves, tiles_per_call=per_call,
                              collectives=waves + 2 if world > 1 else 0, frames=plan.frames)
    return out
