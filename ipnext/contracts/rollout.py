"""What RolloutWorkflow is given, keeps and answers: its input, progress and result, the on-call signals
(pause, resume, abort), gate readings and the rollout status every client reads."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ipnext.contracts.freeze import FreezeOverride
from ipnext.contracts.plan import Plan
from ipnext.contracts.router import RouterConfig
from ipnext.names import Frozen, RolloutOutcome, RolloutState
from ipnext.spec.model import ModelSpec, SnapshotSet

__all__ = [
    "FREEZE_PAUSE",
    "INSUFFICIENT_TRAFFIC",
    "IPNEXT",
    "NEEDS_ATTENTION",
    "ROLLOUT_FAILURE_TYPES",
    "AbortInput",
    "GateReading",
    "PauseInput",
    "PauseRecord",
    "ResumeInput",
    "RolloutEnded",
    "RolloutInput",
    "RolloutProgress",
    "RolloutResult",
    "RolloutStatus",
    "resumes_by_itself",
    "waits_for_traffic",
]


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
    """How a rollout ended; `outcome` says how, and only `completed` moved the traffic. A
    completed rollout is its workflow's result (Temporal's COMPLETED); any other outcome ends
    the workflow FAILED, with this result as its failure's details (`failure_of`, `result_of`):
    the Temporal UI shows a rolled-back rollout as a failure, and its list's filter finds it."""

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

    def failure_type(self) -> str:
        """The application error type its workflow fails with: `RolloutRolledBack`, ..."""
        return "Rollout" + "".join(word.capitalize() for word in self.outcome.value.split("_"))

    def failure_message(self) -> str:
        """The failure's message, the line the Temporal UI shows: the outcome and why."""
        return f"{self.outcome.value.replace('_', ' ')}: {self.detail or 'no detail'}"

    @classmethod
    def of_failure(cls, err: BaseException | None) -> RolloutResult | None:
        """The result a rollout's workflow failure carries (its failure, or one it caused: a
        child's failure, a client's WorkflowFailureError), None when it carries none (the
        rollout failed by a bug, or was terminated). Read by duck type, without Temporal's
        classes: contracts import no client."""
        seen = 0
        while err is not None and seen < 8:
            kind, details = getattr(err, "type", None), getattr(err, "details", None)
            if isinstance(kind, str) and kind in ROLLOUT_FAILURE_TYPES and details:
                try:
                    return cls.model_validate(details[0])
                except ValueError:
                    return None
            err, seen = getattr(err, "cause", None) or err.__cause__, seen + 1
        return None


# Every outcome but completed fails its workflow with one of these types.
ROLLOUT_FAILURE_TYPES = frozenset(
    "Rollout" + "".join(w.capitalize() for w in o.value.split("_"))
    for o in RolloutOutcome
    if o != RolloutOutcome.COMPLETED
)


class RolloutEnded(Frozen):
    """Signal `rollout_ended`: a rollout child tells its model how it ended. It goes to the
    model's workflow id, so it reaches the model's latest run."""

    workflow_id: str
    result: RolloutResult


# The pauses ipnext makes itself (who: IPNEXT): the RolloutWorkflow records them, and the SDK
# tells a caller who waits on the rollout how each one ends.
IPNEXT = "ipnext"
INSUFFICIENT_TRAFFIC = "insufficient_traffic"  # ends by itself once the window holds min_requests
NEEDS_ATTENTION = "needs_attention"  # a rollback that cannot complete: on-call must act
FREEZE_PAUSE = "freeze: "  # the reason's start of a freeze window's hold; ends with the window


# ---- on-call signals ----------------------------------------------------------------------


class PauseInput(Frozen):
    reason: str = Field(min_length=1)
    who: str = Field(min_length=1)


class ResumeInput(Frozen):
    who: str = Field(min_length=1)


class AbortInput(Frozen):
    reason: str = Field(min_length=1)
    who: str = Field(min_length=1)


class PauseRecord(Frozen):
    reason: str
    who: str
    at: datetime
    resumed_by: str | None = None
    resumed_at: datetime | None = None
    # The `ipnext-identity` header the pause (resume) signal came with, "unattributed" without
    # one; None: ipnext's own pause, or recorded before identities were read (ipnext.contracts.identity).
    identity: str | None = None
    resumed_identity: str | None = None


# ---- gates --------------------------------------------------------------------------------


class GateReading(Frozen):
    region: str
    metric: str
    value: float | None  # None: no samples of the new set in the window
    old_value: float | None
    limit: float | None  # None: nothing to compare against yet
    requests: int  # new set's requests in the window
    judged: bool  # enough requests to decide
    breached: bool

    def describe(self) -> str:
        value = "n/a" if self.value is None else f"{self.value:.4g}"
        limit = "n/a" if self.limit is None else f"{self.limit:.4g}"
        mark = "BREACH" if self.breached else ("ok" if self.judged else "waiting")
        return f"{self.region} {self.metric} {value} (limit {limit}, {self.requests} req) {mark}"


# ---- status -------------------------------------------------------------------------------


class RolloutStatus(Frozen):
    model: str
    set_id: str
    from_set_id: str | None
    state: RolloutState
    step: str
    traffic_percent: dict[str, float]  # set id -> percent
    generations: list[int] = Field(default_factory=list)
    detail: str = ""
    workflow_id: str = ""
    steps: list[int] = Field(default_factory=list)  # the planned percents
    steps_done: int = 0
    gates: list[GateReading] = Field(default_factory=list)  # the last readings, every region
    pauses: list[PauseRecord] = Field(default_factory=list)
    freeze_override: FreezeOverride | None = None
    # The identity header of the override_freeze signal (None: given at publish, or recorded before).
    freeze_override_identity: str | None = None
    part: str | None = None  # sync: independent: the part moving now
    part_traffic: dict[str, float] = Field(default_factory=dict)  # changed part -> percent on the new set
    repairs: int = 0  # serving checks during its bakes that pushed Serve again (after an outage)
    last_repair: str = ""
    # Why the last serving check of a bake could not run (Ray down, Serve starting): the bake
    # waits for one that runs, then judges a fresh window ("" once one ran).
    serving_unchecked: str = ""
    outcome: RolloutOutcome | None = None  # how it ended (None while it runs)
    # Workflow time of the last change the rollout made to this status (a step, a split, a gate
    # reading): a reader says how old the answer is from it (None: recorded before it existed).
    updated_at: datetime | None = None
    # The requests a bake's window needs in each region before its gates judge (the spec's
    # rollout.min_requests; 0: recorded before it was carried).
    min_requests: int = 0

    def requests_needed(self) -> int | None:
        """How many more requests the least-fed region's window needs before the gates judge;
        None when no gate is waiting for traffic (or the bound is unknown)."""
        waiting = [g.requests for g in self.gates if not g.judged]
        if not waiting or self.min_requests <= 0:
            return None
        return max(0, self.min_requests - min(waiting))


def waits_for_traffic(status: RolloutStatus) -> bool:
    """Whether a paused rollout waits only for traffic: ipnext's own pause, which it ends once
    the window holds `min_requests`."""
    pause = status.pauses[-1] if status.pauses else None
    return pause is not None and pause.who == IPNEXT and pause.reason == INSUFFICIENT_TRAFFIC


def resumes_by_itself(status: RolloutStatus) -> bool:
    """Whether a paused rollout goes on with no one's signal: ipnext's own pause for traffic
    (traffic ends it) or for a freeze window (its end does). An on-call pause, or ipnext's pause
    of a rollback that cannot complete, needs a person."""
    pause = status.pauses[-1] if status.pauses else None
    return waits_for_traffic(status) or (
        pause is not None and pause.who == IPNEXT and pause.reason.startswith(FREEZE_PAUSE)
    )
