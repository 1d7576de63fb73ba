# SPDX-License-Identifier: Apache-2.0
"""Rank 0's front door: the Starlette app and its uvicorn thread, the /v1/generate and /v1/videos
routes, the gate every request passes, the guarded HTTP/1.1 protocol and the Prometheus metrics."""

from dist_attn.models.h3.serve.http.app import HttpServer, build_app
from dist_attn.models.h3.serve.http.gate import Gate, decode_json
from dist_attn.models.h3.serve.http.metrics import Metrics
from dist_attn.models.h3.serve.http.state import ServerState, VideoJobs, VideoProgress

__all__ = ["Gate", "HttpServer", "Metrics", "ServerState", "VideoJobs", "VideoProgress",
           "build_app", "decode_json"]
