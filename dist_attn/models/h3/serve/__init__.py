# SPDX-License-Identifier: Apache-2.0
"""The served MiniMax H3 (diffusers' ``MiniMaxH3Transformer3DModel``), built on the dist_attn
library (which never imports this package).

Sub-packages, top down; each imports only those below it (``tests/serve/test_layout.py``):

- ``launch``: the process, from flags to the rank loops (CLI, launch checks, logging, OS,
  warm-up, the ``--nproc-per-node`` supervisor);
- ``ranks``: the rank loops: rank 0 serves HTTP and drives each job on every rank, the others
  follow;
- ``http``: rank 0's front door (the app, the /v1/generate and /v1/videos routes, metrics);
- ``h3``: the model (builder, checkpoints, the /v1/generate engine, the t2va pipeline);
- ``jobs``: the work apart from the model and HTTP (request schemas, queue, store, runner
  contract, MP4);
- ``wire``: what the ranks say to each other (control messages, abort votes, the prompt);
- ``config``: the deployment, validated (sections, H3's packing rules, quality tiers).

Entry point: ``python -m dist_attn.models.h3.serve`` or ``torchrun ... launch/serve.py``. Needs the
``serve`` extra (starlette, uvicorn, prometheus_client, safetensors, accelerate) and the
``diffusers`` extra (the model).
"""

from dist_attn.models.h3.serve.config import Config, load_config
from dist_attn.models.h3.serve.config.quality import DeviceFacts, Topology, quality_failures
from dist_attn.models.h3.serve.h3.model import build_h3, compile_blocks, parallelize
from dist_attn.models.h3.serve.h3.weights import WeightsError, load_output, save_output

__all__ = [
    "Config",
    "DeviceFacts",
    "Topology",
    "WeightsError",
    "build_h3",
    "compile_blocks",
    "load_config",
    "load_output",
    "parallelize",
    "quality_failures",
    "save_output",
]
