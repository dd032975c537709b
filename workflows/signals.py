"""Signal payloads read by hand, so that no payload, a malformed one or a second one never fails
a workflow task.

Signals come from every door, the Temporal UI's "Send a Signal" included, which sends no payload
unless told to. A handler typed `input: Model` would then be called with no argument (a
TypeError: the workflow task fails, and fails again on every retry). So handlers take
`raw: Any = NO_PAYLOAD, _extra: Any = None` (the SDK hands over plain JSON values: it uses type
hints only when their count matches the payloads'), and read `raw` here: missing or not a valid
`kind`, the handler gets None and the worker's log says why. Three payloads or more (only a
hand-made CLI call sends them) still fail the task: the SDK has no typed varargs.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from temporalio import workflow

__all__ = ["NO_PAYLOAD", "signal_input"]

T = TypeVar("T")


class _NoPayload:
    def __repr__(self) -> str:
        return "NO_PAYLOAD"


NO_PAYLOAD: Any = _NoPayload()  # a handler's default: the signal carried no payload


def signal_input(raw: Any, kind: type[T], signal: str) -> T | None:
    """`raw` (a signal's JSON payload) read as `kind`; None, with a warning in the worker's log,
    when it is missing or is not a valid `kind`."""
    if raw is NO_PAYLOAD:
        workflow.logger.warning("signal %s carried no payload (expected %s)", signal, kind.__name__)
        return None
    try:
        return TypeAdapter(kind).validate_python(raw)
    except ValidationError as err:
        workflow.logger.warning("signal %s: payload is not a %s, ignored: %s", signal, kind.__name__, err)
        return None
