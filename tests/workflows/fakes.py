"""Fakes and helpers of the workflow tests: the activities at their seam (same names, no Ray),
a model spec with short rollout settings, and ways to wait on a workflow's state."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio import activity
from temporalio.client import Client, WorkflowHandle
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError
from temporalio.worker import Worker

from ipnext.activities.freeze import FreezeWindowsResult
from ipnext.activities.metadata import WatchScheduleInput
from ipnext.activities.pinned_refs import PinnedReferencesInput, Reclaimed
from ipnext.activities.plan import PlanInput
from ipnext.activities.reconcile import ReconcileInput, ReconcileResult
from ipnext.activities.rollouts import RolloutActivities
from ipnext.activities.serving import (
    DeploySetInput,
    DeploySetResult,
    ReadMetricsInput,
    ReadMetricsResult,
    RemoveAppsInput,
    RouteInput,
    RouteResult,
    TeardownInput,
    TeardownResult,
)
from ipnext.activities.validate import (
    ValidateSetInput,
    ValidateSetResult,
    VerifyPinnedInput,
    VerifyPinnedResult,
)
from ipnext.client.worker import WORKFLOWS
from ipnext.contracts.counters import OutcomeTotals, SetCounters
from ipnext.contracts.freeze import FreezeOverride, FreezeWindow
from ipnext.contracts.model import ModelState, ModelWorkflowInput, PublishInput, ValidateSpecInput
from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.contracts.rollout import RolloutStatus
from ipnext.contracts.router import ExperimentRoute, ShadowRoute
from ipnext.names import poll_until, rollout_workflow_id
from ipnext.policy.shadow import DROPPED, compare_answers
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSetRequest

# How long a test waits for a condition before it fails: ample for a loaded 2-core CI machine,
# where a workflow task or an activity may wait seconds for a core.
WAIT_S = 30.0

SPEC = ModelSpec.model_validate(
    {
        "name": "wf-model",
        "owner": "tests",
        "parts": {"embed": {"factory": "m:f", "hardware": {"cpu-std": {"units": 1, "qps": 100}}}},
        "dag": [["input", "embed"], ["embed", "output"]],
        "traffic": {"peak_qps": {"us-east": 10}},
        "latency_budget_ms": 50,
        # Short settings: two steps, a bake of a few checks.
        "rollout": {
            "steps": [50, 100],
            "bake_seconds": 0.6,
            "check_interval_seconds": 0.1,
            "min_requests": 5,
        },
    }
)


class FakeServing:
    """Stands in for the validate/plan/serving activities: records calls, blocks or fails on demand.

    Traffic is simulated: every metrics read adds, per region, `rate` requests split by the
    routers' current weights; apps in `bad_apps` answer every request with an error."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.fail: set[str] = set()
        self.fail_plans: dict[int, int] = {}  # plan revision -> deploys onto it that fail still
        self.deployed: list[str] = []
        self.deploy_specs: list[tuple[str, ModelSpec]] = []  # (set, the spec it was deployed under)
        self.deploy_plans: list[int] = []
        self.scales: list[tuple[str, int, float]] = []  # (set, plan revision, scale) per deploy
        self.part_scales: list[tuple[str, dict[str, float]]] = []  # (set, part -> share) per deploy
        self.routes: list[dict[str, dict[str, float]]] = []
        self.part_routes: list[tuple[dict[str, dict[str, dict[str, float]]], str | None]] = []
        self.router_caps: list[int] = []  # router_max_ongoing_requests of each route call
        # (app, gated part) pairs whose requests fail: a bad snapshot of one part of a set
        self.bad_parts: set[tuple[str, str]] = set()
        self.counted: dict[str, dict[str, float]] = {}  # region -> app -> percent counted
        self.gated: str | None = None
        self.removed: list[str] = []
        self.removed_unwaited: list[str] = []  # apps of a down region: removed, never waited on
        self.generation = 0
        self.windows: list[FreezeWindow] = []
        self.bad_apps: set[str] = set()
        self.rate = 100
        self.replicas = 1  # of the first placement
        self.weights: dict[str, dict[str, float]] = {}
        self.counters: dict[str, dict[str, SetCounters]] = {}  # region -> app -> cumulative
        # Serving checks: each input seen; `drift` is what the next check repairs (then clean);
        # while `reconcile_error` is set every check fails with it (how: `reconcile_unreachable`).
        self.reconciled: list[ReconcileInput] = []
        self.drift: list[str] = []
        self.reconcile_error: str | None = None
        # The checks fail as Ray unreachable does (retryable: they cannot run), not as a check
        # that ran and found what it cannot fix (non-retryable: Serve refused an app).
        self.reconcile_unreachable = False
        self.reconcile_interval = 0.5
        self.restored: list[tuple[str, str, int]] = []  # (region, app, generation) a check routed back
        self.lose_counters = False  # the next metrics read finds every counter gone (Ray restarted)
        # Ray lost right after the next rollout serving check (found clean): its drift, for later.
        self.lose_after_check: list[str] = []
        self.repairing: list[ReconcileInput] = []  # each check that found drift
        self.corrupt: set[str] = set()  # sets whose pinned files fail their checksum
        self.verified: list[str] = []
        self.experiments: list[dict[str, ExperimentRoute]] = []  # each route call's experiment routes
        self.click_rates: dict[str, float] = {}  # app -> share of its answers clicked
        self.shadows: list[dict[str, ShadowRoute]] = []  # each route call's shadow routes
        self.shadow_diff = 0.0  # every shadow answer's max |diff| from the served one
        # Metrics reads so far: one per check of a bake or of an experiment, each after a wait of
        # its check interval, so they count the checks (and the time) a test lets pass.
        self.reads = 0
        # Each model's references written to (or dropped from) the pinned store; while
        # `pinned_error` is set, every write fails with it (as a store that is down).
        self.pinned_refs: list[PinnedReferencesInput] = []
        self.pinned_error: str | None = None

    @activity.defn(name="freeze_windows")
    async def freeze(self) -> FreezeWindowsResult:
        return FreezeWindowsResult(windows=self.windows)

    @activity.defn(name="read_metrics")
    async def metrics(self, input: ReadMetricsInput) -> ReadMetricsResult:
        self.reads += 1
        out: dict[str, dict[str, Any]] = {}
        if self.lose_counters:
            self.lose_counters = False
            self.counters.clear()
            return ReadMetricsResult(snapshots={region: {"sets": {}} for region in input.regions})
        for region in input.regions:
            by_app = self.counters.setdefault(region, {})
            # Like the router: a request counts against the gated part's app, else the set's.
            for app, percent in self.counted.get(region, self.weights.get(region, {})).items():
                c = by_app.setdefault(app, SetCounters())
                served = round(self.rate * percent / 100)
                for _ in range(served):
                    c.requests += 1
                    if app in self.bad_apps or (app, self.gated) in self.bad_parts:
                        c.errors += 1
                    else:
                        c.observe("latency_ms", 4.0)
                if app in self.click_rates:  # feedback on the answers: this share of them clicked
                    clicks = round(served * self.click_rates[app])
                    for click in [1.0] * clicks + [0.0] * (served - clicks):
                        c.outcomes["click"] = c.outcomes.get("click", OutcomeTotals()).add(click)
            shadow = self.shadows[-1].get(region) if self.shadows else None
            if shadow is not None:  # the router's copies of the served requests, compared
                c = by_app.setdefault(shadow.app, SetCounters())
                for _ in range(round(self.rate * shadow.percent / 100)):
                    c.requests += 1
                    failed = shadow.app in self.bad_apps
                    c.errors += failed
                    if not failed:
                        c.observe("latency_ms", 5.0)
                    found = {} if failed else compare_answers([0.5, 0.25], [0.5 + self.shadow_diff, 0.25], 1)
                    for name, value in {DROPPED: 0.0, **found}.items():
                        c.outcomes[name] = c.outcomes.get(name, OutcomeTotals()).add(value)
            out[region] = {"sets": {app: c.model_dump() for app, c in by_app.items()}}
        return ReadMetricsResult(snapshots=out)

    @activity.defn(name="validate_snapshot_set")
    async def validate(self, input: ValidateSetInput) -> ValidateSetResult:
        if input.request.version.startswith("bad"):
            raise ApplicationError("parts.embed: checksum mismatch", type="SnapshotError", non_retryable=True)
        return ValidateSetResult(parts=dict(input.request.parts))

    @activity.defn(name="validate_model_spec")
    async def validate_spec(self, input: ValidateSpecInput) -> None:
        bad = sorted(p for p, part in input.spec.parts.items() if part.factory.startswith("bad"))
        if bad:
            raise ApplicationError(
                f"parts.{bad[0]}.factory: cannot import it", type="SpecError", non_retryable=True
            )

    @activity.defn(name="plan_placement")
    async def plan(self, input: PlanInput) -> Plan:
        placement = DeploymentPlacement(
            replicas={"us-east": {"cpu-std": self.replicas}}, fractions={"us-east": {"us-east": 1.0}}
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
        if self.fail_plans.get(input.plan.revision, 0) > 0:
            self.fail_plans[input.plan.revision] -= 1
            raise ApplicationError(
                f"Serve did not start {set_id}'s apps on revision {input.plan.revision} in time",
                type="ServingError",
                non_retryable=True,
            )
        self.deployed.append(set_id)
        self.deploy_specs.append((set_id, input.spec))
        self.deploy_plans.append(input.plan.revision)
        self.scales.append((set_id, input.plan.revision, input.scale))
        self.part_scales.append((set_id, dict(input.part_scales)))
        suffix = f"-r{input.plan.revision}" if input.plan.revision > 1 else ""
        return DeploySetResult(
            apps={region: f"app-{input.snapshot_set.number}{suffix}" for region in regions(input.plan)}
        )

    @activity.defn(name="route_traffic")
    async def route(self, input: RouteInput) -> RouteResult:
        self.generation += 1
        self.routes.append(input.weights)
        self.part_routes.append((input.parts, input.gated_part))
        self.router_caps.append(input.router_max_ongoing_requests)
        self.weights.update(input.weights)
        self.gated = input.gated_part
        self.counted = {
            region: input.parts[region][input.gated_part]
            for region in input.parts
            if input.gated_part in input.parts[region]
        }
        self.experiments.append(dict(input.experiments))
        self.shadows.append(dict(input.shadows))
        for region, route in input.experiments.items():  # units split by the arms' shares
            self.counted[region] = {route.arms[arm]: share for arm, share in route.split.items()}
        return RouteResult(generations={r: self.generation for r in input.weights})

    @activity.defn(name="remove_apps")
    async def remove(self, input: RemoveAppsInput) -> None:
        self.removed.extend(input.names)
        if not input.wait:
            self.removed_unwaited.extend(input.names)

    @activity.defn(name="teardown_model")
    async def teardown(self, input: TeardownInput) -> TeardownResult:
        return TeardownResult(removed=["app-x"])

    @activity.defn(name="reconcile_serving")
    async def reconcile(self, input: ReconcileInput) -> ReconcileResult:
        self.reconciled.append(input)
        if self.reconcile_error is not None:
            if self.reconcile_unreachable:  # the world's failure: tried again, then given up
                raise ApplicationError(self.reconcile_error, next_retry_delay=timedelta(milliseconds=10))
            raise ApplicationError(self.reconcile_error, non_retryable=True)
        repaired, self.drift = self.drift, []
        if repaired:
            self.repairing.append(input)
        if self.lose_after_check and input.routers and not repaired:
            self.drift, self.lose_after_check, self.lose_counters = self.lose_after_check, [], True
        if not input.routers:  # the model's check: like the real one, every router on its serving app
            for region, app in sorted(input.apps.items()):
                held = self.weights.get(region)
                if held is not None and held != {app: 100.0}:
                    self.generation += 1  # above the one the router holds
                    self.weights[region] = {app: 100.0}
                    self.counted.pop(region, None)
                    self.restored.append((region, app, self.generation))
                    repaired.append(f"router {region}: weights {held} differ from {{{app!r}: 100.0}}")
        generation = max(input.generation_floor, self.generation)
        return ReconcileResult(
            repaired=repaired,
            generations=dict.fromkeys(input.apps, generation),
            interval_seconds=self.reconcile_interval,
        )

    @activity.defn(name="verify_pinned_set")
    async def verify_pinned(self, input: VerifyPinnedInput) -> VerifyPinnedResult:
        self.verified.append(input.snapshot_set.id)
        bad = input.snapshot_set.id in self.corrupt
        return VerifyPinnedResult(problems=["embed: ab12.safetensors: its bytes changed"] if bad else [])

    @activity.defn(name="sync_pinned_references")
    async def pinned(self, input: PinnedReferencesInput) -> Reclaimed:
        if self.pinned_error is not None:
            raise ApplicationError(self.pinned_error, non_retryable=True)
        self.pinned_refs.append(input)
        return Reclaimed(at=datetime.now(UTC))

    def activities(self) -> list[Callable[..., Any]]:
        return [
            self.pinned,
            self.reconcile,
            self.verify_pinned,
            self.validate,
            self.validate_spec,
            self.plan,
            self.watch,
            self.deploy,
            self.route,
            self.remove,
            self.teardown,
            self.freeze,
            self.metrics,
        ]


def with_rollout(**settings: Any) -> ModelSpec:
    """SPEC with some rollout settings changed."""
    rollout = SPEC.rollout.model_copy(update=settings)
    return SPEC.model_copy(update={"rollout": rollout})


def request(version: str, override: FreezeOverride | None = None) -> PublishInput:
    ref = SnapshotRef(uri=f"file:///snap/{version}", sha256="a" * 64, snapshot_id=f"wf-model/embed@{version}")
    return PublishInput(
        request=SnapshotSetRequest(model="wf-model", version=version, parts={"embed": ref}),
        who="test",
        freeze_override=override,
    )


def regions(plan: Plan) -> list[str]:
    return sorted({r for p in plan.deployments.values() for r in p.regions()})


def plan_in(region: str, revision: int) -> Plan:
    placement = DeploymentPlacement(replicas={region: {"cpu-std": 2}}, fractions={"us-east": {region: 1.0}})
    return Plan(deployments={"wf-model/embed": placement}, cost=2.0, solver="fake", revision=revision)


async def until(
    handle: WorkflowHandle[Any, Any], check: Callable[[ModelState], bool], timeout: float = WAIT_S
) -> ModelState:

    async def read() -> ModelState:
        state: ModelState = await handle.query("get", result_type=ModelState)
        return state

    return await poll_until(read, check, timeout_s=timeout, interval_s=0.1, what="the model's condition")


async def until_rollout(
    client: Client, set_id: str, check: Callable[[RolloutStatus], bool], timeout: float = WAIT_S
) -> RolloutStatus:
    """The `status` query of the rollout of `set_id`, once `check` holds."""
    handle = client.get_workflow_handle(rollout_workflow_id("wf-model", set_id))
    return await until_status(handle, check, timeout)


async def until_status(
    handle: WorkflowHandle[Any, Any], check: Callable[[RolloutStatus], bool], timeout: float = WAIT_S
) -> RolloutStatus:
    """A rollout workflow's `status` query, once `check` holds."""

    async def read() -> RolloutStatus | None:
        try:
            # Before this test's rollout starts, the id names an earlier test's closed run, whose
            # worker is gone: its query would wait for a worker, so cut it short and ask again.
            status: RolloutStatus = await handle.query(
                "status", result_type=RolloutStatus, rpc_timeout=timedelta(seconds=1)
            )
        except RPCError:  # not started yet, or that earlier run
            return None
        return status

    found = await poll_until(
        read,
        lambda s: s is not None and check(s),
        timeout_s=timeout,
        interval_s=0.05,
        what="the rollout's condition",
    )
    assert found is not None
    return found


async def until_reads(
    fake: FakeServing, count: int, what: str, routes: int | None = None, timeout: float = WAIT_S
) -> None:
    """Once the fake has served `count` metrics reads in all. A workflow schedules its next read
    only after it judged the one before, so `count` reads mean `count - 1` checks judged. With
    `routes` (the route calls so far), sooner if another route call came: the hold broke, and
    the test's assertions say so at once."""

    async def reads() -> int:
        return fake.reads

    def done(n: int) -> bool:
        return n >= count or (routes is not None and len(fake.routes) > routes)

    await poll_until(reads, done, timeout_s=timeout, interval_s=0.02, what=what)


def checks_in(seconds: float, interval_seconds: float) -> int:
    """How many checks every `interval_seconds` take at least `seconds` (each waits its interval)."""
    return math.ceil(seconds / interval_seconds)


# Events a workflow task's commands may add that start nothing: after them, nothing is due.
_STARTS_NOTHING = {
    "upsert_workflow_search_attributes_event_attributes",
    "workflow_properties_modified_event_attributes",
    "marker_recorded_event_attributes",
}
_CLOSED = {
    "workflow_execution_completed_event_attributes",
    "workflow_execution_failed_event_attributes",
    "workflow_execution_canceled_event_attributes",
    "workflow_execution_terminated_event_attributes",
    "workflow_execution_timed_out_event_attributes",
    "workflow_execution_continued_as_new_event_attributes",
}


async def until_idle(handle: WorkflowHandle[Any, Any], timeout: float = WAIT_S) -> None:
    """Once the workflow's last task started nothing (no activity, timer or child) and no task is
    due: nothing of it moves until an event from outside comes (a signal, an update, a child's
    end). Or once it closed: the test's own assertions then say what moved."""

    async def tail() -> list[str]:
        names = [e.WhichOneof("attributes") or "" for e in (await handle.fetch_history()).events]
        completed = [i for i, name in enumerate(names) if name == "workflow_task_completed_event_attributes"]
        return names[completed[-1] + 1 :] if completed else names

    await poll_until(
        tail,
        lambda after: set(after) <= _STARTS_NOTHING or bool(_CLOSED & set(after)),
        timeout_s=timeout,
        interval_s=0.05,
        what="the workflow idle, nothing of its own due",
    )


async def start(
    client: Client, fake: FakeServing, spec: ModelSpec = SPEC, **input: Any
) -> tuple[Worker, WorkflowHandle[Any, Any]]:
    """A worker of the real workflows with `fake`'s activities (and the real `rollout_outcome`,
    which only asks Temporal), and a ModelWorkflow of `spec` (`input`: more of its input)."""
    queue = f"wf-{uuid.uuid4().hex[:8]}"
    outcomes = RolloutActivities(client)
    activities = [*fake.activities(), outcomes.rollout_outcome, outcomes.experiment_outcome]
    worker = Worker(client, task_queue=queue, workflows=WORKFLOWS, activities=activities)
    handle = await client.start_workflow(
        "ModelWorkflow",
        ModelWorkflowInput(spec=spec, **input),
        id=f"model/wf-{uuid.uuid4().hex[:8]}",
        task_queue=queue,
    )
    return worker, handle
