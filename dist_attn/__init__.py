# SPDX-License-Identifier: Apache-2.0
"""dist_attn: Ulysses sequence-parallel attention with 8-bit Sage kernels for video DiTs."""

from dist_attn.backends.base import AttentionBackend, BackendUnavailableError
from dist_attn.backends.registry import (available_backends, get_backend, register_backend,
                                         resolve_backend, unregister_backend)
from dist_attn.varlen import sage_varlen, trailing_padding_used_len
from dist_attn.distributed import DistEnv, init_distributed
from dist_attn.buffers import StagingBuffers, StagingCapacityError, default_staging_buffers
from dist_attn.profiling import PhaseTimer
from dist_attn.qk_prologue import QKNormRope
from dist_attn.sharding import SequenceShard, gather_sequence, plan_shard, shard_rows, shard_sequence
from dist_attn.ulysses import UlyssesSageAttention, ulysses_attention
from dist_attn.mesh import init_usp_mesh, shard_index
from dist_attn import _moved

_moved.install()  # the old import paths of what moved to dist_attn.models.h3, for one release

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "DistEnv",
    "PhaseTimer",
    "QKNormRope",
    "SequenceShard",
    "StagingBuffers",
    "StagingCapacityError",
    "UlyssesSageAttention",
    "available_backends",
    "default_staging_buffers",
    "gather_sequence",
    "get_backend",
    "init_distributed",
    "init_usp_mesh",
    "plan_shard",
    "register_backend",
    "resolve_backend",
    "sage_varlen",
    "shard_index",
    "shard_rows",
    "shard_sequence",
    "trailing_padding_used_len",
    "ulysses_attention",
    "unregister_backend",
]

__version__ = "0.1.0"
