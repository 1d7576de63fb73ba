# SPDX-License-Identifier: Apache-2.0
"""How a request becomes H3's packed sequence: the geometry rules and the row layout.

The rules are those of diffusers' MiniMax-H3 modular pipeline for a text-to-video+audio (``t2va``)
request, reimplemented here because the pipeline package imports ``transformers`` (its Qwen3-VL
text encoder) and the server has no text encoder:

* frames are rounded up to the next ``17 * n + 5`` the video VAE decodes (``n`` >= 0), and the
  aligned duration at 24 fps must lie in ``[min_duration_s, max_duration_s]`` (H3: 5 to 15 s);
* latent frames = ``5 * n + 2``; latent height / width = pixels / 16 (the VAE), and one row is a
  ``(1, 2, 2)`` patch, so height and width must be multiples of 32;
* audio latents per channel = ``round(frames / 24 * 40)`` (the audio VAE's 40 latents/s), in
  ``audio_channels`` = 2 channel-major blocks (stereo);
* text rows = the prompt's token count; the server has no tokenizer, so ``text_tokens`` stands in
  (H3's reference workload: 512).

The layout is ``[text | audio | video]`` with a ``(t, h, w)`` position per row (text on the time
axis at its index; audio at ``N_text + i`` on the time axis, pinned to the two ends of the width
grid per channel; video frames at ``N_text`` plus a non-uniform ``5/3 * (1, 4, 4, 4, 4)`` frame
clock, on an aspect-normalised spatial grid scaled by 32), modality tags 1 / 2 / 0 and, per denoise
step, the rows' timestep indices (video and text at the video timestep, audio at the audio one).
``tests/serve/test_model.py`` checks every row against the pipeline's own ``before_denoise`` code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dist_attn.models.h3.serve.config.fields import (field_error, require_non_negative,
                                                     require_positive)
from dist_attn.sharding import bucket_multiple, padded_length

__all__ = ["TokenConfig", "PackedLayout", "padded_rows", "request_layout", "VIDEO_TAG", "TEXT_TAG", "AUDIO_TAG"]

#: Per-row modality tags: they index H3's AdaLN table (``timestep_index * 3 + tag``), a checkpoint
#: contract.
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

# The rotary frame clock: one latent frame spans 5/3 x (1, 4, 4, 4, 4)[i % 5] rotary units (the
# VAE groups 17 pixel frames into 5 latents, the first latent covering one frame); the spatial axes
# are normalised by sqrt(latent area) and scaled by 32.
_FRAME_SPAN = 5.0 / 3.0
_FRAMES_PER_LATENT = (1, 4, 4, 4, 4)
_SPATIAL_SCALE = 32


@dataclass(kw_only=True, frozen=True)
class TokenConfig:
    """H3's pipeline rules: a request (frames x height x width) becomes packed rows, denoised on
    two schedules (video and audio)."""

    vae_spatial_compression: int = 16
    """Pixels per video latent along height and width (H3's video VAE: 16)."""
    vae_frames_per_chunk: int = 17
    """Pixel frames the video VAE encodes per chunk (its ``clip_length``: 17)."""
    vae_latents_per_chunk: int = 5
    """Latent frames one chunk keeps (5): frames must be ``17 n + 5``, giving ``5 n + 2`` latents."""
    fps: int = 24
    """H3's fixed frame rate."""
    audio_latents_per_second: int = 40
    """The audio VAE's latent rate (800-sample hop at 32 kHz)."""
    audio_channels: int = 2
    """Audio channels, packed channel-major (H3: stereo)."""
    text_tokens: int = 512
    """Text rows per request: the prompt's token count, which this server (no text encoder) fixes."""
    min_duration_s: float = 5.0
    """Shortest video, seconds, after frames are aligned (H3: 5)."""
    max_duration_s: float = 15.0
    """Longest video, seconds, after frames are aligned (H3: 15)."""
    video_shift: float = 12.0
    """Exponential sigma shift of the video rows' ``MiniMaxH3Scheduler`` (H3: 12)."""
    audio_shift: float = 3.0
    """Exponential sigma shift of the audio rows' ``MiniMaxH3Scheduler`` (H3: 3)."""

    def __post_init__(self) -> None:
        require_positive(self, "vae_spatial_compression", "vae_frames_per_chunk", "fps",
                         "audio_latents_per_second", "audio_channels")
        require_non_negative(self, "vae_latents_per_chunk", "text_tokens")
        if self.vae_latents_per_chunk >= self.vae_frames_per_chunk:
            raise field_error("TokenConfig", "vae_latents_per_chunk", self.vae_latents_per_chunk,
                              f"must be below vae_frames_per_chunk={self.vae_frames_per_chunk}")
        if not 0 <= self.min_duration_s <= self.max_duration_s:
            raise field_error("TokenConfig", "min_duration_s", self.min_duration_s,
                              f"must be >= 0 and at most max_duration_s={self.max_duration_s}")
        for name in ("video_shift", "audio_shift"):
            if not getattr(self, name) > 0:
                raise field_error("TokenConfig", name, getattr(self, name), "must be > 0")

    def align_frames(self, frames: int) -> int:
        """``frames`` rounded up to the next ``vae_frames_per_chunk * n + vae_latents_per_chunk``."""
        step, rest = self.vae_frames_per_chunk, self.vae_latents_per_chunk
        return frames + (rest - frames) % step

    def canvas_multiple(self, patch: tuple[int, int, int]) -> int:
        """What height and width must be multiples of: VAE compression x spatial patch (H3: 32)."""
        return self.vae_spatial_compression * patch[1]


@dataclass(kw_only=True, frozen=True)
class PackedLayout:
    """The packed rows of one request: ``[text | audio | video]``, no padding (the attention
    pads to its world size itself)."""

    frames: int
    """Video frames after alignment to ``17 n + 5``."""
    latent_shape: tuple[int, int, int]
    """(latent frames, latent height, latent width) of the video latents."""
    patch: tuple[int, int, int]
    """The transformer's (t, h, w) patch: one video row per patch."""
    text: int
    """Text rows."""
    audio_latents: int
    """Audio latents per channel."""
    audio_channels: int
    """Audio channels (channel-major blocks of ``audio_latents`` rows)."""

    @property
    def grid(self) -> tuple[int, int, int]:
        """(frames, rows, columns) of video patches."""
        (f, h, w), (pt, ph, pw) = self.latent_shape, self.patch
        return f // pt, h // ph, w // pw

    @property
    def video(self) -> int:
        """Video rows."""
        return math.prod(self.grid)

    @property
    def audio(self) -> int:
        """Audio rows."""
        return self.audio_latents * self.audio_channels

    @property
    def used(self) -> int:
        """S: rows of the packed sequence."""
        return self.text + self.audio + self.video

    def rows(self) -> dict[str, torch.Tensor]:
        """The layout arguments of ``MiniMaxH3Transformer3DModel.forward``, on the CPU.

        Returns:
            ``position_ids`` ``[S, 3]`` float64 (t, h, w); ``token_tags`` ``[S]`` int64;
            ``text_indices`` ``[N_text]``, ``audio_indices`` ``[N_audio]``, ``video_indices``
            ``[N_video]`` int64 positions in the packed sequence.
        """
        n_text, n_audio = self.text, self.audio
        frames, rows, cols = self.grid
        _, lat_h, lat_w = self.latent_shape
        pos = torch.zeros(self.used, 3, dtype=torch.float64)
        pos[:n_text, 0] = torch.arange(n_text, dtype=torch.float64)
        # The spatial grid: dim // patch coordinates centred on the unit interval of the
        # aspect-normalised axis (right end excluded), x 32; numpy's linspace is the grid's
        # definition (torch.linspace rounds differently).
        root = math.sqrt(lat_h * lat_w)
        axes = []
        for dim, count in ((lat_h, rows), (lat_w, cols)):
            left = (1.0 - dim / root) / 2.0
            axes.append(torch.from_numpy(
                np.linspace(left, left + dim / root, count, endpoint=False) * _SPATIAL_SCALE))
        h_grid, w_grid = axes
        audio = slice(n_text, n_text + n_audio)
        # Audio shares the video's clock (one unit per latent at 40 latents/s = 24 fps x 5/3),
        # channel-major, with no height and the first channel at the left end of the width grid.
        clock = float(n_text) + torch.arange(self.audio_latents, dtype=torch.float64)
        pos[audio, 0] = clock.repeat(self.audio_channels)
        pos[audio, 2] = float(w_grid[-1])
        pos[n_text:n_text + self.audio_latents, 2] = float(w_grid[0])
        spans = torch.tensor([_FRAME_SPAN * _FRAMES_PER_LATENT[i % len(_FRAMES_PER_LATENT)]
                              for i in range(frames)], dtype=torch.float64)
        t_grid = float(n_text) + torch.cat((torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)))
        hh, ww = torch.meshgrid(h_grid, w_grid, indexing="ij")  # [rows, cols] each
        video = torch.empty(frames, rows * cols, 3, dtype=torch.float64)
        video[:, :, 0] = t_grid[:, None]
        video[:, :, 1] = hh.reshape(-1)
        video[:, :, 2] = ww.reshape(-1)
        pos[n_text + n_audio:] = video.reshape(-1, 3)  # [F, rows*cols, 3] -> [N_video, 3]
        tags = torch.full((self.used,), VIDEO_TAG, dtype=torch.long)
        tags[:n_text] = TEXT_TAG
        tags[audio] = AUDIO_TAG
        return {"position_ids": pos, "token_tags": tags,
                "text_indices": torch.arange(n_text),
                "audio_indices": torch.arange(n_text, n_text + n_audio),
                "video_indices": torch.arange(n_text + n_audio, self.used)}

    def timestep_rows(self, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(timestep, timestep_indices)`` of one denoise step: the distinct timesteps, sorted
        (``[T]`` float32, T = 1 or 2), and every row's index into them (``[S]`` int64). Text rows
        never reach an output head and take the video timestep, as in H3's pipeline."""
        per_row = torch.full((self.used,), video_t, dtype=torch.float32)
        per_row[self.text:self.text + self.audio] = audio_t
        return torch.unique(per_row, sorted=True, return_inverse=True)


def padded_rows(used: int, world: int, bucket: int) -> int:
    """Rows of a ``used``-row sequence once padded as the served attention pads it: to a multiple
    of ``world * ceil(bucket / world)`` (``runtime.sequence_bucket``, resolved; see
    :func:`dist_attn.integrations.diffusers.enable_ulysses`)."""
    return padded_length(used, world, bucket_multiple(bucket, world))


def request_layout(tok: TokenConfig, patch: tuple[int, int, int], *, frames: int, height: int,
                   width: int) -> PackedLayout:
    """The packed layout of a ``frames`` x ``height`` x ``width`` request under ``tok`` and the
    transformer's ``patch``; raises ValueError naming the request field and the rule."""
    multiple = tok.canvas_multiple(patch)
    for name, value in (("height", height), ("width", width)):
        if value % multiple:
            raise field_error("RequestConfig", name, value, f"must be a multiple of {multiple} (the video "
                              f"VAE's {tok.vae_spatial_compression}x compression times the "
                              f"transformer's {patch[1]}x{patch[2]} patch)")
    if frames < 1:
        raise field_error("RequestConfig", "frames", frames, "must be a positive integer")
    aligned = tok.align_frames(frames)
    seconds = aligned / tok.fps
    if not tok.min_duration_s <= seconds <= tok.max_duration_s:
        raise field_error("RequestConfig", "frames", frames,
                          f"gives {aligned} frames once aligned to {tok.vae_frames_per_chunk} n + "
                          f"{tok.vae_latents_per_chunk} ({seconds:.3f} s at {tok.fps} fps), outside "
                          f"[{tok.min_duration_s}, {tok.max_duration_s}] s")
    latent_frames = ((aligned - tok.vae_latents_per_chunk) // tok.vae_frames_per_chunk
                     * tok.vae_latents_per_chunk + 2)
    shape = (latent_frames, height // tok.vae_spatial_compression, width // tok.vae_spatial_compression)
    if latent_frames % patch[0]:
        raise field_error("RequestConfig", "frames", frames, f"gives {latent_frames} latent frames, not a "
                          f"multiple of the transformer's temporal patch {patch[0]}")
    # Python's round (half to even) is the pipeline's rule for the audio latent count.
    audio = int(round(aligned / tok.fps * tok.audio_latents_per_second))
    return PackedLayout(frames=aligned, latent_shape=shape, patch=tuple(patch), text=tok.text_tokens,
                        audio_latents=audio, audio_channels=tok.audio_channels)
