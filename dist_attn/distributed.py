# SPDX-License-Identifier: Apache-2.0
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

__all__ = ["DistEnv", "init_distributed", "group_size_and_rank", "register_for_compile", "compile_key",
           "resolve_compile_key"]

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
    check_group(group)
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group), dist.get_rank(group)


#: what ``dist.new_group(ranks)`` returns on the ranks outside ``ranks`` (-100 in torch 2.x).
_NON_GROUP_MEMBER = getattr(getattr(dist, "GroupMember", None), "NON_GROUP_MEMBER", -100)


def check_group(group) -> None:
    """Raises unless ``group`` is None (the default group) or a process group this rank belongs
    to. ``dist.new_group(ranks)`` returns ``GroupMember.NON_GROUP_MEMBER`` (-100) on the ranks it
    leaves out, where ``get_world_size`` answers -1 instead of raising."""
    if group is None:
        return
    # A plain int compare: Dynamo traces it (it could not trace the object() sentinel this used).
    if isinstance(group, int) and not isinstance(group, bool) and group == _NON_GROUP_MEMBER:
        where = f"global rank {dist.get_rank()}" if dist.is_initialized() else "this process"
        raise ValueError(f"group={group!r} is torch.distributed's NON_GROUP_MEMBER: {where} is not "
                         "a member of the group (dist.new_group(ranks) returns it on the ranks "
                         "outside ranks); pass a group that contains every calling rank")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed.ProcessGroup or None "
                        "(the default group)")


# ---- process groups and meshes across torch.compile's custom-op boundary ----
# The op takes strings, not groups, so it receives a key into this table. Keys are entered
# EAGERLY: Dynamo replays writes to module state only after the compiled graph has run, so a key
# written while tracing would be missing when the op first runs. Entries hold strong references,
# so an id() is never reused by another object while it is in the table.
_BY_KEY: dict[str, object] = {}
_KEY_BY_ID: dict[int, str] = {}


def register_for_compile(group=None, mesh=None) -> str:
    """Enters ``group`` or ``mesh`` in the table the compiled attention op reads; returns its key
    ("" for the default group). Call it outside compiled code: :class:`UlyssesSageAttention`
    and :func:`dist_attn.mesh.init_usp_mesh` do so themselves."""
    obj = mesh if mesh is not None else group
    if obj is None:
        return ""
    key = _KEY_BY_ID.get(id(obj))
    if key is None:
        key = f"{'mesh' if mesh is not None else 'pg'}:{id(obj)}"
        _BY_KEY[key] = obj
        _KEY_BY_ID[id(obj)] = key
    return key


def compile_key(group=None, mesh=None) -> str:
    """The key of ``group`` / ``mesh`` without writing anything (safe inside traced code).

    A group that was never registered is named by its ``group_name`` (torch resolves that name
    at run time); a mesh must have been registered, else ValueError says how.
    """
    obj = mesh if mesh is not None else group
    if obj is None:
        return ""
    key = _KEY_BY_ID.get(id(obj))
    if key is not None:
        return key
    if mesh is None:
        return "pgname:" + group.group_name
    raise ValueError("mesh= under torch.compile: the mesh must be registered outside the compiled "
                     "region; build UlyssesSageAttention(mesh=...) there, create the mesh with "
                     "dist_attn.mesh.init_usp_mesh, or call "
                     "dist_attn.distributed.register_for_compile(mesh=mesh) first")


def resolve_compile_key(key: str) -> tuple[object, object]:
    """``(group, mesh)`` for a key from :func:`register_for_compile` / :func:`compile_key`."""
    if not key:
        return None, None
    if key.startswith("pgname:"):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(key[len("pgname:"):]), None
    obj = _BY_KEY[key]
    return (None, obj) if key.startswith("mesh:") else (obj, None)
