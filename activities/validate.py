"""Validate activities: a model spec against the fleet and its code (in a child process), a
snapshot set against its parts (pinned here, built with its weights in a child process)."""

from __future__ import annotations

import time

from temporalio import activity
from temporalio.exceptions import ApplicationError

from ipnext.activities import _context
from ipnext.activities.spec_check import TIMEOUT_SETTING, check_factories_in_child, check_part_in_child
from ipnext.contracts.model import ValidateSpecInput
from ipnext.errors import IpnextError, SpecError
from ipnext.names import Frozen
from ipnext.spec.model import (
    ModelSpec,
    SnapshotRef,
    SnapshotSet,
    SnapshotSetRequest,
    check_against_fleet,
    check_factories_allowed,
)
from ipnext.store.validation import complete_set, pin_snapshot

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
    """`err` as its caller sees it: its class name, text and `wire_details` (the fix among them),
    which `ipnext.errors.error_from_wire` turns back into `err` in the SDK. Non-retryable: the
    input is wrong, and another attempt would find it as wrong."""
    return ApplicationError(str(err), err.wire_details(), type=type(err).__name__, non_retryable=True)


@activity.defn
def validate_model_spec(input: ValidateSpecInput) -> None:
    """The spec against the worker's fleet and its factory allow-list, then its factories
    imported in a child process with the validation limits (`activities/spec_check.py`): the
    model's code never runs in the worker itself."""
    current = _context.settings()
    code = current.model_code
    try:
        check_against_fleet(input.spec, current.fleet())
        check_factories_allowed(input.spec, code.factory_prefixes)
        check_factories_in_child(
            input.spec, code.validation_timeout_s, code.validation_memory_bytes, code.factory_prefixes
        )
    except IpnextError as err:
        raise as_application_error(err) from None


class VerifyPinnedInput(Frozen):
    snapshot_set: SnapshotSet


class VerifyPinnedResult(Frozen):
    problems: list[str]  # one per part whose pinned copy is missing or changed; empty: whole


@activity.defn
def verify_pinned_set(input: VerifyPinnedInput) -> VerifyPinnedResult:
    """Hash every pinned file of a set again: may it still be served (a rollback target)?"""
    from ipnext.store.pinned import verify_ref

    store = _context.settings().pinned_store()
    problems = []
    for part, ref in sorted(input.snapshot_set.parts.items()):
        activity.heartbeat(part)
        why = verify_ref(store, ref)
        if why is not None:
            problems.append(f"{part}: {why}")
    return VerifyPinnedResult(problems=problems)


@activity.defn
def validate_snapshot_set(input: ValidateSetInput) -> ValidateSetResult:
    """Pin each new snapshot here (no model code), then build its part with the weights in a
    child process: the parts' builds share one `validation_timeout_s`, so the activity's own
    timeout is never what ends a hanging build."""
    current = _context.settings()
    roots, store, code = current.snapshot_roots, current.pinned_store(), current.model_code
    deadline = time.monotonic() + code.validation_timeout_s
    try:
        check_factories_allowed(input.spec, code.factory_prefixes)  # the setting may have narrowed
        parts = complete_set(input.spec, input.request, input.serving_parts)
        for part in sorted(input.request.parts):
            activity.heartbeat(part)
            pinned = pin_snapshot(input.spec, part, parts[part], roots, store)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SpecError(
                    f"model {input.spec.name}: building its parts did not finish within "
                    f"{code.validation_timeout_s:g} s (part {part} not started; {TIMEOUT_SETTING}).",
                    field=f"parts.{part}",
                    fix=f"have the worker's operator raise {TIMEOUT_SETTING}",
                )
            check_part_in_child(
                input.spec,
                part,
                parts[part],
                pinned,
                left,
                code.validation_memory_bytes,
                code.factory_prefixes,
                budget_s=code.validation_timeout_s,
            )
    except IpnextError as err:
        raise as_application_error(err) from None
    return ValidateSetResult(parts=parts)
