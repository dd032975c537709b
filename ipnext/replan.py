"""Fleet replanning around the pure planner: where fleet plans are kept, and the Schedule
that runs FleetReplanWorkflow every N hours.

Plans are stored as `plans/rev-<n>.json` in the state folder (the flat report of
`ipnext plan solve`, plus who made it, when, and the moves against the previous
revision); `plans/latest.json` names the newest. `ipnext plan show` reads them.
"""

from __future__ import annotations

import json
import os
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
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

from ipnext.errors import IpnextError
from ipnext.fleet import Pool
from ipnext.plan import Plan, PlanMove

__all__ = [
    "REPLAN_SCHEDULE_ID",
    "FleetReplanInput",
    "PlanStore",
    "StoredPlan",
    "ensure_replan_schedule",
    "parse_every",
    "trigger_and_wait",
]

REPLAN_SCHEDULE_ID = "fleet-replan"
REPLAN_WORKFLOW_ID = "fleet-replan/run"


class FleetReplanInput(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    time_limit_s: float = Field(default=120.0, gt=0)
    churn_cost: float = Field(default=0.05, ge=0)


class StoredPlan(BaseModel):
    """A fleet plan as kept on disk: the plan itself and how it came to be."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    revision: int
    created_at: datetime
    made_by: str  # the workflow run that solved it
    models: list[str]
    moves: list[PlanMove]
    plan: dict[str, Any]  # Plan.to_report()
    pools: list[Pool]  # the fleet's pools when it was solved
    units: dict[str, dict[str, int]]  # deployment -> hardware -> units one replica takes

    def as_plan(self) -> Plan:
        return Plan.from_report(self.plan)


class PlanStore:
    def __init__(self, state_dir: Path) -> None:
        self.folder = state_dir / "plans"

    def latest_revision(self) -> int:
        pointer = self.folder / "latest.json"
        if not pointer.exists():
            return 0
        return int(json.loads(pointer.read_text())["revision"])

    def save(self, stored: StoredPlan) -> Path:
        """Write the revision, then move `latest.json` to it (each write atomic by rename)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"rev-{stored.revision:06d}.json"
        _write_atomic(path, stored.model_dump_json(indent=2))
        _write_atomic(self.folder / "latest.json", json.dumps({"revision": stored.revision}))
        return path

    def load(self, revision: int | None = None) -> StoredPlan:
        revision = revision or self.latest_revision()
        path = self.folder / f"rev-{revision:06d}.json"
        if not revision or not path.exists():
            known = sorted(int(p.stem[4:]) for p in self.folder.glob("rev-*.json"))
            raise IpnextError(
                f"no fleet plan revision {revision or '(latest)'} in the plan store; "
                f"stored revisions: {known or 'none'}. Fix: run `ipnext plan schedule --trigger` "
                "or wait for the replan schedule."
            )
        return StoredPlan.model_validate_json(path.read_text())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


_EVERY = re.compile(r"^(\d+(?:\.\d+)?)(s|m|h|d)$")


def parse_every(text: str) -> timedelta:
    """`90s`, `30m`, `6h`, `1d` -> a timedelta (at least one minute)."""
    match = _EVERY.match(text.strip())
    if not match:
        raise IpnextError(f"--every {text!r}: write a number and a unit, like 30m, 6h or 1d.")
    value, unit = float(match[1]), match[2]
    every = timedelta(seconds=value * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])
    if every < timedelta(minutes=1):
        raise IpnextError(f"--every {text!r}: replanning more often than once a minute is not supported.")
    return every


async def ensure_replan_schedule(
    client: Client, task_queue: str, every: timedelta, input: FleetReplanInput, note: str = ""
) -> None:
    """Create the replan Schedule, or change its interval and input in place (its paused
    state is kept). A run still going when the next is due makes the next one skip."""
    from ipnext.workflows.fleet_replan_workflow import FleetReplanWorkflow

    schedule = Schedule(
        action=ScheduleActionStartWorkflow(
            FleetReplanWorkflow.run,
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


async def trigger_and_wait(client: Client, timeout_s: float = 600.0) -> Any:
    """Run the replan Schedule's action now and wait for that run's result."""
    import asyncio
    import time

    from ipnext.workflows.fleet_replan_workflow import FleetReplanResult

    handle = client.get_schedule_handle(REPLAN_SCHEDULE_ID)
    try:
        before = await handle.describe()
    except RPCError as err:
        raise IpnextError(
            f"no replan schedule ({err}). Fix: create it with `ipnext plan schedule --every 6h`."
        ) from None
    seen = _started(before.info)
    await handle.trigger()
    deadline = time.monotonic() + timeout_s
    while True:
        started = [w for w in _started((await handle.describe()).info) if w not in seen]
        if started:
            break
        if time.monotonic() > deadline:
            raise IpnextError("the replan schedule did not start a run; is the schedule paused?")
        await asyncio.sleep(0.5)
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


def now() -> datetime:
    return datetime.now(UTC)
