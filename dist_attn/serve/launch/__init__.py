"""The server process, from flags to the rank loops: the CLI, the launch checks, logging, the OS
(parent death, port, API key), warm-up and the ``--nproc-per-node`` supervisor. Exports ``main``
and ``run`` (the process entry point: ``main``, then the exit)."""

from dist_attn.serve.launch.cli import main, run

__all__ = ["main", "run"]
