"""The inputs, results and record of ModelWorkflow (publish, delete, update, the model's state), and of the
validate and watch workflows it starts."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from ipnext.contracts.experiment import ActiveExperiment, ExperimentStatus
from ipnext.contracts.freeze import FreezeOverride
from ipnext.contracts.plan import Plan
from ipnext.contracts.rollout import RolloutStatus
from ipnext.names import Frozen, ModelStatus, SetStatus
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSet, SnapshotSetRequest

__all__ = [
    "ActiveRollout",
    "ApplyPlanInput",
    "DeleteInput",
    "DeleteResult",
    "ModelRecord",
    "ModelState",
    "ModelWorkflowInput",
    "ModelWorkflowResult",
    "OlderSets",
    "PublishInput",
    "PublishResult",
    "ReconcileRecord",
    "SpecChange",
    "SpecPending",
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
    # An idle model's next own check when not `interval_seconds`: a pooled model's
    # `serve.pools.model_check_seconds` (the fleet's pool check watches its pools meanwhile).
    idle_seconds: float | None = None
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
    kind: str  # ipnext.policy.spec_update.UpdateKind
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
    # The sha256 of the pinned file names `sets` need, as last written to the pinned store's
    # references (workflows/_model_pinned.py); empty: never written by this model's record.
    pinned_refs: str = ""

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
    kind: str  # ipnext.policy.spec_update.UpdateKind: none, in_place, capacity, new_set
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


class WatchInput(Frozen):
    model: str


class WatchResult(Frozen):
    published: list[str]
    rejected: list[str] = Field(default_factory=list)  # why a found snapshot was refused
