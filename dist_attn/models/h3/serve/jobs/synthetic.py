# SPDX-License-Identifier: Apache-2.0
"""A runner with no model (``jobs.runner = "synthetic"``): a test pattern and a tone, at the
steps' pace, for tests and load tests of the jobs API (the serving layer's own cost)."""

from __future__ import annotations

import logging
import time

import numpy as np

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.jobs.mp4 import write_mp4
from dist_attn.models.h3.serve.jobs.runner import StepHook, VideoOutcome
from dist_attn.models.h3.serve.jobs.videos import VideoRequest, VideoRules
from dist_attn.models.h3.serve.wire.abort import Abort, agree_abort

__all__ = ["SyntheticRunner"]

log = logging.getLogger(__name__)


class SyntheticRunner:
    """No model: each step sleeps ``step_s`` (every rank votes after it, as the real runner
    does), then rank 0 writes a moving test pattern and a tone as the MP4. Its rules are
    H3's, at a small default canvas."""

    def __init__(self, env: DistEnv, *, step_s: float = 0.02, rules: VideoRules | None = None
                 ) -> None:
        self.env = env
        self.step_s = step_s
        self.rules = rules or VideoRules(default_height=64, default_width=64, default_steps=4)

    def _denoise(self, steps: int, on_step: StepHook | None) -> tuple[Abort, list[float]]:
        times: list[float] = []
        for k in range(1, steps + 1):
            t0 = time.perf_counter()
            time.sleep(self.step_s)
            times.append(time.perf_counter() - t0)
            vote = on_step(k, times[-1]) if on_step is not None else Abort.NONE
            if k < steps:
                verdict = agree_abort(vote, self.env)
                if verdict is not Abort.NONE:
                    return verdict, times
        return Abort.NONE, times

    def lead(self, req: VideoRequest, *, mp4_path: str, png_path: str | None,
             on_step: StepHook) -> VideoOutcome:
        t0 = time.perf_counter()
        aborted, times = self._denoise(req.steps, on_step)
        out = VideoOutcome(aborted=aborted, step_s=times,
                           timings={"denoise": time.perf_counter() - t0})
        if aborted is not Abort.NONE:
            return out
        t1 = time.perf_counter()
        y, x = np.mgrid[0:req.height, 0:req.width]
        video = np.stack([np.stack([(x + 3 * i + req.seed) % 256, (y * 2) % 256,
                                    np.full_like(x, 96)], -1) for i in range(req.frames)])
        rate = 32_000
        t = np.arange(round(req.frames / self.rules.fps * rate)) / rate
        audio = np.stack([0.2 * np.sin(2 * np.pi * 440 * t), 0.2 * np.sin(2 * np.pi * 554 * t)])
        try:
            out.file = write_mp4(mp4_path, video.astype(np.uint8), audio.astype(np.float32),
                                 fps=self.rules.fps, sample_rate=rate, first_frame_png=png_path)
        except OSError as e:
            log.exception("writing %s failed", mp4_path)
            out.error = f"the video could not be written ({e.strerror or type(e).__name__})"
        out.timings["mux"] = time.perf_counter() - t1
        return out

    def follow(self, req: VideoRequest) -> None:
        self._denoise(req.steps, None)
