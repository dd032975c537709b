"""The `fleet` workflow from the client side: start it once (the worker does, at each start),
and mark regions down and up through its updates. The workflow is addressed by name
(`ipnext.names`)."""

from __future__ import annotations

from typing import TypeVar

from pydantic import ValidationError
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.common import WorkflowIDConflictPolicy
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from ipnext.client.temporal import from_temporal
from ipnext.contracts.fleet import (
    FleetStatus,
    FleetWorkflowInput,
    RegionChangeResult,
    RegionDownInput,
    RegionUpInput,
)
from ipnext.errors import IpnextError, RegionStateError
from ipnext.names import FLEET_WORKFLOW_ID, FleetWorkflowNames, Workflows
from ipnext.spec.settings import Settings

__all__ = ["ensure_fleet_workflow", "fleet_status", "mark_region", "region_change"]

RegionInput = TypeVar("RegionInput", RegionDownInput, RegionUpInput)


def region_change(kind: type[RegionInput], **fields: str) -> RegionInput:
    """A region change read here, so a bad field is refused before anything is sent."""
    try:
        return kind(**fields)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(x) for x in first["loc"])
        message = str(first["msg"]).removeprefix("Value error, ").removeprefix(f"{field}: ")
        raise RegionStateError(
            f"{field}: {message} (got {fields.get(field)!r}).",
            field=field,
            value=fields.get(field),
            fix="name a region of the fleet, say who asks (--who) and, to take it down, why (--reason)",
        ) from None


async def ensure_fleet_workflow(client: Client, settings: Settings) -> str:
    """Start the `fleet` workflow unless it runs (a running one keeps its states and its
    settings); returns the run id of the one running."""
    regions = settings.regions
    handle = await client.start_workflow(
        Workflows.FLEET,
        FleetWorkflowInput(
            check_seconds=regions.check_seconds,
            detect=regions.detect,
            replan_time_limit_s=regions.replan_time_limit_s,
        ),
        id=FLEET_WORKFLOW_ID,
        task_queue=settings.temporal.task_queue,
        id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
    )
    return handle.result_run_id or ""


async def fleet_status(client: Client) -> FleetStatus:
    """The regions' states (the `regions` query of the running `fleet` workflow)."""
    handle = client.get_workflow_handle(FLEET_WORKFLOW_ID)
    try:
        described = await handle.describe()
        if described.status != WorkflowExecutionStatus.RUNNING:
            raise IpnextError(
                f"the {FLEET_WORKFLOW_ID!r} workflow is not running (its last run is "
                f"{described.status.name if described.status else 'unknown'}).",
                fix=(
                    "start the worker (`ipnext dev up`, or `python -m ipnext.client.worker`): "
                    "it starts the workflow"
                ),
            )
        status: FleetStatus = await handle.query(FleetWorkflowNames.REGIONS, result_type=FleetStatus)
    except RPCError as err:
        raise _not_running(err) from None
    return status


async def mark_region(client: Client, change: RegionDownInput | RegionUpInput) -> RegionChangeResult:
    """`region_down` or `region_up`; a refusal raises RegionStateError naming the field and fix."""
    name = (
        FleetWorkflowNames.REGION_DOWN
        if isinstance(change, RegionDownInput)
        else FleetWorkflowNames.REGION_UP
    )
    try:
        result: RegionChangeResult = await client.get_workflow_handle(FLEET_WORKFLOW_ID).execute_update(
            name, change, result_type=RegionChangeResult
        )
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        if isinstance(cause, ApplicationError):
            raise from_temporal(err) from None
        raise RegionStateError(str(cause or err)) from None
    except RPCError as err:
        raise _not_running(err) from None
    return result


def _not_running(err: RPCError) -> IpnextError:
    if err.status == RPCStatusCode.NOT_FOUND:
        return IpnextError(
            f"the {FLEET_WORKFLOW_ID!r} workflow does not run ({err.message}).",
            fix=(
                "start the worker (`ipnext dev up`, or `python -m ipnext.client.worker`): "
                "it starts the workflow"
            ),
        )
    return IpnextError(f"the {FLEET_WORKFLOW_ID!r} workflow did not answer: {err.message}")
