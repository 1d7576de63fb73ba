# SPDX-License-Identifier: Apache-2.0
"""The work, apart from the model and HTTP: what a job asks (the request schemas), where it waits
(the queue, the SQLite store), what runs it (the runner contract) and what it becomes (the MP4)."""

from dist_attn.models.h3.serve.jobs.queue import (Job, JobError, JobQueue, Liveness, QueueFull,
                                                  StepTimes)
from dist_attn.models.h3.serve.jobs.records import JobRecord, JobStatus, Recovery, StoreError
from dist_attn.models.h3.serve.jobs.requests import Request, RequestError, parse_request
from dist_attn.models.h3.serve.jobs.runner import StepHook, VideoOutcome, VideoRunner
from dist_attn.models.h3.serve.jobs.store import JobStore
from dist_attn.models.h3.serve.jobs.store_open import open_job_store
from dist_attn.models.h3.serve.jobs.synthetic import SyntheticRunner
from dist_attn.models.h3.serve.jobs.videos import VideoRequest, VideoRules, parse_video_request

__all__ = ["Job", "JobError", "JobQueue", "JobRecord", "JobStatus", "JobStore", "Liveness",
           "QueueFull", "Recovery", "Request", "RequestError", "StepHook", "StepTimes",
           "StoreError", "SyntheticRunner", "VideoOutcome", "VideoRequest", "VideoRules",
           "VideoRunner", "open_job_store", "parse_request", "parse_video_request"]
