"""ModelWorkflow and RolloutWorkflow rules on a real Temporal dev server, with the activities
replaced at their seam (same names, no Ray): queueing and superseding, failed rollouts leaving
traffic on the last good set, and rejected publishes changing nothing."""

from __future__ import annotations

import asyncio
import sys
import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowUpdateFailedError
from temporalio.exceptions import ApplicationError
from temporalio.worker import Worker

from ipnext.activities.fleet import (
    CollectResult,
    ModelEntry,
    ReadDemandInput,
    ReadDemandResult,
    SolveFleetInput,
    SolveFleetResult,
)
from ipnext.client.schedules import ensure_replan_schedule, trigger_and_wait
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.fleet import FleetReplanInput, FleetReplanResult, SourceSizing
from ipnext.contracts.model import ApplyPlanInput, ModelState, ModelWorkflowInput, PublishResult
from ipnext.contracts.rollout import AbortInput
from ipnext.names import REPLAN_SCHEDULE_ID, RolloutState, poll_until, rollout_workflow_id
from ipnext.policy.demand import declared_only

from .fakes import SPEC, FakeServing, plan_in, request, start, until, until_rollout, with_rollout

pytestmark = pytest.mark.timeout(120)


async def test_publishes_during_a_rollout_queue_and_the_newest_wins(temporal: Client) -> None:
    fake = FakeServing()
    fake.release["wf-model@1"] = asyncio.Event()
    worker, handle = await start(temporal, fake)
    async with worker:
        first: PublishResult = await handle.execute_update(
            "publish", request("v1"), result_type=PublishResult
        )
        await until(handle, lambda s: s.state == "rolling_out")
        for version in ("v2", "v3"):
            await handle.execute_update("publish", request(version), result_type=PublishResult)
        state = await until(handle, lambda s: s.queued == ["wf-model@2", "wf-model@3"])
        assert state.serving_set is None
        fake.release["wf-model@1"].set()
        state = await until(handle, lambda s: s.serving_set == "wf-model@3" and s.state == "serving")
    assert first.set_id == "wf-model@1"
    assert [(s.id, s.status) for s in state.sets] == [
        ("wf-model@1", "retired"),
        ("wf-model@2", "superseded"),
        ("wf-model@3", "serving"),
    ]
    # Lock-step: @3 at half size before half the traffic, @1 halved after, @3 whole before all of it.
    assert fake.scales == [
        ("wf-model@1", 1, 1.0),
        ("wf-model@3", 1, 0.5),
        ("wf-model@1", 1, 0.5),
        ("wf-model@3", 1, 1.0),
    ]
    # Make before break: traffic moved to app-3 before app-1 was removed, and app-2 never existed.
    assert fake.routes == [
        {"us-east": {"app-1": 100.0}},
        {"us-east": {"app-1": 50.0, "app-3": 50.0}},
        {"us-east": {"app-3": 100.0}},
    ]
    assert fake.removed == ["app-1"]
    assert state.rollout is not None and state.rollout.generations == [2, 3]


async def test_a_rollout_terminated_or_cancelled_from_outside_never_fails_the_model(temporal: Client) -> None:
    """The Temporal UI's Terminate and Request Cancellation on a running rollout (here in its
    first deploy): the model workflow records a terminated rollout as failed, a cancelled one as
    cancelled (it rolled back itself), keeps the last good set, and goes on to roll out the next
    publish."""
    fake = FakeServing()
    fake.release["wf-model@2"] = asyncio.Event()  # both rollouts hang in their first deploy
    fake.release["wf-model@3"] = asyncio.Event()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        for set_id, how in (("wf-model@2", "terminated"), ("wf-model@3", "cancelled")):
            await handle.execute_update("publish", request(f"v{set_id[-1]}"), result_type=PublishResult)
            await until(handle, lambda s, x=set_id: s.rollout is not None and s.rollout.set_id == x)
            await until_rollout(temporal, set_id, lambda status: status.state == RolloutState.RUNNING)
            child = temporal.get_workflow_handle(rollout_workflow_id("wf-model", set_id))
            if how == "terminated":
                await child.terminate(reason="from the UI")
            else:
                await child.cancel()
            if how == "cancelled":  # it waits for its deploy to finish, then rolls back
                fake.release[set_id].set()
            ended = {"terminated": "failed", "cancelled": "cancelled"}[how]
            said = {"terminated": "routers", "cancelled": ""}[how]  # once the model put them back
            state = await until(
                handle,
                lambda s, x=set_id, e=ended, w=said: (
                    s.sets[-1].id == x and s.sets[-1].status == e and w in s.sets[-1].detail
                ),
            )
            detail = state.sets[-1].detail
            if how == "terminated":  # ended with no word of its own: the model says what it knows
                assert "was terminated" in detail and "routers were on wf-model@1 already" in detail, detail
            else:
                assert "cancelled (cancellation requested" in detail, detail
            assert state.serving_set == "wf-model@1" and state.serving_apps == {"us-east": "app-1"}
        await handle.execute_update("publish", request("v4"), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@4")
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
    assert [(s.id, s.status) for s in state.sets] == [
        ("wf-model@1", "retired"),
        ("wf-model@2", "failed"),
        ("wf-model@3", "cancelled"),
        ("wf-model@4", "serving"),
    ]


# Events a run may add past its history limit before it continues as new: what is in flight
# when it is reached must end first (a publish's validation, a serving check, a child's start,
# each with its workflow tasks), then the continue-as-new itself. An aborted rollout's run once
# reached 46 events against the limit of 20 (25 then).
HISTORY_SLACK = 30


@pytest.mark.parametrize("ending", ["completed", "rolled_back", "aborted", "cancelled", "terminated"])
async def test_the_model_continues_as_new_mid_rollout_and_records_how_it_ended(
    temporal: Client, ending: str
) -> None:
    """With a history limit this low the model continues as new while its rollout bakes (the
    rollout is abandoned, not terminated, by the run that started it). The latest run learns
    the end from the rollout's signal, or, for a rollout terminated from the Temporal UI, from
    asking Temporal, and records the right outcome and serving set."""
    fake = FakeServing()
    spec = with_rollout(steps=[50, 100], bake_seconds=4.0, min_requests=5)
    worker, handle = await start(temporal, fake, spec, history_limit=20, rollout_check_seconds=0.3)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        if ending == "rolled_back":
            fake.bad_apps.add("app-2")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@2", lambda s: "baking" in s.step)
        child = temporal.get_workflow_handle(rollout_workflow_id("wf-model", "wf-model@2"))
        started_by = (await child.describe()).raw_description.workflow_execution_info.parent_execution.run_id

        async def model_run() -> str:
            run_id: str = (await handle.describe()).run_id
            return run_id

        await poll_until(model_run, lambda run: run != started_by, timeout_s=30, what="a continue-as-new")
        if ending == "aborted":
            await child.signal("abort", AbortInput(reason="drill", who="oncall-a"))
        elif ending == "cancelled":
            await child.cancel()
        elif ending == "terminated":
            await child.terminate(reason="drill")
        state = await until(
            handle,
            lambda s: (
                s.sets[-1].status != "rolling_out"
                and (ending != "terminated" or "routers" in s.sets[-1].detail)
            ),
            timeout=60,
        )
        assert (await handle.describe()).status == WorkflowExecutionStatus.RUNNING
        still = await model_run()
    expected = {
        "completed": ("serving", "wf-model@2"),
        "rolled_back": ("rolled_back", "wf-model@1"),
        "aborted": ("aborted", "wf-model@1"),
        "cancelled": ("cancelled", "wf-model@1"),
        "terminated": ("failed", "wf-model@1"),
    }[ending]
    assert (state.sets[-1].status, state.serving_set) == expected, state.sets[-1]
    assert state.state == "serving" and still != started_by
    assert state.rollout is not None and state.rollout.set_id == "wf-model@2"
    if ending == "terminated":  # mid-bake: the split is undone by the model
        assert (
            "terminated" in state.sets[-1].detail
            and "routers put back on wf-model@1" in state.sets[-1].detail
        )
    if ending in ("terminated", "cancelled"):
        assert fake.weights["us-east"] == {"app-1": 100.0}
    if ending == "completed":
        assert state.serving_apps == {"us-east": "app-2"} and state.rollout.generations == [2, 3]
    # Every run stayed near the limit: it continues once past it, with what is in flight done.
    lengths = [e.history_length async for e in temporal.list_workflows(f'WorkflowId = "{handle.id}"')]
    print(f"{ending}: {len(lengths)} runs of the model, history lengths {sorted(lengths)}")
    assert len(lengths) >= 2 and max(lengths) <= 20 + HISTORY_SLACK, lengths


async def test_the_record_keeps_the_newest_sets_whole_and_summarizes_the_rest(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[100], bake_seconds=0.1), sets_kept=2)
    async with worker:
        for n in range(1, 5):
            await handle.execute_update("publish", request(f"v{n}"), result_type=PublishResult)
            state = await until(handle, lambda s, n=n: s.serving_set == f"wf-model@{n}")
        with pytest.raises(WorkflowUpdateFailedError) as again:
            await handle.execute_update("publish", request("v1"), result_type=PublishResult)
    assert "already published" in str(again.value.cause)
    assert [s.id for s in state.sets] == ["wf-model@3", "wf-model@4"]
    assert state.older_sets is not None
    assert (state.older_sets.count, state.older_sets.by_status, state.older_sets.versions) == (
        2,
        {"retired": 2},
        ["v1", "v2"],
    )


async def test_failed_rollout_leaves_traffic_on_the_last_good_set(temporal: Client) -> None:
    fake = FakeServing()
    fake.fail.add("wf-model@2")
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        state = await until(handle, lambda s: any(x.status == "failed" for x in s.sets))
    assert state.serving_set == "wf-model@1" and state.serving_apps == {"us-east": "app-1"}
    failed = state.sets[1]
    assert failed.id == "wf-model@2" and "DEPLOY_FAILED" in failed.detail
    assert fake.routes == [{"us-east": {"app-1": 100.0}}]  # no weight ever moved off the good set
    assert fake.removed == []


async def test_a_serving_model_checks_serve_against_its_record_and_records_repairs(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        state = await until(handle, lambda s: s.reconcile is not None and s.reconcile.checks >= 1)
        # Right after its rollout: the serving set, its plan and apps, the generation it applied.
        first = fake.reconciled[0]
        assert first.serving_set.id == "wf-model@1" and first.apps == {"us-east": "app-1"}
        assert first.generation_floor == 1 and state.reconcile is not None
        assert state.reconcile.interval_seconds == fake.reconcile_interval and state.reconcile.repairs == 0
        # Serve lost something (a restart): the next check repairs it, and the record says so.
        fake.drift = ["wf-model.us-east.s1.r1: lost (the writer holds none)"]
        state = await until(handle, lambda s: s.reconcile is not None and s.reconcile.repairs == 1)
        assert state.reconcile is not None and "lost" in state.reconcile.last_repair
        # A check that cannot run (Ray down) is recorded; the model stays up and takes a publish.
        fake.reconcile_error = "Ray is unreachable"
        state = await until(handle, lambda s: s.reconcile is not None and s.reconcile.failures >= 1)
        assert state.reconcile is not None and "unreachable" in state.reconcile.last_failure
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@2")
        fake.reconcile_error = None
        checks = len(fake.reconciled)
        state = await until(handle, lambda s: len(fake.reconciled) > checks + 1)
    assert fake.reconciled[-1].serving_set.id == "wf-model@2"
    assert fake.reconciled[-1].generation_floor == fake.generation  # the rollout's generations count
    desc = await handle.describe()
    assert desc.status is not None and desc.status.name == "RUNNING"


async def test_rejected_publish_changes_nothing(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        before = await until(handle, lambda s: s.serving_set == "wf-model@1")
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update("publish", request("bad-1"), result_type=PublishResult)
        assert "checksum mismatch" in str(caught.value.cause)
        with pytest.raises(WorkflowUpdateFailedError) as dup:
            await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        assert "already published" in str(dup.value.cause)
        after: ModelState = await handle.query("get", result_type=ModelState)
        unchecked = {"reconcile": None, "updated_at": None}  # the serving checks go on meanwhile
        assert after.model_copy(update=unchecked) == before.model_copy(update=unchecked)
        # The next good publish still gets the next number: nothing was consumed by the rejects.
        result = await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        assert result.set_id == "wf-model@2"
        assert isinstance(after.sets[0].published_at, datetime)


class FakeFleet:
    """The replan activities at their seam: the registry read is real (the running model
    workflow's state), the observed demand read answers once and then fails as a dead Ray
    would, the solve returns a fixed new placement for `wf-model` and one for a model that
    does not exist."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.solved: list[SolveFleetInput] = []
        self.read: list[ReadDemandInput] = []

    @activity.defn(name="read_observed_demand")
    async def read_demand(self, input: ReadDemandInput) -> ReadDemandResult:
        self.read.append(input)
        if len(self.read) > 1:
            raise ApplicationError("Ray is down", type="StackError", non_retryable=True)
        observed = SourceSizing(
            declared_qps=10, observed_peak_qps=30, planned_qps=36, used="observed", over_budget=True
        )
        sizing = declared_only(input.declared["wf-model"], "").model_copy(
            update={"observed": True, "sources": {"us-east": observed}}
        )
        return ReadDemandResult(demand={"wf-model": sizing})

    @activity.defn(name="collect_models")
    async def collect(self) -> CollectResult:
        state: ModelState = await self.client.get_workflow_handle("model/wf-model").query(
            "get", result_type=ModelState
        )
        return CollectResult(models=[ModelEntry(spec=state.spec, plan=state.plan)])

    @activity.defn(name="solve_fleet_plan")
    async def solve(self, input: SolveFleetInput) -> SolveFleetResult:
        self.solved.append(input)
        gone = plan_in("us-east", 1).model_copy(update={"deployments": {}})
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
            changed={"wf-model": plan_in("eu-west", 2), "no-such-model": gone},
            plan_file="rev-000001.json",
            demand=input.demand,
        )


async def test_scheduled_fleet_replan_hands_models_their_new_placement(temporal: Client) -> None:
    fake, fleet = FakeServing(), FakeFleet(temporal)
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        temporal,
        task_queue=queue,
        workflows=WORKFLOWS,
        activities=[*fake.activities(), fleet.collect, fleet.read_demand, fleet.solve],
    )
    model = await temporal.start_workflow(
        "ModelWorkflow", ModelWorkflowInput(spec=SPEC), id="model/wf-model", task_queue=queue
    )
    async with worker:
        await model.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(model, lambda s: s.serving_set == "wf-model@1")
        await ensure_replan_schedule(temporal, queue, timedelta(hours=6), FleetReplanInput(time_limit_s=5))
        schedule = temporal.get_schedule_handle(REPLAN_SCHEDULE_ID)
        # Paused so only the triggers below run it (every 6 h fires at 00, 06, 12 and 18 UTC, and
        # a run of its own would add a revision); a paused schedule still runs when triggered.
        await schedule.pause(note="held by the test: runs only when triggered")
        try:
            result: FleetReplanResult = await trigger_and_wait(temporal, timeout_s=60)
            state = await until(model, lambda s: s.plan is not None and s.plan.revision == 2)
            again: FleetReplanResult = await trigger_and_wait(temporal, timeout_s=60)
            await schedule.unpause()
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
    # Observed demand: read over the schedule's interval, planned, and said in the result; when
    # it cannot be read the replan goes on with declared demand and says why.
    assert fleet.read[0].declared == {"wf-model": dict(SPEC.traffic.peak_qps)}
    assert fleet.read[0].interval_s == timedelta(hours=6).total_seconds()
    assert fleet.solved[0].demand["wf-model"].sources["us-east"].planned_qps == 36
    assert result.demand["wf-model"].over_budget() == ["us-east"]
    assert fleet.solved[1].demand == {} and "Ray is down" in fleet.solved[1].demand_note


async def test_a_replan_that_only_changes_replica_counts_applies_in_place(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        bigger = plan_in("us-east", 1)  # same region and hardware, 2 replicas instead of 1
        await handle.signal("apply_plan", ApplyPlanInput(plan=bigger, fleet_revision=3))
        state = await until(
            handle,
            lambda s: (
                s.plan is not None and s.plan.deployments == bigger.deployments and s.state == "serving"
            ),
        )
    # The serving app changed its replica count in place: no app beside it, none removed,
    # and the routers' weights stayed where they were.
    assert fake.scales == [("wf-model@1", 1, 1.0), ("wf-model@1", 1, 1.0)]
    assert state.serving_apps == {"us-east": "app-1"} and fake.removed == []
    assert all(r == {"us-east": {"app-1": 100.0}} for r in fake.routes)


async def test_a_rollout_terminated_mid_bake_leaves_the_model_managed_on_the_serving_set(
    temporal: Client,
) -> None:
    """Terminate (no rollback of its own) at a 50/50 split: the model workflow notices, puts the
    routers back on the serving set at a generation above every one the rollout applied, says
    so on the set and the rollout, and stays Running, ready for the next publish."""
    fake = FakeServing()
    worker, handle = await start(temporal, fake, with_rollout(steps=[50, 100], bake_seconds=30.0))
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1")
        await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        split = await until_rollout(temporal, "wf-model@2", lambda s: "baking" in s.step)
        assert fake.weights["us-east"] == {"app-1": 50.0, "app-2": 50.0}
        child = temporal.get_workflow_handle(rollout_workflow_id("wf-model", "wf-model@2"))
        await child.terminate(reason="drill")
        state = await until(
            handle, lambda s: s.sets[-1].status == "failed" and "routers" in s.sets[-1].detail
        )
        running = (await handle.describe()).status
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)
        await until_rollout(temporal, "wf-model@3", lambda s: "baking" in s.step)  # the next one runs
    assert running == WorkflowExecutionStatus.RUNNING
    assert fake.restored and fake.restored[0][:2] == ("us-east", "app-1")
    assert fake.restored[0][2] > max(split.generations), (fake.restored, split.generations)
    detail = state.sets[-1].detail
    assert "was terminated" in detail and "routers put back on wf-model@1" in detail, detail
    assert state.rollout is not None and state.rollout.detail == detail
    assert state.serving_set == "wf-model@1" and state.reconcile is not None and state.reconcile.repairs >= 1


async def test_updates_without_or_with_a_malformed_payload_are_refused(temporal: Client) -> None:
    """What the Temporal UI's "Execute Update" can send: no payload, or one of the wrong shape.
    Each is refused by the update's validator with what it expected; no workflow task fails,
    and the model goes on taking publishes."""
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    binary = str(Path(sys.executable).parent / "temporal")
    address = temporal.service_client.config.target_host

    async def update(name: str, *payloads: str) -> tuple[int, str]:
        inputs = [arg for payload in payloads for arg in ("--input", payload)]
        proc = await asyncio.create_subprocess_exec(
            binary,
            *("workflow", "update", "execute", "--workflow-id", handle.id, "--name", name, *inputs),
            *("--address", address),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), timeout=30)
        return proc.returncode or 0, out.decode() + err.decode()

    async with worker:
        await until(handle, lambda s: s.plan is not None)
        refused = {
            "publish, none": await update("publish"),
            "publish, malformed": await update("publish", '{"request": 5}'),
            "publish, not an object": await update("publish", '"v1"'),
            "delete, none": await update("delete"),
            "delete, malformed": await update("delete", '{"who": 5, "why": "x"}'),
        }
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@1")
        history = await handle.fetch_history()
    for what, (code, text) in refused.items():
        print(f"{what}: exit {code}: {text.strip()[:300]}")
        assert code != 0, what
        assert "UpdateInputError" in text or "Fix: send" in text, (what, text)
    assert "no payload" in refused["publish, none"][1] and "PublishInput" in refused["publish, none"][1]
    assert "request" in refused["publish, malformed"][1]
    assert "DeleteInput" in refused["delete, none"][1]
    failed = [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    assert failed == [] and state.state == "serving"
