"""A first placement: route each traffic source to its nearest region within the latency
budget, then give each region the cheapest replicas that carry its share with headroom.

This is the placement a model gets when it is created. It meets every constraint
(pools, routing, capacity, min_regions, survive_region_loss, groups) but does not
search for the cheapest plan across the fleet; the global optimizing planner
replaces it behind the same `solve(problem, options) -> Plan` interface.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ipnext.errors import InfeasiblePlanError
from ipnext.fleet import Fleet, Pool
from ipnext.plan import DeploymentDemand, DeploymentPlacement, Plan, PlanningProblem, SolveOptions

__all__ = ["solve"]


def solve(problem: PlanningProblem, options: SolveOptions | None = None) -> Plan:
    options = options or SolveOptions()
    fleet = problem.fleet
    used: dict[tuple[str, str], int] = defaultdict(int)  # (region, hw) -> units taken
    placements: dict[str, DeploymentPlacement] = {}
    for members in _groups(problem.deployments):
        fractions = _route(fleet, members)
        regions = sorted({r for row in fractions.values() for r in row})
        regions = _add_regions(fleet, members, regions)
        for dep in members:
            placements[dep.name] = _place(fleet, dep, fractions, regions, used)
    cost = sum(
        n * dep.hardware[hw].units * _pool_cost(fleet, region, hw)
        for dep in problem.deployments
        for region, by_hw in placements[dep.name].replicas.items()
        for hw, n in by_hw.items()
    )
    return Plan(
        deployments=placements,
        cost=round(cost, 6),
        moved_units=_moved_units(problem, placements),
        solver="first-fit",
        revision=(problem.current.revision + 1) if problem.current else 1,
    )


def _groups(deployments: list[DeploymentDemand]) -> list[list[DeploymentDemand]]:
    by_group: dict[str, list[DeploymentDemand]] = {}
    for dep in deployments:
        by_group.setdefault(dep.group or f"\0{dep.name}", []).append(dep)
    return list(by_group.values())


def _hosts(fleet: Fleet, dep: DeploymentDemand, region: str) -> bool:
    return any(fleet.pool(region, hw) for hw in dep.hardware)


def _route(fleet: Fleet, members: list[DeploymentDemand]) -> dict[str, dict[str, float]]:
    """Each source goes whole to the nearest region that is within budget and hosts every member."""
    budget = min(d.latency_budget_ms for d in members)
    sources = sorted({s for d in members for s in d.demand_qps if d.demand_qps[s] > 0})
    fractions: dict[str, dict[str, float]] = {}
    for source in sources:
        candidates = [
            r
            for r in fleet.regions
            if fleet.latency(source, r) <= budget and all(_hosts(fleet, d, r) for d in members)
        ]
        if not candidates:
            raise InfeasiblePlanError(
                f"routing: no region within latency_budget_ms={budget} of source {source!r} "
                f"can host {[d.name for d in members]}.",
                field="latency_budget_ms",
                value=budget,
                fix="raise the latency budget or add pools for the parts' hardware near the source",
            )
        best = min(candidates, key=lambda r: (fleet.latency(source, r), r))
        fractions[source] = {best: 1.0}
    return fractions


def _add_regions(fleet: Fleet, members: list[DeploymentDemand], regions: list[str]) -> list[str]:
    need = max(d.min_regions for d in members)
    if any(d.survive_region_loss for d in members):
        need = max(need, 2)
    spare = [r for r in fleet.regions if r not in regions and all(_hosts(fleet, d, r) for d in members)]
    while len(regions) < need and spare:
        regions = sorted([*regions, spare.pop(0)])
    if len(regions) < need:
        raise InfeasiblePlanError(
            f"min_regions: {[d.name for d in members]} need {need} regions but only "
            f"{len(regions)} can host every part.",
            field="min_regions",
            value=need,
            fix="lower min_regions (or turn off survive_region_loss) or add pools in more regions",
        )
    return regions


def _place(
    fleet: Fleet,
    dep: DeploymentDemand,
    fractions: dict[str, dict[str, float]],
    regions: list[str],
    used: dict[tuple[str, str], int],
) -> DeploymentPlacement:
    routed = {r: 0.0 for r in regions}
    for source, row in fractions.items():
        for region, share in row.items():
            routed[region] += dep.demand_qps.get(source, 0.0) * share
    # Cheapest hardware per served QPS that has a pool in the region.
    choice: dict[str, str] = {}
    for region in regions:
        options = [hw for hw in dep.hardware if fleet.pool(region, hw)]
        choice[region] = min(
            options,
            key=lambda hw: (
                dep.hardware[hw].units * _pool_cost(fleet, region, hw) / dep.hardware[hw].qps,
                hw,
            ),
        )
    usable = 1.0 - dep.headroom

    def capacity(region: str) -> float:
        return usable * dep.hardware[choice[region]].qps

    count = {r: max(1, math.ceil(routed[r] / capacity(r) - 1e-9)) for r in regions}
    if dep.survive_region_loss:
        total = sum(dep.demand_qps.values())
        for lost in regions:
            while sum(count[r] * capacity(r) for r in regions if r != lost) < total - 1e-9:
                others = [r for r in regions if r != lost]
                count[min(others, key=lambda r: (count[r] * capacity(r), r))] += 1
    replicas: dict[str, dict[str, int]] = {}
    for region in regions:
        hw = choice[region]
        units = count[region] * dep.hardware[hw].units
        pool = fleet.pool(region, hw) or _missing_pool(region, hw)
        free = pool.units - used[(region, hw)]
        if units > free:
            raise InfeasiblePlanError(
                f"pools: {dep.name} needs {units} units of {hw} in {region}, {free} of "
                f"{pool.units} are free.",
                field=f"pools.{region}.{hw}",
                value=units,
                fix="add units to the pool, lower the demand, or allow other hardware for the part",
            )
        used[(region, hw)] += units
        replicas[region] = {hw: count[region]}
    return DeploymentPlacement(replicas=replicas, fractions=fractions)


def _missing_pool(region: str, hw: str) -> Pool:
    raise RuntimeError(f"internal: hardware {hw} was chosen in {region} without a pool")


def _pool_cost(fleet: Fleet, region: str, hw: str) -> float:
    pool = fleet.pool(region, hw)
    return pool.unit_cost if pool else math.inf


def _moved_units(problem: PlanningProblem, placements: dict[str, DeploymentPlacement]) -> int:
    if problem.current is None:
        return 0
    moved = 0
    units = {d.name: d.hardware for d in problem.deployments}
    for name, placement in placements.items():
        old = problem.current.deployments.get(name)
        for region, by_hw in placement.replicas.items():
            for hw, n in by_hw.items():
                before = old.replicas.get(region, {}).get(hw, 0) if old else 0
                moved += max(0, n - before) * units[name][hw].units
    return moved
