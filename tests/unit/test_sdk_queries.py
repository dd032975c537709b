"""The SDK's reading of a model's state at the Temporal seam: a query the worker answered with
its deadlock detector's error is asked again; any other failure is a ServingError at once."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import WorkflowQueryFailedError

from ipnext.client import sdk
from ipnext.errors import ServingError

DEADLOCK = "[TMPRL1101] Potential deadlock detected: workflow didn't yield within 2 second(s)."


class Handle:
    """A model workflow's handle whose query fails with `errors` in turn, then answers."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = list(errors)
        self.asked = 0

    async def query(self, name: str, result_type: Any = None) -> str:
        self.asked += 1
        if self.errors:
            raise WorkflowQueryFailedError(self.errors.pop(0))
        return "the state"


def client_with(handle: Handle, monkeypatch: pytest.MonkeyPatch) -> sdk.Client:
    client = sdk.Client.__new__(sdk.Client)

    async def running(name: str) -> Handle:
        return handle

    monkeypatch.setattr(client, "_running_model", running)
    monkeypatch.setattr(sdk, "QUERY_DEADLOCK_PAUSE_S", 0.01)
    return client


async def test_a_deadlock_answer_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    handle = Handle([DEADLOCK, DEADLOCK])
    assert await client_with(handle, monkeypatch)._query_state("m") == "the state"
    assert handle.asked == 3


async def test_deadlock_answers_past_the_retries_and_other_failures_are_serving_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handle = Handle([DEADLOCK] * (sdk.QUERY_DEADLOCK_RETRIES + 1))
    with pytest.raises(ServingError, match="TMPRL1101"):
        await client_with(handle, monkeypatch)._query_state("m")
    assert handle.asked == sdk.QUERY_DEADLOCK_RETRIES + 1
    other = Handle(["a handler raised: KeyError"])
    with pytest.raises(ServingError, match="query failed: a handler raised"):
        await client_with(other, monkeypatch)._query_state("m")
    assert other.asked == 1
