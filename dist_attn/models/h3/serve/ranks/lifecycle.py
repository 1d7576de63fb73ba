# SPDX-License-Identifier: Apache-2.0
"""A serving rank's relations with its process's end.

- SIGTERM/SIGINT (:class:`Shutdown`): the first one starts a drain (the rank loops' business) and
  arms a hard exit, so a rank stuck anyway leaves before torchrun's SIGKILL; a second one is
  logged and ignored.
- Before it serves (:func:`interrupt_start_up`): SIGINT raises KeyboardInterrupt, as Python's
  default does, and is remembered (:func:`stop_signal`, as :class:`Shutdown`'s signals are), so
  the launch ends with one line instead of a traceback per rank (``launch.cli.run``).
- Readiness (:func:`mark_ready`): rank 0 tells the ``--nproc-per-node`` supervisor that the
  server serves, after which a failure is a fault to restart from, not a launch failure.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any, Callable

__all__ = ["READY_ENV", "Shutdown", "interrupt_start_up", "mark_ready", "stop_signal"]

log = logging.getLogger(__name__)

#: The variable naming the file rank 0 writes once it serves (set by the supervisor).
READY_ENV = "DIST_ATTN_SUPERVISOR_READY"
#: The stop signals this process received, first first.
_STOPS: list[signal.Signals] = []


def stop_signal() -> signal.Signals | None:
    """The first SIGTERM/SIGINT this process received through :func:`interrupt_start_up` or
    :class:`Shutdown` (None: none): an error after it is the stop's, not a fault."""
    return _STOPS[0] if _STOPS else None


def interrupt_start_up() -> None:
    """Until :class:`Shutdown` takes over: SIGINT (Ctrl-C reaches every rank) is remembered and
    raises KeyboardInterrupt (main thread only)."""
    signal.signal(signal.SIGINT, _interrupt)


def _interrupt(signum: int, _frame: Any) -> None:
    _STOPS.append(signal.Signals(signum))
    raise KeyboardInterrupt


class Shutdown:
    """The first SIGTERM/SIGINT sets :attr:`requested`, runs ``on_request`` in a new thread and
    arms ``os._exit(1)`` after ``hard_exit_after_s``. Signal handlers run on the main thread
    between bytecodes, so a rank blocked in a collective sees the signal when it returns (at
    the next heartbeat at the latest)."""

    def __init__(self, *, hard_exit_after_s: float,
                 on_request: Callable[[], None] | None = None) -> None:
        self.hard_exit_after_s = hard_exit_after_s
        self.on_request = on_request
        self.requested = threading.Event()
        self.since: float | None = None
        """``time.perf_counter()`` of the first signal."""

    def install(self) -> None:
        """Installs the handlers for SIGTERM and SIGINT (main thread only)."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def request(self, why: str) -> None:
        """Starts the shutdown as a signal would."""
        if self.requested.is_set():
            log.info("%s while already shutting down; ignored", why)
            return
        log.info("%s; shutting down (hard exit after %.1f s)", why, self.hard_exit_after_s)
        self.since = time.perf_counter()
        self.requested.set()
        if self.on_request is not None:
            threading.Thread(target=self.on_request, name="drain", daemon=True).start()
        timer = threading.Timer(self.hard_exit_after_s, self._hard_exit)
        timer.daemon = True
        timer.start()

    def older_than(self, seconds: float) -> bool:
        """Whether the shutdown was requested more than ``seconds`` ago (False before one was)."""
        return self.since is not None and time.perf_counter() - self.since > seconds

    def _handle(self, signum: int, _frame: Any) -> None:
        _STOPS.append(signal.Signals(signum))
        self.request(f"received {signal.Signals(signum).name}")

    def _hard_exit(self) -> None:
        log.error("still running %.1f s after the shutdown request; exiting with status 1",
                  self.hard_exit_after_s)
        logging.shutdown()
        os._exit(1)


def mark_ready() -> None:
    """Rank 0, once it serves: tells the supervisor (when there is one) that a later failure of
    this job is a fault to restart from, not a launch failure."""
    path = os.environ.get(READY_ENV)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(f"{os.getpid()}\n")
    except OSError as e:  # the server serves on; only a restart after a fault is lost
        log.warning("could not tell the supervisor that the server serves (%s: %s): a fault "
                    "will end the job instead of restarting it", path, e.strerror or e)
