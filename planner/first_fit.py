"""First-fit decreasing: the benchmark's baseline placement.

Blocks (a deployment, or a group's parts) go largest first. Each traffic source, largest
first, goes whole to the nearest region within the latency budget where every part still
fits its share; each region gets the cheapest hardware per QPS that still has room for the
replicas (and `spare_replicas` more where it carries any load). It meets every constraint
(pools, routing, capacity, spare replicas, min_regions, survive_region_loss, groups) but does
not search: it never splits a source, never moves a placed block, and gives up when the next
block fits nowhere.
"""

from __future__ import annotations

import math
from collections import defaultdict

from ipnext.contracts.plan import DeploymentPlacement, Plan, PlanningProblem, SolveOptions
from ipnext.errors import InfeasiblePlanError
from ipnext.planner.instance import regions_needed
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet, Pool
from ipnext.spec.model import HardwareOption

__all__ = ["solve"]


def solve(problem: PlanningProblem, options: SolveOptions | None = None) -> Plan:
    options = options or SolveOptions()
    fleet = problem.fleet
    used: dict[tuple[str, str], int] = defaultdict(int)  # (region, hw) -> units taken
    placements: dict[str, DeploymentPlacement] = {}
    blocks = sorted(_groups(problem.deployments), key=_size, reverse=True)
    for k, members in enumerate(blocks):
        try:
            fractions = _route(fleet, members, used)
            regions = sorted({r for row in fractions.values() for r in row})
            regions = _add_regions(fleet, members, regions, used)
            for dep in members:
                placements[dep.name] = _place(fleet, dep, fractions, regions, used)
        except InfeasiblePlanError as err:
            if k == 0:
                raise
            raise InfeasiblePlanError(
                f"first-fit placed {k} of {len(blocks)} blocks, then: {err}",
                field=err.field,
                value=err.value,
            ) from None
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


def _size(members: list[DeploymentDemand]) -> float:
    """Units the block needs at its cheapest hardware per QPS (the 'decreasing' of FFD)."""
    return sum(
        sum(d.demand_qps.values()) / (1 - d.headroom) * min(o.units / o.qps for o in d.hardware.values())
        for d in members
    )


def _hosts(fleet: Fleet, dep: DeploymentDemand, region: str) -> bool:
    return any(fleet.pool(region, hw) for hw in dep.hardware)


def _fits(
    fleet: Fleet, dep: DeploymentDemand, region: str, qps: float, used: dict[tuple[str, str], int]
) -> bool:
    """Whether some hardware in the region still has room for the replicas that carry `qps`."""
    return _pick_hardware(fleet, dep, region, qps, used) is not None


def _carried(dep: DeploymentDemand, qps: float) -> float:
    return sum(dep.demand_qps.values()) if dep.survive_region_loss else qps


def _fits_all(
    fleet: Fleet,
    members: list[DeploymentDemand],
    region: str,
    qps: dict[str, float],
    used: dict[tuple[str, str], int],
) -> bool:
    """Whether every member fits its `qps` in the region together (parts may share a pool).
    A part that must survive a region loss carries its whole demand in each of its regions
    (simple, and always enough; the optimizing planner does better)."""
    taken = defaultdict(int, used)
    for d in members:
        picked = _pick_hardware(fleet, d, region, _carried(d, qps[d.name]), taken)
        if picked is None:
            return False
        hw, count = picked
        taken[(region, hw)] += count * d.hardware[hw].units
    return all(taken[k] <= p.units for k in taken if (p := fleet.pool(*k)) is not None)


def _replicas(dep: DeploymentDemand, option: HardwareOption, qps: float) -> int:
    """Replicas of one option that carry `qps` under the headroom, and where they carry any,
    `spare_replicas` more: losing any of them leaves the rest carrying it."""
    count = math.ceil(qps / ((1 - dep.headroom) * option.qps) - 1e-9)
    return max(1, count + dep.spare_replicas if count > 0 else 0)


def _pick_hardware(
    fleet: Fleet, dep: DeploymentDemand, region: str, qps: float, used: dict[tuple[str, str], int]
) -> tuple[str, int] | None:
    """The cheapest hardware per QPS with room in the region for the replicas `qps` needs."""
    best: tuple[float, str, int] | None = None
    for hw, option in sorted(dep.hardware.items()):
        pool = fleet.pool(region, hw)
        if pool is None:
            continue
        count = _replicas(dep, option, qps)
        if count * option.units > pool.units - used[(region, hw)]:
            continue
        price = count * option.units * pool.unit_cost
        if best is None or price < best[0]:
            best = (price, hw, count)
    return (best[1], best[2]) if best else None


def _route(
    fleet: Fleet, members: list[DeploymentDemand], used: dict[tuple[str, str], int]
) -> dict[str, dict[str, float]]:
    """Each source, largest first, goes whole to the nearest region within budget where every
    member still fits what is routed there."""
    budget = min(d.latency_budget_ms for d in members)
    load = {s: sum(d.demand_qps.get(s, 0.0) for d in members) for d in members for s in d.demand_qps}
    sources = sorted((s for s in load if load[s] > 0), key=lambda s: (-load[s], s))
    fractions: dict[str, dict[str, float]] = {}
    routed: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # region -> dep -> qps
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
        candidates.sort(key=lambda r: (fleet.latency(source, r), r))
        # Nearest first; a source that does not fit whole in one region is split: each region
        # takes the largest share that still fits (halving search), the next takes the rest.
        left = 1.0
        fractions[source] = {}
        for r in candidates:

            def fits(share: float, r: str = r, source: str = source) -> bool:
                loads = {d.name: routed[r][d.name] + share * d.demand_qps.get(source, 0.0) for d in members}
                return _fits_all(fleet, members, r, loads, used)

            if fits(left):
                share = left
            else:
                lo, hi = 0.0, left
                for _ in range(30):
                    mid = (lo + hi) / 2
                    lo, hi = (mid, hi) if fits(mid) else (lo, mid)
                share = lo
            if share <= 1e-6:
                continue
            for d in members:
                routed[r][d.name] += share * d.demand_qps.get(source, 0.0)
            fractions[source][r] = share
            left -= share
            if left <= 1e-9:
                break
        if left > 1e-6:
            raise InfeasiblePlanError(
                f"pools: first-fit found no room within {budget} ms of {source!r} for "
                f"{100 * left:.1f}% of the traffic of {[d.name for d in members]} ({load[source]:g} QPS).",
                field="pools",
                value=source,
                fix="add units to the pools near the source, or raise the latency budget",
            )
        total = sum(fractions[source].values())
        fractions[source] = {r: f / total for r, f in fractions[source].items()}
    return fractions


def _add_regions(
    fleet: Fleet, members: list[DeploymentDemand], regions: list[str], used: dict[tuple[str, str], int]
) -> list[str]:
    need = regions_needed(members)
    spare = [
        r
        for r in fleet.regions
        if r not in regions
        and all(_hosts(fleet, d, r) for d in members)
        and _fits_all(fleet, members, r, {d.name: 0.0 for d in members}, used)
    ]
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
    # The cheapest hardware per QPS with room for the region's share (survive_region_loss may
    # add replicas below; the pool check after that has the last word).
    choice: dict[str, str] = {}
    count: dict[str, int] = {}
    for region in regions:
        picked = _pick_hardware(fleet, dep, region, _carried(dep, routed[region]), used)
        if picked is None:  # no room anywhere: report it below against the cheapest option
            hw = min(
                (h for h in dep.hardware if fleet.pool(region, h)), key=lambda h: _pool_cost(fleet, region, h)
            )
            picked = (hw, _replicas(dep, dep.hardware[hw], routed[region]))
        choice[region], count[region] = picked
    usable = 1.0 - dep.headroom

    def capacity(region: str) -> float:
        return usable * dep.hardware[choice[region]].qps

    def room_for_one_more(region: str) -> bool:
        hw = choice[region]
        pool = fleet.pool(region, hw)
        return (
            pool is not None
            and (count[region] + 1) * dep.hardware[hw].units <= pool.units - used[(region, hw)]
        )

    if dep.survive_region_loss:
        total = sum(dep.demand_qps.values())
        for lost in regions:
            while sum(count[r] * capacity(r) for r in regions if r != lost) < total - 1e-9:
                others = [r for r in regions if r != lost]
                roomy = [
                    r for r in others if room_for_one_more(r)
                ] or others  # none: the pool check reports it
                count[min(roomy, key=lambda r: (count[r] * capacity(r), r))] += 1
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
