# SPDX-License-Identifier: Apache-2.0
"""The supervisor's hold on the HTTP port, in one process: the test plays the supervisor (a
:class:`PortKeeper`) and rank 0 (``rank0_listener``, ``announce_serving``, accepting on the
socket it got). While no rank 0 serves, every connection gets a JSON 503 from the keeper; none
is refused."""

from __future__ import annotations

import json
import socket

import pytest

from dist_attn.models.h3.serve.launch.keeper import (KEEPER_ENV, PortKeeper, announce_serving,
                                                     rank0_listener)


def _request(port: int, raw: bytes = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
             ) -> tuple[int, dict[str, str], dict]:
    """(status, headers, JSON body) of one request on a fresh connection (raises on a refused
    or reset connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(raw)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(lines[0].split()[1]), headers, json.loads(body)


def test_the_keeper_answers_503_while_no_rank_serves_and_hands_the_port_over(tmp_path,
                                                                             monkeypatch):
    """Under the supervisor a restarted job's clients got connection errors for ~17 s (the port
    was closed from rank 0's death until the new rank 0 bound it)."""
    keeper = PortKeeper(str(tmp_path))
    monkeypatch.setenv(KEEPER_ENV, keeper.path)
    try:
        keeper.launched("starting")
        first = rank0_listener("127.0.0.1", 0, 16)  # nothing held yet: bound, then given
        port = first.getsockname()[1]
        status, headers, body = _request(port)
        assert status == 503 and headers["content-type"] == "application/json", headers
        assert body == {"error": {"code": 503, "message": "the server is starting"}}
        assert "retry-after" not in headers  # no start measured yet
        announce_serving()  # rank 0 serves: the keeper no longer accepts
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            first.settimeout(10)
            conn, _ = first.accept()  # rank 0 gets the connection, not the keeper
            conn.close()
        # rank 0 dies: the socket stays open (the keeper holds it); a connection made before
        # the keeper answers again waits in the backlog and is answered then
        first.close()
        waiting = socket.create_connection(("127.0.0.1", port), timeout=10)
        waiting.sendall(b"GET /v1/videos HTTP/1.1\r\nHost: x\r\n\r\n")
        keeper.launched("restarting: the job exited 1 after it served")
        assert waiting.recv(65536).startswith(b"HTTP/1.1 503 ")
        waiting.close()
        body = b'{"prompt": "a fox"}'
        status, headers, answer = _request(port, b"POST /v1/videos HTTP/1.1\r\nHost: x\r\n"
                                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert status == 503 and int(headers["retry-after"]) >= 1, headers
        assert answer["error"]["message"].startswith(
            "the server is restarting: the job exited 1 after it served; ready in about ")
        second = rank0_listener("127.0.0.1", 0, 16)  # the new rank 0 takes the held socket
        assert second.getsockname()[1] == port
        assert _request(port)[0] == 503  # the keeper answers until rank 0 serves
        announce_serving()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            second.settimeout(10)
            second.accept()[0].close()
        second.close()
    finally:
        keeper.close()


def test_without_the_supervisor_rank_0_binds_the_port(monkeypatch):
    monkeypatch.delenv(KEEPER_ENV, raising=False)
    sock = rank0_listener("127.0.0.1", 0, 16)
    try:
        assert sock.getsockname()[1] > 0
        announce_serving()  # nothing to tell
    finally:
        sock.close()


def test_an_unreachable_keeper_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv(KEEPER_ENV, str(tmp_path / "gone"))
    with pytest.raises(OSError, match=r"the supervisor's port keeper .*gone cannot be reached"):
        rank0_listener("127.0.0.1", 0, 16)
