"""The fleet replan Schedule, from the client side: create or change it, and trigger a run
and wait for its result. The workflow is addressed by name (`ipnext.names`)."""

from __future__ import annotations

from datetime import timedelta

from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionExecutionStartWorkflow,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleInfo,
    ScheduleIntervalSpec,
    ScheduleSpec,
    ScheduleState,
    ScheduleUpdate,
    ScheduleUpdateInput,
)
from temporalio.service import RPCError

from ipnext.contracts.fleet import FleetReplanInput, FleetReplanResult
from ipnext.errors import IpnextError
from ipnext.names import (
    REPLAN_SCHEDULE_ID,
    REPLAN_WORKFLOW_ID,
    PollTimeoutError,
    Workflows,
    poll_until,
)

__all__ = ["ensure_replan_schedule", "trigger_and_wait"]


async def ensure_replan_schedule(
    client: Client, task_queue: str, every: timedelta, input: FleetReplanInput, note: str = ""
) -> None:
    """Create the replan Schedule, or change its interval and input in place (its paused
    state is kept). A run still going when the next is due makes the next one skip. Each run
    is told the interval, over which it reads the peak of observed demand."""
    if input.interval_s is None:
        input = input.model_copy(update={"interval_s": every.total_seconds()})
    schedule = Schedule(
        action=ScheduleActionStartWorkflow(
            Workflows.FLEET_REPLAN,
            input,
            id=REPLAN_WORKFLOW_ID,
            task_queue=task_queue,
            execution_timeout=timedelta(seconds=input.time_limit_s + 1800),
        ),
        spec=ScheduleSpec(intervals=[ScheduleIntervalSpec(every=every)]),
        state=ScheduleState(note=note or f"replan the fleet every {every}"),
    )
    try:
        await client.create_schedule(REPLAN_SCHEDULE_ID, schedule)
    except ScheduleAlreadyRunningError:

        def replace(current: ScheduleUpdateInput) -> ScheduleUpdate:
            state = current.description.schedule.state
            return ScheduleUpdate(schedule=Schedule(action=schedule.action, spec=schedule.spec, state=state))

        await client.get_schedule_handle(REPLAN_SCHEDULE_ID).update(replace)


async def trigger_and_wait(client: Client, timeout_s: float = 600.0) -> FleetReplanResult:
    """Run the replan Schedule's action now and wait for that run's result."""
    handle = client.get_schedule_handle(REPLAN_SCHEDULE_ID)
    try:
        before = await handle.describe()
    except RPCError as err:
        raise IpnextError(
            f"no replan schedule ({err}). Fix: create it with `ipnext plan schedule --every 6h`."
        ) from None
    seen = _started(before.info)
    await handle.trigger()

    async def new_runs() -> list[tuple[str, str]]:
        return [w for w in _started((await handle.describe()).info) if w not in seen]

    try:
        started = await poll_until(new_runs, bool, timeout_s=timeout_s, interval_s=0.5, what="a replan run")
    except PollTimeoutError:
        raise IpnextError("the replan schedule did not start a run; is the schedule paused?") from None
    workflow_id, run_id = started[0]
    run = client.get_workflow_handle(workflow_id, run_id=run_id, result_type=FleetReplanResult)
    return await run.result()


def _started(info: ScheduleInfo) -> set[tuple[str, str]]:
    """(workflow id, run id) of the runs the Schedule started, running or recent. The run id
    matters: two runs started in the same second share the workflow id."""
    actions = list(info.running_actions) + [a.action for a in info.recent_actions]
    return {
        (a.workflow_id, a.first_execution_run_id)
        for a in actions
        if isinstance(a, ScheduleActionExecutionStartWorkflow)
    }
