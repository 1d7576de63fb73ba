"""The served H3-shaped DiT, built on the dist_attn library (which never imports this package).

Config (self-validating TOML dataclasses), the sequence-sharded DiT, quality tiers, weights,
and the rank loops with HTTP on rank 0. Entry point: ``python -m dist_attn.serve`` or
``torchrun ... launch/serve.py``.
"""

from dist_attn.serve.config import Config, load_config
from dist_attn.serve.model import DiT, DiTBlock, build_model
from dist_attn.serve.quality import DeviceFacts, Topology, quality_failures
from dist_attn.serve.weights import WeightsError, load_safetensors, load_weights, save_safetensors

__all__ = [
    "Config",
    "DeviceFacts",
    "DiT",
    "DiTBlock",
    "Topology",
    "WeightsError",
    "build_model",
    "load_config",
    "load_safetensors",
    "load_weights",
    "quality_failures",
    "save_safetensors",
]
