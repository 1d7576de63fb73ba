"""Serving configuration loaded from TOML: a file, parsed and validated, then overridden.

A config file has one table per dataclass::

    [model]     -> ModelConfig     (the arguments of diffusers' MiniMaxH3Transformer3DModel)
    [tokens]    -> TokenConfig     (H3's pipeline rules: request -> packed rows, the schedules)
    [parallel]  -> ParallelConfig  (Ulysses / ring / tensor-parallel degrees)
    [runtime]   -> RuntimeConfig   (backend, dtype, quality tier, timeouts)
    [request]   -> RequestConfig   (the default request: ``--once`` and the benchmark)
    [serve]     -> ServeConfig     (HTTP server and request limits)
    [jobs]      -> JobsConfig      (video jobs: store, output directory, runner)
    [memory]    -> MemoryConfig    (the launch's memory pre-flight)
    [decode]    -> DecodeConfig    (the video decode's batch and compilation)

Every ``__post_init__`` raises :class:`ValueError` naming the field, its value and the rule it
breaks. Rules that need the world size (heads vs Ulysses degree, the parallel degrees)
are checked by :meth:`Config.check_world`, which the launcher calls on every rank before the
process group is used.

``load_config(None)`` reads the repository's ``configs/tiny.toml`` (the one copy of the default),
so ``torchrun --nproc-per-node 4 launch/serve.py`` works with no arguments from a checkout or an
editable install (``pip install -e .``).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path
from typing import Any

from dist_attn.serve.config.deployment import Config
from dist_attn.serve.config.jobs import JobsConfig
from dist_attn.serve.config.memory import DecodeConfig, MemoryConfig
from dist_attn.serve.config.sections import (ModelConfig, ParallelConfig, RequestConfig,
                                             RuntimeConfig, ServeConfig)
from dist_attn.serve.config.tokens import TokenConfig

__all__ = ["DEFAULT_CONFIG_PATH", "load_config", "parse_config", "apply_overrides"]

#: The default config: the repository's configs/tiny.toml (found from this file, so a checkout or
#: an editable install reads the one copy; a plain wheel install has no configs/ and must pass a
#: path).
DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[3] / "configs" / "tiny.toml"


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "tokens": TokenConfig,
    "parallel": ParallelConfig,
    "runtime": RuntimeConfig,
    "request": RequestConfig,
    "serve": ServeConfig,
    "jobs": JobsConfig,
    "memory": MemoryConfig,
    "decode": DecodeConfig,
}


def parse_config(data: dict[str, Any], *, source: str = "<dict>") -> Config:
    """Builds a :class:`Config` from a nested dict (as ``tomllib`` returns); unknown sections and
    fields are errors that name them."""
    unknown = set(data) - set(_SECTIONS)
    if unknown:
        raise ValueError(f"{source}: unknown config section(s) {sorted(unknown)}; "
                         f"valid: {sorted(_SECTIONS)}")
    sections = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [{name}] must be a table, got {table!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(table) - names
        if bad:
            raise ValueError(f"{source}: unknown field(s) {sorted(bad)} in [{name}]; "
                             f"valid: {sorted(names)}")
        sections[name] = cls(**table)
    return Config(**sections)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Loads a TOML config file; ``None`` loads :data:`DEFAULT_CONFIG_PATH`."""
    if path is None:
        if not DEFAULT_CONFIG_PATH.is_file():
            raise ValueError(f"no default config: {DEFAULT_CONFIG_PATH} does not exist (the "
                             "package was installed without its repository); pass a config path")
        path = DEFAULT_CONFIG_PATH
    with open(path, "rb") as f:
        return parse_config(tomllib.load(f), source=str(path))


def apply_overrides(cfg: Config, overrides: dict[str, Any]) -> Config:
    """Returns a new config with ``{"section.field": value}`` replaced, re-validating everything.

    A value of ``None`` leaves the field unchanged (an argparse flag that was not given), except
    for ``runtime.quality`` where the launcher passes only given values.
    """
    data = cfg.to_dict()
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if section not in _SECTIONS or name not in {f.name for f in
                                                    dataclasses.fields(_SECTIONS[section])}:
            raise ValueError(f"override {key!r}: no such config field (use section.field, "
                             f"sections {sorted(_SECTIONS)})")
        data[section][name] = value
    return parse_config(data, source="<overrides>")

