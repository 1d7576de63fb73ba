"""The served video as a file: H.264 video + AAC audio in an MP4, written with PyAV (FFmpeg's
libraries in a wheel), atomically.

A reader never sees a partial file: the container is written to a temporary name in the same
directory, flushed to disk and renamed over the final name (``os.replace`` is atomic within one
filesystem). A crash mid-write leaves only a ``.tmp-*`` file, which :func:`remove_stale_temporaries`
deletes at the next start.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

__all__ = ["VideoFile", "write_mp4", "probe_mp4", "remove_stale_temporaries", "TMP_MARKER"]

#: Part of every temporary file name (a crash leaves such files behind; nothing else has it).
TMP_MARKER = ".tmp-"

# x264 at CRF 18 is visually lossless for 8-bit video; "veryfast" keeps the encode a small share
# of a job (a 124-frame 1344x768 clip encodes in a few seconds on one core).
_X264_OPTIONS = {"crf": "18", "preset": "veryfast"}
_AUDIO_BIT_RATE = 192_000


@dataclass(kw_only=True, frozen=True)
class VideoFile:
    """What was written (or what :func:`probe_mp4` read back)."""

    path: str
    """The MP4."""
    png_path: str | None
    """The first frame as a PNG, when asked for."""
    frames: int
    """Video frames."""
    width: int
    height: int
    fps: float
    """Video frames per second."""
    sample_rate: int
    """Audio samples per second (0: no audio track)."""
    audio_channels: int
    audio_samples: int
    """Audio samples per channel."""
    size_bytes: int


def _as_uint8_video(video: np.ndarray) -> np.ndarray:
    """[F, H, W, 3] uint8, or float in [0, 1] (the pipeline's ``output_type="np"``) -> uint8."""
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video.shape={video.shape} must be [frames, height, width, 3] (RGB)")
    if video.shape[0] < 1:
        raise ValueError(f"video.shape={video.shape} has no frame")
    if video.shape[1] % 2 or video.shape[2] % 2:
        raise ValueError(f"video.shape={video.shape}: height and width must be even (H.264 "
                         "stores colour at half resolution, yuv420p)")
    if video.dtype == np.uint8:
        return np.ascontiguousarray(video)
    if not np.issubdtype(video.dtype, np.floating):
        raise ValueError(f"video.dtype={video.dtype} must be uint8 or a float type in [0, 1]")
    return np.ascontiguousarray((np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8))


def _as_float_audio(audio: np.ndarray) -> np.ndarray:
    """[C, N] float in [-1, 1] (C = 1 or 2) -> float32 [C, N], clipped."""
    if audio.ndim != 2 or audio.shape[0] not in (1, 2):
        raise ValueError(f"audio.shape={audio.shape} must be [channels, samples] with 1 or 2 "
                         "channels")
    if not np.issubdtype(audio.dtype, np.floating):
        raise ValueError(f"audio.dtype={audio.dtype} must be a float type in [-1, 1]")
    return np.ascontiguousarray(np.clip(audio, -1.0, 1.0).astype(np.float32))


def _temporary(path: str) -> str:
    head, tail = os.path.split(path)
    return os.path.join(head, f"{tail}{TMP_MARKER}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _publish(tmp: str, path: str) -> None:
    """fsync ``tmp``, rename it to ``path``, fsync the directory (the rename survives a crash)."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_mp4(path: str, video: np.ndarray, audio: np.ndarray | None, *, fps: int = 24,
              sample_rate: int = 0, first_frame_png: str | None = None) -> VideoFile:
    """Writes ``video`` (and ``audio``) to the MP4 ``path`` atomically; optionally the first frame
    to ``first_frame_png`` (also atomically).

    Args:
        video: [F, H, W, 3] RGB, uint8 or float in [0, 1]; H and W even.
        audio: [C, N] float in [-1, 1], C = 1 or 2, at ``sample_rate``; None for no audio track.
        fps: video frame rate (H3 generates at 24).
        sample_rate: audio samples per second (H3's audio VAE: 32,000).
    Returns:
        What was written (frame and sample counts as given, the file's size).
    Raises:
        ValueError naming the argument for a bad shape, dtype or rate; OSError from the disk
        (the temporary file is removed, the final name is never touched).
    """
    import av  # optional dependency (the serve extra)

    frames = _as_uint8_video(video)
    if not (isinstance(fps, int) and fps > 0):
        raise ValueError(f"fps={fps!r} must be a positive int")
    pcm = None
    if audio is not None:
        pcm = _as_float_audio(audio)
        if not (isinstance(sample_rate, int) and sample_rate > 0):
            raise ValueError(f"sample_rate={sample_rate!r} must be a positive int when audio is "
                             "given")
    n, height, width, _ = frames.shape
    tmp = _temporary(path)
    try:
        with av.open(tmp, mode="w", format="mp4") as container:
            vstream = container.add_stream("libx264", rate=fps, options=_X264_OPTIONS)
            vstream.width, vstream.height, vstream.pix_fmt = width, height, "yuv420p"
            astream = None
            if pcm is not None:
                astream = container.add_stream("aac", rate=sample_rate)
                astream.layout = "stereo" if pcm.shape[0] == 2 else "mono"
                astream.bit_rate = _AUDIO_BIT_RATE
            for i in range(n):
                frame = av.VideoFrame.from_ndarray(frames[i], format="rgb24")
                frame.pts = i
                frame.time_base = Fraction(1, fps)
                container.mux(vstream.encode(frame))
            container.mux(vstream.encode(None))  # flush the encoder's look-ahead
            if astream is not None:
                # [C, N] planar float; the encoder cuts it into its own frame size (1024 for AAC)
                aframe = av.AudioFrame.from_ndarray(pcm, format="fltp", layout=astream.layout.name)
                aframe.sample_rate, aframe.pts = sample_rate, 0
                aframe.time_base = Fraction(1, sample_rate)
                container.mux(astream.encode(aframe))
                container.mux(astream.encode(None))
        png = None
        if first_frame_png is not None:
            png = _write_png(first_frame_png, frames[0])
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return VideoFile(path=path, png_path=png, frames=n, width=width, height=height,
                     fps=float(fps), sample_rate=sample_rate if pcm is not None else 0,
                     audio_channels=pcm.shape[0] if pcm is not None else 0,
                     audio_samples=pcm.shape[1] if pcm is not None else 0,
                     size_bytes=os.path.getsize(path))


def _write_png(path: str, rgb: np.ndarray) -> str:
    """One [H, W, 3] uint8 frame as a PNG at ``path``, atomically."""
    import av

    tmp = _temporary(path)
    try:
        with av.open(tmp, mode="w", format="image2") as container:
            stream = container.add_stream("png")
            stream.width, stream.height, stream.pix_fmt = rgb.shape[1], rgb.shape[0], "rgb24"
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
            container.mux(stream.encode(None))
        _publish(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path


def probe_mp4(path: str) -> VideoFile:
    """Reads ``path`` back with PyAV, decoding every packet: the frame count and the audio
    samples are counted, not taken from the header."""
    import av

    with av.open(path) as container:
        vstreams = container.streams.video
        astreams = container.streams.audio
        if len(vstreams) != 1:
            raise ValueError(f"{path}: {len(vstreams)} video streams, expected 1")
        v = vstreams[0]
        frames = sum(1 for _ in container.decode(v))
        width, height, fps = v.codec_context.width, v.codec_context.height, float(v.average_rate)
    rate = channels = samples = 0
    if astreams:
        with av.open(path) as container:
            a = container.streams.audio[0]
            rate, channels = a.codec_context.sample_rate, a.codec_context.channels
            samples = sum(f.samples for f in container.decode(a))
    return VideoFile(path=path, png_path=None, frames=frames, width=width, height=height, fps=fps,
                     sample_rate=rate, audio_channels=channels, audio_samples=samples,
                     size_bytes=os.path.getsize(path))


def remove_stale_temporaries(directory: str) -> list[str]:
    """Deletes the temporary files a crash left in ``directory``; returns their names."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        if TMP_MARKER in name:
            os.remove(os.path.join(directory, name))
            removed.append(name)
    return removed
