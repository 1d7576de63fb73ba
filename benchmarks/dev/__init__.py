# SPDX-License-Identifier: Apache-2.0
"""Kernel development tools (run as ``python -m benchmarks.dev.<name>`` on an H200), not user benchmarks."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["probe_parser", "write_probe_json"]


def write_probe_json(out_dir: str, name: str, data: Any) -> str:
    """Writes a probe's raw results to ``<out_dir>/<name>`` (indented JSON), creating the folder;
    returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path


def probe_parser(doc: str, *, iters: int = 30) -> argparse.ArgumentParser:
    """The timing probes' parser: ``--out`` (the results folder) and ``--iters`` (timed calls a
    median), described by the first paragraph of the probe's ``doc``; a probe adds its own."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--iters", type=int, default=iters)
    return p
