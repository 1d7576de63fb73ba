# SPDX-License-Identifier: Apache-2.0
"""Logging for the served DiT: one stderr handler, the rank in every line; a launch error's one
line on rank 0."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging", "count_in_units", "rank0_error"]


class _RankFilter(logging.Filter):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return True


def setup_logging(rank: int, *, level: str = "INFO", all_ranks: bool = False) -> None:
    """Root logging to stderr with the rank in every line; ranks other than 0 log WARNING and
    above unless ``all_ranks``. uvicorn's access log is silenced (one line per request would
    cost more than the request's bookkeeping); its error log goes through the same handler."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RankFilter(rank))
    handler.setFormatter(logging.Formatter(
        "%(asctime)s [rank %(rank)d] %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if rank == 0 or all_ranks else logging.WARNING)
    logging.getLogger("uvicorn.access").disabled = True


def count_in_units(n: int) -> str:
    """``n`` with two decimals in the largest unit of K, M, B it reaches (a parameter count: the
    tiny model has a few million, H3 about 33 billion)."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def rank0_error(rank: int, message: str) -> None:
    """``launch/serve.py: error: <message>`` on stderr, printed by rank 0 only (every rank reaches
    the same verdict)."""
    if rank == 0:
        print(f"launch/serve.py: error: {message}", file=sys.stderr, flush=True)
