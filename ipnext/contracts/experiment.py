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
    "METRIC_PATTERN",
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
    "metric_directions",
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
    # The least always-valid p-value seen so far per comparison ("<arm>/<outcome>"): the report's
    # p-values are these running minima (policy.sequential.running_p).
    least_p: dict[str, float] = Field(default_factory=dict)
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


# A metric as an experiment names it: `name:higher` or `name:lower` (a bare name: from before).
METRIC_PATTERN = r"[a-z][a-z0-9_]{0,62}(:(higher|lower))?"


def metric_directions(metrics: list[str]) -> dict[str, str | None]:
    """`["click:higher", "latency_ms:lower"]` -> {"click": "higher", "latency_ms": "lower"}."""
    found: dict[str, str | None] = {}
    for metric in metrics:
        name, _, direction = metric.partition(":")
        found[name] = direction or None
    return found


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
    # The outcomes the report decides the winner on, each with the direction that is better:
    # `click:higher`, `latency_ms:lower` (names as the feedback sends them). Every outcome is
    # reported; only these decide, corrected for their number (Holm). None named: no winner is
    # called. A name without a direction is read (experiments started before directions) but a
    # new experiment is refused one (`missing_directions`).
    metrics: list[str] = Field(default_factory=list, max_length=20)

    @field_validator("metrics")
    @classmethod
    def _metric_names(cls, metrics: list[str]) -> list[str]:
        for metric in metrics:
            if not re.fullmatch(METRIC_PATTERN, metric):
                raise ValueError(
                    f"{metric!r} is not an outcome and its direction: `name:higher` or `name:lower`, "
                    "the name in lowercase letters, digits and _, as the feedback names it (click:higher)"
                )
        return metrics

    def directions(self) -> dict[str, str | None]:
        """Each metric's name and the direction that is better (None: not said)."""
        return metric_directions(self.metrics)

    def missing_directions(self) -> list[str]:
        """The metrics named without a direction: a new experiment must say each one's."""
        return [name for name, direction in self.directions().items() if direction is None]

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
    """One arm against control on one outcome (or on `error_rate`): the difference at this look,
    its always-valid interval, and the always-valid p-value over every look so far."""

    arm: str
    outcome: str
    test: str
    control: float
    value: float
    difference: float
    low: float
    high: float
    p_value: float
    # A deciding outcome: rejected by Holm over all of them at alpha; any other: p below alpha.
    significant: bool
    direction: str | None = None  # the better direction, for the outcomes that decide
    better: bool | None = None  # significant and in the arm's favour (None: not deciding)


class ExperimentReport(Frozen):
    experiment: str
    model: str
    control: str
    alpha: float
    arms: list[ArmSummary]
    comparisons: list[OutcomeComparison]
    # The arm better than control on a deciding outcome (`metrics`, each with its direction),
    # significantly after Holm's correction over them, and worse on none; control when every
    # arm that differs is worse; None otherwise (no evidence yet, or it points both ways). A
    # guardrail's error rate is judged by the gates, not here.
    winner: str | None
    unit: str = "user"  # what a request's `unit` names: each one kept its arm throughout
    metrics: list[str] = Field(default_factory=list)  # the deciding outcomes, `name:direction`
    # How significance was decided (the CLI's verdict names it).
    method: str = ""


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
