"""Signal and update payloads read by hand, so that no payload, a malformed one or a second one
never fails a workflow task.

Signals come from every door, the Temporal UI's "Send a Signal" included, which sends no payload
unless told to. A handler typed `input: Model` would then be called with no argument (a
TypeError: the workflow task fails, and fails again on every retry). So handlers take
`raw: Any = NO_PAYLOAD, _extra: Any = None` (the SDK hands over plain JSON values: it uses type
hints only when their count matches the payloads'), and read `raw` here: missing or not a valid
`kind`, the handler gets None and the worker's log says why. Three payloads or more (only a
hand-made CLI call sends them) still fail the task: the SDK has no typed varargs.

Updates take the same `raw` arguments; their validator reads the payload with `update_input`,
which refuses a missing or malformed one (an ApplicationError naming what was expected: the
update is rejected, no workflow task fails and nothing enters the history), and the handler
reads it again the same way (it passed the validator, or was accepted when it was recorded).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError
from temporalio import workflow
from temporalio.exceptions import ApplicationError

__all__ = ["NO_PAYLOAD", "UPDATE_INPUT_ERROR", "signal_input", "update_input"]

UPDATE_INPUT_ERROR = "UpdateInputError"  # the type of an update's refusal for its payload

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


def update_input(raw: Any, kind: type[T], update: str, example: str) -> T:
    """`raw` (an update's JSON payload) read as `kind`; a missing or malformed one raises a
    non-retryable ApplicationError naming the update, what it expected (`example`) and what was
    wrong, so a validator refuses the update with it."""
    if raw is NO_PAYLOAD:
        raise ApplicationError(
            f"update {update}: no payload. Fix: send a {kind.__name__} as its input, e.g. {example}",
            type=UPDATE_INPUT_ERROR,
            non_retryable=True,
        )
    try:
        return TypeAdapter(kind).validate_python(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc']) or 'payload'}: {e['msg']}" for e in err.errors()
        )
        raise ApplicationError(
            f"update {update}: the payload is not a {kind.__name__} ({problems}). Fix: send e.g. {example}",
            type=UPDATE_INPUT_ERROR,
            non_retryable=True,
        ) from None
