# SPDX-License-Identifier: Apache-2.0
"""Why a job stops early, and the vote that stops it on every rank at the same step."""

from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from dist_attn.distributed import DistEnv
from dist_attn.models.h3.serve.wire.control import comm_device

__all__ = ["Abort", "agree_abort"]


class Abort(enum.IntEnum):
    """Why a job stops early; travels between ranks as an integer (max over ranks wins)."""

    NONE = 0
    CLIENT_GONE = 1
    DEADLINE = 2
    SHUTDOWN = 3
    CANCELLED = 4
    """The client cancelled the job (DELETE /v1/videos/{id})."""

    @property
    def label(self) -> str:
        """The metrics label of this reason."""
        return self.name.lower()


def agree_abort(local: Abort, env: DistEnv) -> Abort:
    """Every rank's vote in, the same verdict out on every rank (the largest reason wins), so all
    ranks leave a denoise loop at the same step. One all-reduce of one integer."""
    if not env.distributed:
        return local
    vote = torch.tensor([int(local)], dtype=torch.int64, device=comm_device(env))
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    return Abort(int(vote.item()))
