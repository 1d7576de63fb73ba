# SPDX-License-Identifier: Apache-2.0
"""The HTTP/1.1 protocol under the app: uvicorn's h11 protocol with what it lacks for a server
facing hostile clients (:class:`GuardedH11Protocol`).
:class:`dist_attn.models.h3.serve.http.app.HttpServer` builds one subclass per server."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from dist_attn.models.h3.serve.http.metrics import Metrics

__all__ = ["GuardedH11Protocol"]


# h11's own end of a request head: it accepts bare LF line ends, so "\r\n\r\n" alone is not it.
_HEAD_END = re.compile(rb"\n\r?\n")
_DIGITS = re.compile(rb"[ \t]*[0-9]+[ \t]*")
# uvicorn's warning when h11 refuses what a client sent (logged at INFO here: _ClientLog).
_UVICORN_INVALID = "Invalid HTTP request received."
_INVALID = "invalid HTTP request (malformed, or a head above serve.max_header_bytes)"


def _head_refusal(buffered: bytes, limit: int) -> tuple[int, str] | None:
    """Why the request head at the start of ``buffered`` is refused (status, message), or None.

    h11 merges repeated Content-Length headers of equal value and reads ``24, 24`` as 24, so the
    app cannot see either; the raw head is checked here.
    """
    end = _HEAD_END.search(buffered)
    head = buffered if end is None else buffered[:end.start()]
    if len(head) > limit:  # h11 bounds only heads still incomplete after a read
        return 431, f"request head above serve.max_header_bytes={limit}"
    if end is None:
        return None
    lengths = [line.split(b":", 1)[1].rstrip(b"\r") for line in head.split(b"\n")
               if line.lower().startswith(b"content-length:")]
    if len(lengths) > 1:
        return 400, f"{len(lengths)} Content-Length headers; exactly one is allowed"
    if lengths and not _DIGITS.fullmatch(lengths[0]):
        shown = lengths[0].strip().decode("latin-1")
        return 400, (f"Content-Length={shown!r} must be one decimal number (a list such as "
                     "'24, 24' is refused)")
    return None


class _ClientLog(logging.LoggerAdapter):
    """uvicorn's logger for one connection, with its warning about a malformed request logged at
    INFO: a client's mistake, answered 400, is no server problem."""

    @property
    def level(self) -> int:  # uvicorn reads logger.level before its TRACE messages
        return self.logger.level

    def warning(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if msg == _UVICORN_INVALID:
            self.logger.info("a client sent an invalid HTTP request; answered 400")
        else:
            self.logger.warning(msg, *args, **kwargs)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head, checks of every raw head (one
    Content-Length, a plain number), and JSON for the errors it sends itself.

    uvicorn times out an idle connection only after a response, so a connection that never
    completes a head (silent, or a byte at a time) was held forever: 300 idle connections stayed
    open for 32 s, one thread each, with the old server.

    The heads are checked where h11 is asked for its next event (:meth:`_next_event`), not where
    bytes arrive: a pipelined second request sits in h11's buffer and is parsed after the first
    answer without passing through ``data_received``.
    """

    _head_timer: asyncio.TimerHandle | None = None
    _refusal: tuple[int, str] | None = None
    metrics: Metrics | None = None
    """Where the rejections this protocol answers itself are counted (set per server)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _ClientLog(self.logger, {})
        self._h11_next_event = self.conn.next_event
        self.conn.next_event = self._next_event  # uvicorn calls it for every request it parses

    def _next_event(self) -> Any:
        if self.conn.their_state is h11.IDLE:
            refusal = _head_refusal(self.conn.trailing_data[0],
                                    self.config.h11_max_incomplete_event_size)
            if refusal is not None:
                # uvicorn answers h11's RemoteProtocolError with send_400_response (below)
                self._refusal = refusal
                raise h11.RemoteProtocolError(refusal[1], refusal[0])
        return self._h11_next_event()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a complete head arrived
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.timeout_keep_alive, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        status, message = self._refusal or (400, _INVALID)
        self._refusal = None
        self._send_json_error(status, message)

    def _send_json_error(self, status: int, message: str) -> None:
        cycle = getattr(self, "cycle", None)
        if cycle is not None and not cycle.response_complete:
            # The app is running this request (h11 refused its body, a malformed chunk): its
            # own answer would follow ours on a closed connection and raise an ERROR with a
            # traceback. It sees a disconnected client instead.
            cycle.disconnected = True
            cycle.message_event.set()
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer already began
            self.transport.close()
            return
        if self.metrics is not None:
            self.metrics.error(status)
        body = json.dumps({"error": {"code": status, "message": message}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=status, headers=headers),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
