# SPDX-License-Identifier: Apache-2.0
"""How much disk a video job may take, and whether the output directory has it: checked before a
job is accepted, so that a full disk is refused up front (507) instead of failing the job later.

The bound of one job (:func:`job_bytes`): the video as raw yuv420p frames (what H.264 at the
writer's CRF stays under, noise included: docs/serving.md), the AAC track at its bit rate, the
thumbnail as raw RGB plus a PNG's framing, and a margin for the MP4's own boxes.
"""

from __future__ import annotations

import math
import shutil

from dist_attn.models.h3.serve.jobs.mp4 import AUDIO_BIT_RATE
from dist_attn.models.h3.serve.jobs.videos import VideoRequest

__all__ = ["job_bytes", "space_refusal"]

# The MP4's own boxes (moov: an index entry per frame and per AAC frame) and slack.
_CONTAINER_BYTES = 64 * 1024
# A PNG's header, chunk framing and filter bytes above the raw RGB.
_PNG_BYTES = 4096


def job_bytes(req: VideoRequest, *, fps: int, thumbnail: bool) -> int:
    """The most bytes the files of ``req`` take (MP4 and, with ``thumbnail``, its PNG)."""
    pixels = req.height * req.width
    video = req.frames * pixels * 3 // 2  # yuv420p: 1.5 bytes a pixel
    audio = math.ceil(AUDIO_BIT_RATE / 8 * req.frames / fps)
    png = pixels * 3 + _PNG_BYTES if thumbnail else 0
    return video + audio + _CONTAINER_BYTES + png


def space_refusal(directory: str, req: VideoRequest, ahead: list[VideoRequest], *, fps: int,
                  thumbnail: bool) -> str | None:
    """Why ``req`` is refused for want of disk (a client-facing message, no path), or None:
    the free space of ``directory`` must hold the bound of ``req`` and of every job ``ahead``
    (queued or running: their files are not written yet)."""
    free = shutil.disk_usage(directory).free
    need = job_bytes(req, fps=fps, thumbnail=thumbnail)
    before = sum(job_bytes(r, fps=fps, thumbnail=thumbnail) for r in ahead)
    if free >= need + before:
        return None
    return (f"the output directory has {free} bytes free; this job needs up to {need} bytes "
            f"(its MP4 and thumbnail) and the {len(ahead)} job(s) queued or running before it "
            f"{before}: free space, or submit again once jobs ahead have finished")
