# SPDX-License-Identifier: Apache-2.0
"""The MP4 writer: what PyAV reads back is what was written (streams, frames, size, fps, sample
rate), the first frame's PNG is exact, and a failed write leaves the final name untouched."""

from __future__ import annotations

import os

import numpy as np
import pytest

av = pytest.importorskip("av")

from dist_attn.models.h3.serve.jobs import mp4  # noqa: E402
from dist_attn.models.h3.serve.jobs.mp4 import Mp4Writer, probe_mp4, remove_stale_temporaries, write_mp4  # noqa: E402

FPS, SAMPLE_RATE = 24, 32_000
# AAC encodes whole 1024-sample frames: the decoded track is the written one rounded up to a frame.
AAC_FRAME = 1024


def _clip(frames: int = 29, height: int = 32, width: int = 48):
    """A smooth moving gradient (H.264 keeps it within a few levels) and a stereo tone."""
    y, x = np.mgrid[0:height, 0:width]
    video = np.stack([np.stack([(x * 5 + 7 * i) % 256, (y * 7) % 256,
                                np.full_like(x, 128)], -1) for i in range(frames)]).astype(np.uint8)
    t = np.arange(round(frames / FPS * SAMPLE_RATE)) / SAMPLE_RATE
    audio = np.stack([0.3 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 660 * t)])
    return video, audio.astype(np.float32)


def test_written_mp4_reads_back_with_pyav(tmp_path):
    video, audio = _clip()
    path, png = str(tmp_path / "a.mp4"), str(tmp_path / "a.png")
    written = write_mp4(path, video, audio, fps=FPS, sample_rate=SAMPLE_RATE, first_frame_png=png)
    assert written.frames == 29 and written.size_bytes == os.path.getsize(path)
    with av.open(path) as container:
        assert [s.type for s in container.streams] == ["video", "audio"]
        assert container.streams.video[0].codec_context.name == "h264"
        assert container.streams.audio[0].codec_context.name == "aac"
        first = next(container.decode(video=0)).to_ndarray(format="rgb24")
    back = probe_mp4(path)
    assert (back.frames, back.width, back.height, back.fps) == (29, 48, 32, 24.0)
    assert (back.sample_rate, back.audio_channels) == (SAMPLE_RATE, 2)
    n = audio.shape[1]
    assert -(-n // AAC_FRAME) * AAC_FRAME == back.audio_samples, (n, back.audio_samples)
    # lossy, but the picture is the one given (CRF 18 on a smooth gradient: ~1 level)
    assert np.abs(first.astype(int) - video[0]).mean() < 4
    with av.open(png) as container:
        assert (next(container.decode(video=0)).to_ndarray(format="rgb24") == video[0]).all()
    assert sorted(os.listdir(tmp_path)) == ["a.mp4", "a.png"]  # no temporary left


def test_float_video_and_mono_audio(tmp_path):
    video, audio = _clip(frames=5)
    back = probe_mp4(write_mp4(str(tmp_path / "f.mp4"), video / 255.0, audio[:1], fps=FPS,
                               sample_rate=16_000).path)
    assert (back.frames, back.audio_channels, back.sample_rate) == (5, 1, 16_000)
    silent = probe_mp4(write_mp4(str(tmp_path / "s.mp4"), video, None).path)
    assert silent.frames == 5 and silent.sample_rate == 0


@pytest.mark.parametrize("kw,needle", [
    ({"video": np.zeros((3, 31, 48, 3), np.uint8)}, r"height and width must be even"),
    ({"video": np.zeros((3, 32, 48), np.uint8)}, r"must be \[frames, height, width, 3\]"),
    ({"audio": np.zeros((3, 100), np.float32)}, r"1 or 2 channels"),
    ({"sample_rate": 0}, r"sample_rate=0 must be a positive int"),
    ({"fps": 0}, r"fps=0 must be a positive int"),
])
def test_bad_arguments_name_themselves(tmp_path, kw, needle):
    video, audio = _clip(frames=3)
    args = {"video": video, "audio": audio, "fps": FPS, "sample_rate": SAMPLE_RATE, **kw}
    with pytest.raises(ValueError, match=needle):
        write_mp4(str(tmp_path / "x.mp4"), args.pop("video"), args.pop("audio"), **args)
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_the_final_name_untouched(tmp_path, monkeypatch):
    video, audio = _clip(frames=3)
    path = str(tmp_path / "a.mp4")
    with open(path, "wb") as f:
        f.write(b"previous")

    def broken(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(av.AudioFrame, "from_ndarray", broken)
    with pytest.raises(OSError, match="No space left"):
        write_mp4(path, video, audio, fps=FPS, sample_rate=SAMPLE_RATE)
    assert open(path, "rb").read() == b"previous"
    assert os.listdir(tmp_path) == ["a.mp4"]  # the temporary was removed


def test_stale_temporaries_are_removed(tmp_path):
    (tmp_path / "job.mp4.tmp-123-abcd").write_bytes(b"half")
    (tmp_path / "keep.mp4").write_bytes(b"whole")
    assert remove_stale_temporaries(str(tmp_path)) == ["job.mp4.tmp-123-abcd"]
    assert os.listdir(tmp_path) == ["keep.mp4"]


def _decoded_frames(path: str) -> np.ndarray:
    with av.open(path) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_streamed_mp4_equals_the_one_written_at_once(tmp_path, monkeypatch):
    # x264's mbtree encodes clips this small differently from run to run (a 1344x768 clip: the
    # same bytes); without it the encoder is repeatable, so this compares the streaming alone
    monkeypatch.setattr(mp4, "_X264_OPTIONS", {**mp4._X264_OPTIONS, "x264-params": "mbtree=0"})
    video, audio = _clip(frames=29)
    whole = write_mp4(str(tmp_path / "whole.mp4"), video, audio, fps=FPS, sample_rate=SAMPLE_RATE)
    ready = []
    writer = Mp4Writer(str(tmp_path / "streamed.mp4"), width=48, height=32, fps=FPS, audio=audio,
                       sample_rate=SAMPLE_RATE, first_frame_png=str(tmp_path / "s.png"))
    for start in range(0, 29, 7):  # clip by clip, as the decode hands them over
        writer.add(video[start:start + 7], ready=lambda s=start: ready.append(s))
    assert not os.path.exists(tmp_path / "streamed.mp4")  # published only by close()
    streamed = writer.close()
    assert ready == [0, 7, 14, 21, 28]  # each batch's ready() ran before it was read, in order
    assert (streamed.frames, streamed.audio_samples) == (whole.frames, whole.audio_samples)
    # the same frames into the same encoder: the same pictures
    assert np.array_equal(_decoded_frames(streamed.path), _decoded_frames(whole.path))
    assert probe_mp4(streamed.path).audio_samples == probe_mp4(whole.path).audio_samples
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_streamed_mp4_fails_cleanly(tmp_path):
    video, _ = _clip(frames=4)
    path = str(tmp_path / "bad.mp4")
    writer = Mp4Writer(path, width=48, height=32)
    writer.add(video[:, :16])  # the wrong size, found on the encoder thread
    with pytest.raises(ValueError, match="frames of 48 x 16 pixels added to an MP4 of 48 x 32"):
        writer.close()
    empty = Mp4Writer(path, width=48, height=32)
    with pytest.raises(ValueError, match="no frame"):
        empty.close()
    aborted = Mp4Writer(path, width=48, height=32)
    aborted.add(video)
    aborted.abort()
    assert os.listdir(tmp_path) == []  # no MP4, no temporary
    with pytest.raises(ValueError, match="width=47"):
        Mp4Writer(path, width=47, height=32)


def test_a_writer_that_cannot_open_its_streams_says_why(tmp_path, monkeypatch):
    # its own error, not an AttributeError from the cleanup of a half-made writer
    def no_x264(*a, **k):
        raise ValueError("no such encoder (injected)")
    monkeypatch.setattr(av.container.OutputContainer, "add_stream", no_x264)
    with pytest.raises(ValueError, match="injected"):
        Mp4Writer(str(tmp_path / "x.mp4"), width=48, height=32)
    assert os.listdir(tmp_path) == []


def test_abort_drops_the_backlog(tmp_path):
    video, _ = _clip(frames=8)
    seen = []
    writer = Mp4Writer(str(tmp_path / "a.mp4"), width=48, height=32)
    gate = __import__("threading").Event()
    writer.add(video[:1], ready=gate.wait)  # holds the encoder thread
    for i in range(5):
        writer.add(video[1:2], ready=lambda i=i: seen.append(i))
    # the gate opens only after abort() has marked the writer aborted (it then waits)
    __import__("threading").Timer(0.3, gate.set).start()
    writer.abort()
    assert seen == [] and os.listdir(tmp_path) == []
