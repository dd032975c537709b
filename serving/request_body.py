"""The router's front door for a request body: its size, its JSON nesting and its numbers are
checked before anything reaches a part, and every refusal names what was wrong. Pure (no Ray,
no Starlette): unit tests import it alone.

Why each check sits where it does: the size is checked before the body is read whole (413),
the nesting before `json.loads` (which recurses, and raises RecursionError on a deep enough
array), and the numbers after parsing, because Python's parser reads `NaN`, `Infinity` and
`1e999` as floats that would reach a tensor and come back as the model's own failure."""

from __future__ import annotations

import json
import math
import re
from array import array
from itertools import accumulate
from typing import Any, NamedTuple

__all__ = [
    "BodyError",
    "Feedback",
    "check_json_depth",
    "first_non_finite",
    "parse_feedback_body",
    "parse_request_body",
]

MAX_UNIT_CHARS = 256
MAX_OUTCOMES = 32

# A JSON string, escapes included: what the nesting count must skip ("[" inside a string).
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
# Brackets to +1/-1 as signed bytes, everything else deleted: the nesting is a running sum.
_OPENERS, _CLOSERS = b"[{", b"]}"
_DEPTH_TABLE = bytes(1 if b in _OPENERS else 255 if b in _CLOSERS else 0 for b in range(256))
_NOT_BRACKETS = bytes(b for b in range(256) if b not in _OPENERS + _CLOSERS)


class BodyError(ValueError):
    """A request body refused at the door: the caller's mistake, with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def check_json_depth(raw: bytes, max_depth: int) -> None:
    """Refuse JSON nested deeper than `max_depth` arrays and objects, without parsing it.

    Linear in the body and in C (a regex, a translate, an accumulate over signed bytes), so a
    body made to be slow to check costs what a body of its size costs to read."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS).translate(_DEPTH_TABLE)
    if not brackets:
        return
    deepest = max(accumulate(array("b", brackets)))
    if deepest > max_depth:
        raise BodyError(
            400,
            f"body: JSON nested {deepest} levels deep; at most {max_depth} are accepted "
            "(router.max_json_depth in the model's spec)",
        )


def first_non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinite number in a parsed JSON value, or None.

    Iterative, so the depth check above is the only bound on nesting this needs."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return where
        elif isinstance(item, dict):
            stack.extend((v, f"{where}.{k}") for k, v in reversed(list(item.items())))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def parse_request_body(raw: bytes, max_depth: int) -> dict[str, Any]:
    """A predict body `{"inputs": ..., "key": optional, "stream": optional}`, checked.

    Raises `BodyError` (400) for a body that is not JSON, is nested too deep, is not an object
    with `inputs`, or carries a number that is not finite (named by its path, e.g.
    `inputs.user.features[3]`). The size was checked by the caller, before reading."""
    check_json_depth(raw, max_depth)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError
        raise BodyError(400, f"body is not JSON: {err}") from None
    if not isinstance(body, dict) or "inputs" not in body:
        raise BodyError(400, 'body must be a JSON object {"inputs": ..., "key": optional}')
    bad = first_non_finite(body["inputs"], "inputs")
    if bad is not None:
        raise BodyError(
            400, f"{bad}: not a finite number (NaN, Infinity or out of range); send a finite value"
        )
    key = body.get("key")
    if key is not None and not isinstance(key, str):
        raise BodyError(400, f"key: {key!r:.80} is not a string; send the sticky key as a string")
    unit = body.get("unit")
    if unit is not None:
        body["unit"] = _unit(unit)
    return body


def _unit(unit: Any) -> str:
    """An experiment's unit (a user id): a string or an integer, the same user as either."""
    if isinstance(unit, bool) or not isinstance(unit, (str, int)):
        raise BodyError(400, f"unit: {unit!r:.80} is not a string or an integer; send the user's id")
    text = str(unit)
    if not 0 < len(text) <= MAX_UNIT_CHARS:
        raise BodyError(400, f"unit: 1 to {MAX_UNIT_CHARS} characters, got {len(text)}")
    return text


class Feedback(NamedTuple):
    request_id: str
    outcome: dict[str, float]  # name -> value


def parse_feedback_body(raw: bytes, max_depth: int) -> Feedback:
    """A feedback body `{"request_id": "<an answer's id>", "outcome": {"<name>": number, ...}}`,
    checked; `BodyError` (400) names what is wrong."""
    check_json_depth(raw, max_depth)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise BodyError(400, f"body is not JSON: {err}") from None
    if not isinstance(body, dict) or set(body) != {"request_id", "outcome"}:
        raise BodyError(400, 'body must be a JSON object {"request_id": "...", "outcome": {"name": number}}')
    request_id, outcome = body["request_id"], body["outcome"]
    if not isinstance(request_id, str) or not request_id:
        raise BodyError(400, f"request_id: {request_id!r:.80} is not an answer's request id (a string)")
    if not isinstance(outcome, dict) or not 0 < len(outcome) <= MAX_OUTCOMES:
        raise BodyError(400, f'outcome: an object of 1 to {MAX_OUTCOMES} named numbers, e.g. {{"click": 1}}')
    values: dict[str, float] = {}
    for name, value in outcome.items():
        if not re.fullmatch(r"[a-z][a-z0-9_]{0,62}", name):
            raise BodyError(400, f"outcome.{name[:64]}: a name of lowercase letters, digits and _")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise BodyError(400, f"outcome.{name}: {value!r:.40} is not a finite number")
        values[name] = float(value)
    return Feedback(request_id, values)
