# SPDX-License-Identifier: Apache-2.0
"""Launch checks on every rank before the model is built: backend, quality tier, topology.

Every rank ends with the same list of failures (local findings are merged with one
all_gather_object), so all ranks take the same exit and a failed check cannot hang.
"""

from __future__ import annotations

from typing import Any

import torch

from dist_attn.agreement import gather_objects
from dist_attn.distributed import DistEnv
from dist_attn.models.h3.fp8.linear import fp8_unsupported_reason, require_torchao
from dist_attn.plan import heads_per_rank
from dist_attn.ring import check_ring_transport, resolve_ring_backend
from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.quality import (Topology, gather_device_facts,
                                                      local_device_facts, quality_failures,
                                                      tier_exact_only)

__all__ = ["linear_precision_failures", "resolve_backend_name", "run_launch_checks"]

# Rows of the probe tensor the backend registry is asked with (its rules read the shape's heads,
# head_dim, dtype and device, not the length).
_PROBE_ROWS = 64


def resolve_backend_name(cfg: Config, env: DistEnv, dtype: torch.dtype) -> tuple[str, Any]:
    """The attention backend that will run, as (name, backend object).

    The core's registry is asked with a probe tensor of this rank's largest per-rank head
    count; an unavailable backend (e.g. Sage on CPU) raises here, before the model is built.
    "auto" chooses among exact kernels under quality="lossless", and among kernels that return a
    log-sum-exp when the ring degree is above 1 (the ring merges partial results with it).
    """
    name = cfg.runtime.backend
    heads = max(heads_per_rank(cfg.model.num_heads, cfg.parallel.resolved_ulysses(env.world_size)))
    probe = torch.zeros(_PROBE_ROWS, heads, cfg.model.head_dim, dtype=dtype,
                        device=env.device)
    obj = resolve_ring_backend(name, probe, ring_size=cfg.parallel.ring_degree,
                               exact_only=tier_exact_only(cfg.runtime.quality))
    return str(getattr(obj, "name", name)), obj


def linear_precision_failures(cfg: Config, env: DistEnv) -> list[str]:
    """Why this rank cannot run ``model.linear_precision`` (empty: it can). "fp8" needs a CUDA
    device of compute capability >= 8.9 and torchao; nothing falls back to bf16 silently."""
    precision = cfg.model.linear_precision
    if precision != "fp8":
        return []
    reason = fp8_unsupported_reason(env.device)
    if reason is None:
        try:
            require_torchao()
        except ImportError as e:
            reason = str(e)
    return [f"model.linear_precision={precision!r} cannot run here: {reason}"] if reason else []


def run_launch_checks(cfg: Config, env: DistEnv, dtype: torch.dtype,
                      local_failures: list[str] | None = None) -> tuple[str, list[str]]:
    """Quality tier, backend and topology checks from gathered device facts.

    ``local_failures``: what this rank found on its own (rank 0: a port in use). Returns
    (resolved backend name, failures), the failures identical on every rank.
    """
    failures: list[str] = list(local_failures or [])
    try:
        backend, obj = resolve_backend_name(cfg, env, dtype)
    except Exception as e:  # noqa: BLE001 - reported as a failed launch condition
        backend, obj = cfg.runtime.backend, None
        failures.append(f"backend: {cfg.runtime.backend!r} cannot run here ({e})")
    facts = gather_device_facts(local_device_facts(env.rank, env.device))
    p = cfg.parallel
    topo = Topology(world_size=env.world_size, ulysses_degree=p.resolved_ulysses(env.world_size),
                    ring_degree=p.ring_degree, tensor_parallel=p.tensor_parallel)
    failures += quality_failures(cfg.runtime.quality, facts, topo, backend=backend,
                                 backend_obj=obj, linear_precision=cfg.model.linear_precision)
    failures += linear_precision_failures(cfg, env)
    try:
        cfg.check_backend(backend)
    except ValueError as e:
        failures.append(str(e))
    if p.tensor_parallel != 1:
        failures.append(f"tensor_parallel={p.tensor_parallel}: only Ulysses and ring are "
                        "implemented (tensor_parallel must be 1)")
    try:
        check_ring_transport(ring_size=p.ring_degree, comm_backend=env.backend, device=env.device)
    except ValueError as e:
        failures.append(f"parallel.ring_degree={p.ring_degree}: {e}")
    if env.distributed:
        everyone = gather_objects(failures)
        merged: list[str] = []
        for rank_failures in everyone:
            merged += [f for f in rank_failures if f not in merged]
        failures = merged
    return backend, failures
