"""A PlanningProblem compiled into index arrays the formulation builds models from.

Deployments of one `group` form a block: they share routing fractions and regions, so a
block is the unit the decomposition solves on its own. Obvious impossibilities (a source
with no region within budget, too few regions, a deployment no pool can host, or none that
can hold its spare replicas) are reported here with their names, before any solver runs.

The spare (`spare_replicas` k): wherever a deployment stands, its capacity less k replicas of
its largest-QPS option there carries what is routed there under the headroom (`spare`). Every
solver holds plans to this one linear rule; it implies the validator's (losing any k replicas
leaves the load carried), which needs the k largest replicas actually placed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipnext.contracts.plan import PlanningProblem
from ipnext.errors import InfeasiblePlanError
from ipnext.spec.demand_file import DeploymentDemand

__all__ = ["FLEET_BLOCKS", "Instance", "compile_problem", "regions_needed"]

# Past this many blocks an instance is planned as a fleet: no branch for the bound, the plan
# chosen from the columns without the IP over all of them, more of the time for pricing.
FLEET_BLOCKS = 300


@dataclass
class Instance:
    problem: PlanningProblem
    regions: list[str]
    hardware: list[str]
    pool_units: np.ndarray  # (regions, hardware); 0 where no pool
    pool_cost: np.ndarray  # (regions, hardware) unit cost
    blocks: list[list[int]]  # deployment indices
    block_of: np.ndarray  # deployment -> block
    demand: np.ndarray  # (deployments, regions as sources) QPS
    usable: np.ndarray  # (deployments,) 1 - headroom
    min_regions: np.ndarray  # (blocks,)
    survive: np.ndarray  # (deployments,) bool
    # (deployments, regions): the usable QPS a region holds back where the deployment stands,
    # usable x spare_replicas x the largest QPS of its options there (0 without a spare)
    spare: np.ndarray
    # Options: one per (deployment, region, hardware) a replica may take.
    opt_d: np.ndarray
    opt_r: np.ndarray
    opt_h: np.ndarray
    opt_units: np.ndarray
    opt_qps: np.ndarray
    opt_cost: np.ndarray  # cost of one replica
    opt_cap: np.ndarray  # most replicas the pool holds
    opt_current: np.ndarray  # replicas in the current plan
    # Replicas of the option that alone carry the deployment's whole demand and its spare in
    # the region: more never help (every row is met by that many), so they bound x.
    opt_enough: np.ndarray
    # Routes: one per (block, source, region) a fraction may take.
    route_b: np.ndarray
    route_s: np.ndarray
    route_r: np.ndarray
    options_of: list[np.ndarray] = field(default_factory=list)  # deployment -> option indices
    routes_of: list[np.ndarray] = field(default_factory=list)  # block -> route indices

    @property
    def total_demand(self) -> np.ndarray:
        return self.demand.sum(axis=1)

    @property
    def fleet(self) -> bool:
        """Planned as a fleet: more than FLEET_BLOCKS blocks."""
        return len(self.blocks) > FLEET_BLOCKS


def compile_problem(problem: PlanningProblem) -> Instance:
    fleet = problem.fleet
    regions = list(fleet.regions)
    hardware = sorted(fleet.hardware)
    r_index = {r: i for i, r in enumerate(regions)}
    h_index = {h: i for i, h in enumerate(hardware)}
    pool_units = np.zeros((len(regions), len(hardware)))
    pool_cost = np.zeros((len(regions), len(hardware)))
    for pool in fleet.pools:
        pool_units[r_index[pool.region], h_index[pool.hardware]] = pool.units
        pool_cost[r_index[pool.region], h_index[pool.hardware]] = pool.unit_cost
    deps = problem.deployments
    names = [d.name for d in deps]
    if len(set(names)) != len(names):
        dupes = sorted({n for n in names if names.count(n) > 1})
        raise InfeasiblePlanError(
            f"deployments: duplicate names {dupes}", field="deployments.name", value=dupes
        )

    by_group: dict[str, list[int]] = {}
    blocks: list[list[int]] = []
    for i, dep in enumerate(deps):
        if dep.group is None:
            blocks.append([i])
        else:
            by_group.setdefault(dep.group, []).append(i)
    blocks.extend(by_group.values())
    block_of = np.zeros(len(deps), dtype=np.int64)
    for b, members in enumerate(blocks):
        block_of[members] = b

    demand = np.zeros((len(deps), len(regions)))
    for i, dep in enumerate(deps):
        for source, qps in dep.demand_qps.items():
            if source not in r_index:
                raise InfeasiblePlanError(
                    f"{dep.name}: traffic source {source!r} is not a region of the fleet.",
                    field="demand_qps",
                    value=source,
                    fix=f"use one of {regions}",
                )
            demand[i, r_index[source]] = qps
    cur = problem.current.deployments if problem.current else {}

    opt: dict[str, list[float]] = {k: [] for k in ("d", "r", "h", "units", "qps", "cost", "cap", "current")}
    options_of: list[np.ndarray] = []
    for i, dep in enumerate(deps):
        start = len(opt["d"])
        for r, region in enumerate(regions):
            for hw, option in sorted(dep.hardware.items()):
                if hw not in h_index or pool_units[r, h_index[hw]] < option.units:
                    continue
                h = h_index[hw]
                opt["d"].append(i)
                opt["r"].append(r)
                opt["h"].append(h)
                opt["units"].append(option.units)
                opt["qps"].append(option.qps)
                opt["cost"].append(option.units * pool_cost[r, h])
                opt["cap"].append(pool_units[r, h] // option.units)
                current = cur.get(dep.name)
                opt["current"].append(current.replicas.get(region, {}).get(hw, 0) if current else 0)
        if len(opt["d"]) == start:
            raise InfeasiblePlanError(
                f"{dep.name}: no pool of {sorted(dep.hardware)} can hold even one replica.",
                field="hardware",
                value=sorted(dep.hardware),
                fix="add a pool of one of these hardware classes, or allow other hardware",
            )
        options_of.append(np.arange(start, len(opt["d"])))

    route: dict[str, list[int]] = {"b": [], "s": [], "r": []}
    routes_of: list[np.ndarray] = []
    min_regions = np.zeros(len(blocks), dtype=np.int64)
    for b, members in enumerate(blocks):
        start = len(route["b"])
        hosts = [r for r in range(len(regions)) if all(_hosts(i, r, opt, options_of) for i in members)]
        need = regions_needed([deps[i] for i in members])
        min_regions[b] = need
        if len(hosts) < need:
            raise InfeasiblePlanError(
                f"{_label(deps, members)}: min_regions needs {need} regions, only {len(hosts)} "
                f"({[regions[r] for r in hosts]}) have pools for every part.",
                field="min_regions",
                value=need,
                fix="lower min_regions (or survive_region_loss) or add pools in more regions",
            )
        for s in range(len(regions)):
            active = [i for i in members if demand[i, s] > 0]
            if not active:
                continue
            budget = min(deps[i].latency_budget_ms for i in active)
            targets = [r for r in hosts if fleet.latency(regions[s], regions[r]) <= budget]
            if not targets:
                nearest = min((fleet.latency(regions[s], regions[r]) for r in hosts), default=float("inf"))
                raise InfeasiblePlanError(
                    f"{_label(deps, members)}: no region within latency_budget_ms={budget:g} of source "
                    f"{regions[s]!r} can host it (nearest host is "
                    f"{nearest:g} ms away).",
                    field="latency_budget_ms",
                    value=budget,
                    fix="raise the latency budget or add pools near the source",
                )
            for r in targets:
                route["b"].append(b)
                route["s"].append(s)
                route["r"].append(r)
        routes_of.append(np.arange(start, len(route["b"])))

    def arr(values: Sequence[float], dtype: type = np.float64) -> np.ndarray:
        return np.asarray(values, dtype=dtype)

    usable = arr([1 - d.headroom for d in deps])
    opt_d, opt_r, opt_qps = arr(opt["d"], np.int64), arr(opt["r"], np.int64), arr(opt["qps"])
    spare = _spare(deps, usable, opt_d, opt_r, opt_qps, len(regions))
    _check_spare_fits(deps, usable, demand, spare, opt_d, opt_r, opt_qps, arr(opt["cap"]))
    total = demand.sum(axis=1)
    opt_enough = np.ceil((total[opt_d] + spare[opt_d, opt_r]) / (usable[opt_d] * opt_qps) - 1e-9)

    return Instance(
        problem=problem,
        regions=regions,
        hardware=hardware,
        pool_units=pool_units,
        pool_cost=pool_cost,
        blocks=blocks,
        block_of=block_of,
        demand=demand,
        usable=usable,
        min_regions=min_regions,
        survive=np.asarray([d.survive_region_loss for d in deps], dtype=bool),
        spare=spare,
        opt_d=opt_d,
        opt_r=opt_r,
        opt_h=arr(opt["h"], np.int64),
        opt_units=arr(opt["units"]),
        opt_qps=opt_qps,
        opt_cost=arr(opt["cost"]),
        opt_cap=arr(opt["cap"]),
        opt_current=arr(opt["current"]),
        opt_enough=opt_enough,
        route_b=arr(route["b"], np.int64),
        route_s=arr(route["s"], np.int64),
        route_r=arr(route["r"], np.int64),
        options_of=options_of,
        routes_of=routes_of,
    )


def regions_needed(members: Sequence[DeploymentDemand]) -> int:
    """How many regions a block of these deployments must stand in: the most min_regions of
    any, and two when one must survive losing a region."""
    need = max(d.min_regions for d in members)
    if any(d.survive_region_loss for d in members):
        need = max(need, 2)
    return need


def _spare(
    deps: list[DeploymentDemand],
    usable: np.ndarray,
    opt_d: np.ndarray,
    opt_r: np.ndarray,
    opt_qps: np.ndarray,
    n_regions: int,
) -> np.ndarray:
    """(deployments, regions): usable x spare_replicas x the largest QPS of the deployment's
    options in the region (0 where it has none, or no spare)."""
    largest = np.zeros((len(deps), n_regions))
    np.maximum.at(largest, (opt_d, opt_r), opt_qps)
    k = np.asarray([float(d.spare_replicas) for d in deps])
    return (usable * k)[:, None] * largest


def _check_spare_fits(
    deps: list[DeploymentDemand],
    usable: np.ndarray,
    demand: np.ndarray,
    spare: np.ndarray,
    opt_d: np.ndarray,
    opt_r: np.ndarray,
    opt_qps: np.ndarray,
    opt_cap: np.ndarray,
) -> None:
    """A deployment whose pools, each filled with its replicas, cannot carry its demand beside
    a spare in every region it stands in can never be placed: said here, naming the spare."""
    for i, dep in enumerate(deps):
        if not dep.spare_replicas:
            continue
        mine = opt_d == i
        most = np.zeros(spare.shape[1])
        np.add.at(most, opt_r[mine], usable[i] * opt_cap[mine] * opt_qps[mine])
        carry = float(np.maximum(most - spare[i], 0.0).sum())
        total = float(demand[i].sum())
        if carry < total * (1 - 1e-9):
            raise InfeasiblePlanError(
                f"{dep.name}: with spare_replicas={dep.spare_replicas}, the pools it may use carry at "
                f"most {carry:g} QPS under the headroom beside {dep.spare_replicas} spare replica(s) in "
                f"each region, short of its {total:g} QPS.",
                field="spare_replicas",
                value=dep.spare_replicas,
                fix="lower spare_replicas, or add units to the pools of its hardware",
            )


def _hosts(i: int, r: int, opt: dict[str, list[float]], options_of: list[np.ndarray]) -> bool:
    return any(opt["r"][o] == r for o in options_of[i])


def _label(deps: list[Any], members: list[int]) -> str:
    names = [deps[i].name for i in members]
    group = deps[members[0]].group
    return f"group {group} ({', '.join(names)})" if group and len(names) > 1 else names[0]
