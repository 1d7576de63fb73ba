# SPDX-License-Identifier: Apache-2.0
"""Field rules shared by the config dataclasses: each error names the field, its value and the
rule it breaks."""

from __future__ import annotations

from typing import Any

__all__ = ["field_error", "require_positive", "require_non_negative"]


#: the section of the TOML file and of ``--set`` that each config class is read from.
SECTIONS = {"ModelConfig": "model", "TokenConfig": "tokens", "ParallelConfig": "parallel",
            "RuntimeConfig": "runtime", "RequestConfig": "request", "ServeConfig": "serve",
            "JobsConfig": "jobs", "MemoryConfig": "memory", "DecodeConfig": "decode"}


def field_error(cls: str, name: str, value: Any, rule: str) -> ValueError:
    """``ValueError("section.name=value rule")``, named as the user writes it in the TOML file
    or after ``--set`` (``model.num_layers``, not the class ``ModelConfig``). ``cls`` is a key of
    :data:`SECTIONS` (tests/serve/test_config.py checks it against the loader's sections)."""
    return ValueError(f"{SECTIONS[cls]}.{name}={value!r} {rule}")


def steps_rule(steps: int, max_steps: int) -> str | None:
    """Why ``steps`` denoising steps are refused under ``serve.max_steps``, or None: the one
    owner for the default request, /v1/generate and the video jobs API."""
    return f"exceeds serve.max_steps={max_steps}" if steps > max_steps else None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive(obj: Any, *names: str) -> None:
    """Raises :func:`field_error` unless every named field of ``obj`` is an int > 0."""
    for name in names:
        value = getattr(obj, name)
        if not _is_int(value) or value <= 0:
            raise field_error(type(obj).__name__, name, value, "must be a positive integer")


def require_non_negative(obj: Any, *names: str) -> None:
    """Raises :func:`field_error` unless every named field of ``obj`` is an int >= 0."""
    for name in names:
        value = getattr(obj, name)
        if not _is_int(value) or value < 0:
            raise field_error(type(obj).__name__, name, value, "must be a non-negative integer")
