"""The Python SDK: `Client` for the lifecycle (publish, rollouts, on-call), backed by Temporal,
and `PredictionClient` / `AsyncPredictionClient` for predictions, which need only the serving URL.

    async with await Client.connect() as ipn:
        await ipn.publish_model(load_model_spec("model.yaml"))
        result = await ipn.publish_snapshot("feed-ranker", Path("snapshots/feed-ranker/v1"))
        await ipn.wait_until_serving("feed-ranker", result.set_id)

    with PredictionClient("http://127.0.0.1:8000") as serving:  # no Temporal
        reply = serving.predict("feed-ranker", {"user": 3, "items": [1, 2]}, source="us-east")

`Client.predict` / `predict_stream` still work: they go through its AsyncPredictionClient.
Errors are ipnext errors (ipnext.errors), translated from Temporal and HTTP at this boundary.

One file over 600 lines on purpose: `Client` is the public surface the README documents, one
method per verb with the translation of Temporal's errors at this boundary; the prediction
clients themselves live in ipnext.client.prediction and are only re-exported here.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict
from temporalio.client import (
    Client as TemporalClient,
)
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from ipnext.client import rollout_wait
from ipnext.client.fleet import fleet_status, mark_region, region_change
from ipnext.client.prediction import AsyncPredictionClient, Prediction, PredictionClient
from ipnext.client.rollout_wait import paused_error, progress_line
from ipnext.client.temporal import connect_client, from_temporal, stuck_reason, temporal_errors
from ipnext.contracts.experiment import (
    ExperimentStarted,
    ExperimentStatus,
    PromoteInput,
    StartExperimentInput,
    StopExperimentInput,
)
from ipnext.contracts.fleet import FleetStatus, RegionChangeResult, RegionDownInput, RegionUpInput
from ipnext.contracts.freeze import FreezeOverride
from ipnext.contracts.identity import default_identity
from ipnext.contracts.model import (
    DeleteInput,
    DeleteResult,
    ModelRecord,
    ModelState,
    ModelWorkflowInput,
    OlderSets,
    PublishInput,
    PublishResult,
    ReconcileRecord,
    UpdateModelInput,
    UpdateModelResult,
    ValidateSpecInput,
)
from ipnext.contracts.rollout import (
    AbortInput,
    PauseInput,
    ResumeInput,
    RolloutStatus,
)
from ipnext.contracts.routing import RoutingDocument
from ipnext.errors import (
    IpnextError,
    ModelExistsError,
    ModelNotFoundError,
    RolloutPausedError,
    RolloutStoppedError,
    ServingError,
)
from ipnext.names import (
    MODEL_KEY,
    STATE_KEY,
    ExperimentWorkflowNames,
    ModelWorkflowNames,
    RolloutWorkflowNames,
    Workflows,
    model_name_of,
    model_workflow_id,
    validate_workflow_id,
)
from ipnext.policy.demand import ModelDemand, model_demand
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSetRequest, check_against_fleet
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.snapshots import request_from_folder

__all__ = [
    "AsyncPredictionClient",
    "Client",
    "Freshness",
    "ModelSummary",
    "Prediction",
    "PredictionClient",
    "RolloutPausedError",
    "RolloutStoppedError",
    "RoutingDocument",
    "paused_error",
    "progress_line",
]

# How long publish waits for the worker to check a spec (its factory check alone may take 60 s).
SPEC_CHECK_TIMEOUT = timedelta(minutes=3)
# A rollout's `status` answers in milliseconds; one whose task keeps failing never does (the
# server holds the query): past this, the model's record of it is shown, marked as such.
QUERY_TIMEOUT = timedelta(seconds=10)
# The worker's answer to a query whose workflow activation ran past the SDK's deadlock limit
# (temporalio's "[TMPRL1101] Potential deadlock detected"): transient, asked again (_query_state).
DEADLOCK_CODE = "TMPRL1101"
QUERY_DEADLOCK_RETRIES = 3
QUERY_DEADLOCK_PAUSE_S = 1.0


class ModelSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    state: str
    workflow_id: str


class Freshness(BaseModel):
    """How old a workflow's answer is: `as_of` is the workflow time of its last change (set by
    the workflow itself), `stale` why it may no longer be the truth ('' when nothing says so):
    a workflow whose task keeps failing answers queries from its last good state, unchanged."""

    model_config = ConfigDict(frozen=True)
    workflow_id: str
    as_of: datetime | None
    age_seconds: float | None  # None: the answer carries no time (recorded before it did)
    stale: str = ""

    def describe(self) -> str:
        if self.as_of is None or self.age_seconds is None:
            age = "as of an unknown time (recorded before statuses carried one)"
        else:
            age = f"as of {self.age_seconds:.0f} s ago ({self.as_of:%Y-%m-%d %H:%M:%S} UTC)"
        return f"{self.workflow_id}: {age}" + (f"; MAY BE STALE: {self.stale}" if self.stale else "")


class Client:
    """The control client: models, snapshots, rollouts, over Temporal. Its `predict` and
    `predict_stream` go through `predictions`, an AsyncPredictionClient (no Temporal call)."""

    def __init__(self, temporal: TemporalClient, settings: Settings) -> None:
        self.temporal = temporal
        self.settings = settings
        self.predictions = AsyncPredictionClient.from_settings(settings)

    @classmethod
    async def connect(cls, settings: Settings | None = None, identity: str | None = None) -> Client:
        """Connect with the settings' Temporal TLS and API key. `identity` (default
        `temporal.identity`, else <OS user>@<host>) travels in the `ipnext-identity` header of
        every signal, update and start, and workflows record it beside `who`. Raises
        TemporalConnectionError when Temporal refuses or does not answer."""
        settings = settings or load_settings()
        who_connects = identity or settings.temporal.identity or default_identity()
        temporal = await connect_client(settings, identity=who_connects)
        return cls(temporal, settings)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.predictions.aclose()

    # ---- models --------------------------------------------------------------------------

    async def publish_model(self, spec: ModelSpec, history_limit: int | None = None) -> ModelState:
        """Register a model. It is checked against this client's fleet file first, before any
        workflow starts (names, and traffic no plan could serve), then by the worker (against its
        fleet, and its factories imported in a child process: this machine never imports the
        model's code), so a bad spec creates nothing and its name stays free. Without a fleet
        file here, the worker's check alone runs (still before the model's workflow).
        `history_limit`: events per run of the model's workflow and its rollouts before they
        continue as new (default 10,000; drills set it low)."""
        if self.settings.fleet_file.is_file():
            check_against_fleet(spec, self.settings.fleet())
        await self._check_on_worker(spec)
        input = ModelWorkflowInput(spec=spec)
        if history_limit is not None:
            input = ModelWorkflowInput(spec=spec, history_limit=history_limit)
        try:
            handle = await self._start_model(input, f"model {spec.name} (owner {spec.owner})")
        except WorkflowAlreadyStartedError:
            raise ModelExistsError(
                f"model {spec.name!r} already exists.",
                field="name",
                value=spec.name,
                fix="publish snapshots to it, or delete it first to change its spec",
            ) from None
        return await self._query_state(model_name_of(handle.id))

    async def _check_on_worker(self, spec: ModelSpec) -> None:
        try:
            await self.temporal.execute_workflow(
                Workflows.VALIDATE_MODEL,
                ValidateSpecInput(spec=spec),
                id=validate_workflow_id(spec.name, uuid.uuid4().hex),
                task_queue=self.settings.temporal.task_queue,
                execution_timeout=SPEC_CHECK_TIMEOUT,
                static_summary=f"check model {spec.name}'s spec and factories",
            )
        except WorkflowFailureError as err:
            if isinstance(err.cause, TimeoutError) or "timed out" in str(err.cause).lower():
                raise IpnextError(
                    f"model {spec.name}: no worker checked the spec within {SPEC_CHECK_TIMEOUT}.",
                    fix=f"start the worker on task queue {self.settings.temporal.task_queue!r} "
                    "(`ipnext dev up` does)",
                ) from None
            raise from_temporal(err) from None

    async def get_model(self, name: str) -> ModelState:
        return await self._query_state(name)

    async def list_models(self) -> list[ModelSummary]:
        """Running models, from Temporal visibility (which lags writes by a moment)."""
        found = []
        async for execution in self.temporal.list_workflows(
            f'WorkflowType = "{Workflows.MODEL}" AND ExecutionStatus = "Running"'
        ):
            attrs = execution.typed_search_attributes
            found.append(
                ModelSummary(
                    name=attrs.get(MODEL_KEY) or model_name_of(execution.id),
                    state=attrs.get(STATE_KEY) or "unknown",
                    workflow_id=execution.id,
                )
            )
        return sorted(found, key=lambda m: m.name)

    async def list_orphans(self) -> list[ModelSummary]:
        """Models whose workflow ended without a delete (terminated or cancelled from the
        Temporal UI, failed, timed out): nothing tore their apps down, so they keep serving,
        but nothing manages them. `adopt_model` registers one again. `state` says how it ended."""
        ended = " OR ".join(f'ExecutionStatus = "{s}"' for s in _ORPHANING)
        orphans: dict[str, ModelSummary] = {}
        async for execution in self.temporal.list_workflows(
            f'WorkflowType = "{Workflows.MODEL}" AND ({ended})'
        ):
            if execution.id in orphans:
                continue
            latest = await self.temporal.get_workflow_handle(execution.id).describe()
            if latest.status is not None and latest.status.name.lower() in _ORPHANING_NAMES:
                name = model_name_of(execution.id)
                orphans[execution.id] = ModelSummary(
                    name=name, state=f"orphan ({latest.status.name.lower()})", workflow_id=execution.id
                )
        return sorted(orphans.values(), key=lambda m: m.name)

    async def adopt_model(self, name: str) -> ModelState:
        """Register again a model whose workflow ended without a delete: the ended run's last
        record (read by a query, which replays its history) becomes a new run's, so its sets,
        queue, what serves, its placement and its router generations carry on, and a rollout it
        had started is waited for and recorded; the new run's serving check then makes Serve
        match the record. (A replanned placement not yet applied is dropped: the next replan
        sends it again.)"""
        handle, status = await self._model_workflow(name)
        if status == WorkflowExecutionStatus.RUNNING:
            raise ModelExistsError(
                f"model {name!r} is registered (its workflow runs): nothing to adopt.",
                field="name",
                value=name,
                fix="`ipnext model get` shows it",
            )
        if status == WorkflowExecutionStatus.COMPLETED:
            raise ModelNotFoundError(
                f"model {name!r} was deleted (its apps were torn down): nothing to adopt.",
                field="name",
                value=name,
                fix="publish it again with `ipnext model publish`",
            )
        try:
            last = await handle.query(ModelWorkflowNames.GET, result_type=ModelState)
        except WorkflowQueryFailedError as err:
            raise ServingError(f"model {name}: its ended run could not be read: {err}") from None
        ended = status.name.lower() if status is not None else "ended"
        record = ModelRecord(
            sets=list(last.sets),
            serving_set=last.serving_set,
            serving_apps=dict(last.serving_apps),
            plan=last.plan,
            queued=list(last.queued),
            next_number=max((s.number for s in last.sets), default=0) + 1,
            rollout=last.rollout,
            reconcile=last.reconcile or ReconcileRecord(),
            # A rollout the ended run had started runs on (it was abandoned, not terminated): the
            # new run waits for it as any continued run does, and records how it ends.
            active_rollout=last.active_rollout,
            older_sets=last.older_sets or OlderSets(),
        )
        await self._start_model(
            ModelWorkflowInput(spec=last.spec, record=record),
            f"model {name} (owner {last.spec.owner}), adopted after its workflow {ended}",
        )
        return await self.get_model(name)

    async def delete_model(self, name: str, who: str = "sdk") -> DeleteResult:
        handle = await self._running_model(name)
        with temporal_errors():
            result: DeleteResult = await handle.execute_update(
                ModelWorkflowNames.DELETE, DeleteInput(who=who), result_type=DeleteResult
            )
        with temporal_errors():
            await handle.result()
        return result

    async def update_model(
        self,
        spec: ModelSpec,
        who: str = "sdk",
        snapshots: Path | dict[str, SnapshotRef] | None = None,
    ) -> UpdateModelResult:
        """Change a model's spec. The worker checks it as at publish (fleet, factories), then it
        applies the lightest way it can: in place (gates, rollout and router settings, choices,
        batching), a capacity move (traffic, latency budget, availability), or a new set of the
        serving snapshots under the new spec, rolled out as usual (parts, factories, hardware, the
        DAG). `snapshots` (a folder with a manifest, or part -> ref) brings snapshots for parts the
        update adds or changes. A refused update changes nothing."""
        if self.settings.fleet_file.is_file():
            check_against_fleet(spec, self.settings.fleet())
        refs = request_from_folder(snapshots).parts if isinstance(snapshots, Path) else dict(snapshots or {})
        handle = await self._running_model(spec.name)
        with temporal_errors():
            result: UpdateModelResult = await handle.execute_update(
                ModelWorkflowNames.UPDATE,
                UpdateModelInput(spec=spec, who=who, snapshots=refs),
                result_type=UpdateModelResult,
            )
        return result

    # ---- experiments ---------------------------------------------------------------------

    async def start_experiment(self, name: str, input: StartExperimentInput) -> ExperimentStarted:
        """Run an experiment on model `name`: its serving set against `input.treatment` (a set
        published with hold) for `input.duration_seconds`; refused with the reason while the model
        is busy. It ends by itself; `experiment_status` follows it, `stop_experiment` ends it."""
        handle = await self._running_model(name)
        with temporal_errors():
            started: ExperimentStarted = await handle.execute_update(
                ModelWorkflowNames.START_EXPERIMENT, input, result_type=ExperimentStarted
            )
        return started

    async def start_shadow(
        self, name: str, candidate: str, percent: float, shadow: str | None = None, **options: Any
    ) -> ExperimentStarted:
        """Copy `percent` of model `name`'s requests to `candidate` (a held set) after answering
        them and compare the answers: an experiment in shadow mode named `shadow` (default
        shadow-<the set's number>); `options`: StartExperimentInput's, duration_seconds required."""
        called = shadow or f"shadow-{candidate.rpartition('@')[2]}"
        shadow_input = StartExperimentInput(
            name=called, treatment=candidate, treatment_percent=percent, mode="shadow", **options
        )
        return await self.start_experiment(name, shadow_input)

    async def experiment_status(self, name: str, experiment: str | None = None) -> ExperimentStatus:
        """The model's running experiment, live (with its report so far), or an ended one from
        the model's record; `experiment`: its name (default: the running one, else the latest)."""
        state = await self.get_model(name)
        running = state.experiment
        if running is not None and experiment in (None, running.name):
            if not running.started:  # asked for, the model starts it on its next pass
                return running.status(name, "starting")
            handle = self.temporal.get_workflow_handle(running.workflow_id)
            try:
                live: ExperimentStatus = await handle.query(
                    ExperimentWorkflowNames.STATUS, result_type=ExperimentStatus
                )
            except (WorkflowQueryFailedError, RPCError) as err:
                raise ServingError(f"experiment {running.name} of {name} did not answer: {err}") from None
            return live
        ended = [e for e in state.experiments if experiment in (None, e.name)]
        if not ended:
            raise IpnextError(
                f"model {name} has no experiment{' named ' + repr(experiment) if experiment else ''}.",
                fix=f"start one with `ipnext experiment start {name} --treatment <held set> --duration 1d`",
            )
        return ended[-1]

    async def stop_experiment(self, name: str, reason: str, who: str = "sdk") -> ExperimentStatus:
        """End the model's running experiment now: all traffic back to control; its report so far."""
        state = await self.get_model(name)
        if state.experiment is None or not state.experiment.started:
            raise IpnextError(f"model {name} runs no experiment to stop.")
        handle = self.temporal.get_workflow_handle(state.experiment.workflow_id)
        await handle.signal(ExperimentWorkflowNames.STOP, StopExperimentInput(who=who, reason=reason))
        return await self.experiment_status(name, state.experiment.name)

    async def promote_experiment(
        self, name: str, experiment: str | None = None, who: str = "sdk"
    ) -> PublishResult:
        """Roll an ended experiment's winning treatment out through the normal gradual rollout;
        refused when its report names no winner over control (nothing to roll out). A shadow has
        no winner: its candidate is promoted on its evidence once it ended (the gates judge it)."""
        ended = await self.experiment_status(name, experiment)
        winner = ended.report.winner if ended.report is not None else None
        if ended.mode == "shadow":
            winner = "treatment"
        if ended.phase != "ended" or winner != "treatment":
            said = (
                "it has not ended" if ended.phase != "ended" else f"its report's winner is {winner or 'none'}"
            )
            raise IpnextError(
                f"experiment {ended.name} of {name}: nothing promoted: {said}.",
                fix="promote a set by hand when you know better: publish it again without --hold",
            )
        handle = await self._running_model(name)
        why = f"{'after shadow' if ended.mode == 'shadow' else 'won experiment'} {ended.name}"
        ask = PromoteInput(set_id=ended.arms["treatment"], who=who, reason=why)
        with temporal_errors():
            result: PublishResult = await handle.execute_update(
                ModelWorkflowNames.PROMOTE, ask, result_type=PublishResult
            )
        return result

    # ---- snapshots -----------------------------------------------------------------------

    async def publish_snapshot(
        self,
        name: str,
        snapshot: Path | SnapshotSetRequest,
        who: str = "sdk",
        freeze_override: FreezeOverride | None = None,
        hold: bool = False,
    ) -> PublishResult:
        """Publish a snapshot set (a folder with a manifest, or a request); it is validated before
        anything changes. `freeze_override` lets its rollout start inside a freeze window; `hold`
        keeps the set validated without rolling it out (status `held`), for an experiment or a
        shadow to take."""
        request = request_from_folder(snapshot) if isinstance(snapshot, Path) else snapshot
        handle = await self._running_model(name)
        with temporal_errors():
            return await handle.execute_update(
                ModelWorkflowNames.PUBLISH,
                PublishInput(request=request, who=who, freeze_override=freeze_override, hold=hold),
                result_type=PublishResult,
            )

    async def wait_until_serving(
        self,
        name: str,
        set_id: str,
        timeout_s: float = 300.0,
        *,
        on_progress: Callable[[RolloutStatus], object] | None = None,
        stop_on_pause: bool = True,
        through_traffic_pause: bool = False,
        heartbeat_s: float | None = None,
    ) -> ModelState:
        """Wait until `set_id` serves, and return the model's state then.

        Raises, as soon as it is known: `RolloutPausedError` when the set's rollout pauses (by
        on-call, by ipnext for too little traffic, for a freeze window), or the one it is queued
        behind does: the rollout stays paused, and the error's `fix` says how it goes on
        (`stop_on_pause=False` waits through pauses; `through_traffic_pause=True` waits through
        ipnext's own pauses that end by themselves, for too little traffic or a freeze window,
        and still stops on one that needs a person); `RolloutStoppedError` when it ends without
        the set serving (rolled back, aborted, failed, refused, superseded; its detail says
        why); `ServingError` when `timeout_s` runs out (naming where the rollout is).
        `on_progress` is called with the running rollout's status (the set's own, or the one it
        is queued behind) each time its state, step or split changes, and every `heartbeat_s`
        when set (`ipnext.client.rollout_wait`)."""
        return await rollout_wait.wait_until_serving(
            self,
            name,
            set_id,
            timeout_s,
            on_progress=on_progress,
            stop_on_pause=stop_on_pause,
            through_traffic_pause=through_traffic_pause,
            heartbeat_s=heartbeat_s,
        )

    async def rollout_status(self, name: str) -> RolloutStatus | None:
        """The model's latest rollout: live from the RolloutWorkflow while it runs."""
        state = await self.get_model(name)
        last = state.rollout
        if last is None or state.state != "rolling_out" or not last.workflow_id:
            return last
        try:
            # Bounded: a query waits for a worker, and a caller that waits (wait_until_serving)
            # must keep its own deadline while none answers.
            live: RolloutStatus = await self.temporal.get_workflow_handle(last.workflow_id).query(
                RolloutWorkflowNames.STATUS, result_type=RolloutStatus, rpc_timeout=QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError) as err:
            # Between the model's record and the child's first task, or a rollout whose task
            # fails (its query then times out): the model's record of it, saying so.
            why = err.message if isinstance(err, RPCError) else str(err)
            note = f"(the rollout's own status could not be read: {why}; this is the model's record of it)"
            return last.model_copy(update={"detail": f"{last.detail} {note}".strip()})
        return live

    async def freshness(self, workflow_id: str, as_of: datetime | None) -> Freshness:
        """How old an answer of `workflow_id` stamped `as_of` is, and whether its workflow is
        stuck (`temporal.stuck_reason`): then every query answers its last good state."""
        stale = await stuck_reason(self.temporal, workflow_id)
        age = None if as_of is None else max(0.0, (datetime.now(UTC) - as_of).total_seconds())
        return Freshness(workflow_id=workflow_id, as_of=as_of, age_seconds=age, stale=stale)

    async def pause_rollout(self, name: str, reason: str, who: str = "sdk") -> RolloutStatus:
        """Hold the running rollout at its current split (gates still roll it back)."""
        return await self._signal_rollout(
            name, RolloutWorkflowNames.PAUSE, PauseInput(reason=reason, who=who)
        )

    async def resume_rollout(self, name: str, who: str = "sdk") -> RolloutStatus:
        """Go on with a paused rollout; the bake of its current step starts again."""
        return await self._signal_rollout(name, RolloutWorkflowNames.RESUME, ResumeInput(who=who))

    async def abort_rollout(self, name: str, reason: str, who: str = "sdk") -> RolloutStatus:
        """Roll the running rollout back to the previous set; it ends `aborted`."""
        return await self._signal_rollout(
            name, RolloutWorkflowNames.ABORT, AbortInput(reason=reason, who=who)
        )

    async def override_freeze(self, name: str, reason: str, who: str) -> RolloutStatus:
        """Let the running rollout go on through a freeze window (who and why stay in its history)."""
        return await self._signal_rollout(
            name, RolloutWorkflowNames.OVERRIDE_FREEZE, FreezeOverride(reason=reason, who=who)
        )

    async def _signal_rollout(self, name: str, signal: str, arg: BaseModel) -> RolloutStatus:
        status = await self.rollout_status(name)
        if status is None or not status.state.is_live:
            raise ServingError(
                f"model {name} has no rollout running"
                + (f" (the last one, {status.workflow_id}, is {status.state.value})" if status else ""),
                fix="check `ipnext rollout status " + name + "`",
            )
        handle = self.temporal.get_workflow_handle(status.workflow_id)
        await handle.signal(signal, arg)
        return status

    # ---- predictions (no Temporal call: see AsyncPredictionClient) -----------------------

    async def predict(self, name: str, inputs: Any, **where: str | None) -> Prediction:
        """`AsyncPredictionClient.predict` (keywords `source`, `region`, `key`, `unit`): POST to the
        serving region the model's routing document picks for `source`."""
        return await self.predictions.predict(name, inputs, **where)

    def predict_stream(self, name: str, inputs: Any, **where: str | None) -> AsyncIterator[Prediction]:
        """`AsyncPredictionClient.predict_stream` (same keywords): the answer piece by piece."""
        return self.predictions.predict_stream(name, inputs, **where)

    async def feedback(
        self, name: str, answer: Prediction | str, outcome: dict[str, float], region: str | None = None
    ) -> dict[str, Any]:
        """`AsyncPredictionClient.feedback`: what came of an answer given in an experiment."""
        return await self.predictions.feedback(name, answer, outcome, region=region)

    async def model_demand(self, name: str, window_seconds: float = 60.0) -> ModelDemand:
        """The model's declared demand (`traffic.peak_qps`) against what its callers sent, per
        source, over windows of `window_seconds`, summed over every region that serves it."""
        state = await self.get_model(name)
        regions = sorted(set(state.serving_apps) | set(state.spec.traffic.peak_qps))
        reports = {}
        for region in regions:
            report = await self.predictions.demand(name, region, window_seconds)
            if report is not None:
                reports[region] = report
        return model_demand(name, dict(state.spec.traffic.peak_qps), reports, time.time(), window_seconds)

    # ---- regions (the `fleet` workflow) --------------------------------------------------

    async def region_down(self, region: str, reason: str, who: str) -> RegionChangeResult:
        """Take `region` out of service until `region_up`: its callers go to surviving regions at
        once and an emergency replan plans without it (`.replan` names that workflow). A refusal
        (unknown region, empty `who` or `reason`, the last region up) raises RegionStateError;
        nothing changed."""
        change = region_change(RegionDownInput, region=region, reason=reason, who=who)
        return await mark_region(self.temporal, change)

    async def region_up(self, region: str, who: str, reason: str = "") -> RegionChangeResult:
        """End a region's outage: a normal replan (`.replan`) moves capacity back."""
        return await mark_region(
            self.temporal, region_change(RegionUpInput, region=region, who=who, reason=reason)
        )

    async def fleet_regions(self) -> FleetStatus:
        """Every region's state, the replans their changes caused, and the recent changes."""
        return await fleet_status(self.temporal)

    # ---- helpers -------------------------------------------------------------------------

    async def _model_workflow(self, name: str) -> tuple[Any, WorkflowExecutionStatus | None]:
        """The handle of `model/<name>` (its latest run) and that run's status; a model never
        registered raises ModelNotFoundError."""
        handle = self.temporal.get_workflow_handle(model_workflow_id(name))
        try:
            description = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise _not_found(name) from None
            raise
        return handle, description.status

    async def _running_model(self, name: str) -> Any:
        handle, status = await self._model_workflow(name)
        if status != WorkflowExecutionStatus.RUNNING:
            raise _not_found(name)
        return handle

    async def _start_model(self, input: ModelWorkflowInput, summary: str) -> Any:
        """Start `model/<name>` with `input` (a new model, or an adopted record)."""
        record = input.record
        return await self.temporal.start_workflow(
            Workflows.MODEL,
            input,
            id=model_workflow_id(input.spec.name),
            task_queue=self.settings.temporal.task_queue,
            id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
            id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
            search_attributes=TypedSearchAttributes(
                [
                    SearchAttributePair(MODEL_KEY, input.spec.name),
                    SearchAttributePair(STATE_KEY, "serving" if record.serving_set else "empty"),
                ]
            ),
            static_summary=summary,
        )

    async def _query_state(self, name: str) -> ModelState:
        """The model's state by query. A query the worker answered with its deadlock detector's
        error (a workflow activation that held its thread over the SDK's fixed 2 s: the worker's
        process busy on a loaded machine, its sync activities holding the GIL) is asked again,
        QUERY_DEADLOCK_RETRIES times, QUERY_DEADLOCK_PAUSE_S apart: the worker retries that task
        itself, so the next answer is usually the state. CI once failed a drill's wait on one
        such answer. Any other failure, or that one again after the retries, is a ServingError."""
        handle = await self._running_model(name)
        for attempt in range(QUERY_DEADLOCK_RETRIES + 1):
            try:
                return await handle.query(ModelWorkflowNames.GET, result_type=ModelState)
            except WorkflowQueryFailedError as err:
                if DEADLOCK_CODE not in str(err) or attempt == QUERY_DEADLOCK_RETRIES:
                    raise ServingError(f"model {name}: query failed: {err}") from None
                await asyncio.sleep(QUERY_DEADLOCK_PAUSE_S)
        raise AssertionError("unreachable")  # the loop returns or raises


# How a model workflow may end without a delete (its apps then keep serving, unmanaged).
_ORPHANING = ("Terminated", "Canceled", "Failed", "TimedOut")
_ORPHANING_NAMES = {"terminated", "canceled", "failed", "timed_out"}


def _not_found(name: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {name!r} is not registered.",
        field="name",
        value=name,
        fix="check `ipnext model list`",
    )
