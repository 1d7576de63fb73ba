# SPDX-License-Identifier: Apache-2.0
"""The request schema: what a client may send to ``/v1/generate`` and how it is checked.

Everything here runs on rank 0 before anything is broadcast; a rejected request costs no
collective. Limits are checked before the costly step they guard: the geometry before multiplying
it out (the body's JSON nesting depth and integer length before parsing:
:func:`dist_attn.models.h3.serve.http.gate.decode_json`).
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

from dist_attn.models.h3.serve.config.deployment import Config
from dist_attn.models.h3.serve.config.fields import steps_rule
from dist_attn.models.h3.serve.config.tokens import PackedLayout
from dist_attn.models.h3.serve.wire.control import WIRE_FIELDS

__all__ = ["RequestError", "Request", "parse_request", "request_from_wire"]

_FIELDS = (*WIRE_FIELDS, "timeout_s")
#: frames, height and width are bounded before the packed rows are computed, so a huge number
#: costs no time; serve.max_tokens then bounds the rows themselves.
_GEOMETRY_BOUND = 1_000_000


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
    rule = steps_rule(fields["steps"], cfg.serve.max_steps)
    if rule:
        raise RequestError(413, f"steps={fields['steps']} {rule}")
    # Bound the geometry before multiplying it out, so a huge number cannot cost time here.
    for name in ("frames", "height", "width"):
        if fields[name] > _GEOMETRY_BOUND:
            raise RequestError(413, f"{name}={fields[name]} is too large: at most {_GEOMETRY_BOUND} "
                                    f"(and the request's packed rows at most serve.max_tokens="
                                    f"{cfg.serve.max_tokens})")
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
