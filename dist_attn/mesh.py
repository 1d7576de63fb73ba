# SPDX-License-Identifier: Apache-2.0
"""The 2-D ("ring", "ulysses") device mesh of hybrid Ulysses x Ring (USP) attention, and the one
rule for which rows each rank holds.

Ulysses is the inner mesh dim (the ranks of one host, all-to-all over NVLink); ring is the outer
one (hosts, point-to-point K/V rotation over the inter-node network). With ``R = mesh.size("ring")``
and ``U = mesh.size("ulysses")``, the rank at mesh coordinate ``(r, u)`` holds shard ``r*U + u`` of
the packed sequence: rows ``[(r*U + u) * S_local, (r*U + u + 1) * S_local)``. The U ranks of ring
position r therefore hold, together, the contiguous ring chunk ``[r*U*S_local, (r+1)*U*S_local)``,
which is what the Ulysses all-to-all gathers for each rank's heads. Code outside this repository
shards its inputs by exactly this rule (:func:`shard_index`).

No process-group state lives here: the mesh is passed in by the caller, and every function reads
only it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dist_attn.distributed import register_for_compile

__all__ = ["MESH_DIM_NAMES", "ParallelGroups", "check_mesh", "check_mesh_or_group", "init_usp_mesh", "parallel_groups",
           "shard_index"]

#: The mesh dim names, outer (ring) first: Ulysses innermost so its all-to-all stays on one host.
MESH_DIM_NAMES = ("ring", "ulysses")


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's place in a Ulysses (x Ring) layout, read from a group or a mesh."""

    ulysses_group: object
    """Process group of the all-to-all (None: no process group, single rank)."""
    ulysses_size: int
    """U, ranks of the all-to-all."""
    ulysses_rank: int
    """u, this rank's index in ``ulysses_group`` (its shard within the ring chunk)."""
    ring_group: object
    """Process group of the K/V rotation (None when ``ring_size == 1``)."""
    ring_size: int
    """R, positions on the ring (1: pure Ulysses)."""
    ring_rank: int
    """r, this rank's ring position (its ring chunk)."""
    ring_send_to: int | None
    """Global rank of ring position ``r + 1`` (same u): where this rank's K/V go each step."""
    ring_recv_from: int | None
    """Global rank of ring position ``r - 1`` (same u): where the next K/V come from."""
    desc: str
    """How the caller's argument is named in messages ("the default process group", ...)."""

    @property
    def world(self) -> int:
        """U * R, the ranks that share one packed sequence."""
        return self.ulysses_size * self.ring_size

    @property
    def shard(self) -> int:
        """``r*U + u``: which ``S_local``-row shard of the packed sequence this rank holds."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def check_mesh(mesh) -> None:
    """Raises unless ``mesh`` is a 2-D ``("ring", "ulysses")`` DeviceMesh holding this rank with
    ranks ascending along ``"ulysses"`` (host facts only: the same verdict on every rank)."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh={mesh!r} must be a torch.distributed.device_mesh.DeviceMesh "
                        f"(build it with dist_attn.init_usp_mesh or init_device_mesh)")
    if mesh.ndim != 2 or tuple(mesh.mesh_dim_names or ()) != MESH_DIM_NAMES:
        raise ValueError(f"mesh has {mesh.ndim} dims named {mesh.mesh_dim_names}; expected 2 dims "
                         f"named {MESH_DIM_NAMES} (ring outer, Ulysses inner)")
    if mesh.get_coordinate() is None:
        raise ValueError(f"this rank ({dist.get_rank()}) is not in mesh {mesh.mesh.tolist()}")
    ranks = mesh.mesh  # [R, U] global ranks; identical on every rank, so the verdict is too
    if ranks.shape[1] > 1 and not bool((ranks[:, 1:] > ranks[:, :-1]).all()):
        # a process group numbers its members in ascending global rank, and the all-to-all
        # delivers shards in that order: a descending Ulysses row would swap shards silently
        raise ValueError(f"mesh {ranks.tolist()}: global ranks must ascend along the 'ulysses' dim "
                         "(each row) so that the all-to-all order matches the shard order")


def check_mesh_or_group(mesh, group) -> None:
    """Raises when both are given: ``group`` means pure Ulysses, ``mesh`` means Ulysses x Ring."""
    if mesh is not None and group is not None:
        raise ValueError("mesh= and group= were both given: pass group= for pure Ulysses or mesh= "
                         "(dims ('ring', 'ulysses')) for Ulysses x Ring, not both")


def parallel_groups(*, mesh=None, group=None) -> ParallelGroups:
    """The groups one forward uses, from a 2-D mesh or a plain Ulysses group (not both).

    Args:
        mesh: a ``DeviceMesh`` with ``mesh_dim_names == ("ring", "ulysses")``, or None.
        group: a process group for pure Ulysses, or None (the default group; a single rank when
            torch.distributed is not initialised).

    Raises:
        ValueError / TypeError naming the argument, before any collective (only host facts are read).
    """
    check_mesh_or_group(mesh, group)
    if mesh is None:
        from dist_attn.distributed import group_size_and_rank

        desc = "the default process group" if group is None else "the given process group"
        group, size, rank = group_size_and_rank(group)
        return ParallelGroups(ulysses_group=group, ulysses_size=size, ulysses_rank=rank,
                              ring_group=None, ring_size=1, ring_rank=0, ring_send_to=None,
                              ring_recv_from=None, desc=desc)
    check_mesh(mesh)
    r, u = mesh.get_coordinate()
    n_ring, n_uly = mesh.mesh.shape
    ranks = mesh.mesh
    ring_group = mesh.get_group("ring") if n_ring > 1 else None
    return ParallelGroups(
        ulysses_group=mesh.get_group("ulysses"), ulysses_size=n_uly, ulysses_rank=u,
        ring_group=ring_group, ring_size=n_ring, ring_rank=r,
        ring_send_to=int(ranks[(r + 1) % n_ring, u]) if n_ring > 1 else None,
        ring_recv_from=int(ranks[(r - 1) % n_ring, u]) if n_ring > 1 else None,
        desc=f"the mesh's 'ulysses' dim (mesh shape ring={n_ring} x ulysses={n_uly})",
    )


def shard_index(mesh) -> int:
    """``r*U + u`` for this rank's mesh coordinate ``(r, u)``: the rank holds rows
    ``[shard * S_local, (shard + 1) * S_local)`` of the packed sequence."""
    return parallel_groups(mesh=mesh).shard


def init_usp_mesh(ring_degree: int, ulysses_degree: int, *, device_type: str | None = None):
    """``init_device_mesh(device_type, (ring_degree, ulysses_degree), mesh_dim_names=("ring",
    "ulysses"))``: consecutive global ranks share a Ulysses group, so with torchrun's numbering
    (one host's ranks consecutive) the all-to-all stays inside a host and the ring crosses hosts.
    The default process group must already exist (e.g. from :func:`dist_attn.init_distributed`)
    and have ``ring_degree * ulysses_degree`` ranks. ``device_type`` None means "cuda" when CUDA
    is available, else "cpu" (gloo).
    """
    from torch.distributed.device_mesh import init_device_mesh

    for name, val in (("ring_degree", ring_degree), ("ulysses_degree", ulysses_degree)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 1:
            raise ValueError(f"{name}={val!r} must be a positive int")
    if not dist.is_initialized():
        raise ValueError("init_usp_mesh needs an initialised default process group "
                         "(call dist_attn.init_distributed() under torchrun first)")
    world = dist.get_world_size()
    if ring_degree * ulysses_degree != world:
        raise ValueError(f"ring_degree={ring_degree} x ulysses_degree={ulysses_degree} = "
                         f"{ring_degree * ulysses_degree} must equal the world size {world}")
    if device_type is None:  # the device the ranks compute on: CUDA when there is one
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device_type, (ring_degree, ulysses_degree), mesh_dim_names=MESH_DIM_NAMES)
    register_for_compile(mesh=mesh)  # so compiled attention can name it
    return mesh

