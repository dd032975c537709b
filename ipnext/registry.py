"""Inputs, results and state of the lifecycle workflows (ModelWorkflow, RolloutWorkflow, the watcher).

Each workflow, update, signal and activity takes one of these and returns one, so
fields can be added later without breaking callers or running histories.
"""

from __future__ import annotations

from pydantic import Field

from ipnext.contracts import Frozen, model_workflow_id, rollout_workflow_id
from ipnext.model import ModelSpec, SnapshotSet, SnapshotSetRequest
from ipnext.plan import Plan
from ipnext.rollout import (
    AbortInput,
    FreezeOverride,
    GateReading,
    PauseRecord,
    RolloutState,
    RolloutStatus,
)

__all__ = [
    "ApplyPlanInput",
    "DeleteInput",
    "DeleteResult",
    "ModelState",
    "ModelWorkflowInput",
    "ModelWorkflowResult",
    "PublishInput",
    "PublishResult",
    "RolloutCheckpoint",
    "RolloutInput",
    "RolloutResult",
    "WatchInput",
    "WatchResult",
    "model_workflow_id",
    "rollout_workflow_id",
]


class ModelWorkflowInput(Frozen):
    """Start (or continue-as-new) a model's registry workflow; later fields carry state over."""

    spec: ModelSpec
    sets: list[SnapshotSet] = Field(default_factory=list)
    serving_set: str | None = None
    serving_apps: dict[str, str] = Field(default_factory=dict)  # region -> set app
    plan: Plan | None = None
    queued: list[str] = Field(default_factory=list)
    next_number: int = 1
    pending_plan: ApplyPlanInput | None = None
    freeze_overrides: dict[str, FreezeOverride] = Field(default_factory=dict)  # queued set id -> override


class ApplyPlanInput(Frozen):
    """A new placement for the model from a fleet replan (signal `apply_plan`)."""

    plan: Plan
    fleet_revision: int


class ModelWorkflowResult(Frozen):
    model: str
    deleted_by: str
    sets: int


class PublishInput(Frozen):
    request: SnapshotSetRequest
    who: str = "unknown"
    freeze_override: FreezeOverride | None = None  # roll out even inside a freeze window


class PublishResult(Frozen):
    set_id: str
    status: str  # "queued" until its rollout starts


class DeleteInput(Frozen):
    who: str = "unknown"


class DeleteResult(Frozen):
    model: str
    removed_apps: list[str]


class ModelState(Frozen):
    """What `get` answers: the model's spec, its sets, what serves, the plan, the rollout."""

    spec: ModelSpec
    state: str  # "empty", "rolling_out", "serving", "deleting"
    sets: list[SnapshotSet]
    serving_set: str | None
    serving_apps: dict[str, str]
    queued: list[str]
    plan: Plan | None
    rollout: RolloutStatus | None
    pending_plan: int | None = None  # revision of a replanned placement waiting to be applied


class RolloutCheckpoint(Frozen):
    """Where a rollout was when it continued as new (a long bake or pause grows the history):
    the step it was baking and everything already applied. The next run bakes that step again
    from a fresh window and goes on."""

    index: int  # the step (over all the steps, per part with sync: independent) being baked
    steps_done: int
    step: str
    paused: bool
    freeze_hold: bool
    new_apps: dict[str, str]
    old_scales: dict[str, float]
    percent: float
    traffic: dict[str, float]
    part_traffic: dict[str, float] = Field(default_factory=dict)
    generations: list[int] = Field(default_factory=list)
    gates: list[GateReading] = Field(default_factory=list)
    pauses: list[PauseRecord] = Field(default_factory=list)
    abort: AbortInput | None = None
    detail: str = ""


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
    checkpoint: RolloutCheckpoint | None = None


class RolloutResult(Frozen):
    state: RolloutState
    apps: dict[str, str]  # region -> set app serving when the rollout ended
    generations: list[int]
    detail: str = ""
    status: RolloutStatus | None = None  # the rollout's `status` as it ended (gates, pauses, steps)


class WatchInput(Frozen):
    model: str


class WatchResult(Frozen):
    published: list[str]
    rejected: list[str] = Field(default_factory=list)  # why a found snapshot was refused


ModelWorkflowInput.model_rebuild()
