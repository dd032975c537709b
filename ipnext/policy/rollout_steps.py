"""The step arithmetic of a rollout: which steps it walks, what each one deploys and routes, and
how much traffic can go back at once when it rolls back.

Pure (no Temporal, no Ray), like the gate maths in ipnext.policy.gates: RolloutWorkflow calls it
deterministically and the unit tests check it alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from pydantic import Field

from ipnext.contracts.model import ApplyPlanInput
from ipnext.contracts.plan import Plan
from ipnext.contracts.rollout import RolloutInput
from ipnext.names import Frozen, RolloutState
from ipnext.policy.gates import mix_weights, scaled_replicas
from ipnext.spec.model import RolloutSpec

__all__ = [
    "CAPACITY_MOVE_ATTEMPTS",
    "IDLE_SHARE",
    "PartWeights",
    "RolloutStep",
    "Routes",
    "Weights",
    "capacity_retry",
    "carried_share",
    "cutover_weights",
    "deploy_scale",
    "initial_traffic",
    "is_gradual",
    "lost_apps",
    "new_set_scales",
    "old_set_scales",
    "part_weights",
    "rollback_percent",
    "rolling_parts",
    "rollout_history_limit",
    "rollout_steps",
    "start_weights",
    "step_routes",
    "traffic_split",
    "without_down_regions",
]

Weights = dict[str, dict[str, float]]  # region -> set app -> percent
PartWeights = dict[str, dict[str, dict[str, float]]]  # region -> part -> set app -> percent
Routes = tuple[Weights, PartWeights, str | None]  # a route_traffic call: weights, parts, gated part
# A part that does not move yet keeps one replica per (region, hardware) on the other set.
IDLE_SHARE = 1e-6


class RolloutStep(Frozen):
    """One step: `percent` of the traffic on the new set, for the whole set (`part` None) or,
    with `sync: independent`, for `part` alone once the parts in `done` have moved."""

    index: int  # over every step of the rollout: what a continued run bakes again
    percent: int
    number: int  # 1-based, within the set's walk or the part's
    of: int
    part: str | None = None
    done: list[str] = Field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.part + ' ' if self.part else ''}step {self.number}/{self.of} ({self.percent}%)"


def is_gradual(input: RolloutInput) -> bool:
    """Step by step, unless nothing serves yet or a capacity move keeps the same apps (replica
    counts change in place: nothing to move traffic between)."""
    if input.old_set is None or not input.old_apps:
        return False
    old_plan = input.old_plan or input.plan
    return not (input.old_set.id == input.new_set.id and old_plan.revision == input.plan.revision)


def rolling_parts(input: RolloutInput) -> list[str]:
    """sync: independent: the parts whose snapshot changed, in DAG order (each rolls on its own);
    none (the whole set moves) when the sets run under different specs."""
    old = input.old_set
    if not is_gradual(input) or input.spec.sync != "independent" or old is None or old.id == input.new_set.id:
        return []
    if input.old_spec is not None and input.old_spec != input.spec:
        return []  # a model update changed parts or the DAG: the sets' parts do not mix
    return [
        part
        for part in input.spec.topological_order()
        if part in input.new_set.parts
        and (part not in old.parts or old.parts[part].snapshot_id != input.new_set.parts[part].snapshot_id)
    ]


def rollout_steps(input: RolloutInput) -> list[RolloutStep]:
    """Every step the rollout walks: the model's `rollout.steps` for the whole set; with `sync:
    independent`, all of them for each changed part in turn; one step to 100% when it is not
    gradual (a first rollout, or replica counts changed in place)."""
    percents = list(input.spec.rollout.steps) if is_gradual(input) else [100]
    parts = rolling_parts(input)
    if not parts:
        return [
            RolloutStep(index=i, percent=p, number=i + 1, of=len(percents)) for i, p in enumerate(percents)
        ]
    return [
        RolloutStep(
            index=k * len(percents) + n - 1, percent=p, number=n, of=len(percents), part=part, done=parts[:k]
        )
        for k, part in enumerate(parts)
        for n, p in enumerate(percents, start=1)
    ]


def start_weights(input: RolloutInput) -> Weights:
    """The routers' weights before the move (none for a rollout that is not gradual)."""
    return {region: {app: 100.0} for region, app in input.old_apps.items()} if is_gradual(input) else {}


def initial_traffic(input: RolloutInput) -> dict[str, float]:
    """Set id -> percent before anything moved."""
    traffic = {input.new_set.id: 0.0}
    if input.old_set is not None and input.old_set.id != input.new_set.id:
        traffic[input.old_set.id] = 100.0
    return traffic


def traffic_split(input: RolloutInput, percent: float) -> dict[str, float]:
    """Set id -> percent once the new set takes `percent`; a capacity move keeps one set serving."""
    if input.old_set is not None and input.old_set.id == input.new_set.id:
        return {input.new_set.id: 100.0}
    traffic = {input.new_set.id: percent}
    if input.old_set is not None:
        traffic[input.old_set.id] = 100.0 - percent
    return traffic


def cutover_weights(input: RolloutInput, new_apps: dict[str, str]) -> Weights:
    """Router weights once the new set (or placement) takes all traffic: each serving region's
    router to its new app, and the router of every other region the model's traffic comes from
    (or that served before) to the app of the region that takes its traffic, so callers of its
    URL keep getting answers. A down region's router is left out: it has no node to run on."""
    weights = serving_weights(input.plan, new_apps, input.old_apps)
    return {r: w for r, w in weights.items() if r not in input.down_regions}


def lost_apps(input: RolloutInput) -> list[str]:
    """The old apps of the input's down regions (their replicas died with the region's node)."""
    return sorted(app for region, app in input.old_apps.items() if region in input.down_regions)


def without_down_regions(input: RolloutInput) -> RolloutInput:
    """The rollout as it runs while `down_regions` are down: their old apps and the old plan's
    replicas there dropped, so no step deploys, routes to, waits on or gates a region that has
    no node (Serve would wait forever for a replica it cannot place). The same input without
    down regions."""
    if not input.down_regions:
        return input
    down = set(input.down_regions)

    def strip(plan: Plan) -> Plan:
        return plan.model_copy(
            update={
                "deployments": {
                    name: d.model_copy(
                        update={"replicas": {r: hw for r, hw in d.replicas.items() if r not in down}}
                    )
                    for name, d in plan.deployments.items()
                }
            }
        )

    return input.model_copy(
        update={
            "plan": strip(input.plan),
            "old_plan": strip(input.old_plan) if input.old_plan is not None else None,
            "old_apps": {r: app for r, app in input.old_apps.items() if r not in down},
        }
    )


def serving_weights(plan: Plan, apps: dict[str, str], also: Iterable[str] = ()) -> Weights:
    """Router weights while `apps` (region -> set app on `plan`) serve all traffic: each of
    their regions to its own app; every other region the plan takes traffic from, and every
    region in `also` (routers that exist), to the app of the region serving its traffic."""
    weights = {region: {app: 100.0} for region, app in apps.items()}
    sources = {s for p in plan.deployments.values() for s in p.fractions}
    for region in sorted((sources | set(also)) - set(apps)):
        targets = sorted(t for p in plan.deployments.values() if (t := p.serving_region(region)) in apps)
        if targets:
            weights[region] = {apps[targets[0]]: 100.0}
    return weights


def part_weights(start: Weights, end: Weights, done: list[str], part: str, percent: float) -> PartWeights:
    """Per region: the parts already moved at `end`, and `part` `percent` of the way there."""
    mixed = mix_weights(start, end, percent)
    return {
        region: {
            **{d: dict(end[region] if region in end else start[region]) for d in done},
            part: mixed[region],
        }
        for region in sorted(set(start) | set(end))
        if region in mixed
    }


def step_routes(
    start: Weights, end: Weights, percent: float, part: str | None = None, done: list[str] | None = None
) -> Routes:
    """What the routers get with `percent` on the new set. The whole set: its weights
    `percent` of the way from `start` to `end` (`end` when nothing served before, `start` at
    0). One part (sync: independent): the DAG stays at `start`, that part and the parts already
    moved get their own weights, and requests are counted against the moving part."""
    if part is not None:
        return start, part_weights(start, end, list(done or []), part, percent), part
    if not start:
        return end, {}, None
    return (mix_weights(start, end, percent) if percent > 0 else start), {}, None


def new_set_scales(step: RolloutStep, parts: list[str]) -> dict[str, float]:
    """Part -> the new set's share of its plan for `step`: the step's share for what moves, all
    of it for the parts already moved, one replica for the parts still waiting."""
    share = step.percent / 100
    if step.part is None:
        return dict.fromkeys(parts, share)
    return {p: share if p == step.part else 1.0 if p in step.done else IDLE_SHARE for p in parts}


def old_set_scales(step: RolloutStep, scales: dict[str, float]) -> dict[str, float] | None:
    """Part -> the old set's share of its plan once `step` has baked: what its remaining
    traffic needs. None: the old set keeps its size (the whole set at 100%: it goes once the
    rollout completes). A part at 100% keeps one idle replica until the set is removed."""
    left = (100 - step.percent) / 100
    if step.part is None:
        return dict.fromkeys(scales, left) if step.percent < 100 else None
    return {**scales, step.part: left if step.percent < 100 else IDLE_SHARE}


def deploy_scale(scales: dict[str, float], parts: list[str]) -> tuple[float, dict[str, float]]:
    """`deploy_set_apps`'s (scale, part_scales) for per-part shares: one scale when every part
    has the same share, else the shares themselves."""
    if scales and set(scales) == set(parts) and len(set(scales.values())) == 1:
        return next(iter(scales.values())), {}
    return 1.0, dict(scales)


def carried_share(
    plan: Plan, headroom: float, scales: dict[str, float], only: set[str] | None = None
) -> float:
    """The share of the model's traffic the old set's replicas, each part at its scale, carry at
    full load (1.0 or more: all of it), over the plan's deployments (`only` those, if given).
    The plan sizes replicas for all traffic at (1 - headroom) load."""
    shares = []
    for name, placement in plan.deployments.items():
        if only is not None and name not in only:
            continue
        scale = scales.get(name.split("/", 1)[-1], 1.0)
        full = sum(n for by_hw in placement.replicas.values() for n in by_hw.values())
        now = sum(scaled_replicas(n, scale) for by_hw in placement.replicas.values() for n in by_hw.values())
        if full:
            shares.append(now / full / max(1e-9, 1 - headroom))
    return min(shares) if shares else 1.0


def rollback_percent(
    plan: Plan, headroom: float, scales: dict[str, float], only: set[str] | None = None
) -> float:
    """Percent of the traffic that stays on the new set in a rollback's first weight change:
    what the old set's replicas, at their current scales, cannot carry at full load."""
    return max(0.0, 100.0 - 100.0 * carried_share(plan, headroom, scales, only))


# A capacity move is tried this many times in all (ModelWorkflow waits one serving check's
# interval before each retry, and the check that runs first puts Serve back on the record).
CAPACITY_MOVE_ATTEMPTS = 3


def capacity_retry(move: ApplyPlanInput | None, ended: RolloutState) -> ApplyPlanInput | None:
    """The next try of a capacity move whose rollout ended `ended`, or None. Only a move that
    failed is tried again: an activity gave up (Serve did not start the new apps in time, Ray
    was lost), a fault of the moment, and a region's return must not wait hours for the next
    scheduled replan because its node came back slowly. A gate breach, an abort, a cancel or a
    freeze is an answer, not a fault: the old placement serves and the move is not repeated."""
    if move is None or ended != RolloutState.FAILED or move.attempt >= CAPACITY_MOVE_ATTEMPTS:
        return None
    return move.model_copy(update={"attempt": move.attempt + 1})


# A continued rollout bakes its step again from a fresh window, so one run must hold a step
# (scale, shift: tens of events) and a whole bake (a timer, a metrics read and a workflow task
# per check: at most EVENTS_PER_CHECK events), or no bake would ever end.
ROLLOUT_HISTORY_FLOOR = 100
EVENTS_PER_CHECK = 10


def rollout_history_limit(rollout: RolloutSpec, model_limit: int) -> int:
    """A rollout's history limit: the model's own, never under what one step and its bake need."""
    checks = math.ceil(rollout.bake_seconds / rollout.check_interval_seconds)
    return max(ROLLOUT_HISTORY_FLOOR + EVENTS_PER_CHECK * checks, model_limit)
