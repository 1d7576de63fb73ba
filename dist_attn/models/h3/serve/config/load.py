# SPDX-License-Identifier: Apache-2.0
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

The shipped configs (``tiny``, the CPU default, and ``h3``, the real model) are package data,
``dist_attn/models/h3/serve/configs/*.toml`` (the clone's ``configs/`` points there):
``load_config(None)`` reads ``tiny.toml`` through :mod:`importlib.resources`, so ``python -m
dist_attn.models.h3.serve`` works with no arguments from a clone, an editable install or a plain
``pip install .``, and ``--config h3`` names the shipped H3 config wherever the package is
installed.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import os
import re
import sys
import tomllib
from typing import Any

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.jobs import JobsConfig
from dist_attn.models.h3.serve.config.memory import DecodeConfig, MemoryConfig
from dist_attn.models.h3.serve.config.sections import (ModelConfig, ParallelConfig, RequestConfig,
                                                       RuntimeConfig, ServeConfig)
from dist_attn.models.h3.serve.config.tokens import TokenConfig

__all__ = ["DEFAULT_CONFIG_PATH", "SHIPPED_CONFIGS", "load_config", "parse_config", "apply_overrides",
           "parse_override"]

#: The folder of the shipped configs, inside the installed package.
_SHIPPED = importlib.resources.files("dist_attn.models.h3.serve") / "configs"
#: The shipped configs by name (``--config h3``): the one copy of each, package data.
SHIPPED_CONFIGS = {"tiny": _SHIPPED / "tiny.toml", "h3": _SHIPPED / "h3.toml"}
#: The default config: the shipped ``tiny.toml``.
DEFAULT_CONFIG_PATH = SHIPPED_CONFIGS["tiny"]


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
        raise ValueError(f"{source}: unknown config section(s) {sorted(unknown)}"
                         f"{_did_you_mean(unknown, _SECTIONS)}; valid: {sorted(_SECTIONS)}")
    sections = {}
    for name, cls in _SECTIONS.items():
        table = data.get(name, {})
        if not isinstance(table, dict):
            raise ValueError(f"{source}: [{name}] must be a table, got {table!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        bad = set(table) - names
        if bad:
            raise ValueError(f"{source}: unknown field(s) {sorted(bad)} in [{name}]"
                             f"{_did_you_mean(bad, names)}; valid: {sorted(names)}")
        sections[name] = cls(**table)
    return Config(**sections)


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Loads a TOML config file: a path, the name of a shipped config (:data:`SHIPPED_CONFIGS`,
    when no file of that name exists), or ``None`` for :data:`DEFAULT_CONFIG_PATH`."""
    if path is None:
        path = DEFAULT_CONFIG_PATH
    elif not os.path.exists(path):
        if str(path) not in SHIPPED_CONFIGS:
            raise ValueError(f"config {os.fspath(path)!r} does not exist (the shipped configs, by "
                             f"name: {', '.join(map(repr, SHIPPED_CONFIGS))})")
        path = SHIPPED_CONFIGS[str(path)]
    with (open(path, "rb") if isinstance(path, (str, os.PathLike)) else path.open("rb")) as f:
        text = f.read().decode()  # as tomllib.load decodes
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        raise
    except ValueError as e:  # a value tomllib parsed but Python refused (an int's digit limit)
        raise ValueError(f"{path}: {_long_integer(text) or 'a value'}: {e}") from None
    return parse_config(data, source=str(path))


def _long_integer(text: str) -> str | None:
    """Where a TOML text holds an integer longer than Python converts (``[section] field (line
    N) holds an integer of D digits``), or None."""
    limit, table = sys.get_int_max_str_digits(), "top level"
    for n, line in enumerate(text.splitlines(), 1):
        header = re.match(r"\s*\[+\s*([^\]]+?)\s*\]", line)
        if header:
            table = f"[{header.group(1)}]"
            continue
        runs = [len(r.replace("_", "")) for r in re.findall(r"[0-9][0-9_]*", line)]
        if limit and runs and max(runs) > limit:
            key = re.match(r"\s*([A-Za-z0-9_.\"'-]+)\s*=", line)
            name = f"{table} {key.group(1)}" if key else table
            return f"{name} (line {n}) holds an integer of {max(runs)} digits"
    return None


def parse_override(item: str) -> tuple[str, Any]:
    """``SECTION.FIELD=VALUE`` (a ``--set``) as ``(key, value)``: VALUE is read as a TOML value,
    a bare word as a string. Raises ValueError naming the item."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep:
        raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw  # a bare word: take it as a string
    except ValueError as e:  # parsed, but Python refused it (an int's digit limit)
        digits = raw.strip().lstrip("+-").replace("_", "")
        shown = (f"<an integer of {len(digits)} digits>" if digits.isdigit() and len(digits) > 40
                 else repr(raw))
        raise ValueError(f"--set {key}={shown}: {e}") from None


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
            every = [f"{s}.{f.name}" for s, cls in _SECTIONS.items() for f in dataclasses.fields(cls)]
            raise ValueError(f"override {key!r}: no such config field{_did_you_mean([key], every)} "
                             f"(use section.field, sections {sorted(_SECTIONS)})")
        data[section][name] = value
    return parse_config(data, source="<overrides>")



def _did_you_mean(words, choices) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``choices`` to each of ``words`` (difflib),
    or "" when none is near."""
    near = [m[0] for w in sorted(words) if (m := difflib.get_close_matches(w, list(choices), n=1,
                                                                         cutoff=0.5))]
    return f" (did you mean {', '.join(map(repr, near))}?)" if near else ""
