# SPDX-License-Identifier: Apache-2.0
"""The ``[memory]`` and ``[decode]`` sections of a config: the launch's memory pre-flight and the
video decode's batch and compilation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dist_attn.models.h3.serve.config.fields import field_error

__all__ = ["DecodeConfig", "MemoryConfig"]


def _auto_bool(cls: str, name: str, value: object) -> None:
    if not isinstance(value, bool) and value != "auto":
        raise field_error(cls, name, value, 'must be true, false or "auto"')


@dataclass(kw_only=True, frozen=True)
class MemoryConfig:
    """The memory pre-flight: before any weight is loaded, every rank estimates its peak
    (weights per rank, text encoder, activations of the largest warm-up geometry, decode batch,
    allocator slack; :mod:`dist_attn.models.h3.serve.h3.memory`) against its device's free memory,
    and the launch proceeds (logging the estimate) or stops with one message naming what would
    fit."""

    preflight: bool | Literal["auto"] = "auto"
    """Run the pre-flight: ``"auto"`` on CUDA (and wherever ``device_gb`` is set), never on a
    CPU otherwise (there is no device memory to plan); ``true`` everywhere (a CPU needs
    ``device_gb``); ``false`` never (``parallel.shard_weights = "auto"`` then needs it: refused)."""
    headroom_fraction: float = 0.1
    """Part of the free device memory the estimate must leave unused (the estimate is a planning
    figure: checked against the measured peak after every warm-up). ``parallel.shard_weights =
    "auto"`` shards when a replica's estimate exceeds ``(1 - headroom_fraction)`` of it."""
    device_gb: float = 0.0
    """Plan for a device with this much free memory (GB, 1e9 bytes) instead of asking
    ``torch.cuda.mem_get_info``: ``--check-only --set memory.device_gb=80`` plans an 80 GB GPU
    deployment on any machine (on a CPU with a GPU's dtypes: ``runtime.dtype`` or bf16 blocks,
    a float16 video VAE). 0: ask the device."""

    def __post_init__(self) -> None:
        _auto_bool("MemoryConfig", "preflight", self.preflight)
        if not (isinstance(self.headroom_fraction, (int, float)) and not isinstance(self.headroom_fraction, bool)
                and 0 <= self.headroom_fraction < 1):
            raise field_error("MemoryConfig", "headroom_fraction", self.headroom_fraction,
                              "must be a number in [0, 1)")
        if not (isinstance(self.device_gb, (int, float)) and not isinstance(self.device_gb, bool)
                and self.device_gb >= 0):
            raise field_error("MemoryConfig", "device_gb", self.device_gb, "must be a number >= 0")

    def enabled(self, device_type: str) -> bool:
        """Whether the pre-flight runs on a device of ``device_type``."""
        if self.preflight == "auto":
            return device_type == "cuda" or self.device_gb > 0
        return bool(self.preflight)


@dataclass(kw_only=True, frozen=True)
class DecodeConfig:
    """The video VAE decode of a job (every rank decodes a share of the tiles)."""

    tiles_per_call: int | Literal["auto"] = "auto"
    """Tiles in one batched decoder call per rank (the decode's memory: ~0.15 GB a tile at H3's
    256 x 256 tiles, float16). ``"auto"``: as many as 8 GiB of activations allow, at most 8
    (:func:`dist_attn.integrations.diffusers.enable_parallel_decode`)."""
    compile: bool | Literal["auto"] = "auto"
    """Compile the video decoder's repeated blocks (regional ``torch.compile``, one compilation
    for the 36 ViT blocks), as the decode's part of the launch warm-up. ``"auto"``: on CUDA, not
    under ``quality = "lossless"``; ``true`` compiles on a CPU too (slow: inductor's C++ build)."""

    def __post_init__(self) -> None:
        tiles = self.tiles_per_call
        if tiles != "auto" and (isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1):
            raise field_error("DecodeConfig", "tiles_per_call", tiles,
                              'must be a positive integer or "auto"')
        _auto_bool("DecodeConfig", "compile", self.compile)

    def tiles(self) -> int | None:
        """``tiles_per_call`` for :class:`dist_attn.models.h3.serve.h3.decode.JobDecoder` (None: its
        rule)."""
        return None if self.tiles_per_call == "auto" else self.tiles_per_call

    def compiled(self, device_type: str, quality: str | None) -> bool:
        """Whether the decoder's blocks are compiled on a device of ``device_type``."""
        if self.compile == "auto":
            return device_type == "cuda" and quality != "lossless"
        return bool(self.compile)
