"""Validate activities: a model spec against the fleet and its code (in a child process), a
snapshot set against its parts."""

from __future__ import annotations

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ipnext.activities import _context
from ipnext.activities.spec_check import check_factories_in_child
from ipnext.contracts import Frozen
from ipnext.errors import IpnextError
from ipnext.model import (
    ModelSpec,
    SnapshotRef,
    SnapshotSet,
    SnapshotSetRequest,
    check_against_fleet,
)
from ipnext.registry import ValidateSpecInput
from ipnext.validation import complete_set, validate_snapshot

__all__ = [
    "ValidateSetInput",
    "ValidateSetResult",
    "ValidateSpecInput",
    "VerifyPinnedInput",
    "VerifyPinnedResult",
    "validate_model_spec",
    "validate_snapshot_set",
    "verify_pinned_set",
]


class ValidateSetInput(Frozen):
    spec: ModelSpec
    request: SnapshotSetRequest
    serving_parts: dict[str, SnapshotRef] | None = None


class ValidateSetResult(Frozen):
    parts: dict[str, SnapshotRef]


def as_application_error(err: IpnextError) -> ApplicationError:
    return ApplicationError(str(err), type=type(err).__name__, non_retryable=True)


@activity.defn
def validate_model_spec(input: ValidateSpecInput) -> None:
    """The spec against the worker's fleet, then its factories imported in a child process
    (`activities/spec_check.py`): the model's code never runs in the worker itself."""
    try:
        check_against_fleet(input.spec, _context.settings().fleet())
        check_factories_in_child(input.spec)
    except IpnextError as err:
        raise as_application_error(err) from None


class VerifyPinnedInput(Frozen):
    snapshot_set: SnapshotSet


class VerifyPinnedResult(Frozen):
    problems: list[str]  # one per part whose pinned copy is missing or changed; empty: whole


@activity.defn
def verify_pinned_set(input: VerifyPinnedInput) -> VerifyPinnedResult:
    """Hash every pinned file of a set again: may it still be served (a rollback target)?"""
    from ipnext.pinned import verify

    store = _context.settings().pinned_store()
    problems = []
    for part, ref in sorted(input.snapshot_set.parts.items()):
        activity.heartbeat(part)
        why = verify(store, ref.sha256)
        if why is not None:
            problems.append(f"{part}: {why}")
    return VerifyPinnedResult(problems=problems)


@activity.defn
def validate_snapshot_set(input: ValidateSetInput) -> ValidateSetResult:
    current = _context.settings()
    roots, store = current.snapshot_roots, current.pinned_store()
    try:
        parts = complete_set(input.spec, input.request, input.serving_parts)
        for part in sorted(input.request.parts):
            activity.heartbeat(part)
            validate_snapshot(input.spec, part, parts[part], roots, store)
    except IpnextError as err:
        raise as_application_error(err) from None
    return ValidateSetResult(parts=parts)
