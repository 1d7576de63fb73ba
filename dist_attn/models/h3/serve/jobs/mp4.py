# SPDX-License-Identifier: Apache-2.0
"""The served video as a file: H.264 video + AAC audio in an MP4, written with PyAV (FFmpeg's
libraries in a wheel), atomically.

A reader never sees a partial file: the container is written to a temporary name in the same
directory, flushed to disk and renamed over the final name (``os.replace`` is atomic within one
filesystem). A crash mid-write leaves only a ``.tmp-*`` file, which :func:`remove_stale_temporaries`
deletes at the next start.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading as _threading
import uuid
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable

import numpy as np

__all__ = ["EncoderThread", "Mp4Writer", "VideoFile", "write_mp4", "probe_mp4",
           "remove_stale_temporaries", "TMP_MARKER", "AUDIO_BIT_RATE"]

#: Part of every temporary file name (a crash leaves such files behind; nothing else has it).
TMP_MARKER = ".tmp-"

# x264 at CRF 18 is visually lossless for 8-bit video; "veryfast" keeps the encode a small share
# of a job (a 124-frame 1344x768 clip encodes in a few seconds on one core).
_X264_OPTIONS = {"crf": "18", "preset": "veryfast"}
AUDIO_BIT_RATE = 192_000  #: the AAC track's bits per second


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


def _check_video(video: np.ndarray) -> None:
    if not isinstance(video, np.ndarray):
        raise ValueError(f"video of type {type(video).__name__} must be a numpy array")
    if video.ndim != 4 or video.shape[-1] != 3:
        raise ValueError(f"video.shape={video.shape} must be [frames, height, width, 3] (RGB)")
    if video.shape[0] < 1:
        raise ValueError(f"video.shape={video.shape} has no frame")
    if video.shape[1] % 2 or video.shape[2] % 2:
        raise ValueError(f"video.shape={video.shape}: height and width must be even (H.264 "
                         "stores colour at half resolution, yuv420p)")


def _as_uint8_video(video: np.ndarray) -> np.ndarray:
    """[F, H, W, 3] uint8, or float in [0, 1] (the pipeline's ``output_type="np"``) -> uint8."""
    _check_video(video)
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


class EncoderThread:
    """One thread that runs MP4 encoding work in the order it was submitted. A server keeps one
    for all its jobs: a new thread per job grew rank 0's RSS by ~90 MB over 4 jobs of the soak
    smoke (glibc gives new threads malloc arenas of their own, kept after the thread ends)."""

    def __init__(self) -> None:
        self._queue: queue.Queue = queue.Queue()
        self._thread = _threading.Thread(target=self._loop, name="mp4-encoder", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        """Runs ``fn()`` on the thread after everything submitted before (``fn`` must not
        raise: :class:`Mp4Writer` catches its own errors)."""
        self._queue.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            fn()

    def close(self) -> None:
        """Finishes the submitted work and ends the thread."""
        self._queue.put(None)
        self._thread.join()


class Mp4Writer:
    """An MP4 written as its frames arrive: :meth:`add` hands frames to an encoder thread (with
    ``background=True``) and returns at once, :meth:`close` waits for the encoder, muxes the
    audio and publishes the file atomically. The served job feeds it the decoded frames of each
    clip while later clips still decode, so the encode is off the decode's critical path.

    Args:
        path: the final MP4 name (a temporary beside it until :meth:`close`).
        width, height: frame size (even: H.264 stores colour at half resolution, yuv420p).
        fps: video frame rate (H3 generates at 24).
        audio: [C, N] float in [-1, 1], C = 1 or 2, at ``sample_rate``; None for no audio track.
        sample_rate: audio samples per second (H3's audio VAE: 32,000).
        first_frame_png: also write the first frame as a PNG here (atomically).
        background: encode on a worker thread (False: :meth:`add` encodes before returning).
        encoder: the :class:`EncoderThread` to encode on (background only; None: a thread of
            this writer's own, ended by :meth:`close`).
        threading: x264's threads: "frame" (several frames at once: the best throughput) or
            "slice" (each frame cut in slices: fewer frames in flight, so a shorter flush).
    """

    def __init__(self, path: str, *, width: int, height: int, fps: int = 24,
                 audio: np.ndarray | None = None, sample_rate: int = 0,
                 first_frame_png: str | None = None, background: bool = True,
                 threading: str = "frame", encoder: EncoderThread | None = None) -> None:
        import av  # optional dependency (the serve extra)

        if not (isinstance(fps, int) and fps > 0):
            raise ValueError(f"fps={fps!r} must be a positive int")
        for name, v in (("width", width), ("height", height)):
            if not (isinstance(v, int) and v > 0 and v % 2 == 0):
                raise ValueError(f"{name}={v!r} must be a positive even int (H.264 stores colour "
                                 "at half resolution, yuv420p)")
        self._pcm = None
        if audio is not None:
            self._pcm = _as_float_audio(audio)
            if not (isinstance(sample_rate, int) and sample_rate > 0):
                raise ValueError(f"sample_rate={sample_rate!r} must be a positive int when audio "
                                 "is given")
        if threading not in ("frame", "slice"):
            raise ValueError(f"threading={threading!r} must be 'frame' or 'slice'")
        self.path, self.width, self.height, self.fps = path, width, height, fps
        self.sample_rate, self.first_frame_png = sample_rate, first_frame_png
        self.frames = 0
        self._png = None
        self._tmp = _temporary(path)
        self._error: BaseException | None = None
        self._aborted = False
        self._encoder: EncoderThread | None = None
        self._own_encoder = False
        self._container = av.open(self._tmp, mode="w", format="mp4")
        try:
            self._vstream = self._container.add_stream("libx264", rate=fps, options=_X264_OPTIONS)
            self._vstream.width, self._vstream.height = width, height
            self._vstream.pix_fmt = "yuv420p"
            # PyAV asks for slice threads by default; 0 threads = x264 picks by the core count
            self._vstream.codec_context.thread_type = threading.upper()
            self._vstream.codec_context.thread_count = 0
            self._astream = None
            if self._pcm is not None:
                self._astream = self._container.add_stream("aac", rate=sample_rate)
                self._astream.layout = "stereo" if self._pcm.shape[0] == 2 else "mono"
                self._astream.bit_rate = AUDIO_BIT_RATE
        except BaseException:
            self._discard()
            raise
        if background:
            self._own_encoder = encoder is None
            self._encoder = encoder if encoder is not None else EncoderThread()
        # the soundtrack first, while the video still decodes: its AAC encode (0.1-0.2 s for
        # 5 s of stereo on 2 cores) would otherwise land after the last frame; the muxer
        # interleaves the packets by time
        try:
            self._run(self._encode_audio)
        except BaseException:
            self._discard()
            raise

    def _run(self, fn: Callable[[], None]) -> None:
        """``fn()`` now (no encoder thread) or on the encoder thread, its error kept."""
        if self._encoder is None:
            fn()
            return

        def guarded() -> None:
            if self._error is None and not self._aborted:  # an aborted job's backlog is dropped
                try:
                    fn()
                except BaseException as e:  # noqa: BLE001 - re-raised by add() or close()
                    self._error = e
        self._encoder.submit(guarded)

    def _encode_audio(self) -> None:
        if self._astream is not None:
            # [C, N] planar float; the encoder cuts it into its own frame size (1024 for AAC)
            aframe = _audio_frame(self._pcm, self._astream.layout.name, self.sample_rate)
            self._container.mux(self._astream.encode(aframe))
            self._container.mux(self._astream.encode(None))

    def add(self, frames: np.ndarray, ready: Callable[[], None] | None = None) -> None:
        """Queues ``frames`` [n, H, W, 3] (uint8, or float in [0, 1]) after those before.
        ``ready()``, if given, is called on the encoder thread before ``frames`` is read (e.g.
        a CUDA event's synchronize, when they are still being copied to the host)."""
        if self._error is not None:
            raise self._error
        self._run(lambda: self._encode(frames, ready))

    def _encode(self, frames: np.ndarray, ready: Callable[[], None] | None) -> None:
        import av

        if ready is not None:
            ready()
        frames = _as_uint8_video(frames)
        if frames.shape[1:3] != (self.height, self.width):
            raise ValueError(f"frames of {frames.shape[2]} x {frames.shape[1]} pixels added to an "
                             f"MP4 of {self.width} x {self.height}")
        if self.first_frame_png is not None and self._png is None:
            self._png = _write_png(self.first_frame_png, frames[0])
        for rgb in frames:
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pts = self.frames
            frame.time_base = Fraction(1, self.fps)
            self._container.mux(self._vstream.encode(frame))
            self.frames += 1

    def close(self) -> VideoFile:
        """Waits for the encoder, muxes the audio, publishes the file; returns what was written.
        On any error the temporary file is removed and the final name never touched."""
        try:
            self._join()
            if self._error is not None:
                raise self._error
            if self.frames < 1:
                raise ValueError("the MP4 has no frame (add() was never called with one)")
            self._container.mux(self._vstream.encode(None))  # flush the encoder's look-ahead
            pcm = self._pcm
            self._container.close()
            _publish(self._tmp, self.path)
        except BaseException:
            self._discard()
            raise
        return VideoFile(path=self.path, png_path=self._png, frames=self.frames,
                         width=self.width, height=self.height, fps=float(self.fps),
                         sample_rate=self.sample_rate if pcm is not None else 0,
                         audio_channels=pcm.shape[0] if pcm is not None else 0,
                         audio_samples=pcm.shape[1] if pcm is not None else 0,
                         size_bytes=os.path.getsize(self.path))

    def abort(self) -> None:
        """Stops the encoder (frames still queued are dropped) and removes the temporary file
        (a failed job)."""
        self._aborted = True
        self._discard()

    def _join(self) -> None:
        """Waits until the encoder thread has run everything this writer submitted."""
        if self._encoder is None:
            return
        done = _threading.Event()
        self._encoder.submit(done.set)
        done.wait()
        if self._own_encoder:
            self._encoder.close()
        self._encoder = None

    def _discard(self) -> None:
        try:
            self._join()
        finally:
            with contextlib.suppress(Exception):  # already failing; the file goes anyway
                self._container.close()
            if os.path.exists(self._tmp):
                os.remove(self._tmp)


def _audio_frame(pcm: np.ndarray, layout: str, sample_rate: int):
    """[C, N] float32 planar samples as one PyAV audio frame at pts 0."""
    import av

    aframe = av.AudioFrame.from_ndarray(pcm, format="fltp", layout=layout)
    aframe.sample_rate, aframe.pts = sample_rate, 0
    aframe.time_base = Fraction(1, sample_rate)
    return aframe


def write_mp4(path: str, video: np.ndarray, audio: np.ndarray | None, *, fps: int = 24,
              sample_rate: int = 0, first_frame_png: str | None = None) -> VideoFile:
    """Writes ``video`` (and ``audio``) to the MP4 ``path`` atomically; optionally the first frame
    to ``first_frame_png`` (also atomically). The whole video at once: :class:`Mp4Writer`
    takes it clip by clip.

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
    _check_video(video)
    writer = Mp4Writer(path, width=video.shape[2], height=video.shape[1], fps=fps, audio=audio,
                       sample_rate=sample_rate, first_frame_png=first_frame_png,
                       background=False)
    try:
        writer.add(video)
    except BaseException:
        writer.abort()
        raise
    return writer.close()


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
