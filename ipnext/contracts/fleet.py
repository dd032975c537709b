"""What FleetWorkflow and FleetReplanWorkflow are given, keep and answer: each region's state, on-call's
region changes, the regions check, and the replan's input and result."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ipnext.names import Frozen
from ipnext.spec.fleet import Name

__all__ = [
    "DOWN_BY_IPNEXT",
    "EVENTS_KEPT",
    "REPLANS_KEPT",
    "DemandSizing",
    "FleetReplanInput",
    "FleetReplanResult",
    "FleetState",
    "FleetStatus",
    "FleetWorkflowInput",
    "NodeSighting",
    "RegionChange",
    "RegionChangeResult",
    "RegionDownInput",
    "RegionEvent",
    "RegionHealth",
    "RegionState",
    "RegionUpInput",
    "RegionsCheckInput",
    "RegionsCheckResult",
    "ReplanRecord",
    "SourceSizing",
    "region_resource",
]


DOWN_BY_IPNEXT = "ipnext"  # `who` of a change ipnext's own node check made
EVENTS_KEPT = 100  # region events kept in the state (the history has all of them)
REPLANS_KEPT = 20


class RegionHealth(StrEnum):
    UP = "up"
    DOWN = "down"


def region_resource(region: str) -> str:
    """The Ray custom resource every node of a region carries."""
    return f"region:{region}"


# -- on-call's doors ---------------------------------------------------------------------


def _said(value: str, field: str) -> str:
    value = value.strip()
    if not value:
        raise ValueError(
            f"{field}: empty; say {'who asks' if field == 'who' else 'why'} (it goes in the audit trail)"
        )
    return value


class RegionDownInput(Frozen):
    """`region down`: on-call takes a region out of service (it stays down until `region up`)."""

    region: Name
    reason: str = Field(min_length=1, max_length=500)
    who: str = Field(min_length=1, max_length=200)

    @field_validator("reason")
    @classmethod
    def _reason(cls, value: str) -> str:
        return _said(value, "reason")

    @field_validator("who")
    @classmethod
    def _who(cls, value: str) -> str:
        return _said(value, "who")


class RegionUpInput(Frozen):
    """`region up`: the region serves again (a normal replan moves capacity back)."""

    region: Name
    who: str = Field(min_length=1, max_length=200)
    reason: str = Field(default="", max_length=500)

    @field_validator("who")
    @classmethod
    def _who(cls, value: str) -> str:
        return _said(value, "who")


class RegionChangeResult(Frozen):
    region: str
    health: RegionHealth
    changed: bool  # False: it already was in that state (nothing recorded, no replan)
    replan: str = ""  # the replan workflow this change starts (or joins), "" for none
    detail: str = ""


# -- the state -----------------------------------------------------------------------------


class RegionState(Frozen):
    region: str
    health: RegionHealth = RegionHealth.UP
    since: datetime | None = None  # when it entered this health (None: up since the fleet began)
    reason: str = ""
    who: str = ""
    # The `ipnext-identity` header of the change ("unattributed" without one); None: ipnext's own
    # node check, or recorded before identities were read (ipnext.contracts.identity).
    identity: str | None = None
    # Down by ipnext's own node check (who == "ipnext"): it comes up by itself once its nodes are
    # back. Down by on-call: only `region up` ends it, whatever the nodes do.
    detected: bool = False
    replan: str = ""  # the replan this state caused
    alive_nodes: list[str] = Field(default_factory=list)  # as last seen in Ray's node table
    dead_nodes: list[str] = Field(default_factory=list)


class RegionEvent(Frozen):
    at: datetime
    region: str
    health: RegionHealth
    who: str
    reason: str
    replan: str = ""
    identity: str | None = None  # as RegionState.identity


class ReplanRecord(Frozen):
    """A replan FleetWorkflow started, and how it ended."""

    workflow_id: str
    kind: str  # "emergency" (a region went down) or "return" (a region came back)
    down_regions: list[str]
    started_at: datetime
    outcome: str = "running"  # running | applied | failed | superseded
    revision: int = 0
    relaxed: list[str] = Field(default_factory=list)
    detail: str = ""


class FleetState(BaseModel):
    """FleetWorkflow's state, and whole its continue-as-new payload."""

    model_config = ConfigDict(extra="forbid")

    regions: dict[str, RegionState] = Field(default_factory=dict)  # every region of the fleet file
    events: list[RegionEvent] = Field(default_factory=list)  # the last EVENTS_KEPT
    replans: list[ReplanRecord] = Field(default_factory=list)  # the last REPLANS_KEPT
    replans_started: int = 0  # numbers the replan workflow ids
    # A change not yet replanned: "emergency" (a region went down) or "return" (one came up).
    replan_due: str | None = None
    last_check: datetime | None = None
    last_check_error: str = ""
    # The pool check's memory (activities/pool_check.py): pooled model -> when the writer last
    # held it, and when each model in doubt was last asked to check (unix seconds).
    pool_members: dict[str, float] = Field(default_factory=dict)
    pool_asked: dict[str, float] = Field(default_factory=dict)
    last_pool_check_error: str = ""

    def down(self) -> list[str]:
        return sorted(r for r, s in self.regions.items() if s.health == RegionHealth.DOWN)

    def record(self, event: RegionEvent) -> None:
        self.events = [*self.events, event][-EVENTS_KEPT:]

    def add_replan(self, replan: ReplanRecord) -> None:
        self.replans = [*self.replans, replan][-REPLANS_KEPT:]

    def finish_replan(self, workflow_id: str, **update: object) -> None:
        self.replans = [
            r.model_copy(update=update) if r.workflow_id == workflow_id else r for r in self.replans
        ]


class FleetStatus(Frozen):
    """What FleetWorkflow's `regions` query answers."""

    regions: list[RegionState]
    down: list[str]
    replans: list[ReplanRecord]
    events: list[RegionEvent]
    replan_due: str | None = None
    last_check: datetime | None = None
    last_check_error: str = ""
    updated_at: datetime | None = None


class FleetWorkflowInput(Frozen):
    state: FleetState | None = None  # carried across continue-as-new
    # How often the workflow reads the fleet file and Ray's node table; False: no node check
    # (regions go down only by on-call).
    check_seconds: float = Field(default=5.0, gt=0)
    detect: bool = True
    replan_time_limit_s: float = Field(default=60.0, gt=0)
    churn_cost: float = Field(default=0.05, ge=0)
    history_limit: int = Field(default=2000, ge=100)


# -- detection -------------------------------------------------------------------------------


class NodeSighting(Frozen):
    """One row of Ray's node table: a node, whether Ray holds it alive, the regions it carries."""

    node_id: str
    alive: bool
    regions: list[str]


class RegionsCheckInput(Frozen):
    look_at_nodes: bool = True


class RegionsCheckResult(Frozen):
    regions: list[str]  # the fleet file's regions
    nodes: list[NodeSighting] | None = None  # None: not read (switched off, or Ray did not answer)
    error: str = ""  # why the nodes were not read


class RegionChange(Frozen):
    region: str
    health: RegionHealth
    reason: str
    alive_nodes: list[str] = Field(default_factory=list)
    dead_nodes: list[str] = Field(default_factory=list)


class FleetReplanInput(Frozen):
    time_limit_s: float = Field(default=120.0, gt=0)
    churn_cost: float = Field(default=0.05, ge=0)
    # Regions planned without (their pools left out; they stay traffic sources), besides those
    # the `fleet` workflow holds down when the run starts. An emergency replan names them.
    down_regions: list[str] = Field(default_factory=list)
    reason: str = ""  # why this run (FleetWorkflow's replans say which region change)
    # The Schedule's interval (`ensure_replan_schedule` sets it): observed demand's peak is read
    # over the windows since one interval ago. None: over all the history the actors keep.
    interval_s: float | None = Field(default=None, gt=0)


class FleetReplanResult(Frozen):
    """What a FleetReplanWorkflow run returns (and its details in the Temporal UI show)."""

    revision: int  # 0 when there was nothing to plan
    models: list[str]
    cost: float = 0.0
    objective: float = 0.0
    lower_bound: float | None = None
    gap: float | None = None
    status: str = ""
    moved_units: int = 0
    moves: list[str] = Field(default_factory=list)
    moves_total: int = 0
    applied_to: list[str] = Field(default_factory=list)  # models told of their new placement
    not_applied: dict[str, str] = Field(default_factory=dict)  # model -> why
    plan_file: str = ""
    down_regions: list[str] = Field(default_factory=list)  # planned without these regions
    relaxed: list[str] = Field(default_factory=list)  # constraints relaxed for them, readable
    reason: str = ""
    # Per model, what each source was planned for: declared or observed, both figures, and
    # whether observed exceeds the declared peak_qps (`ipnext.policy.demand.DemandSizing`).
    demand: dict[str, DemandSizing] = Field(default_factory=dict)


class SourceSizing(Frozen):
    """What the fleet replan planned one source of one model for, and from what."""

    declared_qps: float  # traffic.peak_qps (0 for a source the spec does not name)
    observed_peak_qps: float | None  # the peak over the replan's interval; None: not used
    planned_qps: float
    used: Literal["declared", "observed"]
    over_budget: bool = False  # observed peak above the declared peak_qps (the owner's budget)


class DemandSizing(Frozen):
    """Per model: whether observed demand was used, and per source the figures the plan used."""

    history_seconds: float = 0.0
    window_seconds: float = 0.0
    margin: float = 0.0
    observed: bool = False  # enough history: observed demand was weighed against declared
    note: str = ""  # why only declared demand was used, or what was left out
    sources: dict[str, SourceSizing] = Field(default_factory=dict)

    def demand_qps(self) -> dict[str, float]:
        return {source: s.planned_qps for source, s in self.sources.items()}

    def over_budget(self) -> list[str]:
        return [source for source, s in self.sources.items() if s.over_budget]
