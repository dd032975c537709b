"""Inputs, results and state of the lifecycle workflows (ModelWorkflow, RolloutWorkflow, the watcher).

Each workflow, update, signal and activity takes one of these and returns one, so
fields can be added later without breaking callers or running histories. Each long-lived
workflow keeps its state in one mutable model (`ModelRecord`, `RolloutProgress`) that its
input carries whole when it continues as new.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ipnext.contracts import Frozen, ModelStatus, RolloutOutcome, SetStatus
from ipnext.counters import SetCounters
from ipnext.experiments import ExperimentReport
from ipnext.model import ModelSpec, SnapshotRef, SnapshotSet, SnapshotSetRequest
from ipnext.plan import Plan
from ipnext.rollout import (
    AbortInput,
    FreezeOverride,
    GateReading,
    PauseRecord,
    RolloutState,
    RolloutStatus,
    RouterConfig,
)
from ipnext.shadow import ShadowSummary

__all__ = [
    "ActiveExperiment",
    "ActiveRollout",
    "ApplyPlanInput",
    "ArmsMoved",
    "DeleteInput",
    "DeleteResult",
    "ExperimentInput",
    "ExperimentStarted",
    "ExperimentState",
    "ExperimentStatus",
    "ModelRecord",
    "ModelState",
    "ModelWorkflowInput",
    "ModelWorkflowResult",
    "MoveArmsInput",
    "OlderSets",
    "PromoteInput",
    "PublishInput",
    "PublishResult",
    "ReconcileRecord",
    "RolloutEnded",
    "RolloutInput",
    "RolloutProgress",
    "RolloutResult",
    "SpecChange",
    "SpecPending",
    "StartExperimentInput",
    "StopExperimentInput",
    "UpdateModelInput",
    "UpdateModelResult",
    "ValidateSpecInput",
    "WatchInput",
    "WatchResult",
]


class ApplyPlanInput(Frozen):
    """A new placement for the model from a fleet replan (signal `apply_plan`)."""

    plan: Plan
    fleet_revision: int
    # Regions down when it was planned (planned without them): the move leaves them alone.
    down_regions: list[str] = Field(default_factory=list)
    # What asked for it when not a fleet replan (fleet_revision 0): "model update 3 by alice".
    cause: str = ""
    # Which try of this move (a capacity move that failed is tried again: ModelWorkflow).
    attempt: int = 1


class ReconcileRecord(Frozen):
    """What the model's serving checks found: Serve made to serve what the record says
    (activities/reconcile.py). A repair is a check that found Serve differing and pushed the
    record's state again; a failure is a check that could not run (Ray or the writer down)."""

    checks: int = 0
    repairs: int = 0
    failures: int = 0
    last_repair: str = ""  # what the latest repair pushed again, and why
    last_repair_at: datetime | None = None
    last_failure: str = ""
    interval_seconds: float = 30.0  # the worker's `serve.reconcile_seconds`, learned at each check
    generation_floor: int = 0  # the highest router generation applied that the record saw


class ActiveRollout(Frozen):
    """A rollout child the model started and has not seen end: what the model needs to record
    its outcome, carried across the model's continue-as-new (the child outlives the run that
    started it: ParentClosePolicy.ABANDON)."""

    workflow_id: str
    kind: str = "snapshots"  # "snapshots": a new set; "capacity": the serving set to `new_plan`
    new_set: str
    old_set: str | None = None
    old_plan: Plan | None = None  # snapshots: the placement the old apps run on
    new_plan: Plan | None = None  # capacity: the placement moved to
    move: ApplyPlanInput | None = None  # capacity: the move carried out (tried again if it fails)
    # snapshots: the fleet replan the new set came up on; if the set does not serve, the
    # serving set moves to it instead (a replan is never lost with a failed rollout)
    replanned: ApplyPlanInput | None = None
    detail: str = ""


class OlderSets(Frozen):
    """The sets a model no longer keeps whole (past `sets_kept`, none serving or in flight):
    how many, by how they ended, and their versions (a version is never published twice)."""

    count: int = 0
    by_status: dict[str, int] = Field(default_factory=dict)
    versions: list[str] = Field(default_factory=list)


class SpecChange(Frozen):
    """One accepted update of the model's spec: who, when, what changed and how it applied."""

    number: int  # 1, 2, ... per model
    at: datetime
    who: str
    kind: str  # ipnext.spec_update.UpdateKind
    changes: list[str]  # "rollout.bake_seconds: 60 -> 5", one per changed field
    # "applied in place", "capacity move to placement revision 3", "rolling out as m@4",
    # "applied: m@4 serves", "rolled back: ..." (a new set's update ends with its rollout)
    outcome: str


class SpecPending(Frozen):
    """An update that changes parts or the DAG: its spec serves once its set does."""

    spec: ModelSpec
    set_id: str
    change: int  # its SpecChange number


class ModelRecord(BaseModel):
    """A ModelWorkflow's state, and whole its continue-as-new payload: the model's sets, what
    serves, its placement, the queue. (What only a running handler holds, a delete or a
    publish in flight, never crosses a continue-as-new: the run continues only when idle.)"""

    model_config = ConfigDict(extra="forbid")

    sets: list[SnapshotSet] = Field(default_factory=list)
    serving_set: str | None = None
    serving_apps: dict[str, str] = Field(default_factory=dict)  # region -> set app
    plan: Plan | None = None
    queued: list[str] = Field(default_factory=list)
    next_number: int = 1
    pending_plan: ApplyPlanInput | None = None
    freeze_overrides: dict[str, FreezeOverride] = Field(default_factory=dict)  # queued set id -> override
    rollout: RolloutStatus | None = None  # the latest rollout's summary
    reconcile: ReconcileRecord = Field(default_factory=ReconcileRecord)
    active_rollout: ActiveRollout | None = None
    older_sets: OlderSets = Field(default_factory=OlderSets)
    updated_at: datetime | None = None  # workflow time of the last pass of the model's loop
    spec_changes: list[SpecChange] = Field(default_factory=list)  # the latest SPEC_CHANGES_KEPT
    spec_pending: SpecPending | None = None
    experiment: ActiveExperiment | None = None  # asked for or running: rollouts and checks wait
    experiments: list[ExperimentStatus] = Field(default_factory=list)  # ended ones, newest last

    def trim_sets(self, kept: int) -> None:
        """Keep at most `kept` sets whole: the oldest ones that neither serve, wait in the
        queue nor take part in a rollout are summarized in `older_sets`."""
        excess = len(self.sets) - kept
        if excess <= 0:
            return
        active = self.active_rollout
        busy = {self.serving_set, *self.queued, *((active.new_set, active.old_set) if active else ())}
        busy |= {s.id for s in self.sets if s.status == SetStatus.HELD}  # an experiment may take it
        dropped = [s for s in self.sets if s.id not in busy][:excess]
        if not dropped:
            return
        older = self.older_sets
        by_status = dict(older.by_status)
        for s in dropped:
            by_status[s.status] = by_status.get(s.status, 0) + 1
        self.older_sets = OlderSets(
            count=older.count + len(dropped),
            by_status=by_status,
            versions=[*older.versions, *(s.version for s in dropped)],
        )
        gone = {s.id for s in dropped}
        self.sets = [s for s in self.sets if s.id not in gone]


class ModelWorkflowInput(Frozen):
    """Start a model's registry workflow (`record` empty) or continue it as new (its record)."""

    spec: ModelSpec
    record: ModelRecord = Field(default_factory=ModelRecord)
    # Continue as new once the history holds this many events (or the server suggests it),
    # also while a rollout runs.
    history_limit: int = Field(default=10_000, ge=20)
    # After continuing as new during a rollout, how often to ask Temporal whether the rollout
    # ended without its end signal (terminated or cancelled from the Temporal UI).
    rollout_check_seconds: float = Field(default=30.0, gt=0)
    # Sets kept whole in the record (and so in every continue-as-new payload); older ones are
    # summarized in `ModelRecord.older_sets`.
    sets_kept: int = Field(default=100, ge=2)


class ModelWorkflowResult(Frozen):
    model: str
    deleted_by: str
    sets: int


class PublishInput(Frozen):
    request: SnapshotSetRequest
    who: str = "unknown"
    freeze_override: FreezeOverride | None = None  # roll out even inside a freeze window
    # Validate and keep the set without rolling it out (status `held`): for an experiment's or a
    # shadow's candidate.
    hold: bool = False


class PublishResult(Frozen):
    set_id: str
    status: str  # "queued" until its rollout starts; "held" when published with hold


class DeleteInput(Frozen):
    who: str = "unknown"


class DeleteResult(Frozen):
    model: str
    removed_apps: list[str]


class UpdateModelInput(Frozen):
    """Update `update_model`: the model's whole new spec (as `model update -f` reads it)."""

    spec: ModelSpec
    who: str = "unknown"
    # Snapshots the update brings, for an update that makes a new set (parts, factories, hardware
    # or the DAG changed): required for an added part; the serving set's snapshots fill the rest.
    snapshots: dict[str, SnapshotRef] = Field(default_factory=dict)


class UpdateModelResult(Frozen):
    model: str
    kind: str  # ipnext.spec_update.UpdateKind: none, in_place, capacity, new_set
    changes: list[str]
    outcome: str  # as SpecChange.outcome; "no change" for an identical spec
    set_id: str | None = None  # new_set: the set that carries it
    plan_revision: int | None = None  # capacity: the placement moved to


class ValidateSpecInput(Frozen):
    """ValidateModelWorkflow's input: the spec the worker checks before the model is registered."""

    spec: ModelSpec


class ModelState(Frozen):
    """What `get` answers: the model's spec, its sets, what serves, the plan, the rollout."""

    spec: ModelSpec
    state: ModelStatus
    sets: list[SnapshotSet]
    serving_set: str | None
    serving_apps: dict[str, str]
    queued: list[str]
    plan: Plan | None
    rollout: RolloutStatus | None
    pending_plan: int | None = None  # revision of a replanned placement waiting to be applied
    reconcile: ReconcileRecord | None = None  # the serving checks: repairs and failures
    active_rollout: ActiveRollout | None = None  # the rollout child the model waits on
    older_sets: OlderSets | None = None  # sets no longer kept whole, summarized
    spec_changes: list[SpecChange] = Field(default_factory=list)  # updates of the spec, newest last
    spec_pending: SpecPending | None = None  # an update rolling out with its new set
    experiment: ActiveExperiment | None = None
    experiments: list[ExperimentStatus] = Field(default_factory=list)
    # Workflow time when the model workflow last looked at its record (every pass of its loop:
    # at least every serving check while idle). A reader says how old the answer is from it.
    updated_at: datetime | None = None


class RolloutProgress(BaseModel):
    """A RolloutWorkflow's state, and whole its continue-as-new payload: everything it has
    applied and seen. The fields `RolloutStatus` shows have its names."""

    model_config = ConfigDict(extra="forbid")

    state: RolloutState = RolloutState.PENDING
    step: str = "pending"
    traffic_percent: dict[str, float] = Field(default_factory=dict)  # set id -> percent
    percent: float = 0.0  # the new set's share (sync: independent: the mean over the moving parts)
    part: str | None = None  # sync: independent: the part moving now
    part_traffic: dict[str, float] = Field(default_factory=dict)  # changed part -> percent on the new set
    steps_done: int = 0
    generations: list[int] = Field(default_factory=list)
    gates: list[GateReading] = Field(default_factory=list)
    pauses: list[PauseRecord] = Field(default_factory=list)
    detail: str = ""
    freeze_override: FreezeOverride | None = None
    freeze_hold: bool = False  # paused by a freeze window: only its end or an override ends it
    abort: AbortInput | None = None
    # The `ipnext-identity` headers of the abort and override_freeze signals ("unattributed"
    # without one; None: not by a signal, or recorded before identities were read).
    abort_identity: str | None = None
    freeze_override_identity: str | None = None
    resumes: int = 0  # counts resumes: a bake restarts when it changes
    new_apps: dict[str, str] = Field(default_factory=dict)  # region -> the new set's app
    old_scales: dict[str, float] = Field(default_factory=dict)  # part -> the old set's share of its plan
    new_scales: dict[str, float] = Field(default_factory=dict)  # part -> the new set's share, as deployed
    routers: dict[str, RouterConfig] = Field(default_factory=dict)  # region -> as last routed
    repairs: int = 0  # serving checks during bakes that found Serve different and pushed it again
    last_repair: str = ""
    # Why the bake's last serving check could not run ("" once one ran): while it is set the
    # bake neither ends nor pauses for traffic (the window since holds what Serve was not
    # checked to serve), and the next check that runs starts a fresh window.
    serving_unchecked: str = ""
    # A continued run (a long bake or pause grows the history): the step it bakes again from a
    # fresh window, its scaling and weights already applied.
    continued_at: int | None = None
    # Temporal's cancellation was requested: the rollout stops as `abort` does (`abort` holds
    # who and why), and ends `cancelled`.
    cancelled: bool = False
    updated_at: datetime | None = None  # workflow time of the last change to what `status` shows


class RolloutInput(Frozen):
    spec: ModelSpec
    plan: Plan
    new_set: SnapshotSet
    old_set: SnapshotSet | None
    old_apps: dict[str, str] = Field(default_factory=dict)  # region -> set app of the old set
    # "snapshots": a new set; "capacity": the same set moved to a new plan (a fleet replan).
    kind: str = "snapshots"
    old_plan: Plan | None = None  # the placement the old apps run on (default: `plan`)
    freeze_override: FreezeOverride | None = None
    # Continue as new once the history holds this many events (or the server suggests it).
    history_limit: int = Field(default=10_000, ge=100)
    progress: RolloutProgress | None = None  # where a continued run goes on from
    # Regions down (a capacity move planned without them): their nodes are gone, so nothing of
    # theirs is deployed, routed, waited on or gated; their callers reach other regions through
    # the routing document. Their old apps are removed without waiting.
    down_regions: list[str] = Field(default_factory=list)
    # The spec the old set's apps run under, when a model update changed parts or the DAG and
    # `spec` is the new one (None: both sets run under `spec`). Such a rollout moves whole sets.
    old_spec: ModelSpec | None = None

    def spec_of_old(self) -> ModelSpec:
        return self.old_spec or self.spec


class RolloutResult(Frozen):
    """How a rollout ended. The workflow completes (Temporal's status COMPLETED) whatever
    happened; `outcome` says how, and only `completed` moved the traffic."""

    state: RolloutState
    outcome: RolloutOutcome
    apps: dict[str, str]  # region -> set app serving when the rollout ended
    generations: list[int]
    detail: str = ""
    status: RolloutStatus | None = None  # the rollout's `status` as it ended (gates, pauses, steps)

    @classmethod
    def ended_outside(cls, apps: dict[str, str], how: str) -> RolloutResult:
        """A rollout that did not end by its own rules (failed, terminated or cancelled from the
        Temporal UI): the model outlives it and says so; `apps` serve as before."""
        return cls(
            state=RolloutState.FAILED,
            outcome=RolloutOutcome.FAILED,
            apps=dict(apps),
            generations=[],
            detail=f"{how}; needs attention: traffic may still be split between the sets "
            "(`ipnext rollout status`), the new set's apps may still run",
        )

    @model_validator(mode="before")
    @classmethod
    def _outcome_of_state(cls, raw: Any) -> Any:
        """Results recorded before `outcome` existed (histories that replay) name it by state."""
        if isinstance(raw, dict) and "outcome" not in raw and "state" in raw:
            raw = {**raw, "outcome": RolloutOutcome.of(RolloutState(raw["state"]))}
        return raw


class RolloutEnded(Frozen):
    """Signal `rollout_ended`: a rollout child tells its model how it ended. It goes to the
    model's workflow id, so it reaches the model's latest run."""

    workflow_id: str
    result: RolloutResult


class WatchInput(Frozen):
    model: str


class WatchResult(Frozen):
    published: list[str]
    rejected: list[str] = Field(default_factory=list)  # why a found snapshot was refused


# ---- experiments -------------------------------------------------------------------------------


class MoveArmsInput(Frozen):
    """A replanned placement both arms of a running experiment move to (signal `move_arms`,
    from the model): new apps for each arm where the placement changed, the routers switched
    to them, the old apps removed. `move` names it in the answer (`ArmsMoved`)."""

    move: str = Field(min_length=1)
    plan: Plan
    down_regions: list[str] = Field(default_factory=list)  # their apps are removed unwaited
    cause: str = ""


class ArmsMoved(Frozen):
    """The experiment's answer to a `MoveArmsInput` (signal `arms_moved` to the model): the
    control's apps on the new placement, or why the arms stay where they were."""

    move: str
    control_apps: dict[str, str] = Field(default_factory=dict)
    error: str = ""  # empty: moved


class ExperimentState(BaseModel):
    """An ExperimentWorkflow's state, and whole its continue-as-new payload: nothing counted so far
    (each arm's totals, the last metrics read the next window starts from) is lost across it."""

    model_config = ConfigDict(extra="forbid")

    phase: str = "deploying"  # deploying, running, ending, ended
    started_at: datetime | None = None
    ends_at: datetime | None = None
    treatment_apps: dict[str, str] = Field(default_factory=dict)  # region -> the treatment's set app
    generations: list[int] = Field(default_factory=list)  # router generations applied
    totals: dict[str, SetCounters] = Field(default_factory=dict)  # arm -> summed over the experiment
    last_read: dict[str, dict[str, Any]] | None = None  # region -> metrics snapshot; None: none yet
    guardrails: list[GateReading] = Field(default_factory=list)  # the latest window's readings
    end: str = ""  # why it ended (or is ending)
    outcome: str = ""  # completed, stopped, guardrail, failed
    checks: int = 0
    shadow_windows: list[ShadowSummary] = Field(default_factory=list)  # a shadow's latest windows
    # A capacity move of both arms the model asked for, not done yet (a signal that came in).
    move: MoveArmsInput | None = None
    # arm -> region -> the apps it served from before a move: the next window counts them too
    # (requests they answered between the last read and the switch), then they are forgotten.
    moved_from: dict[str, dict[str, list[str]]] = Field(default_factory=dict)
    moves: int = 0  # capacity moves done


class ExperimentInput(Frozen):
    """Start an ExperimentWorkflow (or continue it, with `state`): the serving set (control, its
    apps already serving) against a treatment set, split by unit for `duration_seconds`."""

    spec: ModelSpec
    plan: Plan
    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")
    salt: str = Field(min_length=8)
    control_set: SnapshotSet
    control_apps: dict[str, str]  # region -> the control's set app
    treatment_set: SnapshotSet
    treatment_percent: float = Field(gt=0, le=100)
    duration_seconds: float = Field(gt=0)
    check_seconds: float = Field(default=10.0, gt=0)
    alpha: float = Field(default=0.01, gt=0, lt=1)
    who: str = "unknown"
    history_limit: int = Field(default=10_000, ge=50)
    state: ExperimentState | None = None
    mode: Literal["split", "shadow"] = "split"  # shadow: the treatment is sent copies, never answers
    shadow_max_in_flight: int = Field(default=8, ge=1, le=1000)
    unit: str = "user"  # StartExperimentInput's
    metrics: list[str] = Field(default_factory=list)  # StartExperimentInput's


class StopExperimentInput(Frozen):
    who: str = "unknown"
    reason: str = Field(min_length=1)


class ExperimentStatus(Frozen):
    """What the experiment's `status` query answers, and its result: where it is, why it ended,
    the guardrails' latest readings and the report so far."""

    model: str
    name: str
    workflow_id: str
    phase: str
    outcome: str
    end: str
    started_at: datetime | None
    ends_at: datetime | None
    arms: dict[str, str]  # arm -> set id
    treatment_percent: float
    guardrails: list[GateReading]
    report: ExperimentReport | None
    mode: Literal["split", "shadow"] = "split"
    # A shadow's comparisons: over its whole run, and its latest windows (one per check).
    shadow: ShadowSummary | None = None
    shadow_windows: list[ShadowSummary] = Field(default_factory=list)
    unit: str = "user"


class StartExperimentInput(Frozen):
    """Update `start_experiment`: the serving set (control) against a held set (treatment), split
    by unit; or with `mode` shadow, the serving set answering everything while `treatment_percent`
    of its requests are copied to the treatment and the answers compared."""

    name: str = Field(pattern=r"^[a-z][a-z0-9-]{0,40}$")
    treatment: str  # a set id of the model, published with hold
    treatment_percent: float = Field(default=50.0, gt=0, le=100)
    duration_seconds: float = Field(gt=0)
    check_seconds: float = Field(default=10.0, gt=0)
    alpha: float = Field(default=0.01, gt=0, lt=1)
    who: str = "unknown"
    mode: Literal["split", "shadow"] = "split"
    shadow_max_in_flight: int = Field(default=8, ge=1, le=1000)  # per router replica
    # What a request's `unit` field names (a user id, a session id): the arms are assigned per
    # unit, and the report says so. The unit itself is always the request's `unit` field.
    unit: str = Field(default="user", pattern=r"^[a-z][a-z0-9_]{0,30}$")
    # The outcomes the report decides the winner on (every outcome when none is named; all are
    # reported). Names as the feedback sends them, e.g. click.
    metrics: list[str] = Field(default_factory=list, max_length=20)

    @field_validator("metrics")
    @classmethod
    def _metric_names(cls, metrics: list[str]) -> list[str]:
        for name in metrics:
            if not re.fullmatch(r"[a-z][a-z0-9_]{0,62}", name):  # as the feedback route reads them
                raise ValueError(
                    f"{name!r} is not an outcome name: lowercase letters, digits and _, as the feedback names it (click)"
                )
        return metrics

    @model_validator(mode="after")
    def _a_split_leaves_control_some(self) -> StartExperimentInput:
        if self.mode == "split" and self.treatment_percent >= 100:
            raise ValueError(
                f"treatment_percent: {self.treatment_percent:g} leaves the control no units; "
                "a split gives the treatment under 100 (a shadow may copy 100)"
            )
        return self


class ExperimentStarted(Frozen):
    workflow_id: str
    control: str  # set id
    treatment: str


class ActiveExperiment(Frozen):
    """The experiment child the model waits on (its start, then its end)."""

    workflow_id: str
    name: str
    control: str
    treatment: str
    start: StartExperimentInput
    started: bool = False  # the child was started (a run continued as new after may not have)

    def status(self, model: str, phase: str, outcome: str = "", end: str = "") -> ExperimentStatus:
        """What is known of it without asking it: before it starts, or after it was lost."""
        return ExperimentStatus(
            model=model,
            name=self.name,
            workflow_id=self.workflow_id,
            phase=phase,
            outcome=outcome,
            end=end,
            started_at=None,
            ends_at=None,
            arms={"control": self.control, "treatment": self.treatment},
            treatment_percent=self.start.treatment_percent,
            guardrails=[],
            report=None,
            mode=self.start.mode,
        )


class PromoteInput(Frozen):
    """Update `promote`: a held set (an experiment's winner) queued for the normal gradual rollout."""

    set_id: str
    who: str = "unknown"
    reason: str = ""
