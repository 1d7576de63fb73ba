# SPDX-License-Identifier: Apache-2.0
"""The server process, from flags to the rank loops: the CLI, checks, the model build, logging, the
OS (parent death, port, API key), warm-up, the ``--nproc-per-node`` supervisor. Exports ``main``, ``run``."""

from dist_attn.models.h3.serve.launch.cli import main, run

__all__ = ["main", "run"]
