"""The request schema: what a client may send to ``/v1/generate`` and how it is checked.

Everything here runs on rank 0 before anything is broadcast; a rejected request costs no
collective. Limits are checked before the costly step they guard: the JSON nesting depth and
integer length before parsing, the geometry before multiplying it out.
"""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass
from typing import Any

from dist_attn.serve.config import Config, ServeConfig
from dist_attn.serve.config.tokens import PackedLayout
from dist_attn.serve.wire.control import WIRE_FIELDS

__all__ = ["RequestError", "Request", "decode_json", "parse_request",
           "request_from_wire"]

_FIELDS = (*WIRE_FIELDS, "timeout_s")


class RequestError(ValueError):
    """A request rejected on rank 0 before anything is broadcast; ``status`` is the HTTP code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(kw_only=True, frozen=True)
class Request:
    """A validated generation request. The integer fields are broadcast to every rank;
    ``request_id`` and ``timeout_s`` stay on rank 0."""

    request_id: str
    frames: int
    height: int
    width: int
    steps: int
    seed: int
    timeout_s: float | None = None
    """Seconds from receipt after which the request is dropped or aborted (None: the server's
    serve.request_timeout_s)."""

    def layout(self, cfg: Config) -> PackedLayout:
        """The packed rows of this request under ``cfg`` (H3's rules)."""
        return cfg.layout(frames=self.frames, height=self.height, width=self.width)

    def wire(self) -> tuple[int, ...]:
        """The fields every rank needs, as integers in :data:`WIRE_FIELDS` order."""
        return tuple(getattr(self, k) for k in WIRE_FIELDS)

    def to_json(self) -> dict[str, Any]:
        """The request as echoed in a result (the id and deadline are reported elsewhere)."""
        return {k: getattr(self, k) for k in WIRE_FIELDS}


_ids = itertools.count(1)


def _new_request_id() -> str:
    return f"req-{next(_ids):06d}-{uuid.uuid4().hex[:8]}"


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


def decode_json(body: bytes, limits: ServeConfig) -> Any:
    """Parses a request body within ``limits``; raises :class:`RequestError` (400) naming the
    limit. Integers longer than max_int_digits, NaN/Infinity and a key repeated in one object
    are refused during parsing."""
    depth = _nesting_depth(body)
    if depth > limits.max_json_depth:
        raise RequestError(400, f"JSON nesting depth {depth} exceeds serve.max_json_depth="
                                f"{limits.max_json_depth}")

    def parse_int(text: str) -> int:
        if len(text.lstrip("-")) > limits.max_int_digits:
            raise RequestError(400, f"integer literal of {len(text.lstrip('-'))} digits exceeds "
                                    f"serve.max_int_digits={limits.max_int_digits}")
        return int(text)

    def parse_constant(text: str) -> Any:
        raise RequestError(400, f"{text} is not valid JSON")

    try:
        return json.loads(body.decode("utf-8"), parse_int=parse_int,
                          parse_constant=parse_constant, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RequestError(400, f"body is not valid JSON: {e}") from None


def parse_request(payload: Any, cfg: Config, *, request_id: str | None = None) -> Request:
    """Validates a decoded JSON request; raises :class:`RequestError` (400 malformed, 413 too
    large) naming the field. Absent fields take the config's [request] defaults. ``timeout_s``
    (a number of seconds) may shorten the server's deadline, never extend it."""
    if not isinstance(payload, dict):
        raise RequestError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - set(_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field(s) {unknown}; valid: {list(_FIELDS)}")
    payload = dict(payload)
    timeout_s = payload.pop("timeout_s", None)
    for name, value in payload.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(400, f"{name}={value!r} must be an integer")
    if timeout_s is not None:
        if (not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool)
                or not 0 < timeout_s <= cfg.serve.request_timeout_s):
            raise RequestError(400, f"timeout_s={timeout_s!r} must be a number in (0, "
                                    f"serve.request_timeout_s={cfg.serve.request_timeout_s}]")
    d = cfg.request
    fields = {name: payload.get(name, getattr(d, name)) for name in WIRE_FIELDS}
    for name in ("frames", "height", "width", "steps"):
        if fields[name] <= 0:
            raise RequestError(400, f"{name}={fields[name]} must be a positive integer")
    if not 0 <= fields["seed"] < 2**63:
        raise RequestError(400, f"seed={fields['seed']} must be in [0, 2**63)")
    if fields["steps"] > cfg.serve.max_steps:
        raise RequestError(413, f"steps={fields['steps']} exceeds serve.max_steps="
                                f"{cfg.serve.max_steps}")
    # Bound the geometry before multiplying it out, so a huge number cannot cost time here.
    for name in ("frames", "height", "width"):
        if fields[name] > 1_000_000:
            raise RequestError(413, f"{name}={fields[name]} is too large")
    try:
        layout = cfg.layout(frames=fields["frames"], height=fields["height"], width=fields["width"])
    except ValueError as e:
        raise RequestError(400, str(e)) from None
    rule = cfg.rows_rule(layout)
    if rule:
        raise RequestError(413, rule)
    return Request(request_id=request_id or _new_request_id(), timeout_s=timeout_s, **fields)


def request_from_wire(values: tuple[int, ...]) -> Request:
    """A request rebuilt on a worker rank from its :meth:`Request.wire` integers."""
    return Request(request_id="-", **dict(zip(WIRE_FIELDS, values)))
