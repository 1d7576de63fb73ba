# SPDX-License-Identifier: Apache-2.0
"""Quality tiers, decided at launch on every rank before the model is built.

Every rank describes its device (:func:`local_device_facts`), the facts are gathered with
``all_gather_object`` (:func:`gather_device_facts`, by :mod:`dist_attn.agreement`), and every
rank runs the same PURE decision (:func:`quality_failures`) on the same list, so all ranks agree
and exit together without any further collective: a failed check cannot hang.

Tiers (``--quality``):
    absent      no constraint; every backend (Sage included) and any topology the config allows.
    "lossless"  exact bf16 kernels only; a backend that declares 8-bit numerics (Sage) is an
                error, and so are FP8 linear layers (``model.linear_precision="fp8"``).
    "high"      the strict H3 deployment: exactly 4 ranks on one host, each on its own GPU, every
                GPU an H200 with compute capability 9.0, all four identical, every pair
                peer-accessible (P2P), Ulysses degree 4, ring 1, tensor parallel 1. Sage and FP8
                linear layers allowed.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, get_args

import torch

__all__ = [
    "QualityTier",
    "QUALITY_TIERS",
    "DeviceFacts",
    "Topology",
    "QualityError",
    "HIGH_WORLD_SIZE",
    "local_device_facts",
    "gather_device_facts",
    "quality_failures",
    "is_8bit_backend",
    "registered_backend",
    "check_tier_name",
    "tier_name_rule",
    "tier_backend_rule",
    "tier_exact_only",
    "tier_linear_rule",
    "tier_compile_rule",
]

#: Valid ``--quality`` values. ``None`` (flag absent) means no tier constraint.
QualityTier = Literal["lossless", "high"]
QUALITY_TIERS: tuple[str, ...] = get_args(QualityTier)

#: quality="high" is the 4 x H200 H3 deployment: Ulysses 4 over one host's NVLink.
HIGH_WORLD_SIZE = 4
_HIGH_GPU = "H200"
_HIGH_CAPABILITY = (9, 0)


class QualityError(RuntimeError):
    """The launch does not meet its quality tier; the message lists every failed condition."""


@dataclass(kw_only=True, frozen=True)
class DeviceFacts:
    """What one rank reports about itself (picklable; gathered with all_gather_object)."""

    rank: int
    """Global rank."""
    hostname: str
    """Host the rank runs on."""
    device_type: str
    """"cuda" or "cpu"."""
    device_index: int | None = None
    """CUDA ordinal the rank uses, as seen by the process."""
    device_uuid: str | None = None
    """GPU UUID (identifies a physical GPU even when ordinals are remapped)."""
    gpu_name: str | None = None
    """torch.cuda.get_device_name, e.g. "NVIDIA H200"."""
    capability: tuple[int, int] | None = None
    """Compute capability (major, minor)."""
    total_memory: int | None = None
    """Bytes of device memory."""
    peer_access: dict[int, bool] = field(default_factory=dict)
    """Other visible CUDA ordinal -> can this rank's device access it peer-to-peer."""


@dataclass(kw_only=True, frozen=True)
class Topology:
    """The parallel layout being launched (from the config and the world size)."""

    world_size: int
    ulysses_degree: int
    ring_degree: int = 1
    tensor_parallel: int = 1


def local_device_facts(rank: int, device: torch.device) -> DeviceFacts:
    """Describes ``device`` as used by ``rank`` (queries CUDA only if the device is CUDA)."""
    host = socket.gethostname()
    if device.type != "cuda":
        return DeviceFacts(rank=rank, hostname=host, device_type=device.type)
    idx = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(idx)
    peers = {j: bool(torch.cuda.can_device_access_peer(idx, j))
             for j in range(torch.cuda.device_count()) if j != idx}
    return DeviceFacts(rank=rank, hostname=host, device_type="cuda", device_index=idx,
                       device_uuid=str(getattr(props, "uuid", "")) or None,
                       gpu_name=props.name, capability=(props.major, props.minor),
                       total_memory=int(props.total_memory), peer_access=peers)


def gather_device_facts(facts: DeviceFacts, group: Any = None) -> list[DeviceFacts]:
    """All ranks' facts, in rank order (one all_gather_object; local list if not distributed)."""
    from dist_attn.agreement import gather_objects

    out = gather_objects(dataclasses.asdict(facts), group)
    return [DeviceFacts(**{**d, "capability": tuple(d["capability"]) if d["capability"] else None})
            for d in out]


def registered_backend(name: str):
    """The core's backend object called ``name``, or None when no such backend is registered."""
    from dist_attn import available_backends, get_backend

    return get_backend(name) if name in available_backends() and name != "auto" else None


def is_8bit_backend(name: str, backend: Any = None) -> bool:
    """Whether a backend quantizes to 8 bits, as it declares (``AttentionBackend.exact`` False):
    ``backend``, else the backend registered as ``name``. "auto" and a name not registered yet
    declare nothing (False): "auto" under "lossless" resolves exact kernels only, and the launch
    checks the resolved backend's object again."""
    if backend is None:
        backend = registered_backend(name)
    return backend is not None and not backend.exact


def tier_name_rule(tier: Any) -> str | None:
    """The broken rule (to follow the offending value in a message) if ``tier`` is not None or
    a quality tier, else None."""
    if tier is None or tier in QUALITY_TIERS:
        return None
    return ("is not a quality tier; valid values: " + ", ".join(map(repr, QUALITY_TIERS))
            + " (absent: no constraint)")


def check_tier_name(tier: str | None) -> None:
    """Raises ValueError listing the valid values if ``tier`` is not a quality tier."""
    rule = tier_name_rule(tier)
    if rule:
        raise ValueError(f"quality={tier!r} {rule}")


def tier_backend_rule(tier: str | None, name: str, backend: Any = None) -> str | None:
    """The broken rule if ``tier`` does not admit the attention backend ``name`` (object
    ``backend`` when known), else None. Only "lossless" restricts backends: no 8-bit kernel."""
    if tier == "lossless" and is_8bit_backend(name, backend):
        return ("is an 8-bit backend, not allowed under quality='lossless' (exact kernels only; "
                "use 'sdpa' or 'auto')")
    return None


def tier_linear_rule(tier: str | None, linear_precision: str) -> str | None:
    """The broken rule if ``tier`` does not admit the linear layers' precision, else None. Only
    "lossless" restricts it: FP8 linears round every activation and weight to 3 mantissa bits."""
    if tier == "lossless" and linear_precision != "bf16":
        return ("quantizes the blocks' linear layers to 8 bits (e4m3), not allowed under "
                "quality='lossless' (exact layers only; use 'bf16')")
    return None


def tier_compile_rule(tier: str | None, compile: bool | str) -> str | None:
    """The broken rule if ``tier`` does not admit compiling the blocks, else None. "lossless"
    serves the eager bf16 path bit for bit: inductor fuses the norms, RoPE and residual adds and
    rounds differently ("auto" then stays eager; an explicit ``true`` is refused)."""
    if tier == "lossless" and compile is True:
        return ("compiles the blocks, whose fused kernels round differently from the eager bf16 "
                "path that quality='lossless' serves bit for bit (use false or \"auto\")")
    return None


def tier_exact_only(tier: str | None) -> bool:
    """Whether ``tier`` admits exact kernels only: then "auto" chooses among those (FA3 when
    importable on Hopper, else torch SDPA)."""
    return tier == "lossless"


def _fmt(values: Sequence[Any]) -> str:
    return "[" + ", ".join(f"rank {i}: {v}" for i, v in enumerate(values)) + "]"


def quality_failures(tier: str | None, facts: Sequence[DeviceFacts], topology: Topology,
                     *, backend: str = "auto", backend_obj: Any = None,
                     linear_precision: str = "bf16") -> list[str]:
    """Every condition of ``tier`` that the gathered ``facts`` and ``topology`` fail, each with
    the value observed. Empty list: the launch meets the tier. PURE: no device or process-group
    access, so it is unit-tested with fake facts.

    Args:
        tier: None, "lossless" or "high".
        facts: one DeviceFacts per rank, in rank order.
        topology: the parallel layout being launched.
        backend: the (resolved, if known) attention backend name; ``backend_obj`` its object.
        linear_precision: ``model.linear_precision`` ("bf16" or "fp8").
    """
    check_tier_name(tier)
    if tier is None:
        return []
    if tier == "lossless":
        return _lossless_failures(backend, backend_obj, linear_precision)
    return [*_high_device_failures(facts, topology), *_high_p2p_failures(facts),
            *_high_topology_failures(topology)]


def _lossless_failures(backend: str, backend_obj: Any, linear_precision: str) -> list[str]:
    """quality="lossless": the attention backend and the linear layers' precision."""
    failures = []
    rule = tier_backend_rule("lossless", backend, backend_obj)
    if rule:
        failures.append(f"backend: {backend!r} {rule}")
    rule = tier_linear_rule("lossless", linear_precision)
    if rule:
        failures.append(f"linear layers: model.linear_precision={linear_precision!r} {rule}")
    return failures


def _high_device_failures(facts: Sequence[DeviceFacts], topology: Topology) -> list[str]:
    """quality="high": the world size, one host, and an own GPU of the one model per rank."""
    failures = []
    if topology.world_size != HIGH_WORLD_SIZE or len(facts) != HIGH_WORLD_SIZE:
        failures.append(f"world size: exactly {HIGH_WORLD_SIZE} ranks required, observed "
                        f"{topology.world_size}")
    hosts = sorted({f.hostname for f in facts})
    if len(hosts) != 1:
        failures.append(f"one host: all ranks must share one host, observed {len(hosts)} hosts "
                        f"{hosts}")
    not_cuda = [f.rank for f in facts if f.device_type != "cuda"]
    if not_cuda:
        failures.append(f"GPU per rank: every rank must run on a CUDA GPU, observed device "
                        f"types {_fmt([f.device_type for f in facts])}")
    gpus = [(f.hostname, f.device_uuid or f.device_index) for f in facts if f.device_type == "cuda"]
    if len(set(gpus)) != len(gpus):
        failures.append(f"own GPU: each rank needs its own GPU, observed devices "
                        f"{_fmt([f.device_uuid or f.device_index for f in facts])}")
    names = [f.gpu_name for f in facts]
    if not all(name and _HIGH_GPU in name for name in names):
        failures.append(f"GPU model: every GPU name must contain {_HIGH_GPU}, observed "
                        f"{_fmt(names)}")
    caps = [f.capability for f in facts]
    if not all(c == _HIGH_CAPABILITY for c in caps):
        want = ".".join(map(str, _HIGH_CAPABILITY))
        failures.append(f"compute capability: every GPU must be {want}, observed "
                        f"{_fmt(['.'.join(map(str, c)) if c else None for c in caps])}")
    kinds = {(f.gpu_name, f.capability, f.total_memory) for f in facts}
    if len(kinds) > 1:
        failures.append(f"identical GPUs: all GPUs must be the same model, observed "
                        f"{_fmt([(f.gpu_name, f.total_memory) for f in facts])}")
    return failures


def _high_p2p_failures(facts: Sequence[DeviceFacts]) -> list[str]:
    """quality="high": every pair of one host's CUDA ranks on distinct GPUs is peer-accessible
    both ways."""
    cuda = [f for f in facts if f.device_type == "cuda" and f.device_index is not None]
    no_p2p = []
    for a in cuda:
        for b in cuda:
            if a.rank < b.rank and a.hostname == b.hostname and a.device_index != b.device_index:
                if not (a.peer_access.get(b.device_index) and b.peer_access.get(a.device_index)):
                    no_p2p.append(f"{a.rank}<->{b.rank}")
    if not no_p2p:
        return []
    return [f"P2P: every GPU pair must be peer-accessible, observed no peer access "
            f"between ranks {', '.join(no_p2p)}"]


def _high_topology_failures(topology: Topology) -> list[str]:
    """quality="high": Ulysses over all :data:`HIGH_WORLD_SIZE` ranks, no ring, no tensor
    parallelism."""
    failures = []
    if topology.ulysses_degree != HIGH_WORLD_SIZE:
        failures.append(f"Ulysses degree: must be {HIGH_WORLD_SIZE}, observed "
                        f"{topology.ulysses_degree}")
    if topology.ring_degree != 1:
        failures.append(f"ring degree: must be 1, observed {topology.ring_degree}")
    if topology.tensor_parallel != 1:
        failures.append(f"tensor parallel: must be 1, observed {topology.tensor_parallel}")
    return failures
