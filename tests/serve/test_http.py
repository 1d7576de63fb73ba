# SPDX-License-Identifier: Apache-2.0
"""The HTTP layer alone: uvicorn + the Starlette app on a loopback port in this process, with the
test playing the rank-0 loop (it takes jobs from the queue itself). Raw sockets send what
ordinary clients would not. Every wait is bounded."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from dist_attn.models.h3.serve.config import apply_overrides, load_config
from dist_attn.models.h3.serve.http import HttpServer, ServerState
from dist_attn.models.h3.serve.http.metrics import Metrics
from dist_attn.models.h3.serve.jobs.queue import JobQueue, Liveness
from dist_attn.models.h3.serve.launch.process import bind_listener

from tests.serve._server import metric_samples

KEY = "s3cret"
AUTH = f"Authorization: Bearer {KEY}\r\n"
IDLE_S = 1.0


class _Done:
    """A finished job's result as the HTTP layer sees it."""

    def to_json(self) -> dict:
        return {"ok": True}


@pytest.fixture
def app():
    cfg = apply_overrides(load_config(None), {"serve.queue_size": 2,
                                              "serve.idle_timeout_s": IDLE_S})
    jobs = JobQueue(cfg.serve.queue_size)
    state = ServerState(cfg=cfg, jobs=jobs, metrics=Metrics(lambda: len(jobs)),
                        liveness=Liveness(), info={"model": "tiny"}, api_key=KEY)
    sock = bind_listener("127.0.0.1", 0, cfg.serve.backlog)
    server = HttpServer(state, sock)
    server.start()
    state.port = sock.getsockname()[1]
    yield state
    for job in jobs.drain():
        job.fail(503, "test over")
    server.stop()
    sock.close()


def _exchange(port: int, raw: bytes, *, half_close: bool = False, timeout: float = 10) -> bytes:
    """Sends ``raw`` on a fresh connection and reads until the server closes it or ``timeout``."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            data += chunk
            if b"\r\n\r\n" in data and _complete(data):
                break
        return data


def _complete(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


def _parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return int(lines[0].split()[1]), headers, body


def _post(body: bytes, extra: str = "") -> bytes:
    return (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def _json_error(data: bytes, status: int) -> dict[str, str]:
    got, headers, body = _parse(data)
    assert got == status, data[:500]
    assert headers["content-type"] == "application/json", headers
    assert json.loads(body)["error"]["code"] == status
    assert "server" not in headers  # no version banner
    return headers


def test_malformed_inputs_get_json_4xx(app):
    port = app.port
    _json_error(_exchange(port, _post(b'{"seed": ' + b"9" * 5000 + b"}")), 400)
    _json_error(_exchange(port, _post(b"[" * 30_000 + b"]" * 30_000)), 400)
    headers = _json_error(_exchange(port, _post(b"{}", "Content-Length: 2\r\n")), 400)
    assert headers["connection"] == "close"  # duplicate Content-Length
    big = f"POST /v1/generate HTTP/1.1\r\nHost: x\r\n{AUTH}Content-Length: 70000\r\n\r\n"
    assert _json_error(_exchange(port, big.encode()), 413)["connection"] == "close"
    chunked = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n"
               "\r\n2\r\n{}\r\n0\r\n\r\n")
    assert _json_error(_exchange(port, chunked.encode()), 411)["connection"] == "close"
    _json_error(_exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"), 404)
    _json_error(_exchange(port, b"BREW /v1/generate HTTP/1.1\r\nHost: x\r\n\r\n"), 405)
    huge_head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
    _json_error(_exchange(port, huge_head), 431)
    _json_error(_exchange(port, b"\x16\x03\x01 not http\r\n\r\n"), 400)
    # a truncated body (Content-Length larger than what was sent, then half-close) never runs
    truncated = _post(b'{"steps": 1}')[:-4]
    _exchange(port, truncated, half_close=True, timeout=3)
    assert len(app.jobs) == 0
    samples = metric_samples(app.metrics.render().decode())
    assert samples["dist_attn_requests_total"] == 0


def test_bearer_token_on_every_endpoint_but_health(app):
    port = app.port
    status, headers, _ = _parse(_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status == 200
    for request in (b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
                    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
                    b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n\r\n"):
        assert _json_error(_exchange(port, request), 401)["www-authenticate"] == "Bearer"
    ok = _exchange(port, f"GET /metrics HTTP/1.1\r\nHost: x\r\n{AUTH}\r\n".encode())
    assert _parse(ok)[0] == 200 and b"dist_attn_requests_total" in ok


def _submit(port: int, body: bytes, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(_exchange(port, _post(body), timeout=20)))
    t.start()
    return t


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_queue_full_answers_429_with_retry_after(app):
    answers: list[bytes] = []
    waiting = [_submit(app.port, b'{"steps": 1}', answers) for _ in range(2)]
    _wait(lambda: len(app.jobs) == 2)
    headers = _json_error(_exchange(app.port, _post(b'{"steps": 1}')), 429)
    assert int(headers["retry-after"]) >= 1
    for _ in range(2):  # play the loop: serve the queued two
        app.jobs.get(timeout=1).finish(_Done())
    for t in waiting:
        t.join(10)
    assert [_parse(a)[0] for a in answers] == [200, 200]


class _NotJson:
    """A result whose answer cannot be encoded (a NaN checksum, say)."""

    def to_json(self) -> dict:
        return {"sum": float("nan")}


def test_a_result_that_cannot_be_encoded_fails_alone(app):
    answers: list[bytes] = []
    waiting = _submit(app.port, b'{"steps": 1}', answers)
    app.jobs.get(timeout=10).finish(_NotJson())
    waiting.join(10)
    body = json.loads(_parse(answers[0])[2])
    _json_error(answers[0], 500)
    assert "could not be encoded" in body["error"]["message"] and "nan" not in body["error"]["message"]
    waiting = _submit(app.port, b'{"steps": 1}', answers)  # the next request is served
    app.jobs.get(timeout=10).finish(_Done())
    waiting.join(10)
    assert _parse(answers[1])[0] == 200


def test_client_that_disconnects_is_dropped_from_the_queue(app):
    with socket.create_connection(("127.0.0.1", app.port), timeout=5) as s:
        s.sendall(_post(b'{"steps": 1}'))
        _wait(lambda: len(app.jobs) == 1)
    _wait(lambda: len(app.jobs) == 0, timeout=5)  # gone without being taken by the loop
    samples = metric_samples(app.metrics.render().decode())
    assert samples['dist_attn_requests_cancelled_total{reason="client_gone"}'] == 1


def test_deadline_drops_a_queued_request(app):
    t0 = time.monotonic()
    data = _exchange(app.port, _post(b'{"steps": 1, "timeout_s": 0.5}'), timeout=10)
    assert time.monotonic() - t0 < 5
    assert "deadline" in json.loads(_parse(data)[2])["error"]["message"]
    _json_error(data, 504)
    assert len(app.jobs) == 0
    samples = metric_samples(app.metrics.render().decode())
    assert samples['dist_attn_requests_cancelled_total{reason="deadline"}'] == 1


def test_200_concurrent_connections_are_all_answered(app):
    conns = [socket.create_connection(("127.0.0.1", app.port), timeout=30) for _ in range(200)]
    try:
        for c in conns:  # all 200 are open before any request is sent
            c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        statuses = []
        for c in conns:
            data = b""
            while not (b"\r\n\r\n" in data and _complete(data)):
                chunk = c.recv(65536)
                assert chunk, "connection closed without an answer"
                data += chunk
            statuses.append(_parse(data)[0])
    finally:
        for c in conns:
            c.close()
    assert statuses == [200] * 200


def test_idle_and_slow_connections_are_closed(app):
    with socket.create_connection(("127.0.0.1", app.port), timeout=10) as s:
        t0 = time.monotonic()
        assert s.recv(1) == b""  # closed by the server, nothing sent
        assert time.monotonic() - t0 < IDLE_S + 3
    with socket.create_connection(("127.0.0.1", app.port), timeout=10) as s:
        t0 = time.monotonic()
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":  # a head, one byte per 0.2 s
            try:
                s.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
            if time.monotonic() - t0 > IDLE_S + 3:
                break
        if not closed:
            s.settimeout(3)
            closed = s.recv(1) == b""
        assert closed and time.monotonic() - t0 < IDLE_S + 4


def test_a_body_that_stalls_gets_408(app):
    t0 = time.monotonic()
    stalled = _post(b'{"steps": 1}')[:-8]  # the head and part of the body, then nothing
    headers = _json_error(_exchange(app.port, stalled, timeout=IDLE_S + 5), 408)
    assert headers["connection"] == "close" and time.monotonic() - t0 < IDLE_S + 4
    assert len(app.jobs) == 0


def test_health_reports_silent_ranks_and_shutdown(app):
    status = _parse(_exchange(app.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status[0] == 200 and json.loads(status[2])["status"] == "ok"
    app.liveness._last -= app.cfg.runtime.health_timeout_s + 1  # no rank answered for a while
    status = _parse(_exchange(app.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status[0] == 503 and json.loads(status[2])["status"] == "not_ready"
    app.liveness.contact()
    app.liveness.stopping = True
    status = _parse(_exchange(app.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert status[0] == 503 and json.loads(status[2])["status"] == "shutting_down"
    _json_error(_exchange(app.port, _post(b'{"steps": 1}')), 503)


def test_answers_are_not_held_by_nagle(app):
    """Headers and body leave in two writes; without TCP_NODELAY on accepted connections the
    body waited for the client's delayed ACK: 45 ms median per keep-alive request, 0.9 ms with."""
    with socket.create_connection(("127.0.0.1", app.port), timeout=10) as s:
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while not (b"\r\n\r\n" in data and _complete(data)):
                data += s.recv(65536)
            times.append(time.perf_counter() - t0)
    assert sorted(times)[10] < 0.030, sorted(times)


def test_a_trailing_slash_is_a_404_json_not_a_redirect(app):
    """Starlette redirected /health/ with a 307, an empty body and a Location built from the
    client's Host header (a client can make the server point anywhere)."""
    for raw in (b"GET /health/ HTTP/1.1\r\nHost: evil.example\r\n\r\n",
                _post(b'{"steps": 1}').replace(b"/v1/generate ", b"/v1/generate/ ")):
        headers = _json_error(_exchange(app.port, raw), 404)
        assert "location" not in headers
    assert len(app.jobs) == 0


def test_the_bearer_scheme_is_case_insensitive(app):
    """RFC 9110 11.1: the auth scheme is case-insensitive; the token is not."""
    for scheme in ("bearer", "BEARER", "bEaReR"):
        raw = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: {scheme} {KEY}\r\n\r\n"
        assert _parse(_exchange(app.port, raw.encode()))[0] == 200, scheme
    raw = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY.upper()}\r\n\r\n"
    _json_error(_exchange(app.port, raw.encode()), 401)
    raw = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {KEY}\r\n\r\n"
    _json_error(_exchange(app.port, raw.encode()), 401)


def test_every_rejection_is_counted_in_the_error_metrics(app):
    """401 (auth), 431 (head too large) and the protocol's own 400s were answered but never
    counted; 404 and 405 neither."""
    port = app.port
    _json_error(_exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"), 401)
    huge_head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000 + b"\r\n\r\n"
    _json_error(_exchange(port, huge_head), 431)
    _json_error(_exchange(port, b"\x16\x03\x01 not http\r\n\r\n"), 400)
    _json_error(_exchange(port, _post(b"{}", "Content-Length: 2\r\n")), 400)
    _json_error(_exchange(port, b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n"), 404)
    _json_error(_exchange(port, b"BREW /v1/generate HTTP/1.1\r\nHost: x\r\n\r\n"), 405)
    samples = metric_samples(app.metrics.render().decode())
    got = {code: samples.get(f'dist_attn_request_errors_total{{code="{code}"}}')
           for code in ("400", "401", "404", "405", "431")}
    assert got == {"400": 2, "401": 1, "404": 1, "405": 1, "431": 1}, got


def test_a_client_gone_while_its_job_runs_logs_info_not_an_asyncio_error(app, caplog):
    """The handler left the job's future unawaited; when the loop later failed the job, asyncio
    logged 'ERROR asyncio: Future exception was never retrieved' with a traceback. A client that
    leaves is a normal event."""
    import gc
    import logging

    caplog.set_level(logging.INFO)
    with socket.create_connection(("127.0.0.1", app.port), timeout=5) as s:
        s.sendall(_post(b'{"steps": 1}'))
        job = app.jobs.get(timeout=5)  # the loop took it: it is running, not queued
    _wait(lambda: job.abort_reason().label == "client_gone", timeout=5)
    job.fail(499, "client disconnected")  # what the rank-0 loop does after the abort
    time.sleep(0.5)  # the failure reaches the HTTP thread's event loop
    gc.collect()  # asyncio reports unretrieved exceptions when the future is collected
    time.sleep(0.2)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        (r.name, r.getMessage()) for r in caplog.records if r.levelno >= logging.WARNING]
    gone = [r for r in caplog.records if "client disconnected" in r.getMessage()]
    assert gone and all(r.levelno == logging.INFO and r.exc_info is None for r in gone)


def test_retry_after_is_when_a_slot_opens_from_measured_step_times(app):
    """A full queue's Retry-After was the whole backlog (running + every queued job): 9x the time
    until a slot opens, which is when the running job ends and the loop takes the next. It is
    that now: the running job's measured whole time less what it has run, at least its steps
    left; the time outside the steps counts until the job ends, not until its last step."""
    from dist_attn.models.h3.serve.jobs.queue import Job
    from dist_attn.models.h3.serve.jobs.requests import parse_request

    rows = parse_request({"steps": 4}, app.cfg).layout(app.cfg).used
    app.step_times.observe_step(rows, 2.0)
    app.step_times.observe_overhead("generate", 0.25)
    # 3 steps left: 6.0 s at least, whatever the clock (its whole 8.25 s less 100 s run)
    app.running = Job(request=parse_request({"steps": 4}, app.cfg), rows=rows, steps_done=1,
                      started=time.perf_counter() - 100.0)
    answers: list[bytes] = []
    waiting = [_submit(app.port, b'{"steps": 4}', answers) for _ in range(2)]
    _wait(lambda: len(app.jobs) == 2)
    headers = _json_error(_exchange(app.port, _post(b'{"steps": 4}')), 429)
    assert headers["retry-after"] == "6", headers  # the backlog was 6.25 + 2 x 8.25 -> 23
    app.running = None
    for _ in range(2):
        app.jobs.get(timeout=1).finish(_Done())
    for t in waiting:
        t.join(10)


def test_step_times_estimate_unmeasured_lengths_from_the_nearest():
    from dist_attn.models.h3.serve.jobs.queue import StepTimes

    times = StepTimes(default_step_s=2.0)
    assert times.step_s(100) == 2.0  # nothing measured yet
    times.observe_step(100, 1.0)
    times.observe_step(100, 2.0)
    assert times.step_s(100) == pytest.approx(1.5)  # the median of the recent ones
    times.observe_step(1000, 5.0)
    assert times.step_s(900) == pytest.approx(4.5)  # nearest (1000), scaled by length
    assert times.job_s(100, 3, "video") == pytest.approx(4.5)  # no overhead seen
    times.observe_overhead("video", 4.0)
    assert times.job_s(100, 3, "video") == pytest.approx(3 * 1.5 + 4.0)
    # running: the whole time less the time run, at least the steps left
    assert times.running_s(100, 3, "video", steps_done=1, elapsed_s=2.0) == pytest.approx(6.5)
    assert times.running_s(100, 3, "video", steps_done=1, elapsed_s=7.0) == pytest.approx(3.0)
    assert times.running_s(100, 3, "video", steps_done=3, elapsed_s=6.0) == pytest.approx(2.5)
    assert times.running_s(100, 3, "video", steps_done=3, elapsed_s=9.0) == 0.0
    assert StepTimes.retry_after(0.01) == 1 and StepTimes.retry_after(5.2) == 6


def test_a_cold_first_measurement_does_not_skew_the_estimates():
    """The estimates were moving averages seeded by the first measurement: the first job after
    a start (one CPU rank, the tiny H3: 0.64 s outside its steps against 0.39-0.55 s for the next
    four) weighed on them for ten jobs more. They are medians of the recent measurements now."""
    from dist_attn.models.h3.serve.jobs.queue import StepTimes

    times = StepTimes()
    for seconds in (0.64, 0.39, 0.45, 0.50):
        times.observe_overhead("video", seconds)
        times.observe_step(576, seconds / 10)
    assert times.job_s(576, 1, "video") == pytest.approx(0.0475 + 0.475)
    for _ in range(20):  # only the recent ones count
        times.observe_step(576, 0.01)
    assert times.step_s(576) == 0.01


def _read_until_closed(port: int, raw: bytes, timeout: float = 10) -> bytes:
    """Sends ``raw`` and reads every answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            data += chunk
        return data


def test_content_length_lists_and_pipelined_duplicates_are_refused(app):
    """h11 reads 'Content-Length: 2, 2' as 2 and merges equal repeats, so the app sees neither.
    The raw-head check looked at the first head of a packet only, ended by CRLF CRLF: a
    pipelined second request with two Content-Length headers passed, and so did a head with bare
    LF line ends (which h11 accepts)."""
    port = app.port
    listed = b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2, 2\r\n\r\n{}"
    data = _exchange(port, listed)
    assert _json_error(data, 400)["connection"] == "close"
    assert "Content-Length='2, 2' must be one decimal number" in json.loads(_parse(data)[2])[
        "error"]["message"]
    twice = b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"
    bare_lf = twice.replace(b"\r\n", b"\n")
    _json_error(_exchange(port, bare_lf), 400)
    pipelined = _read_until_closed(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + twice,
                                   timeout=IDLE_S + 5)
    first, sep, second = pipelined.partition(b"HTTP/1.1 ")[2].partition(b"HTTP/1.1 ")
    assert first.startswith(b"200") and sep, pipelined
    second = b"HTTP/1.1 " + second
    _json_error(second, 400)
    assert b"2 Content-Length headers" in second
    samples = metric_samples(app.metrics.render().decode())
    assert samples['dist_attn_request_errors_total{code="400"}'] == 3
    assert 'dist_attn_request_errors_total{code="404"}' not in samples


def test_a_malformed_chunked_body_is_400_logged_at_info_without_traceback(app, caplog):
    """h11 refused the chunk while the app already ran the request: uvicorn logged a WARNING,
    then the app's own answer met a closed connection and wrote an ERROR with a traceback. A
    client's mistake is logged at INFO, once, without a traceback."""
    import logging

    caplog.set_level(logging.INFO)
    raw = (f"POST /v1/generate HTTP/1.1\r\nHost: x\r\n{AUTH}Transfer-Encoding: chunked\r\n\r\n"
           "zz\r\n{}\r\n0\r\n\r\n").encode()
    _json_error(_exchange(app.port, raw), 400)
    time.sleep(0.5)  # the app's task for the request ends after the answer
    loud = [(r.name, r.levelname, r.getMessage()) for r in caplog.records
            if r.levelno >= logging.WARNING or r.exc_info]
    assert loud == [], loud
    assert any("invalid HTTP request" in r.getMessage() and r.levelno == logging.INFO
               for r in caplog.records)
    assert len(app.jobs) == 0
    assert _parse(_exchange(app.port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"))[0] == 200


def test_a_500_is_json_and_counted(app, monkeypatch):
    """Every error answer is counted in dist_attn_request_errors_total; 500s were not."""
    import dist_attn.models.h3.serve.http.generate as http_module

    def broken(*_a, **_k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(http_module, "parse_request", broken)
    data = _exchange(app.port, _post(b'{"steps": 1}'))
    _json_error(data, 500)
    assert "a bug" not in data.decode()  # library internals stay in the log
    samples = metric_samples(app.metrics.render().decode())
    assert samples['dist_attn_request_errors_total{code="500"}'] == 1
