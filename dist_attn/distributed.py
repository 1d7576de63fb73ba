"""Process-group setup from torchrun's environment, and the group facts every call needs.

One owner for the question "which device and which process-group backend does this rank use":
the served DiT, the benchmarks and user scripts all call :func:`init_distributed`.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistEnv", "init_distributed", "group_size_and_rank"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class DistEnv:
    """This process's place in a torchrun job."""

    rank: int
    """Global rank (0 outside torchrun)."""
    world_size: int
    """Number of ranks (1 outside torchrun)."""
    local_rank: int
    """Rank within this host."""
    device: torch.device
    """The device this rank computes on."""
    backend: str | None
    """The process-group backend ("nccl" or "gloo"), None when no group was created."""
    shared_gpu: bool = False
    """True when several local ranks share one GPU (gloo only; NCCL refuses it)."""

    @property
    def distributed(self) -> bool:
        """Whether a process group of more than one rank exists."""
        return self.world_size > 1


def init_distributed(*, backend: str = "auto", device: str = "auto",
                     timeout_s: float | None = None) -> DistEnv:
    """Reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), picks this
    rank's device and initialises the default process group when the world has > 1 rank.

    Args:
        backend: ``"auto"``: NCCL when every local rank has a GPU of its own, else gloo (logged);
            ``"nccl"`` or ``"gloo"``: exactly that, or a ValueError saying why it cannot run.
        device: ``"auto"`` (CUDA when available), ``"cuda"`` or ``"cpu"``.
        timeout_s: process-group timeout (None: torch's default). A rank whose peers died leaves
            its collective after at most this long.

    Returns:
        A :class:`DistEnv`. With gloo and fewer GPUs than local ranks, ranks share ``cuda:0``.
    """
    if backend not in ("auto", "nccl", "gloo"):
        raise ValueError(f"backend={backend!r} must be 'auto', 'nccl' or 'gloo'")
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"device={device!r} must be 'auto', 'cuda' or 'cpu'")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch.cuda.is_available() is False")
    ngpu = torch.cuda.device_count() if use_cuda else 0
    if backend == "auto":
        backend = "nccl" if use_cuda and ngpu >= local_world and dist.is_nccl_available() else "gloo"
        if world > 1:
            logger.info("process-group backend 'auto' chose %s (%d GPU(s) for %d local rank(s))",
                        backend, ngpu, local_world)
    if backend == "nccl" and (not use_cuda or ngpu < local_world):
        # NCCL refuses two ranks on one GPU ("Duplicate GPU detected").
        raise ValueError(f"backend='nccl' needs one GPU per local rank: {ngpu} GPU(s) for "
                         f"{local_world} local rank(s); use backend='gloo' to share GPUs")
    shared = bool(use_cuda and ngpu < local_world)
    if use_cuda:
        dev = torch.device("cuda", 0 if shared else local_rank % ngpu)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        if backend == "nccl":
            # NVLink SHARP multicast is unavailable on some hosts and NCCL / symmetric memory
            # then fail at init; the ordinary NVLink path is what Ulysses needs.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        if timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world, **kwargs)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=dev,
                   backend=backend if world > 1 else None, shared_gpu=shared)


def group_size_and_rank(group=None):
    """``(group, world_size, rank)`` of ``group``; ``(None, 1, 0)`` when torch.distributed is not
    initialised. ``group=None`` means the default group (``dist.group.WORLD``)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"group={group!r} was given but torch.distributed is not initialised")
        return None, 1, 0
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)
