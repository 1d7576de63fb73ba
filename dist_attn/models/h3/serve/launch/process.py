# SPDX-License-Identifier: Apache-2.0
"""The server process's relations with the operating system: its parent, its signals, its port.

- Parent death: under torchrun every rank asks Linux for SIGTERM when its parent (the agent)
  dies, so a ``kill -9`` of the agent cannot leave ranks serving forever (they drained and
  exited within the drain bound instead of running on for 75 s and more).
- SIGTERM/SIGINT: the serving rank's own
(:class:`dist_attn.models.h3.serve.ranks.lifecycle.Shutdown`).
- The listening socket is bound on rank 0 before the model is built, so a port in use fails the
  launch with one message instead of a traceback after minutes of weight loading.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import signal
import socket
import sys
from typing import Mapping

__all__ = ["set_parent_death_signal", "bind_listener", "is_loopback",
           "exposure_warnings", "API_KEY_ENV", "resolve_api_key"]

#: Environment variable holding the API key (keeps the secret off the command line).
API_KEY_ENV = "DIST_ATTN_API_KEY"

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> None:
    """Linux: the kernel sends ``sig`` to this process when its parent dies. Elsewhere: logs a
    warning (a killed launcher then leaves its ranks running)."""
    if not sys.platform.startswith("linux"):
        log.warning("parent-death signal is Linux-only: on %s, ranks outlive a killed launcher",
                    sys.platform)
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}")
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def bind_listener(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening; raises OSError (e.g. EADDRINUSE)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP (not 0) is what asyncio checks before it sets TCP_NODELAY on accepted
    # connections: with proto 0, Nagle + delayed ACK hold every answer ~40 ms (docs/serving.md).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        # REUSEADDR lets a restart bind while old connections sit in TIME_WAIT; it never lets
        # two listeners share the port on Linux.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    """Whether ``host`` names a loopback address ("localhost", 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def resolve_api_key(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The bearer token the server requires: ``--api-key`` if given, else ``$DIST_ATTN_API_KEY``;
    None when neither is set.

    An empty value is no key (logged; requests are not refused as if the empty string were the
    key). A key with spaces or
    non-printable characters raises ValueError: HTTP strips the spaces around a header value, so
    no client could ever send it.
    """
    source, key = ("--api-key", flag) if flag is not None else (API_KEY_ENV,
                                                                environ.get(API_KEY_ENV))
    if key is None:
        return None
    if key == "":
        log.info("%s is empty: no API key is set (every endpoint is open)", source)
        return None
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(f"{source}: the API key must be printable ASCII without spaces (HTTP "
                         f"strips spaces around header values, so a client could not send it)")
    return key


def exposure_warnings(host: str, api_key: str | None) -> list[str]:
    """What to warn about when binding ``host`` (empty on loopback)."""
    if is_loopback(host):
        return []
    warnings = [f"serve.host={host!r} is not a loopback address: the server is reachable from "
                "other machines"]
    if not api_key:
        warnings.append("no API key is set (--api-key or DIST_ATTN_API_KEY): anyone who reaches "
                        "the port can submit work")
    return warnings
