# SPDX-License-Identifier: Apache-2.0
"""Shared test plumbing: repository paths, a subprocess environment, free loopback ports.

Tests import these as ``from tests.conftest import ...`` only through the fixtures below; the
multi-rank runner and the float64 reference live in :mod:`tests._multirank` and
:mod:`tests.reference`.
"""

from __future__ import annotations

import os
import socket

# One intra-op thread in the pytest workers too (before anything imports torch): CI has 2 cores
# shared by 2 workers and the rank subprocesses they start; idle OpenMP threads spinning on top
# of those cost CPU the ranks need.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

#: The repository root (where configs/, launch/ and benchmarks/ live).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: one OpenMP thread per rank (CI has 2 cores), the
    repository importable (benchmarks run as ``python -m benchmarks.x``), unbuffered output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def repo_root() -> str:
    return ROOT
