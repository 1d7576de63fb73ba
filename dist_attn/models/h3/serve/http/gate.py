# SPDX-License-Identifier: Apache-2.0
"""What every route passes through, and how a refusal reads: the bearer token, the body within
``serve.max_body_bytes`` and ``serve.idle_timeout_s``, its JSON within the nesting and integer
limits (checked before the costly step they guard: the depth and the integer length before
parsing), and the error answer ``{"error": {"code", "message"}}``, counted by status."""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any, Callable, TypeVar

from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response

from dist_attn.models.h3.serve.config.sections import ServeConfig
from dist_attn.models.h3.serve.http.state import ServerState
from dist_attn.models.h3.serve.jobs.requests import RequestError

__all__ = ["Gate", "decode_json", "error_response"]

_Parsed = TypeVar("_Parsed")


def error_response(status: int, message: str, *, close: bool = False,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON error answer (not counted: :meth:`Gate.fail` counts)."""
    hdrs = dict(headers or {})
    if close:  # the body was left unread: the connection cannot carry another request
        hdrs["connection"] = "close"
    return JSONResponse({"error": {"code": status, "message": message}}, status_code=status,
                        headers=hdrs)


def _nesting_depth(body: bytes) -> int:
    """Deepest [ / { nesting of a JSON text, strings skipped (no recursion, O(len))."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in body:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys appear once. json.loads kept the last of a repeated key, so
    ``{"steps": 1000, "steps": 2}`` was a 202 for 2 steps; what a client meant is unknown."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise RequestError(400, f"duplicate key {key!r} in a JSON object ({key!r}: "
                                    f"{obj[key]!r}, then {value!r}): each key may appear once")
        obj[key] = value
    return obj


class _LongInt:
    """Stands in for an integer literal above ``serve.max_int_digits`` while the body is parsed
    (``int()`` of it is never called: its cost grows with the square of its length)."""

    __slots__ = ("digits",)

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:  # how a message that shows the value reads
        return f"<an integer of {self.digits} digits>"


def _find_long_int(value: Any, path: str) -> tuple[str, _LongInt] | None:
    """The first :class:`_LongInt` in ``value`` (document order) and its path (``a.b[1]``)."""
    if isinstance(value, _LongInt):
        return path, value
    items: Any = ()
    if isinstance(value, dict):
        items = ((f"{path}.{k}" if path else k, v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path or 'body'}[{i}]", v) for i, v in enumerate(value))
    for where, item in items:
        found = _find_long_int(item, where)
        if found is not None:
            return found
    return None


def decode_json(body: bytes, limits: ServeConfig) -> Any:
    """Parses a request body within ``limits``; raises :class:`RequestError` (400) naming the
    limit. Integers longer than max_int_digits (named by their path in the body), NaN/Infinity
    and a key repeated in one object are refused; none of them is converted."""
    depth = _nesting_depth(body)
    if depth > limits.max_json_depth:
        raise RequestError(400, f"JSON nesting depth {depth} exceeds serve.max_json_depth="
                                f"{limits.max_json_depth}")
    too_long = False

    def parse_int(text: str) -> int | _LongInt:
        nonlocal too_long
        digits = len(text.lstrip("-"))
        if digits > limits.max_int_digits:
            too_long = True
            return _LongInt(digits)
        return int(text)

    def parse_constant(text: str) -> Any:
        raise RequestError(400, f"{text} is not valid JSON")

    try:
        value = json.loads(body.decode("utf-8"), parse_int=parse_int,
                           parse_constant=parse_constant, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON: {e}") from None
    if too_long:
        # the message named no field (16 fields of the two bodies read alike)
        found = _find_long_int(value, "")
        assert found is not None
        where, literal = found
        raise RequestError(400, f"{where or 'body'}={literal!r} exceeds serve.max_int_digits={limits.max_int_digits}")
    return value


async def _read_body(request: HttpRequest, length: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > length:
            break
        chunks.append(chunk)
    return b"".join(chunks)


class Gate:
    """The checks and refusals of one server's routes, over its :class:`ServerState`."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def fail(self, status: int, message: str, **kw: Any) -> JSONResponse:
        """The error answer, counted in the metrics by ``status``."""
        self.state.metrics.error(status)
        return error_response(status, message, **kw)

    def refused(self, request: HttpRequest) -> JSONResponse | None:
        """The 401 to send when the server has an API key and ``request`` does not carry it."""
        api_key = self.state.api_key
        if api_key is None:
            return None
        # The scheme is case-insensitive (RFC 9110 11.1: curl users send "bearer"); the token
        # is compared exactly, in constant time.
        scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                              api_key.encode()):
            return None
        return self.fail(401, "missing or wrong bearer token",
                         headers={"www-authenticate": "Bearer"})

    async def read_json(self, request: HttpRequest) -> Any:
        """The decoded JSON body within the limits, or the error Response to send."""
        limits = self.state.cfg.serve
        if "transfer-encoding" in request.headers or "content-length" not in request.headers:
            return self.fail(411, "Content-Length required (chunked bodies are not accepted)",
                             close=True)
        length = int(request.headers["content-length"])  # one, digits only (h11 + GuardedH11Protocol)
        if length > limits.max_body_bytes:
            return self.fail(413, f"body of {length} bytes exceeds serve.max_body_bytes="
                                  f"{limits.max_body_bytes}", close=True)
        try:
            body = await asyncio.wait_for(_read_body(request, length), limits.idle_timeout_s)
        except ClientDisconnect:  # a truncated body is never executed
            return Response(status_code=400)
        except asyncio.TimeoutError:
            return self.fail(408, f"body not received within serve.idle_timeout_s="
                                  f"{limits.idle_timeout_s}", close=True)
        try:
            return decode_json(body, limits)
        except RequestError as e:
            return self.fail(e.status, str(e))

    async def admit(self, request: HttpRequest,
                    parse: Callable[[Any], _Parsed]) -> _Parsed | Response:
        """What a route that takes work does first: the token, the JSON body within the limits,
        ``parse`` of it (a :class:`RequestError` is the answer) and a 503 once a shutdown
        started. The parsed request, or the error Response to send."""
        denied = self.refused(request)
        if denied:
            return denied
        payload = await self.read_json(request)
        if isinstance(payload, Response):
            return payload
        try:
            parsed = parse(payload)
        except RequestError as e:
            return self.fail(e.status, str(e))
        if self.state.liveness.stopping:
            return self.fail(503, "server is shutting down")
        return parsed
