"""ExperimentWorkflow on a real Temporal dev server with the activities faked at their seam: the
treatment deployed at its share and routed by unit, outcomes summed per arm into a report that
finds the better arm, and every way it ends (duration, on-call stop, a guardrail) putting all
traffic back on control and removing the treatment; across continue-as-new nothing is lost."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle
from temporalio.worker import Worker

from ipnext.activities.rollouts import RolloutActivities
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.experiment import ExperimentInput, ExperimentStatus, StopExperimentInput
from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.names import ARMS_KEY, MODEL_KEY, STATE_KEY, SetStatus
from ipnext.spec.model import SnapshotRef, SnapshotSet

from .fakes import SPEC, WAIT_S, FakeServing, until_idle, with_rollout

pytestmark = pytest.mark.timeout(120)

PLAN = Plan(
    deployments={
        "wf-model/embed": DeploymentPlacement(
            replicas={"us-east": {"cpu-std": 2}}, fractions={"us-east": {"us-east": 1.0}}
        )
    },
    cost=2.0,
    solver="fake",
)


def snapshot_set(number: int, status: SetStatus) -> SnapshotSet:
    ref = SnapshotRef(uri=f"file:///snap/v{number}", sha256="a" * 64, snapshot_id=f"wf-model/embed@v{number}")
    return SnapshotSet(
        id=f"wf-model@{number}",
        number=number,
        version=f"v{number}",
        parts={"embed": ref},
        status=status,
        published_at=datetime(2026, 11, 28, tzinfo=UTC),
    )


async def start(
    temporal: Client, fake: FakeServing, **change: Any
) -> tuple[Worker, WorkflowHandle[Any, Any]]:
    queue = f"exp-{uuid.uuid4().hex[:8]}"
    worker = Worker(
        temporal,
        task_queue=queue,
        workflows=WORKFLOWS,
        activities=[*fake.activities(), RolloutActivities(temporal).rollout_outcome],
    )
    input = ExperimentInput(
        spec=change.pop("spec", SPEC),
        plan=PLAN,
        name="exp-1",
        salt="salt-0123456",
        control_set=snapshot_set(1, SetStatus.SERVING),
        control_apps={"us-east": "app-1"},
        treatment_set=snapshot_set(2, SetStatus.HELD),
        treatment_percent=50,
        duration_seconds=change.pop("duration_seconds", 2.0),
        check_seconds=0.2,
        **change,
    )
    handle = await temporal.start_workflow(
        "ExperimentWorkflow",
        input,
        id=f"experiment/wf-{uuid.uuid4().hex[:8]}/exp-1",
        task_queue=queue,
        result_type=ExperimentStatus,
    )
    return worker, handle


async def test_an_experiment_runs_its_time_and_its_report_finds_the_better_arm(temporal: Client) -> None:
    fake = FakeServing()
    fake.weights = {"us-east": {"app-1": 100.0}}  # the control serves before the experiment
    fake.click_rates = {"app-1": 0.20, "app-2": 0.30}
    fake.rate = 4000  # requests per metrics read: 2000 per arm (one window is evidence enough)
    worker, handle = await start(temporal, fake, metrics=["click:higher"])
    async with worker:
        result: ExperimentStatus = await handle.result()
    assert (result.phase, result.outcome) == ("ended", "completed") and "duration of 2 s ended" in result.end
    listed = (await handle.describe()).typed_search_attributes  # what the Temporal UI lists it by
    assert (listed.get(MODEL_KEY), listed.get(STATE_KEY)) == ("wf-model", "ended")
    assert listed.get(ARMS_KEY) == ["control=wf-model@1", "treatment=wf-model@2"]
    assert fake.scales[0] == ("wf-model@2", 1, 0.5)  # the treatment at its share of the plan
    on, off = fake.experiments[0]["us-east"], fake.experiments[-1]
    assert on.arms == {"control": "app-1", "treatment": "app-2"} and on.split == {
        "control": 50.0,
        "treatment": 50.0,
    }
    assert off == {} and fake.routes[-1] == {"us-east": {"app-1": 100.0}}  # all back on control
    assert fake.removed == ["app-2"]
    report = result.report
    assert report is not None and [a.arm for a in report.arms] == ["control", "treatment"]
    control, treatment = report.arms
    assert control.requests == treatment.requests > 0 and control.outcomes["click"][1] == pytest.approx(0.2)
    (clicks,) = [c for c in report.comparisons if c.outcome == "click"]
    assert clicks.difference == pytest.approx(0.1) and clicks.significant and report.winner == "treatment"


async def test_on_call_stops_it_and_nothing_counted_is_lost_across_continue_as_new(temporal: Client) -> None:
    fake = FakeServing()
    fake.weights = {"us-east": {"app-1": 100.0}}
    fake.click_rates = {"app-1": 0.5, "app-2": 0.5}
    worker, handle = await start(temporal, fake, duration_seconds=600.0, history_limit=50)
    async with worker:
        runs: set[str | None] = set()
        while True:
            status: ExperimentStatus = await handle.query("status", result_type=ExperimentStatus)
            runs.add((await handle.describe()).run_id)
            if len(runs) >= 3 and status.report is not None:
                break
        await handle.signal("stop", StopExperimentInput(who="ann", reason="enough"))
        result: ExperimentStatus = await handle.result()
    assert (result.outcome, result.end) == ("stopped", "stopped by ann: enough")
    assert result.report is not None
    control, treatment = result.report.arms
    # Every window of every run counted: 50 requests per arm per read after the first.
    checks = control.requests // 50
    assert control.requests == treatment.requests == 50 * checks and checks >= 3
    assert control.outcomes["click"][0] == control.requests
    assert fake.removed == ["app-2"] and fake.experiments[-1] == {}


async def test_a_guardrail_breach_ends_it_with_all_traffic_on_control(temporal: Client) -> None:
    fake = FakeServing()
    fake.weights = {"us-east": {"app-1": 100.0}}
    fake.bad_apps = {"app-2"}  # the treatment fails every request
    spec = with_rollout(gates=[{"metric": "error_rate", "max": 0.05}], min_requests=5)
    worker, handle = await start(temporal, fake, spec=spec, duration_seconds=600.0)
    async with worker:
        result: ExperimentStatus = await handle.result()
    assert result.outcome == "guardrail" and result.end.startswith(
        "guardrail error_rate breached by the treatment"
    )
    assert fake.routes[-1] == {"us-east": {"app-1": 100.0}} and fake.experiments[-1] == {}
    assert fake.removed == ["app-2"]
    breached = [g for g in result.guardrails if g.breached]
    assert breached and breached[0].value == 1.0


async def test_a_model_runs_its_experiment_and_holds_rollouts_and_checks_until_it_ends(
    temporal: Client,
) -> None:
    from temporalio.client import WorkflowUpdateFailedError

    from ipnext.contracts.experiment import ExperimentStarted, StartExperimentInput
    from ipnext.contracts.model import ModelState, PublishResult

    from .fakes import request, until
    from .fakes import start as start_model

    fake = FakeServing()
    fake.click_rates = {"app-1": 0.2, "app-2": 0.3}
    fake.rate = 4000
    worker, handle = await start_model(temporal, fake)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
        held = request("v2").model_copy(update={"hold": True})
        await handle.execute_update("publish", held, result_type=PublishResult)
        ask = StartExperimentInput(
            name="exp-1", treatment="wf-model@2", duration_seconds=3, check_seconds=0.2, metrics=["click"]
        )
        with pytest.raises(WorkflowUpdateFailedError) as refused:  # a deciding outcome without a direction
            await handle.execute_update("start_experiment", ask, result_type=ExperimentStarted)
        assert "metrics: 'click' does not say which way is better" in str(refused.value.cause)
        ask = ask.model_copy(update={"treatment": "wf-model@1", "metrics": ["click:higher"]})
        with pytest.raises(WorkflowUpdateFailedError) as refused:  # the serving set is no treatment
            await handle.execute_update("start_experiment", ask, result_type=ExperimentStarted)
        assert "treatment: 'wf-model@1' is not a held set of wf-model (held: ['wf-model@2'])" in str(
            refused.value.cause
        )
        ask = ask.model_copy(update={"treatment": "wf-model@2", "who": "ann"})
        started: ExperimentStarted = await handle.execute_update(
            "start_experiment", ask, result_type=ExperimentStarted
        )
        assert (started.control, started.treatment) == ("wf-model@1", "wf-model@2")
        await until(handle, lambda s: s.experiment is not None and s.experiment.started)
        checks = len(fake.reconciled)
        await until_idle(handle)  # no timer for a check: they wait for its end
        assert [r for r in fake.reconciled[checks:] if not r.sets] == []  # its checks wait
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)  # waits for the end
        during: ModelState = await handle.query("get", result_type=ModelState)
        assert during.queued == ["wf-model@3"] and during.serving_set == "wf-model@1"
        state = await until(
            handle, lambda s: s.experiments != [] and s.serving_set == "wf-model@3", timeout=60
        )
    (ended,) = state.experiments
    assert ended.outcome == "completed" and ended.workflow_id == started.workflow_id
    assert ended.report is not None and ended.report.winner == "treatment"
    assert fake.removed[0] == "app-2"  # the treatment's app went first, then the rollout to @3


@pytest.mark.parametrize("ending", ["completed", "terminated"])
async def test_the_model_continues_as_new_while_its_experiment_runs_and_learns_its_end(
    temporal: Client, ending: str
) -> None:
    """A model whose history passes its (low) limit continues as new while its experiment runs;
    the latest run learns the end from the experiment's signal, or, for one terminated from the
    Temporal UI, by asking Temporal (`experiment_outcome`), and records it."""
    from ipnext.contracts.experiment import ExperimentStarted, StartExperimentInput
    from ipnext.contracts.model import PublishResult
    from ipnext.names import poll_until

    from .fakes import request, until
    from .fakes import start as start_model

    fake = FakeServing()
    worker, handle = await start_model(temporal, fake, history_limit=20, rollout_check_seconds=0.3)
    async with worker:
        await handle.execute_update("publish", request("v1"), result_type=PublishResult)
        await until(handle, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
        await handle.execute_update(
            "publish", request("v2").model_copy(update={"hold": True}), result_type=PublishResult
        )
        duration = 4 if ending == "completed" else 600
        ask = StartExperimentInput(
            name="exp-1", treatment="wf-model@2", duration_seconds=duration, check_seconds=0.2
        )
        started = await handle.execute_update("start_experiment", ask, result_type=ExperimentStarted)
        await until(handle, lambda s: s.experiment is not None and s.experiment.started)
        first = (await handle.describe()).run_id

        async def model_run() -> str:
            # Each signal is an event: the waiting run sees its history grow past the limit.
            await handle.signal("reconcile")
            run_id: str = (await handle.describe()).run_id
            return run_id

        await poll_until(model_run, lambda run: run != first, timeout_s=WAIT_S, what="a continue-as-new")
        if ending == "terminated":
            await temporal.get_workflow_handle(started.workflow_id).terminate(reason="drill")
        state = await until(handle, lambda s: s.experiments != [] and s.experiment is None, timeout=60)
    (ended,) = state.experiments
    if ending == "completed":
        assert ended.outcome == "completed" and ended.report is not None
    else:
        assert ended.outcome == "failed" and "ended without its report: terminated" in ended.end
    assert state.serving_set == "wf-model@1" and state.state == "serving"


async def test_a_shadow_copies_requests_to_the_candidate_and_keeps_each_windows_comparison(
    temporal: Client,
) -> None:
    """Shadow mode: control keeps all the traffic, the routers get the shadow route, every window's
    comparison is kept, and a candidate that fails every copy ends nothing (its gates are evidence)."""
    fake = FakeServing()
    fake.weights = {"us-east": {"app-1": 100.0}}
    fake.shadow_diff = 0.125
    fake.bad_apps = set()
    spec = with_rollout(gates=[{"metric": "error_rate", "max": 0.05}], min_requests=5)
    worker, handle = await start(temporal, fake, spec=spec, mode="shadow", shadow_max_in_flight=3)
    async with worker:
        result: ExperimentStatus = await handle.result()
    assert (result.mode, result.outcome) == ("shadow", "completed") and result.report is None
    listed = (await handle.describe()).typed_search_attributes
    assert listed.get(ARMS_KEY) == ["control=wf-model@1", "shadow=wf-model@2"]
    assert fake.scales[0] == ("wf-model@2", 1, 0.5)  # the candidate at the copied share of the plan
    assert all(route == {"us-east": {"app-1": 100.0}} for route in fake.routes)  # control answers all
    on = fake.shadows[0]["us-east"]
    assert (on.app, on.percent, on.max_in_flight, on.shadow) == ("app-2", 50.0, 3, "exp-1")
    assert fake.shadows[-1] == {} and fake.experiments[0] == {} and fake.removed == ["app-2"]
    whole = result.shadow
    assert whole is not None and whole.compared == whole.mirrored == whole.candidate_requests > 0
    assert whole.max_abs_diff_mean == pytest.approx(0.125) and whole.differing == 1.0
    assert whole.rank_correlation_mean == 1.0 and whole.dropped == 0
    assert result.shadow_windows and sum(w.compared for w in result.shadow_windows) == whole.compared
    assert all(w.compared == 50 for w in result.shadow_windows)  # 100 requests a read, half copied

    failing = FakeServing()
    failing.weights = {"us-east": {"app-1": 100.0}}
    failing.bad_apps = {"app-2"}
    worker, handle = await start(temporal, failing, spec=spec, mode="shadow")
    async with worker:
        result = await handle.result()
    assert result.outcome == "completed"  # a shadow's breach harms no caller: it runs its time
    assert any(g.breached for g in result.guardrails) and result.shadow is not None
    assert result.shadow.candidate_errors == result.shadow.candidate_requests > 0
    assert result.shadow.compared == 0


async def experiment_started(handle: WorkflowHandle[Any, Any], duration_seconds: float) -> None:
    """v1 serving, v2 held, and experiment exp-1 (25% to v2) started on the model."""
    from ipnext.contracts.experiment import ExperimentStarted, StartExperimentInput
    from ipnext.contracts.model import PublishResult

    from .fakes import request, until

    await handle.execute_update("publish", request("v1"), result_type=PublishResult)
    await until(handle, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")
    await handle.execute_update(
        "publish", request("v2").model_copy(update={"hold": True}), result_type=PublishResult
    )
    ask = StartExperimentInput(
        name="exp-1",
        treatment="wf-model@2",
        treatment_percent=25,
        duration_seconds=duration_seconds,
        check_seconds=0.2,
    )
    await handle.execute_update("start_experiment", ask, result_type=ExperimentStarted)
    await until(handle, lambda s: s.experiment is not None and s.experiment.started)


async def test_replans_reach_both_arms_in_place_or_on_new_apps_while_the_experiment_runs(
    temporal: Client,
) -> None:
    """During an experiment a fleet replan that only changes replica counts (same placement
    revision) moves both arms at once: control at full size, the treatment at its share, and the
    model's plan is the new one. A replan to another region (new apps) is moved by the
    experiment: both arms' new apps, the routers switched with the same salt, then the routing,
    the old apps removed; the report counts both."""
    from ipnext.contracts.model import ApplyPlanInput
    from ipnext.names import poll_until

    from .fakes import plan_in, until
    from .fakes import start as start_model

    fake = FakeServing()
    worker, handle = await start_model(temporal, fake)
    async with worker:
        await experiment_started(handle, duration_seconds=6)
        # The experiment's own deploy of its treatment first (a fresh run once counted it as the replan's).
        await poll_until(
            lambda: asyncio.sleep(0, list(fake.scales)),
            lambda scales: ("wf-model@2", 1, 0.25) in scales,
            timeout_s=WAIT_S,
            interval_s=0.05,
            what="the treatment deployed at its share",
        )
        deploys = len(fake.scales)
        bigger = Plan(  # the model's placement (us-east, cpu-std) with 6 replicas: in place
            deployments={
                "wf-model/embed": DeploymentPlacement(
                    replicas={"us-east": {"cpu-std": 6}}, fractions={"us-east": {"us-east": 1.0}}
                )
            },
            cost=6.0,
            solver="fake",
        )
        await handle.signal("apply_plan", ApplyPlanInput(plan=bigger, fleet_revision=3))
        moved = await until(
            handle,
            lambda s: (
                s.plan is not None
                and s.plan.deployments["wf-model/embed"].replicas["us-east"]["cpu-std"] == 6
            ),
        )
        assert moved.experiment is not None and moved.pending_plan is None  # while it runs
        assert fake.scales[deploys:] == [("wf-model@1", 1, 1.0), ("wf-model@2", 1, 0.25)]
        # Another region: new apps for both arms, moved by the experiment while it runs.
        routes = len(fake.experiments)
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=4))
        during = await until(handle, lambda s: s.plan is not None and s.plan.revision == 2)
        assert during.experiment is not None and during.pending_plan is None  # while it runs
        assert during.serving_apps == {"eu-west": "app-1-r2"}
        assert fake.scales[deploys + 2 :] == [
            ("wf-model@1", 2, 1.0),  # the control's new apps, routing not published yet
            ("wf-model@2", 2, 0.25),
            ("wf-model@1", 2, 1.0),  # the routers switched: the routing follows the new plan
        ]
        switched = fake.experiments[routes:]
        assert [sorted(e) for e in switched] == [["eu-west"]], switched
        route = switched[0]["eu-west"]
        assert (
            route.arms == {"control": "app-1-r2", "treatment": "app-2-r2"} and route.split["treatment"] == 25
        )
        assert route.salt == fake.experiments[routes - 1]["us-east"].salt  # units keep their arms
        assert {"app-1", "app-2"} <= set(fake.removed)  # the old apps of both arms
        state = await until(handle, lambda s: s.experiments != [], timeout=60)
    assert state.plan is not None and state.plan.revision == 2 and state.pending_plan is None
    assert state.serving_apps == {"eu-west": "app-1-r2"}
    report = state.experiments[-1].report
    assert report is not None and all(a.requests > 0 for a in report.arms), report
    assert fake.routes[-1] == {"eu-west": {"app-1-r2": 100.0}}  # at the end: all on the new control
    assert "app-2-r2" in fake.removed


async def test_a_move_of_the_arms_that_fails_leaves_them_and_the_replan_waits_for_the_end(
    temporal: Client,
) -> None:
    """The treatment cannot come up on the new placement: what came up goes, the arms stay on
    their apps, and the model moves its capacity after the experiment ended."""
    from ipnext.contracts.model import ApplyPlanInput

    from .fakes import plan_in, until
    from .fakes import start as start_model

    fake = FakeServing()
    worker, handle = await start_model(temporal, fake)
    async with worker:
        await experiment_started(handle, duration_seconds=4)
        await until(handle, lambda s: "wf-model@2" in fake.deployed)
        fake.fail.add("wf-model@2")
        await handle.signal("apply_plan", ApplyPlanInput(plan=plan_in("eu-west", 2), fleet_revision=4))
        await until(handle, lambda s: "app-1-r2" in fake.removed)  # the control's new apps went
        during = await until(handle, lambda s: s.pending_plan == 2)
        assert during.experiment is not None and during.plan is not None and during.plan.revision == 1
        assert during.serving_apps == {"us-east": "app-1"}
        fake.fail.clear()
        state = await until(
            handle, lambda s: s.experiments != [] and s.plan is not None and s.plan.revision == 2, timeout=60
        )
    assert state.serving_apps == {"eu-west": "app-1-r2"}  # moved once the experiment ended
