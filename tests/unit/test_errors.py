"""The error tree crosses processes whole: every ipnext error a worker raises reaches the SDK as
its own class with its message, fix, field, value and attributes, through the real Temporal
failure conversion (the pydantic data converter, no server)."""

from __future__ import annotations

import pytest
from temporalio.api.failure.v1 import Failure
from temporalio.client import WorkflowFailureError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ActivityError, ApplicationError, RetryState

from ipnext import errors
from ipnext.activities.validate import as_application_error
from ipnext.client.temporal import from_temporal, temporal_errors
from ipnext.errors import IpnextError, PredictionOverloadedError, error_from_wire

CLASSES = sorted(errors._every_error_class().values(), key=lambda c: c.__name__)


def test_the_tree_holds_every_class_the_module_exports() -> None:
    exported = {getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)}
    assert exported == set(CLASSES)


async def _across(raised: BaseException) -> BaseException:
    """`raised` as a Temporal failure, encoded and decoded as between worker and client."""
    failure = Failure()
    await pydantic_data_converter.encode_failure(raised, failure)
    return await pydantic_data_converter.decode_failure(failure)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
async def test_every_error_reaches_the_client_as_its_class_with_its_fix(cls: type[IpnextError]) -> None:
    err = cls.__new__(cls)
    IpnextError.__init__(
        err, "parts.embed: checksum mismatch.", field="parts.embed", value=3, fix="publish again"
    )
    if issubclass(cls, errors.PredictionError):
        err.status_code, err.retry_after_s = 503, 1.5
    arrived = await _across(as_application_error(err))
    # As the SDK meets it: an activity's failure under a workflow's.
    outer = WorkflowFailureError(
        cause=ActivityError(
            "x",
            scheduled_event_id=1,
            started_event_id=2,
            identity="w",
            activity_type="a",
            activity_id="1",
            retry_state=RetryState.NON_RETRYABLE_FAILURE,
        )
    )
    outer.cause.__cause__ = arrived
    rebuilt = from_temporal(outer)
    assert type(rebuilt) is cls
    assert (rebuilt.message, rebuilt.fix, rebuilt.field, rebuilt.value) == (
        err.message,
        "publish again",
        "parts.embed",
        3,
    )
    assert str(rebuilt) == str(err)
    if issubclass(cls, errors.PredictionError):
        assert (rebuilt.status_code, rebuilt.retry_after_s) == (503, 1.5)


def test_an_error_a_workflow_raised_by_hand_keeps_its_fix_from_its_text() -> None:
    raised = ApplicationError(
        "version: 'v1' was already published. Fix: give a new version label.", type="SnapshotError"
    )
    rebuilt = error_from_wire(raised.type, raised.message)
    assert isinstance(rebuilt, errors.SnapshotError)
    assert (rebuilt.message, rebuilt.fix) == (
        "version: 'v1' was already published.",
        "give a new version label.",
    )


def test_an_unknown_type_arrives_as_the_base_error_with_its_text() -> None:
    rebuilt = error_from_wire("TimeoutError", "the check did not answer")
    assert type(rebuilt) is IpnextError and str(rebuilt) == "the check did not answer"


async def test_the_client_context_translates_a_failed_workflow_and_passes_other_errors() -> None:
    arrived = await _across(
        as_application_error(PredictionOverloadedError("queue full", status_code=503, fix="retry"))
    )
    with pytest.raises(PredictionOverloadedError, match="queue full Fix: retry"):
        with temporal_errors():
            raise WorkflowFailureError(cause=arrived)
    with pytest.raises(KeyError):
        with temporal_errors():
            raise KeyError("not Temporal's")
