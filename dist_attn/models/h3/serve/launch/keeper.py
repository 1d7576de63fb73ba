# SPDX-License-Identifier: Apache-2.0
"""The supervisor keeps the HTTP port while no rank 0 serves, and answers it.

Under ``--nproc-per-node`` the port stays open across a restart after a rank died, so clients
get no connection errors while the ranks come back: the supervisor (:class:`PortKeeper`) holds a
copy of the listening socket for the job's life:

- rank 0 asks it for the socket instead of binding (:func:`rank0_listener`); at the first
  start the keeper has none, so rank 0 binds (the port check of the launch stays there) and gives
  it a copy. Sockets travel over a Unix socket in the supervisor's private directory
  (``SCM_RIGHTS``), named by ``$DIST_ATTN_SUPERVISOR_PORT_KEEPER``.
- From a start (:meth:`PortKeeper.launched`) until rank 0 is about to serve
  (:func:`announce_serving`), the keeper accepts on the socket and answers every request with a
  JSON 503 saying why and, once a start has been measured, ``Retry-After``: the last start's
  duration less the time this one has run. Then it stops accepting: rank 0's server alone does.
- When the job dies, the socket stays open in the keeper: new connections wait in its backlog
  until the keeper answers them (no connection is refused while the supervisor lives).

One thread answers, one connection at a time (each bounded by :data:`_CLIENT_S`).
"""

from __future__ import annotations

import json
import math
import os
import selectors
import socket
import threading
import time

from dist_attn.models.h3.serve.launch.process import bind_listener

__all__ = ["KEEPER_ENV", "PortKeeper", "rank0_listener", "announce_serving"]

#: The environment variable that names the keeper's Unix socket to rank 0.
KEEPER_ENV = "DIST_ATTN_SUPERVISOR_PORT_KEEPER"
# One client of the keeper (a request head and body, the answer) gets at most this long.
_CLIENT_S = 1.0
# The most request bytes the keeper reads before it answers (a body a client sends with its
# request is read first, so that closing the connection does not reset it before the answer).
_MAX_REQUEST = 1 << 20
# How often the keeper's thread looks at what the supervisor changed.
_POLL_S = 0.1


class PortKeeper:
    """The supervisor's side: the Unix socket ``<directory>/port-keeper`` that rank 0 talks
    to, the listening socket once one was given, and the thread that answers while no rank 0
    serves. ``directory`` must be private to this user (the supervisor's temporary one)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "port-keeper")
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(8)
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._answering = False
        self._why = "starting"
        self._launched = time.monotonic()
        self._start_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="port-keeper", daemon=True)
        self._thread.start()

    def launched(self, why: str) -> None:
        """A job starts now: answer 503 "the server is ``why``" until its rank 0 serves."""
        with self._lock:
            self._launched, self._why, self._answering = time.monotonic(), why, True

    def close(self) -> None:
        """Stops the thread and closes both sockets (the port closes with the supervisor)."""
        self._stop.set()
        self._thread.join()
        self._server.close()
        if self._listener is not None:
            self._listener.close()

    def _loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._server, selectors.EVENT_READ)
            watched: socket.socket | None = None
            while not self._stop.is_set():
                with self._lock:
                    wanted = self._listener if self._answering else None
                if wanted is not watched:
                    if watched is not None:
                        sel.unregister(watched)
                    if wanted is not None:
                        sel.register(wanted, selectors.EVENT_READ)
                    watched = wanted
                for key, _ in sel.select(_POLL_S):
                    if key.fileobj is self._server:
                        self._talk()
                        break  # what rank 0 said may change what is watched
                    self._answer()

    def _talk(self) -> None:
        """One request of rank 0: ``take`` (the socket, or none yet), ``give`` (its socket),
        ``serving`` (stop answering)."""
        conn, _ = self._server.accept()
        with conn:
            conn.settimeout(10)
            msg, fds, _, _ = socket.recv_fds(conn, 64, 1)
            with self._lock:
                if msg == b"take":
                    held = [self._listener.fileno()] if self._listener is not None else []
                    socket.send_fds(conn, [b"sock" if held else b"none"], held)
                    return
                if msg == b"give" and fds:
                    if self._listener is not None:
                        self._listener.close()
                    self._listener = socket.socket(fileno=fds[0])
                    # accept() must never wait: a client gone between select and accept would
                    # hold this thread, and rank 0's next request with it
                    self._listener.setblocking(False)
                elif msg == b"serving":
                    self._answering = False
                    self._start_s = time.monotonic() - self._launched
                else:
                    for fd in fds:
                        os.close(fd)
                    conn.sendall(b"what")
                    return
            conn.sendall(b"ok")

    def _answer(self) -> None:
        """Accepts one connection on the held socket and answers its request with a 503."""
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):  # the client left before it was accepted
            return
        with conn:
            conn.settimeout(_CLIENT_S)
            try:
                _read_request(conn)
                conn.sendall(self._response())
                conn.shutdown(socket.SHUT_WR)
            except OSError:  # the client left or stalled: nothing to answer
                pass

    def _response(self) -> bytes:
        with self._lock:
            why, start_s = self._why, self._start_s
            ran = time.monotonic() - self._launched
        headers = [b"HTTP/1.1 503 Service Unavailable", b"content-type: application/json",
                   b"connection: close"]
        message = f"the server is {why}"
        if start_s is not None:
            retry = max(1, math.ceil(start_s - ran))
            message += f"; ready in about {retry} s"
            headers.append(b"retry-after: %d" % retry)
        body = json.dumps({"error": {"code": 503, "message": message}}).encode()
        headers.append(b"content-length: %d" % len(body))
        return b"\r\n".join(headers) + b"\r\n\r\n" + body


def _read_request(conn: socket.socket) -> None:
    """Reads a request's head and its Content-Length body (at most :data:`_MAX_REQUEST`)."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < _MAX_REQUEST:
        chunk = conn.recv(65536)
        if not chunk:
            return
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and value.strip().isdigit():
            length = min(int(value.strip()[:8]), _MAX_REQUEST)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return
        body += chunk


def _ask(path: str, msg: bytes, fds: list[int] | None = None) -> tuple[bytes, list[int]]:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(path)
            socket.send_fds(s, [msg], fds or [])
            reply, got, _, _ = socket.recv_fds(s, 64, 1)
    except OSError as e:
        raise OSError(f"the supervisor's port keeper {path} cannot be reached "
                      f"({e.strerror or e})") from e
    return reply, got


def rank0_listener(host: str, port: int, backlog: int) -> socket.socket:
    """Rank 0's listening socket: the supervisor's held one when it holds one; else bound here
    (OSError when the port is taken) and, under the supervisor, given to it too. Raises OSError
    naming the keeper when the supervisor cannot be reached."""
    path = os.environ.get(KEEPER_ENV)
    if not path:
        return bind_listener(host, port, backlog)
    reply, fds = _ask(path, b"take")
    if fds:
        return socket.socket(fileno=fds[0])
    sock = bind_listener(host, port, backlog)
    try:
        _ask(path, b"give", [sock.fileno()])
    except OSError:
        sock.close()
        raise
    return sock


def announce_serving() -> None:
    """Rank 0 is about to serve on its socket: the supervisor stops answering it (nothing to
    do without the supervisor)."""
    path = os.environ.get(KEEPER_ENV)
    if path:
        _ask(path, b"serving")
