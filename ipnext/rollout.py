"""Rollout state shared by the workflows, the SDK and the CLI: router configs, rollout status,
on-call signals, freeze windows, and the gate arithmetic.

Everything here is pure (no Temporal, no Ray), so the RolloutWorkflow can evaluate gates and
freeze windows deterministically inside workflow code and the unit tests can check them alone.
"""

from __future__ import annotations

import math
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from pydantic import Field, model_validator

from ipnext.contracts import Frozen, RolloutOutcome, RolloutState
from ipnext.counters import MetricsSnapshot, SetCounters

__all__ = [
    "FREEZE_PAUSE",
    "GATE_MIN_SAMPLES",
    "INSUFFICIENT_TRAFFIC",
    "IPNEXT",
    "NEEDS_ATTENTION",
    "AbortInput",
    "ExperimentRoute",
    "FreezeCalendar",
    "FreezeOverride",
    "FreezeWindow",
    "GateReading",
    "PauseInput",
    "PauseRecord",
    "ResumeInput",
    "RolloutState",
    "RolloutStatus",
    "RouterConfig",
    "ShadowRoute",
    "active_freeze",
    "evaluate_gates",
    "judge_window",
    "mix_weights",
    "scaled_replicas",
    "waits_for_traffic",
    "window_counters",
]

# A gate is judged once the new set served this many requests in the window (or min_requests,
# when that is smaller): one slow first request must not roll a healthy set back.
GATE_MIN_SAMPLES = 10

# The pauses ipnext makes itself (who: IPNEXT): the RolloutWorkflow records them, and the SDK
# tells a caller who waits on the rollout how each one ends.
IPNEXT = "ipnext"
INSUFFICIENT_TRAFFIC = "insufficient_traffic"  # ends by itself once the window holds min_requests
NEEDS_ATTENTION = "needs_attention"  # a rollback that cannot complete: on-call must act
FREEZE_PAUSE = "freeze: "  # the reason's start of a freeze window's hold; ends with the window


class ExperimentRoute(Frozen):
    """A running experiment as routers draw it: a request that names its `unit` goes to the set app
    of the arm `experiments.assign_arm` gives that unit (sticky: a salted hash), and its answer
    carries the arm and a signed request id; a request without a unit runs as if there were no
    experiment (`RouterConfig.weights`)."""

    experiment: str = Field(pattern=r"^[a-z][a-z0-9-]*$")
    salt: str = Field(min_length=8)
    control: str
    arms: dict[str, str] = Field(min_length=2)  # arm -> set app
    split: dict[str, float]  # arm -> percent of units

    @model_validator(mode="after")
    def _arms_and_split_agree(self) -> ExperimentRoute:
        if self.control not in self.arms:
            raise ValueError(f"control: {self.control!r} is not one of the arms {sorted(self.arms)}")
        if set(self.split) != set(self.arms):
            raise ValueError(f"split: names the arms {sorted(self.split)}, the arms are {sorted(self.arms)}")
        if any(share < 0 for share in self.split.values()) or abs(sum(self.split.values()) - 100) > 1e-6:
            raise ValueError(f"split: shares of at least 0 that sum to 100, got {self.split}")
        return self


class ShadowRoute(Frozen):
    """A running shadow as routers mirror it: `percent` of the requests answered from the
    serving set are sent again, after the caller's answer, to the candidate's set app (`app`),
    whose answer is compared with the served one (`ipnext.shadow`) and never returned. At most
    `max_in_flight` such calls per router replica at once: past that a mirrored request is
    dropped, and counted as dropped."""

    shadow: str = Field(pattern=r"^[a-z][a-z0-9-]*$")  # the shadow's name (an experiment's)
    app: str
    percent: float = Field(gt=0, le=100)
    max_in_flight: int = Field(default=8, ge=1, le=1000)
    top_k: int = Field(default=3, ge=1)  # a ranking answer's top k, for the overlap


class RouterConfig(Frozen):
    """The router app's user_config: applied in place by `reconfigure`, never restarting it.

    `weights` picks the set app that runs a request's DAG. A model with `sync: independent`
    rolls each changed part on its own: `parts` then gives that part its own weights (the part
    is called on the app drawn from them, the rest of the DAG on the app drawn from `weights`),
    and `gated_part` names the part whose app a request is counted against, so the rollout
    gates judge the snapshot that is moving."""

    generation: int = Field(ge=0)
    weights: dict[str, float]  # set app name -> percent of traffic
    parts: dict[str, dict[str, float]] = Field(default_factory=dict)  # part -> set app -> percent
    gated_part: str | None = None
    experiment: ExperimentRoute | None = None
    shadow: ShadowRoute | None = None  # never answers a caller: not in `weights`

    @model_validator(mode="after")
    def _gated_part_has_weights(self) -> RouterConfig:
        if self.gated_part is not None and self.gated_part not in self.parts:
            raise ValueError(f"gated_part {self.gated_part!r} has no weights in parts {sorted(self.parts)}")
        return self

    def apps(self) -> set[str]:
        """Every set app a request may reach (a shadow's as a copy, never for its answer)."""
        named = {a for a, w in self.weights.items() if w > 0}
        if self.shadow is not None:
            named.add(self.shadow.app)
        if self.experiment is not None:
            named |= {app for arm, app in self.experiment.arms.items() if self.experiment.split[arm] > 0}
        return named | {a for by_app in self.parts.values() for a, w in by_app.items() if w > 0}


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
    # one; None: ipnext's own pause, or recorded before identities were read (ipnext.identity).
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


def window_counters(before: dict[str, Any] | None, after: dict[str, Any], apps: set[str]) -> SetCounters:
    """Counters of `apps` between two metrics-actor snapshots (summed over the apps).

    Snapshots with per-replica counters are diffed replica by replica (see
    `MetricsSnapshot.minus`): a metrics actor that restarted, or a replica that did, starts
    nothing over and breaches nothing. Snapshots recorded before replicas were kept carry sums
    only, and are diffed as sums (a workflow replaying its history reads the same window)."""
    earlier = MetricsSnapshot.model_validate(before or {})
    later = MetricsSnapshot.model_validate(after)
    if later.replicas or earlier.replicas:
        window = later.minus(earlier)
        total = SetCounters()
        for app in apps:
            total = total.plus(window.get(app, SetCounters()))
        return total
    total = SetCounters()
    for app in apps:
        now = later.sets.get(app, SetCounters())
        total = total.plus(now.minus(earlier.sets.get(app, SetCounters())))
    return total


def _metric(counters: SetCounters, metric: str) -> float | None:
    if metric == "error_rate":
        return counters.errors / counters.requests if counters.requests else None
    # latency_p99_ms -> latency_ms, read by the rule of the counters' layout (histogram_quantile)
    return counters.quantile_ms(metric.removesuffix("_p99_ms") + "_ms", 0.99)


def evaluate_gates(
    gates: list[Any], region: str, new: SetCounters, old: SetCounters, min_requests: int
) -> list[GateReading]:
    """Each gate (`ipnext.model.GateSpec`) on the new set's window against the old set's.

    A bound is `max`, or `max_ratio_to_old` x the old set's value, whichever is lower; a value
    at or under `floor` never fails. Judged only once the new set has served
    min(min_requests, GATE_MIN_SAMPLES) requests in the window (at least one)."""
    needed = max(1, min(min_requests, GATE_MIN_SAMPLES))
    readings = []
    for gate in gates:
        value = _metric(new, gate.metric)
        old_value = _metric(old, gate.metric)
        limits = []
        if gate.max is not None:
            limits.append(gate.max)
        if gate.max_ratio_to_old is not None and old_value is not None and math.isfinite(old_value):
            limits.append(gate.max_ratio_to_old * old_value)
        limit = min(limits) if limits else None
        judged = new.requests >= needed and value is not None
        breached = judged and limit is not None and value is not None and value > max(limit, gate.floor)
        readings.append(
            GateReading(
                region=region,
                metric=gate.metric,
                value=value,
                old_value=old_value,
                limit=None if limit is None else max(limit, gate.floor),
                requests=new.requests,
                judged=judged,
                breached=breached,
            )
        )
    return readings


def judge_window(
    gates: list[Any],
    min_requests: int,
    regions: list[str],
    before: dict[str, dict[str, Any]],
    after: dict[str, dict[str, Any]],
    new_apps: set[str],
    old_apps: set[str],
) -> tuple[list[GateReading], int]:
    """The gates of every region over the window between two metrics reads (region -> the
    metrics actor's snapshot), and the requests the new set's apps served in it."""
    readings: list[GateReading] = []
    requests = 0
    for region in regions:
        new = window_counters(before.get(region), after.get(region, {}), new_apps)
        old = window_counters(before.get(region), after.get(region, {}), old_apps)
        readings += evaluate_gates(gates, region, new, old, min_requests)
        requests += new.requests
    return readings, requests


# ---- steps --------------------------------------------------------------------------------


def scaled_replicas(replicas: int, share: float) -> int:
    """Replicas a deployment needs for `share` (0-1) of its traffic: the plan's count scaled and
    rounded up, so each replica's load, and so the plan's headroom, is never worse than planned."""
    if replicas <= 0 or share <= 0:
        return 0
    return max(1, math.ceil(replicas * min(share, 1.0) - 1e-9))


def mix_weights(
    start: dict[str, dict[str, float]], end: dict[str, dict[str, float]], percent: float
) -> dict[str, dict[str, float]]:
    """Router weights `percent` of the way from `start` to `end` (region -> app -> percent).
    A region only in `end` (a router the move creates) takes `end` as it is."""
    mixed: dict[str, dict[str, float]] = {}
    share = percent / 100.0
    for region in sorted(set(start) | set(end)):
        if region not in start:
            mixed[region] = dict(end[region])
            continue
        if region not in end:
            mixed[region] = dict(start[region])
            continue
        weights: dict[str, float] = {}
        for app, w in start[region].items():
            weights[app] = weights.get(app, 0.0) + w * (1 - share)
        for app, w in end[region].items():
            weights[app] = weights.get(app, 0.0) + w * share
        mixed[region] = {a: round(w, 6) for a, w in sorted(weights.items()) if w > 1e-9}
    return mixed


# ---- freeze windows -----------------------------------------------------------------------


class FreezeWindow(Frozen):
    """Rollouts may not start (and running ones hold) from `start` to `end`, UTC.

    Written as `{date: 2026-12-25, reason: ...}` for one whole day, or `{start: ..., end: ...,
    reason: ...}` with dates (whole days, `end` included) or datetimes."""

    reason: str = Field(min_length=1)
    start: datetime
    end: datetime

    @model_validator(mode="before")
    @classmethod
    def _days(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        if "date" in raw:
            day = raw.pop("date")
            if "start" in raw or "end" in raw:
                raise ValueError("freeze window: give date, or start and end, not both")
            raw["start"] = raw["end"] = day
        if "start" not in raw or "end" not in raw:
            raise ValueError("freeze window: give date: YYYY-MM-DD, or start and end")
        for key, day_edge in (("start", time.min), ("end", None)):
            value = raw[key]
            if isinstance(value, str) and len(value) == 10:
                value = date.fromisoformat(value)
            if isinstance(value, date) and not isinstance(value, datetime):
                if day_edge is None:  # an end date includes the whole day
                    value = datetime.combine(value + timedelta(days=1), time.min)
                else:
                    value = datetime.combine(value, day_edge)
            raw[key] = value
        return raw

    @model_validator(mode="after")
    def _utc_and_ordered(self) -> FreezeWindow:
        for key in ("start", "end"):
            value: datetime = getattr(self, key)
            if value.tzinfo is None:
                object.__setattr__(self, key, value.replace(tzinfo=UTC))
        if self.end <= self.start:
            raise ValueError(
                f"freeze window {self.reason!r}: end {self.end.isoformat()} is not after start "
                f"{self.start.isoformat()}"
            )
        return self

    def covers(self, now: datetime) -> bool:
        return self.start <= now < self.end


class FreezeCalendar(Frozen):
    freezes: list[FreezeWindow] = Field(default_factory=list)


class FreezeOverride(Frozen):
    """Start (or keep going) through a freeze window: who decided it and why, kept in the history."""

    reason: str = Field(min_length=1)
    who: str = Field(min_length=1)


def active_freeze(windows: list[FreezeWindow], now: datetime) -> FreezeWindow | None:
    """The window in force at `now` that ends last, if any."""
    covering = [w for w in windows if w.covers(now)]
    return max(covering, key=lambda w: w.end) if covering else None


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


def waits_for_traffic(status: RolloutStatus) -> bool:
    """Whether a paused rollout waits only for traffic: ipnext's own pause, which it ends once
    the window holds `min_requests`."""
    pause = status.pauses[-1] if status.pauses else None
    return pause is not None and pause.who == IPNEXT and pause.reason == INSUFFICIENT_TRAFFIC
