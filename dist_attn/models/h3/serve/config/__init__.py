# SPDX-License-Identifier: Apache-2.0
"""The deployment, validated: one dataclass per TOML section, H3's packing rules, the quality tiers,
and the loader. Imports the dist_attn library only; every other part of the server imports it."""

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.jobs import JobsConfig
from dist_attn.models.h3.serve.config.load import (DEFAULT_CONFIG_PATH, SHIPPED_CONFIGS,
                                                   apply_overrides, load_config, parse_config)
from dist_attn.models.h3.serve.config.memory import DecodeConfig, MemoryConfig
from dist_attn.models.h3.serve.config.sections import (H3_ARCHITECTURE, ModelConfig, ParallelConfig,
                                                       RequestConfig, RuntimeConfig, ServeConfig)
from dist_attn.models.h3.serve.config.tokens import PackedLayout, TokenConfig

__all__ = [
    "Config",
    "DecodeConfig",
    "MemoryConfig",
    "DEFAULT_CONFIG_PATH",
    "H3_ARCHITECTURE",
    "JobsConfig",
    "ModelConfig",
    "PackedLayout",
    "ParallelConfig",
    "RequestConfig",
    "RuntimeConfig",
    "SHIPPED_CONFIGS",
    "ServeConfig",
    "TokenConfig",
    "apply_overrides",
    "load_config",
    "parse_config",
]
