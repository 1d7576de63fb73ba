"""dist_attn: Ulysses sequence-parallel attention with 8-bit Sage kernels for video DiTs."""

from dist_attn.backends import (
    AttentionBackend,
    BackendUnavailableError,
    available_backends,
    get_backend,
    register_backend,
    resolve_backend,
    unregister_backend,
)
from dist_attn.bridge import sage_varlen, trailing_padding_used_len
from dist_attn.config import Config, load_config
from dist_attn.buffers import StagingBuffers, StagingCapacityError, default_staging_buffers
from dist_attn.profiling import PhaseTimer
from dist_attn.ulysses import UlyssesSageAttention, ulysses_attention
from dist_attn.model import DiT, DiTBlock, build_model
from dist_attn.quality import DeviceFacts, Topology, quality_failures
from dist_attn.weights import WeightsError, load_safetensors, load_weights, save_safetensors

__all__ = [
    "AttentionBackend",
    "BackendUnavailableError",
    "Config",
    "DeviceFacts",
    "DiT",
    "DiTBlock",
    "Topology",
    "WeightsError",
    "PhaseTimer",
    "StagingBuffers",
    "StagingCapacityError",
    "UlyssesSageAttention",
    "available_backends",
    "build_model",
    "load_config",
    "load_safetensors",
    "load_weights",
    "quality_failures",
    "save_safetensors",
    "default_staging_buffers",
    "get_backend",
    "register_backend",
    "resolve_backend",
    "sage_varlen",
    "trailing_padding_used_len",
    "ulysses_attention",
    "unregister_backend",
]

__version__ = "0.1.0"
