"""What ExperimentWorkflow is given, keeps and answers, and the model's updates that start, end and promote
an experiment."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ipnext.contracts.counters import SetCounters
from ipnext.contracts.plan import Plan
from ipnext.contracts.rollout import GateReading
from ipnext.names import Frozen
from ipnext.spec.model import ModelSpec, SnapshotSet

__all__ = [
    "ActiveExperiment",
    "ArmSummary",
    "ArmsMoved",
    "ExperimentInput",
    "ExperimentReport",
    "ExperimentStarted",
    "ExperimentState",
    "ExperimentStatus",
    "MoveArmsInput",
    "OutcomeComparison",
    "PromoteInput",
    "ShadowSummary",
    "StartExperimentInput",
    "StopExperimentInput",
]


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
                    f"{name!r} is not an outcome name: lowercase letters, digits and _, "
                    "as the feedback names it (click)"
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


class ArmSummary(Frozen):
    arm: str
    set_id: str
    requests: int
    errors: int
    error_rate: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    outcomes: dict[str, tuple[int, float | None]]  # name -> (count, mean)


class OutcomeComparison(Frozen):
    """One arm against control on one outcome (or on `error_rate`)."""

    arm: str
    outcome: str
    test: str
    control: float
    value: float
    difference: float
    low: float
    high: float
    p_value: float
    significant: bool  # p below the report's alpha


class ExperimentReport(Frozen):
    experiment: str
    model: str
    control: str
    alpha: float
    arms: list[ArmSummary]
    comparisons: list[OutcomeComparison]
    # The arm whose every outcome that differs significantly from control is higher (None: no
    # arm differs from control, or the evidence points both ways). Outcomes are "more is
    # better" (a click, a purchase); a guardrail's error rate is judged by the gates, not here.
    # With `metrics` named, only those outcomes decide (the others are reported all the same).
    winner: str | None
    unit: str = "user"  # what a request's `unit` names: each one kept its arm throughout
    metrics: list[str] = Field(default_factory=list)  # the outcomes the winner is decided on (none: all)


class ShadowSummary(Frozen):
    """A window (or the whole shadow) of comparisons, from the candidate's counters: what was
    mirrored, compared, dropped and failed, and how the answers agreed (None: nothing measured)."""

    # Each counted when it happens: a copy sent before a window began and compared in it counts
    # in that window's `compared`, not its `mirrored`.
    mirrored: int = 0  # requests picked for the shadow (sent or dropped)
    dropped: int = 0  # of those, dropped: the candidate had max_in_flight shadow calls
    compared: int = 0  # candidate answers compared with the served one
    candidate_requests: int = 0  # shadow calls the candidate's counters hold
    candidate_errors: int = 0
    candidate_p50_ms: float | None = None
    candidate_p99_ms: float | None = None
    mismatched: int = 0  # answers of another shape
    differing: float | None = None  # share of compared answers that differ at all
    max_abs_diff_mean: float | None = None
    rank_correlation_mean: float | None = None
    top_k_overlap_mean: float | None = None
    windows: int = Field(default=0, ge=0)  # how many windows this sums (1 for one window)
