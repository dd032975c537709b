"""FleetWorkflow against a real Temporal dev server, with its activities faked at their seam: a
region down by on-call or by its dead nodes, the routing sent around it and the emergency
replan started at once (cancelling the Schedule's run in flight), up again, refusals, and its
state across continue-as-new."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Worker

from ipnext.activities.fleet import (
    CollectResult,
    FleetActivities,
    ModelEntry,
    SolveFleetInput,
    SolveFleetResult,
)
from ipnext.activities.pool_check import PoolCheckInput, PoolCheckResult
from ipnext.activities.regions import RegionActivities, RouteAroundInput, RouteAroundResult
from ipnext.client.fleet import fleet_status, mark_region
from ipnext.client.sdk import Client as IpnextClient
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.fleet import (
    FleetReplanInput,
    FleetReplanResult,
    FleetStatus,
    FleetWorkflowInput,
    NodeSighting,
    RegionDownInput,
    RegionHealth,
    RegionsCheckInput,
    RegionsCheckResult,
    RegionUpInput,
)
from ipnext.contracts.model import ModelWorkflowInput
from ipnext.errors import IpnextError, RegionStateError
from ipnext.names import (
    FLEET_WORKFLOW_ID,
    REGIONS_DOWN_KEY,
    REPLAN_WORKFLOW_ID,
    STATE_KEY,
    FleetWorkflowNames,
    Workflows,
    poll_until,
)
from ipnext.spec.settings import Settings

from .fakes import SPEC, WAIT_S

REGIONS = ["us-east", "us-west", "eu-west"]
HELD_CHECKS = 5  # node checks, each a check interval apart, that a hold must outlast


class FakeRegions:
    """The region and fleet activities: a node table the test edits, routing calls and solves
    recorded; a solve with no down region (the Schedule's) waits until `release` is set."""

    def __init__(self) -> None:
        self.nodes: list[NodeSighting] | None = None
        self.routed: list[list[str]] = []
        self.solved: list[SolveFleetInput] = []
        self.release = asyncio.Event()
        self.log: list[str] = []  # "route <down>" and "solve <down>", in order
        self.node_checks = 0  # checks that read the node table
        self.pool_checks: list[PoolCheckInput] = []

    @activity.defn(name="check_pools")
    async def pools(self, input: PoolCheckInput) -> PoolCheckResult:
        """Each check adds a member `m<n>`: the n-th check's input must hold m1..m(n-1)."""
        self.pool_checks.append(input)
        n = len(self.pool_checks)
        return PoolCheckResult(members={**input.members, f"m{n}": float(n)}, asked={"m1": 1.0})

    @activity.defn(name="check_regions")
    async def check(self, input: RegionsCheckInput) -> RegionsCheckResult:
        if input.look_at_nodes:
            self.node_checks += 1
        return RegionsCheckResult(regions=REGIONS, nodes=self.nodes if input.look_at_nodes else None)

    @activity.defn(name="route_around_regions")
    async def route(self, input: RouteAroundInput) -> RouteAroundResult:
        self.routed.append(list(input.down))
        self.log.append(f"route {input.down}")
        return RouteAroundResult(published={"wf-model": len(self.routed)})

    @activity.defn(name="collect_models")
    async def collect(self) -> CollectResult:
        return CollectResult(models=[])

    @activity.defn(name="solve_fleet_plan")
    async def solve(self, input: SolveFleetInput) -> SolveFleetResult:
        self.solved.append(input)
        self.log.append(f"solve {input.down_regions}")
        if "us-east" in input.down_regions:  # as the planner says when the survivors are too small
            raise ApplicationError(
                "wf-model: us-west gets 900.0 QPS, carries 80.0",
                type="InfeasiblePlanError",
                non_retryable=True,
            )
        if not input.down_regions:
            await self.release.wait()
        return SolveFleetResult(
            revision=len(self.solved),
            cost=1.0,
            objective=1.0,
            lower_bound=1.0,
            gap=0.0,
            status="optimal",
            solve_seconds=0.1,
            moved_units=0,
            moves=[],
            moves_total=0,
            plan_file=f"rev-{len(self.solved):06d}.json",
            relaxed=[f"wf-model: min_regions 3 -> {3 - len(input.down_regions)} (test)"]
            if input.down_regions
            else [],
        )


class NonEmptyCollect(FakeRegions):
    """Collects one model (the replan then solves), holding none of its down regions."""

    @activity.defn(name="collect_models")
    async def collect(self) -> CollectResult:
        return CollectResult(models=[ModelEntry(spec=SPEC, plan=None)])


@asynccontextmanager
async def fleet(
    client: Client, fake: FakeRegions, real_collect: bool = False, **input: Any
) -> AsyncIterator[tuple[WorkflowHandle[Any, Any], str]]:
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    collect = FleetActivities(client).collect_models if real_collect else fake.collect
    worker = Worker(
        client,
        task_queue=queue,
        workflows=WORKFLOWS,
        activities=[
            fake.check,
            fake.route,
            collect,
            fake.solve,
            fake.pools,
            RegionActivities(client).cancel_scheduled_replan,
        ],
    )
    async with worker:
        handle = await client.start_workflow(
            Workflows.FLEET,
            FleetWorkflowInput(**{"check_seconds": 0.2, "replan_time_limit_s": 5, **input}),
            id=FLEET_WORKFLOW_ID,
            task_queue=queue,
        )
        await until(client, lambda s: sorted(r.region for r in s.regions) == sorted(REGIONS))
        try:
            yield handle, queue
        finally:
            fake.release.set()
            with contextlib.suppress(RPCError):
                await handle.terminate("test over")


async def until(client: Client, check: Any, timeout: float = WAIT_S) -> FleetStatus:
    async def read() -> FleetStatus | None:
        try:
            return await fleet_status(client)
        except IpnextError:
            return None

    found = await poll_until(
        read,
        lambda s: s is not None and check(s),
        timeout_s=timeout,
        interval_s=0.1,
        what="the fleet's state",
    )
    assert found is not None
    return found


async def until_node_checks(fake: FakeRegions, count: int) -> None:
    async def checks() -> int:
        return fake.node_checks

    await poll_until(checks, lambda n: n >= count, timeout_s=WAIT_S, interval_s=0.02, what="the node checks")


def region(status: FleetStatus, name: str) -> Any:
    return next(r for r in status.regions if r.region == name)


async def test_region_down_routes_around_at_once_and_replans_while_a_scheduled_replan_is_in_flight(
    temporal: Client,
) -> None:
    fake = NonEmptyCollect()
    async with fleet(temporal, fake) as (handle, queue):
        scheduled = await temporal.start_workflow(
            Workflows.FLEET_REPLAN, FleetReplanInput(time_limit_s=5), id=REPLAN_WORKFLOW_ID, task_queue=queue
        )

        async def solves() -> int:
            return len(fake.solved)

        await poll_until(solves, bool, timeout_s=WAIT_S, what="the scheduled run's solve")
        result = await mark_region(
            temporal, RegionDownInput(region="eu-west", reason="power loss in eu-west-1a", who="alice")
        )
        assert result.changed and result.health == RegionHealth.DOWN
        assert result.replan == "fleet-replan/emergency-1"
        status = await until(temporal, lambda s: s.replans and s.replans[-1].outcome != "running")
        emergency = temporal.get_workflow_handle(result.replan, result_type=FleetReplanResult)
        replanned: FleetReplanResult = await emergency.result()

        async def scheduled_status() -> WorkflowExecutionStatus | None:
            return (await scheduled.describe()).status

        cancelled = await poll_until(
            scheduled_status,
            lambda s: s != WorkflowExecutionStatus.RUNNING,
            timeout_s=WAIT_S,
            what="the scheduled run",
        )
        described = await handle.describe()
        again = await mark_region(temporal, RegionDownInput(region="eu-west", reason="still", who="bob"))
    # Callers of eu-west were sent elsewhere before the replan's solve, which planned without it
    # and said what it relaxed; the Schedule's run, which planned with eu-west, was cancelled.
    assert fake.log.index("route ['eu-west']") < fake.log.index("solve ['eu-west']")
    assert [s.down_regions for s in fake.solved] == [[], ["eu-west"]]
    assert replanned.down_regions == ["eu-west"] and replanned.relaxed == [
        "wf-model: min_regions 3 -> 2 (test)"
    ]
    assert "eu-west down (alice: power loss in eu-west-1a)" in replanned.reason
    assert cancelled == WorkflowExecutionStatus.CANCELED
    eu = region(status, "eu-west")
    assert (eu.health, eu.who, eu.reason, eu.detected) == (
        RegionHealth.DOWN,
        "alice",
        "power loss in eu-west-1a",
        False,
    )
    assert eu.replan == "fleet-replan/emergency-1" and status.down == ["eu-west"]
    assert status.replans[-1].outcome == "applied" and status.replans[-1].relaxed == replanned.relaxed
    assert [(e.region, e.health, e.who) for e in status.events] == [("eu-west", RegionHealth.DOWN, "alice")]
    # The Temporal UI: the regions down as a search attribute, and the fleet's state.
    assert described.typed_search_attributes.get(REGIONS_DOWN_KEY) == ["eu-west"]
    assert described.typed_search_attributes.get(STATE_KEY) == "degraded"
    # A second down of a region down already records nothing and starts no replan.
    assert not again.changed and again.replan == "fleet-replan/emergency-1"


async def test_region_up_by_on_call_ends_it_and_a_return_replan_runs(temporal: Client) -> None:
    fake = FakeRegions()
    ipn = IpnextClient(temporal, Settings())  # the SDK's doors
    async with fleet(temporal, fake) as (handle, _):
        await ipn.region_down("us-west", reason="drill", who="alice")
        await until(temporal, lambda s: len(s.replans) == 1 and s.replans[0].outcome != "running")
        up = await ipn.region_up("us-west", who="bob")
        await until(temporal, lambda s: len(s.replans) == 2 and s.replans[1].outcome != "running")
        status = await ipn.fleet_regions()
        described = await handle.describe()
    assert up.changed and up.replan == "fleet-replan/return-2"
    assert [r.workflow_id for r in status.replans] == ["fleet-replan/emergency-1", "fleet-replan/return-2"]
    assert status.replans[1].down_regions == [] and status.down == []
    assert fake.routed[0] == ["us-west"] and fake.routed[-1] == []  # callers back on the plan's routing
    west = region(status, "us-west")
    assert (west.health, west.who, west.replan) == (RegionHealth.UP, "bob", "fleet-replan/return-2")
    assert described.typed_search_attributes.get(STATE_KEY) == "healthy"


async def test_a_region_whose_nodes_all_die_goes_down_by_itself_and_comes_back_with_them(
    temporal: Client,
) -> None:
    fake = FakeRegions()
    alive = [NodeSighting(node_id=f"node-{r}", alive=True, regions=[r]) for r in REGIONS]
    fake.nodes = alive
    async with fleet(temporal, fake):
        fake.nodes = [*alive[:2], NodeSighting(node_id="node-eu-west", alive=False, regions=["eu-west"])]
        down = await until(temporal, lambda s: s.down == ["eu-west"] and bool(region(s, "eu-west").replan))
        with pytest.raises(RegionStateError, match=r"node-eu-west.*bring its nodes back"):
            await mark_region(temporal, RegionUpInput(region="eu-west", who="alice"))
        fake.nodes = [*fake.nodes, NodeSighting(node_id="node-eu-west-2", alive=True, regions=["eu-west"])]
        back = await until(temporal, lambda s: s.down == [])
        # On-call's down holds whatever the nodes say; only on-call's up ends it.
        await mark_region(temporal, RegionDownInput(region="us-east", reason="bad switch", who="carol"))
        # Node checks judged since, every node alive (the workflow starts one only after it
        # applied the one before).
        await until_node_checks(fake, fake.node_checks + HELD_CHECKS + 1)
        held = await fleet_status(temporal)
    eu = region(down, "eu-west")
    assert (eu.who, eu.detected, eu.dead_nodes) == ("ipnext", True, ["node-eu-west"])
    assert "node-eu-west" in eu.reason and eu.replan.startswith("fleet-replan/emergency-")
    assert region(back, "eu-west").who == "ipnext" and "alive again" in region(back, "eu-west").reason
    assert held.down == ["us-east"] and region(held, "us-east").who == "carol"


async def test_bad_region_changes_are_refused_by_name_and_change_nothing(temporal: Client) -> None:
    fake = FakeRegions()
    async with fleet(temporal, fake) as (handle, _):
        with pytest.raises(RegionStateError, match=r"region: 'mars' is not a region of the fleet.*Fix"):
            await mark_region(temporal, RegionDownInput(region="mars", reason="x", who="alice"))
        with pytest.raises(WorkflowUpdateFailedError) as refused:
            await handle.execute_update(FleetWorkflowNames.REGION_DOWN, {"region": "eu-west", "reason": "x"})
        with pytest.raises(IpnextError, match="reason"):
            await mark_region(temporal, RegionDownInput.model_construct(region="eu-west", reason="", who="a"))
        await mark_region(temporal, RegionDownInput(region="eu-west", reason="drill", who="alice"))
        await mark_region(temporal, RegionDownInput(region="us-west", reason="drill", who="alice"))
        with pytest.raises(
            RegionStateError, match=r"is the last region up.*Fix: bring another region up first"
        ):
            await mark_region(temporal, RegionDownInput(region="us-east", reason="drill", who="alice"))
        status = await fleet_status(temporal)
    assert "who: Field required" in str(refused.value.cause) and "Fix: send" in str(refused.value.cause)
    assert status.down == ["eu-west", "us-west"]
    assert [e.region for e in status.events] == ["eu-west", "us-west"]


async def test_the_regions_states_survive_continue_as_new(temporal: Client) -> None:
    fake = FakeRegions()
    async with fleet(temporal, fake, check_seconds=0.05, history_limit=100) as (handle, _):
        await mark_region(temporal, RegionDownInput(region="eu-west", reason="flood", who="alice"))
        first = (await handle.describe()).run_id

        async def run_id() -> str | None:
            return (await temporal.get_workflow_handle(FLEET_WORKFLOW_ID).describe()).run_id

        await poll_until(run_id, lambda r: r != first, timeout_s=60, what="a continued run")
        status = await until(temporal, lambda s: s.last_check is not None)
    assert status.down == ["eu-west"] and region(status, "eu-west").who == "alice"
    assert [r.workflow_id for r in status.replans] == ["fleet-replan/emergency-1"]
    # The pool check's memory went from each check to the next, across continue-as-new too.
    checks = list(fake.pool_checks)
    assert len(checks) > 2
    for n, seen in enumerate(checks):
        assert sorted(seen.members) == sorted(f"m{k}" for k in range(1, n + 1)), n
        assert seen.asked == ({} if n == 0 else {"m1": 1.0})


async def test_every_replan_plans_without_the_regions_fleet_holds_down(temporal: Client) -> None:
    """The Schedule's run reads the down regions from `fleet` (the real `collect_models`), so it
    never plans capacity back into a region that is down."""
    fake = FakeRegions()
    fake.release.set()
    async with fleet(temporal, fake, real_collect=True) as (_, queue):
        model = await temporal.start_workflow(
            "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id="model/wf-model", task_queue=queue
        )
        await mark_region(temporal, RegionDownInput(region="eu-west", reason="drill", who="alice"))
        await until(temporal, lambda s: bool(s.replans) and s.replans[-1].outcome != "running")
        result = await temporal.execute_workflow(
            Workflows.FLEET_REPLAN,
            FleetReplanInput(time_limit_s=5),
            id=REPLAN_WORKFLOW_ID,
            task_queue=queue,
            result_type=FleetReplanResult,
        )
        await model.terminate()
    assert [s.down_regions for s in fake.solved] == [["eu-west"], ["eu-west"]]
    assert result.down_regions == ["eu-west"] and result.models == ["wf-model"]


async def test_an_emergency_replan_that_cannot_plan_is_recorded_and_the_region_stays_down(
    temporal: Client,
) -> None:
    fake = NonEmptyCollect()
    async with fleet(temporal, fake) as (handle, _):
        await mark_region(temporal, RegionDownInput(region="us-east", reason="fire", who="alice"))
        status = await until(temporal, lambda s: bool(s.replans) and s.replans[-1].outcome != "running")
        described = await handle.describe()
    failed = status.replans[-1]
    assert failed.outcome == "failed" and "carries 80.0" in failed.detail, failed
    assert status.down == ["us-east"] and fake.routed[0] == ["us-east"]  # its callers were still sent away
    assert described.status == WorkflowExecutionStatus.RUNNING
