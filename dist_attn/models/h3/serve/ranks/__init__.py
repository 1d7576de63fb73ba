# SPDX-License-Identifier: Apache-2.0
"""The rank loops: rank 0 serves HTTP, decides which job runs and drives it on every rank; every
other rank follows its control messages. Exports :func:`serve`, the loop of every rank."""

from dist_attn.models.h3.serve.ranks.front import Front
from dist_attn.models.h3.serve.ranks.generate import GenerateDrive
from dist_attn.models.h3.serve.ranks.lifecycle import Shutdown, mark_ready
from dist_attn.models.h3.serve.ranks.loop import Rank0, serve
from dist_attn.models.h3.serve.ranks.video import VideoDrive

__all__ = ["Front", "GenerateDrive", "Rank0", "Shutdown", "VideoDrive", "mark_ready", "serve"]
