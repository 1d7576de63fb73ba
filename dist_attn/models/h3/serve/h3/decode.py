# SPDX-License-Identifier: Apache-2.0
"""A served job after its last denoise step: the audio decode (rank 0), the video decode on every
rank (:func:`dist_attn.integrations.diffusers.enable_parallel_decode`), and the MP4 encoded on
rank 0 from each clip's frames while later clips still decode.

Precision: the video VAE's decoder block stack runs in float16 on CUDA, the modules the class
keeps in float32 (``_keep_in_fp32_modules``: norms, block scales, the encoder) stay float32, as
``from_pretrained(torch_dtype=float16)`` loads it. ``benchmarks/vae_decode.py`` measures it
against a float32 decode (docs/benchmarks.md); diffusers measured the same on the released
weights: float16 0 pixels off by more than 1/255, bfloat16 0.057% (huggingface/diffusers#14754).
On the CPU the VAE runs in float32.

Failure: the video decode is collective. A decoder failure on any rank is told to every rank
inside the decode's own all-gather, so all raise together; what only rank 0 does (the audio, the
pixel conversion, the encoder) is caught there and reported after the decode, never between two
collectives.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.jobs.mp4 import EncoderThread, Mp4Writer, VideoFile

__all__ = ["DecodeResult", "JobDecoder", "cast_like_from_pretrained", "video_vae_dtype"]

log = logging.getLogger(__name__)

#: The video VAE's dtype on CUDA (see the module docstring for the measurement).
CUDA_VIDEO_VAE_DTYPE = torch.float16


def video_vae_dtype(device: torch.device) -> torch.dtype:
    """float16 on CUDA, float32 elsewhere (CPU half precision is slow and not what is served)."""
    return CUDA_VIDEO_VAE_DTYPE if device.type == "cuda" else torch.float32


def cast_like_from_pretrained(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model``'s parameters in ``dtype`` except those ``from_pretrained(torch_dtype=dtype)``
    keeps in float32: a parameter whose dotted name has a component in the class's
    ``_keep_in_fp32_modules`` (diffusers' loader matches whole components). For models built
    with random weights (benchmarks), where there is no checkpoint to load; buffers keep their
    dtype, as non-persistent buffers do under from_pretrained."""
    keep = set(getattr(type(model), "_keep_in_fp32_modules", None) or ())
    for name, param in model.named_parameters():
        param.data = param.data.to(torch.float32 if keep & set(name.split(".")) else dtype)
    return model


@dataclass(kw_only=True)
class DecodeResult:
    """One job's decode on this rank."""

    file: VideoFile | None = None
    """The MP4 (rank 0, when it was written)."""
    error: str | None = None
    """What failed (rank 0's audio or encoder; the video decode raises instead)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds: ``decode_audio`` (rank 0), ``decode_video`` (the parallel decode, the encoder
    fed meanwhile), ``mux`` (from the last decoded frame to the MP4 committed: the encode's
    part not hidden under the decode), ``after_denoise`` (all of it)."""


class JobDecoder:
    """Every rank's decode of a served job's latents; rank 0 also writes the MP4.

    Args:
        vae: the video VAE (every rank; its decode is made parallel here).
        audio_vae: the audio VAE (rank 0; None elsewhere).
        env: this rank.
        pixel_mean, pixel_std: the VAE's ImageNet pixel normalisation (the pipeline's).
        fps: video frame rate of the MP4.
        tiles_per_call: the decode's batch (None: from its memory budget).
        compile: the decoder's repeated blocks under ``torch.compile``
            (:func:`dist_attn.integrations.diffusers.compile_vae_decoder`; each batch shape
            compiles on its first decode: warm it, as the launch's warm-up does).
    """

    def __init__(self, vae: nn.Module, audio_vae: nn.Module | None, env: DistEnv, *,
                 pixel_mean: Any, pixel_std: Any, fps: int,
                 tiles_per_call: int | None = None, compile: bool = False) -> None:
        from dist_attn.integrations.diffusers import compile_vae_decoder, enable_parallel_decode

        self.vae, self.audio_vae, self.env, self.fps = vae, audio_vae, env, fps
        # rank 0's one encoder thread for every job (see EncoderThread)
        self._encoder = EncoderThread() if audio_vae is not None else None
        self._audio_step = None
        if audio_vae is not None:
            from diffusers.modular_pipelines.minimax_h3.decoders import MiniMaxH3AudioDecodeStep

            self._audio_step = MiniMaxH3AudioDecodeStep().init_pipeline()
            self._audio_step.update_components(audio_vae=audio_vae)
        self.handle = enable_parallel_decode(vae, tiles_per_call=tiles_per_call)
        self.compiled = compile
        if compile:
            from dist_attn.models.h3.serve.h3.model import raise_recompile_limit

            raise_recompile_limit()
            compile_vae_decoder(vae)
        device = env.device
        self._mean = torch.tensor(pixel_mean, dtype=torch.float32, device=device).view(3, 1, 1, 1)
        self._std = torch.tensor(pixel_std, dtype=torch.float32, device=device).view(3, 1, 1, 1)
        cfg = vae.config
        self._lat_mean = torch.tensor(cfg.latents_mean, device=device).view(1, -1, 1, 1, 1)
        self._lat_std = torch.tensor(cfg.latents_std, device=device).view(1, -1, 1, 1, 1)

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    def _audio(self, audio_latents: torch.Tensor) -> tuple[np.ndarray, int]:
        """Rank 0: diffusers' audio decode step on the audio VAE -> ([2, N] float32, rate)."""
        out = self._audio_step(audio_latents=audio_latents.to(self.audio_vae.dtype),
                   output=["audio", "sampling_rate"])
        return out["audio"][0].float().cpu().numpy(), int(out["sampling_rate"])

    def to_uint8(self, frames: torch.Tensor) -> torch.Tensor:
        """``[1, 3, n, H, W]`` decoded (ImageNet-normalised) -> ``[n, H, W, 3]`` uint8 on the
        device: diffusers' decode step (``x * std + mean``, clamped to [0, 1], float32) and then
        ``round(255 x)`` as the MP4 writer converts float frames."""
        x = frames[0].float() * self._std + self._mean  # [3, n, H, W]
        x = x.clamp_(0, 1).mul_(255).round_().to(torch.uint8)
        return x.permute(1, 2, 3, 0).contiguous()  # [3, n, H, W] -> [n, H, W, 3]

    def warm(self, latent_shape: tuple[int, int, int], *, seed: int = 0) -> float:
        """Every rank: one video decode of seeded random latents of ``[C, T, h, w]`` =
        (the VAE's latent channels, ``latent_shape``), nothing written: compiles the decoder's
        blocks for that geometry's batch shapes and JITs its kernels. Returns seconds."""
        t0 = time.perf_counter()
        g = torch.Generator(device="cpu").manual_seed(seed)
        z = torch.randn(1, self.vae.config.latent_channels, *latent_shape, generator=g)
        self.decode(z.to(self._mean.device), None)
        return time.perf_counter() - t0

    def decode(self, latents: torch.Tensor, audio_latents: torch.Tensor, *,
               mp4_path: str | None = None, png_path: str | None = None) -> DecodeResult:
        """Every rank, with the same denoised ``latents`` ``[1, C, T, h, w]`` (and rank 0 the
        ``audio_latents``): decodes the video over the ranks; rank 0 writes ``mp4_path``.

        Raises:
            RuntimeError / ValueError from the video decode, on every rank alike.
        """
        t0 = time.perf_counter()
        result = DecodeResult()
        writer: Mp4Writer | None = None
        if self.env.rank == 0 and mp4_path is not None:
            writer = self._open_writer(latents, audio_latents, mp4_path, png_path, result, t0)
        failed: list[BaseException] = []  # rank 0's own failures, reported after the decode
        t1 = self._decode_video(latents, self._sink(writer, failed), writer)
        t2 = time.perf_counter()
        result.timings["decode_video"] = t2 - t1
        if writer is not None:
            self._close(writer, failed, result, mp4_path)
            result.timings["mux"] = time.perf_counter() - t2
        result.timings["after_denoise"] = time.perf_counter() - t0
        _release_host_memory()
        return result

    def _open_writer(self, latents: torch.Tensor, audio_latents: torch.Tensor, mp4_path: str,
                     png_path: str | None, result: DecodeResult, t0: float) -> Mp4Writer | None:
        """Rank 0, before the decode's collectives: decodes the audio (``decode_audio`` seconds
        since ``t0``) and opens the MP4 writer; a failure is logged and kept in ``result.error``
        (None returned), never raised."""
        try:
            wave, rate = self._audio(audio_latents)
            self._sync()
            result.timings["decode_audio"] = time.perf_counter() - t0
            height = latents.shape[-2] * self.vae.spatial_compression_ratio
            width = latents.shape[-1] * self.vae.spatial_compression_ratio
            return Mp4Writer(mp4_path, width=width, height=height, fps=self.fps,
                             audio=wave, sample_rate=rate, first_frame_png=png_path,
                             encoder=self._encoder)
        except Exception as e:  # noqa: BLE001 - PyAV raises its own types; never between
            log.exception("decoding the audio or opening %s failed", mp4_path)  # collectives
            result.error = _why(e, "decoding the audio or opening the MP4")
            return None

    def _sink(self, writer: Mp4Writer | None,
              failed: list[BaseException]) -> Callable[[int, torch.Tensor], None]:
        """The decode's frame sink: each clip's frames to ``writer`` as uint8 (through pinned
        host memory on CUDA); a failure is appended to ``failed``, and after one none is fed."""

        def sink(_start: int, frames: torch.Tensor) -> None:
            # called between two of the decode's collectives: it must not raise
            if writer is None or failed:
                return
            try:
                rgb = self.to_uint8(frames)
                if rgb.is_cuda:
                    host = torch.empty(rgb.shape, dtype=torch.uint8, pin_memory=True)
                    host.copy_(rgb, non_blocking=True)
                    ready = torch.cuda.Event()
                    ready.record()  # on the stream of the copy: the encoder waits for it
                    writer.add(host.numpy(), ready=ready.synchronize)
                else:
                    writer.add(rgb.numpy())
            except Exception as e:  # noqa: BLE001 - kept, reported after the decode
                failed.append(e)

        return sink

    def _decode_video(self, latents: torch.Tensor, sink: Callable[[int, torch.Tensor], None],
                      writer: Mp4Writer | None) -> float:
        """Every rank: the parallel video decode of ``latents``, its frames to ``sink``; returns
        when it started (after the latents' denormalisation). On any exception ``writer`` is
        aborted and the exception raised."""
        try:
            z = latents.float() * self._lat_std + self._lat_mean  # as diffusers' decode step
            t1 = time.perf_counter()
            with torch.no_grad(), self.handle.stream(sink):
                self.vae.decode(z, return_dict=False)
            self._sync()
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        return t1

    def _close(self, writer: Mp4Writer, failed: list[BaseException], result: DecodeResult,
               mp4_path: str) -> None:
        """Rank 0, after the decode: commits the MP4 into ``result.file``, or, after a failure of
        the sink or the encoder, aborts it, logs and keeps the failure in ``result.error``."""
        try:
            if failed:
                raise failed[0]
            result.file = writer.close()
        except Exception as e:  # noqa: BLE001 - this job fails, the server serves on
            writer.abort()
            log.exception("writing %s failed", mp4_path)
            result.error = _why(e, "encoding or writing the video")


def _release_host_memory() -> None:
    """Returns the freed host heap to the OS after a job (glibc's ``malloc_trim``): a job's
    frames, its audio and the encoder's buffers are freed in many threads' malloc arenas, and
    without it rank 0's RSS rose by 57-88 MB over the soak smoke's 4 jobs (13-17 MB in other
    runs: it depends on which arenas the frees land in). A no-op where glibc is absent."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes

            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def _why(e: BaseException, what: str) -> str:
    why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
    return f"{what} failed ({why})"
