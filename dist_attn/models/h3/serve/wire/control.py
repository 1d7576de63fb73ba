# SPDX-License-Identifier: Apache-2.0
"""The control messages rank 0 sends every other rank (the rank loops' one channel).

Control messages travel as ONE int64 broadcast from rank 0: ``[op, frames, height, width,
steps, seed]`` (one small tensor, where broadcast_object_list takes two broadcasts plus pickling:
less than half the time on loaded CPU gloo; docs/serving.md). A broadcast can return on rank
0 before a stopped rank has received it (the bytes sit in a socket buffer), so a heartbeat is
followed by a one-integer all-reduce that completes only once every rank has entered it: that is
the proof of life /health reports. RUN needs no such answer: the denoise steps' all-to-alls are.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dist_attn.distributed import DistEnv

__all__ = ["Op", "Control", "WIRE_FIELDS", "comm_device", "exchange"]

#: The integer fields of a request, in the order they travel to the other ranks (the slots of a
#: RUN or VIDEO message after its op).
WIRE_FIELDS = ("frames", "height", "width", "steps", "seed")


class Op(enum.IntEnum):
    """Control operations (0 is never sent: it is what the non-root ranks contribute)."""

    HEARTBEAT = 1
    RUN = 2
    SHUTDOWN = 3
    VIDEO = 4
    """A video job: its integers (runner.video_wire) follow; the runner does the rest."""


@dataclass(frozen=True)
class Control:
    """One control message; ``request`` holds the request's wire integers for Op.RUN."""

    op: Op
    request: tuple[int, ...] = ()


def comm_device(env: DistEnv) -> torch.device:
    """Where a tensor sent between ranks lives: NCCL moves device tensors only; gloo is fastest on
    host tensors."""
    return env.device if env.backend == "nccl" else torch.device("cpu")


def exchange(msg: Control | None, env: DistEnv) -> Control:
    """Rank 0 passes ``msg``; the other ranks pass None and block (up to the process-group
    timeout) until rank 0 sends. A HEARTBEAT returns on rank 0 only once every rank answered."""
    if not env.distributed:
        assert msg is not None, "a single rank is rank 0"
        return msg
    wire = torch.zeros(1 + len(WIRE_FIELDS), dtype=torch.int64)
    if msg is not None:
        wire[0] = int(msg.op)
        if msg.request:
            wire[1:] = torch.tensor(msg.request, dtype=torch.int64)
    wire = wire.to(comm_device(env))
    dist.broadcast(wire, src=0)
    got = msg
    if got is None:
        values = wire.tolist()
        op = Op(values[0])
        got = Control(op, tuple(values[1:]) if op in (Op.RUN, Op.VIDEO) else ())
    if got.op is Op.HEARTBEAT:
        dist.all_reduce(torch.ones(1, dtype=torch.int64, device=comm_device(env)))
    return got
