# SPDX-License-Identifier: Apache-2.0
"""Fixtures shared by the serve tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture
def launcher(monkeypatch):
    """launch/serve.py's main() in this process as world 1 (no torchrun env), logging restored."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    from dist_attn.models.h3.serve.launch import cli

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield cli
    root.handlers[:], root.level = handlers, level
