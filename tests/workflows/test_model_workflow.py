"""ModelWorkflow and RolloutWorkflow rules on a real Temporal dev server, with the activities
replaced at their seam (same names, no Ray): queueing and superseding, failed rollouts leaving
traffic on the last good set, and rejected publishes changing nothing."""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio import activity
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from ipnext.activities.fleet import CollectResult, ModelEntry, SolveFleetInput, SolveFleetResult
from ipnext.activities.metadata import WatchScheduleInput
from ipnext.activities.plan import PlanInput
from ipnext.activities.serving import (
    DeploySetInput,
    DeploySetResult,
    RemoveAppsInput,
    RouteInput,
    RouteResult,
    TeardownInput,
    TeardownResult,
)
from ipnext.activities.validate import ValidateSetInput, ValidateSetResult
from ipnext.model import ModelSpec, SnapshotRef, SnapshotSetRequest
from ipnext.plan import DeploymentPlacement, Plan
from ipnext.registry import ApplyPlanInput, ModelState, ModelWorkflowInput, PublishInput, PublishResult
from ipnext.replan import REPLAN_SCHEDULE_ID, FleetReplanInput, ensure_replan_schedule, trigger_and_wait
from ipnext.temporal import MODEL_KEY, STATE_KEY, TRAFFIC_KEY
from ipnext.worker import WORKFLOWS
from ipnext.workflows.fleet_replan_workflow import FleetReplanResult

pytestmark = pytest.mark.timeout(120)

SPEC = ModelSpec.model_validate(
    {
        "name": "wf-model",
        "owner": "tests",
        "parts": {"embed": {"factory": "m:f", "hardware": {"cpu-std": {"units": 1, "qps": 100}}}},
        "dag": [["input", "embed"], ["embed", "output"]],
        "traffic": {"peak_qps": {"us-east": 10}},
        "latency_budget_ms": 50,
    }
)


class FakeServing:
    """Stands in for the validate/plan/serving activities: records calls, blocks or fails on demand."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()
        self.deployed: list[str] = []
        self.deploy_plans: list[int] = []
        self.routes: list[dict[str, dict[str, float]]] = []
        self.removed: list[str] = []
        self.generation = 0

    @activity.defn(name="validate_snapshot_set")
    async def validate(self, input: ValidateSetInput) -> ValidateSetResult:
        if input.request.version.startswith("bad"):
            raise ApplicationError("parts.embed: checksum mismatch", type="SnapshotError", non_retryable=True)
        return ValidateSetResult(parts=dict(input.request.parts))

    @activity.defn(name="plan_placement")
    async def plan(self, input: PlanInput) -> Plan:
        placement = DeploymentPlacement(
            replicas={"us-east": {"cpu-std": 1}}, fractions={"us-east": {"us-east": 1.0}}
        )
        return Plan(deployments={"wf-model/embed": placement}, cost=1.0, solver="fake")

    @activity.defn(name="ensure_watch_schedule")
    async def watch(self, input: WatchScheduleInput) -> None:
        return None

    @activity.defn(name="deploy_set_apps")
    async def deploy(self, input: DeploySetInput) -> DeploySetResult:
        set_id = input.snapshot_set.id
        if set_id in self.release:
            await self.release[set_id].wait()
        if set_id in self.fail:
            raise ApplicationError(
                f"Serve app of {set_id} is DEPLOY_FAILED", type="ServingError", non_retryable=True
            )
        self.deployed.append(set_id)
        self.deploy_plans.append(input.plan.revision)
        suffix = f"-r{input.plan.revision}" if input.plan.revision > 1 else ""
        return DeploySetResult(
            apps={region: f"app-{input.snapshot_set.number}{suffix}" for region in _regions(input.plan)}
        )

    @activity.defn(name="route_traffic")
    async def route(self, input: RouteInput) -> RouteResult:
        self.generation += 1
        self.routes.append(input.weights)
        return RouteResult(generations={r: self.generation for r in input.weights})

    @activity.defn(name="remove_apps")
    async def remove(self, input: RemoveAppsInput) -> None:
        self.removed.extend(input.names)

    @activity.defn(name="teardown_model")
    async def teardown(self, input: TeardownInput) -> TeardownResult:
        return TeardownResult(removed=["app-x"])

    def activities(self) -> list[object]:
        return [self.validate, self.plan, self.watch, self.deploy, self.route, self.remove, self.teardown]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def temporal() -> AsyncIterator[Client]:
    env = await WorkflowEnvironment.start_local(
        data_converter=pydantic_data_converter,
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        search_attributes=[MODEL_KEY, STATE_KEY, TRAFFIC_KEY],
    )
    try:
        yield env.client
    finally:
        await env.shutdown()


def _request(version: str) -> PublishInput:
    ref = SnapshotRef(uri=f"file:///snap/{version}", sha256="a" * 64, snapshot_id=f"wf-model/embed@{version}")
    return PublishInput(
        request=SnapshotSetRequest(model="wf-model", version=version, parts={"embed": ref}), who="test"
    )


def _regions(plan: Plan) -> list[str]:
    return sorted({r for p in plan.deployments.values() for r in p.regions()})


def _plan_in(region: str, revision: int) -> Plan:
    placement = DeploymentPlacement(replicas={region: {"cpu-std": 2}}, fractions={"us-east": {region: 1.0}})
    return Plan(deployments={"wf-model/embed": placement}, cost=2.0, solver="fake", revision=revision)


async def _until(
    handle: WorkflowHandle[Any, Any], check: Callable[[ModelState], bool], timeout: float = 30
) -> ModelState:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        state: ModelState = await handle.query("get", result_type=ModelState)
        if check(state):
            return state
        assert asyncio.get_running_loop().time() < deadline, f"condition never held: {state}"
        await asyncio.sleep(0.1)


async def _start(client: Client, fake: FakeServing) -> tuple[Worker, WorkflowHandle[Any, Any]]:
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    worker = Worker(client, task_queue=queue, workflows=WORKFLOWS, activities=fake.activities())
    handle = await client.start_workflow(
        "ModelWorkflow",
        ModelWorkflowInput(spec=SPEC),
        id=f"model/wf-{uuid.uuid4().hex[:8]}",
        task_queue=queue,
    )
    return worker, handle


async def test_publishes_during_a_rollout_queue_and_the_newest_wins(temporal: Client) -> None:
    fake = FakeServing()
    fake.release["wf-model@1"] = asyncio.Event()
    worker, handle = await _start(temporal, fake)
    async with worker:
        first: PublishResult = await handle.execute_update(
            "publish", _request("v1"), result_type=PublishResult
        )
        await _until(handle, lambda s: s.state == "rolling_out")
        for version in ("v2", "v3"):
            await handle.execute_update("publish", _request(version), result_type=PublishResult)
        state = await _until(handle, lambda s: s.queued == ["wf-model@2", "wf-model@3"])
        assert state.serving_set is None
        fake.release["wf-model@1"].set()
        state = await _until(handle, lambda s: s.serving_set == "wf-model@3" and s.state == "serving")
    assert first.set_id == "wf-model@1"
    assert [(s.id, s.status) for s in state.sets] == [
        ("wf-model@1", "retired"),
        ("wf-model@2", "superseded"),
        ("wf-model@3", "serving"),
    ]
    assert fake.deployed == ["wf-model@1", "wf-model@3"]
    # Make before break: traffic moved to app-3 before app-1 was removed, and app-2 never existed.
    assert fake.routes == [{"us-east": {"app-1": 100.0}}, {"us-east": {"app-3": 100.0}}]
    assert fake.removed == ["app-1"]
    assert state.rollout is not None and state.rollout.generations == [2]


async def test_failed_rollout_leaves_traffic_on_the_last_good_set(temporal: Client) -> None:
    fake = FakeServing()
    fake.fail.add("wf-model@2")
    worker, handle = await _start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", _request("v1"), result_type=PublishResult)
        await _until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.execute_update("publish", _request("v2"), result_type=PublishResult)
        state = await _until(handle, lambda s: any(x.status == "failed" for x in s.sets))
    assert state.serving_set == "wf-model@1" and state.serving_apps == {"us-east": "app-1"}
    failed = state.sets[1]
    assert failed.id == "wf-model@2" and "DEPLOY_FAILED" in failed.detail
    assert fake.routes == [{"us-east": {"app-1": 100.0}}]  # no weight ever moved off the good set
    assert fake.removed == []


async def test_rejected_publish_changes_nothing(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await _start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", _request("v1"), result_type=PublishResult)
        before = await _until(handle, lambda s: s.serving_set == "wf-model@1")
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update("publish", _request("bad-1"), result_type=PublishResult)
        assert "checksum mismatch" in str(caught.value.cause)
        with pytest.raises(WorkflowUpdateFailedError) as dup:
            await handle.execute_update("publish", _request("v1"), result_type=PublishResult)
        assert "already published" in str(dup.value.cause)
        after: ModelState = await handle.query("get", result_type=ModelState)
        assert after == before
        # The next good publish still gets the next number: nothing was consumed by the rejects.
        result = await handle.execute_update("publish", _request("v2"), result_type=PublishResult)
        assert result.set_id == "wf-model@2"
        assert isinstance(after.sets[0].published_at, datetime)


async def test_replanned_placement_moves_capacity_make_before_break(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await _start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", _request("v1"), result_type=PublishResult)
        before = await _until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.signal("apply_plan", ApplyPlanInput(plan=_plan_in("eu-west", 2), fleet_revision=7))
        state = await _until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
    # Same set, same statuses; its apps moved to the new placement.
    assert state.serving_set == "wf-model@1" and state.sets == before.sets
    assert state.serving_apps == {"eu-west": "app-1-r2"}
    assert fake.deployed == ["wf-model@1", "wf-model@1"] and fake.deploy_plans == [1, 2]
    # New apps up, every router (the old region's too) moved to them, and only then the old app removed.
    assert fake.routes == [
        {"us-east": {"app-1": 100.0}},
        {"eu-west": {"app-1-r2": 100.0}, "us-east": {"app-1-r2": 100.0}},
    ]
    assert fake.removed == ["app-1"]
    assert state.rollout is not None and state.rollout.state.value == "completed"
    assert state.rollout.traffic_percent == {"wf-model@1": 100.0}
    assert "fleet plan 7" in state.rollout.detail
    assert state.pending_plan is None


async def test_placement_replanned_before_anything_serves_is_used_by_the_first_rollout(
    temporal: Client,
) -> None:
    fake = FakeServing()
    worker, handle = await _start(temporal, fake)
    async with worker:
        await _until(handle, lambda s: s.plan is not None)
        await handle.signal("apply_plan", ApplyPlanInput(plan=_plan_in("eu-west", 2), fleet_revision=1))
        await _until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
        await handle.execute_update("publish", _request("v1"), result_type=PublishResult)
        state = await _until(handle, lambda s: s.serving_set == "wf-model@1")
    assert fake.deploy_plans == [2]  # one deploy, straight onto the replanned placement
    assert state.serving_apps == {"eu-west": "app-1-r2"}


class FakeFleet:
    """The replan activities at their seam: the registry read is real (the running model
    workflow's state), the solve returns a fixed new placement for `wf-model` and one for a
    model that does not exist."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.solved: list[SolveFleetInput] = []

    @activity.defn(name="collect_models")
    async def collect(self) -> CollectResult:
        state: ModelState = await self.client.get_workflow_handle("model/wf-model").query(
            "get", result_type=ModelState
        )
        return CollectResult(models=[ModelEntry(spec=state.spec, plan=state.plan)])

    @activity.defn(name="solve_fleet_plan")
    async def solve(self, input: SolveFleetInput) -> SolveFleetResult:
        self.solved.append(input)
        gone = _plan_in("us-east", 1).model_copy(update={"deployments": {}})
        return SolveFleetResult(
            revision=len(self.solved),
            cost=2.0,
            objective=2.1,
            lower_bound=2.1,
            gap=0.0,
            status="optimal",
            solve_seconds=0.1,
            moved_units=2,
            moves=["wf-model/embed: eu-west/cpu-std 0 -> 2", "wf-model/embed: us-east/cpu-std 1 -> 0"],
            moves_total=2,
            changed={"wf-model": _plan_in("eu-west", 2), "no-such-model": gone},
            plan_file="rev-000001.json",
        )


async def test_scheduled_fleet_replan_hands_models_their_new_placement(temporal: Client) -> None:
    fake, fleet = FakeServing(), FakeFleet(temporal)
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        temporal,
        task_queue=queue,
        workflows=WORKFLOWS,
        activities=[*fake.activities(), fleet.collect, fleet.solve],
    )
    model = await temporal.start_workflow(
        "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id="model/wf-model", task_queue=queue
    )
    async with worker:
        await model.execute_update("publish", _request("v1"), result_type=PublishResult)
        await _until(model, lambda s: s.serving_set == "wf-model@1")
        await ensure_replan_schedule(temporal, queue, timedelta(hours=6), FleetReplanInput(time_limit_s=5))
        schedule = temporal.get_schedule_handle(REPLAN_SCHEDULE_ID)
        try:
            result: FleetReplanResult = await trigger_and_wait(temporal, timeout_s=60)
            state = await _until(model, lambda s: s.plan is not None and s.plan.revision == 2)
            again: FleetReplanResult = await trigger_and_wait(temporal, timeout_s=60)
            await schedule.pause(note="on-call: hold capacity moves")
            described = await schedule.describe()
        finally:
            await schedule.delete()
            await model.terminate()
    assert fleet.solved[0].models[0].spec.name == "wf-model" and fleet.solved[0].time_limit_s == 5
    assert result.revision == 1 and result.models == ["wf-model"]
    assert again.revision == 2  # a second run of the schedule, told apart from the first
    assert result.applied_to == ["wf-model"]
    assert list(result.not_applied) == ["no-such-model"]
    assert result.moves[0] == "wf-model/embed: eu-west/cpu-std 0 -> 2"
    assert state.serving_apps == {"eu-west": "app-1-r2"}
    assert described.schedule.state.paused and described.schedule.state.note == "on-call: hold capacity moves"
    assert [i.every for i in described.schedule.spec.intervals] == [timedelta(hours=6)]
