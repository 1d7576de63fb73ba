# SPDX-License-Identifier: Apache-2.0
"""One stored video job on every rank, driven by rank 0: the next job taken from the store, the
VIDEO message, the runner's two halves with rank 0's vote after every step (cancel, drain), and
how the job ended written back to the store.

A failure on rank 0 alone (decode, muxing, disk) fails the job and the server serves on; a
failure in the collective path leaves the job 'running' in the store (the restart re-queues it
once) and ends the server."""

from __future__ import annotations

import logging
import os
import time

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.http.state import VideoJobs, VideoProgress
from dist_attn.models.h3.serve.jobs.records import JobRecord, JobStatus, StoreError
from dist_attn.models.h3.serve.jobs.retention import prune_videos, remove_files
from dist_attn.models.h3.serve.jobs.runner import VideoOutcome, VideoRunner, video_wire
from dist_attn.models.h3.serve.ranks.front import Front
from dist_attn.models.h3.serve.ranks.lifecycle import Shutdown
from dist_attn.models.h3.serve.wire.abort import Abort
from dist_attn.models.h3.serve.wire.control import Control, Op, exchange

__all__ = ["VideoDrive"]

log = logging.getLogger(__name__)

# A job store that cannot start the next job (a full disk) is logged at most this often.
_STORE_ERROR_LOG_S = 60.0
# Old videos are looked for after each job and, while idle, this often (jobs.videos_max_age_s).
_PRUNE_EVERY_S = 60.0


class VideoDrive:
    """Runs the stored video jobs on every rank from rank 0 and records how each ended."""

    def __init__(self, cfg: Config, env: DistEnv, runner: VideoRunner, videos: VideoJobs,
                 front: Front, shutdown: Shutdown) -> None:
        self.cfg, self.env, self.runner, self.videos = cfg, env, runner, videos
        self.front, self.shutdown = front, shutdown
        self._store_error_logged = -_STORE_ERROR_LOG_S
        self._pruned = -_PRUNE_EVERY_S

    def start_next(self) -> JobRecord | None:
        """The oldest queued video job, now running; None when there is none or when the store
        cannot commit (a full disk): then the job stays queued (the transaction rolled back),
        the error is logged at most once a minute, and the server serves on (/v1/generate
        included). Old videos are deleted first, once a minute."""
        if time.monotonic() - self._pruned >= _PRUNE_EVERY_S:
            self.prune()
        try:
            return self.videos.store.start_next()
        except StoreError as e:
            now = time.monotonic()
            if now - self._store_error_logged >= _STORE_ERROR_LOG_S:
                self._store_error_logged = now
                log.error("job store %s: the next video job cannot start: %s (retried until it "
                          "can; logged once a minute)", e.path, e)
            return None

    def run(self, record: JobRecord) -> None:
        """Runs one stored video job on every rank and records how it ended."""
        videos, runner, front = self.videos, self.runner, self.front
        req, job_id = record.request, record.id
        progress = VideoProgress(job_id=job_id, rows=req.rows, steps=req.steps,
                                 started=record.started_at or time.time())
        mp4_rel, png_rel = f"videos/{job_id}.mp4", f"videos/{job_id}.png"
        try:
            os.makedirs(os.path.join(videos.output_dir, "videos"), exist_ok=True)
        except OSError as e:  # rank 0 alone, before any collective: this job fails
            log.exception("%s: the videos directory cannot be made", job_id)
            videos.store.fail(job_id, f"the output directory is not writable "
                                      f"({e.strerror or type(e).__name__})")
            front.metrics.video_finished(JobStatus.FAILED.value)
            return
        videos.running = progress
        log.info("%s started (attempt %d): %d frames %dx%d, %d steps, %d rows", job_id,
                 record.attempts, req.frames, req.width, req.height, req.steps, req.rows)

        def on_step(k: int, seconds: float) -> Abort:
            progress.step = k
            front.liveness.contact()  # the step's all-to-alls needed every rank
            front.state.step_times.observe_step(req.rows, seconds)
            front.metrics.observe_step("video", seconds)
            if job_id in videos.cancels:
                return Abort.CANCELLED
            if self.shutdown.older_than(self.cfg.serve.drain_timeout_s):
                return Abort.SHUTDOWN
            return Abort.NONE

        t0 = time.perf_counter()
        try:
            exchange(Control(Op.VIDEO, video_wire(req)), self.env)
            outcome = runner.lead(req, mp4_path=os.path.join(videos.output_dir, mp4_rel),
                                  png_path=(os.path.join(videos.output_dir, png_rel)
                                            if videos.thumbnail else None),
                                  on_step=on_step)
        except Exception:
            log.exception("%s failed in the collective path; the server stops (the job is "
                          "re-queued once at the next start)", job_id)
            raise
        finally:
            videos.running = None
            videos.cancels.discard(job_id)
        front.liveness.contact()
        self._record(record, outcome, time.perf_counter() - t0, mp4_rel, png_rel)
        self.prune()

    def prune(self, now: float | None = None) -> list[str]:
        """Deletes the files of succeeded jobs past ``jobs.videos_kept`` and
        ``jobs.videos_max_age_s`` (:func:`~dist_attn.models.h3.serve.jobs.retention.prune_videos`,
        ``now`` Unix seconds, default the clock's); returns their ids. A store error is logged."""
        jobs = self.cfg.jobs
        self._pruned = time.monotonic()
        try:
            gone = prune_videos(self.videos.store, self.videos.output_dir,
                                keep=jobs.videos_kept, max_age_s=jobs.videos_max_age_s,
                                now=time.time() if now is None else now)
        except StoreError as e:
            log.error("job store %s: old videos cannot be deleted now: %s", e.path, e)
            return []
        if gone:
            log.info("deleted the MP4s of %d job(s) past jobs.videos_kept=%d / "
                     "jobs.videos_max_age_s=%g: %s", len(gone), jobs.videos_kept,
                     jobs.videos_max_age_s, ", ".join(gone))
        return gone

    def _record(self, record: JobRecord, outcome: VideoOutcome, total: float, mp4_rel: str,
                png_rel: str) -> None:
        """Writes how the job ended (``total`` seconds after its VIDEO message) to the store and
        the metrics; rank 0 alone: a store that cannot commit leaves the job as it was."""
        req, job_id = record.request, record.id
        metrics = self.front.metrics
        done = len(outcome.step_s)
        timings = {k: round(v, 4) for k, v in outcome.timings.items()}
        timings.update(queue=round((record.started_at or 0) - record.created_at, 4),
                       total=round(total, 4), step_s=[round(x, 4) for x in outcome.step_s])
        store = self.videos.store
        try:
            if outcome.aborted is Abort.CANCELLED:
                store.cancelled(job_id, f"cancelled by the client after {done} of {req.steps} "
                                        "steps", timings=timings)
                metrics.video_finished(JobStatus.CANCELLED.value)
            elif outcome.aborted is Abort.SHUTDOWN:
                store.requeue(job_id, f"re-queued: the server was stopped after {done} of "
                                      f"{req.steps} steps")
            elif outcome.error is not None or outcome.file is None:
                # the thumbnail is published before the MP4: a failed MP4 left it behind
                remove_files(self.videos.output_dir, [mp4_rel, png_rel])
                store.fail(job_id, outcome.error or "no video was written", timings=timings)
                metrics.video_finished(JobStatus.FAILED.value)
            else:
                thumb = png_rel if outcome.file.png_path else None
                store.succeed(job_id, output=mp4_rel, thumbnail=thumb, timings=timings)
                self.front.state.step_times.observe_overhead("video", max(0.0, total
                                                                          - sum(outcome.step_s)))
                phases = {k: v for k, v in timings.items() if isinstance(v, float)}
                metrics.video_finished(JobStatus.SUCCEEDED.value, phases)
        except Exception:  # noqa: BLE001 - rank 0 alone: the store stays as it was (running)
            log.exception("%s: recording its end in the job store failed", job_id)
            return
        log.info("%s %s after %d of %d steps in %.2f s", job_id,
                 outcome.aborted.label if outcome.aborted is not Abort.NONE
                 else ("failed" if outcome.error else "succeeded"), done, req.steps, total)
