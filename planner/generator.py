"""Seeded planning instances for tests and benchmarks: fleets with regions on a plane, and
deployments shaped like real models (a few hardware options, traffic from a few sources,
groups of parts that share routing, some needing several regions or to survive a region loss).

`utilization` sets total pool capacity against an estimate of what the demand needs, so 0.9
gives nearly full pools that couple every deployment.
"""

from __future__ import annotations

import math
import random

from ipnext.contracts.plan import PlanningProblem
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet, HardwareClass, Pool
from ipnext.spec.model import HardwareOption

__all__ = ["changed_demand", "generate"]


def generate(
    seed: int,
    deployments: int,
    regions: int,
    hardware: int,
    *,
    utilization: float = 0.5,
    group_share: float = 0.3,
) -> PlanningProblem:
    rng = random.Random(seed)
    region_names = [f"r{i}" for i in range(regions)]
    hw_names = [f"{'gpu' if i % 2 else 'cpu'}{i}" for i in range(hardware)]
    points = {r: (rng.uniform(0, 100), rng.uniform(0, 100)) for r in region_names}
    latency = {
        s: {r: round(1 + math.dist(points[s], points[r]) * 1.2, 1) for r in region_names}
        for s in region_names
    }
    hw_speed = {h: rng.choice([1.0, 2.0, 4.0, 8.0]) for h in hw_names}
    hw_units = {h: rng.choice([1, 2, 4]) for h in hw_names}

    demands: list[DeploymentDemand] = []
    while len(demands) < deployments:
        size = 1
        if rng.random() < group_share:
            size = min(rng.choice([2, 3]), deployments - len(demands))
        group = f"g{len(demands)}" if size > 1 else None
        sources = rng.sample(region_names, k=min(len(region_names), rng.choice([1, 1, 2, 3, 4])))
        qps = {s: round(rng.lognormvariate(4.5, 1.2), 1) for s in sources}
        budget = rng.choice([40.0, 60.0, 90.0, 150.0])
        min_regions = rng.choice([1, 1, 1, 2, 2, 3])
        survive = rng.random() < 0.3
        headroom = rng.choice([0.1, 0.2, 0.3])
        for part in range(size):
            options = rng.sample(hw_names, k=rng.randint(1, min(3, len(hw_names))))
            base_qps = rng.lognormvariate(4.0, 0.8)
            demands.append(
                DeploymentDemand(
                    name=f"d{len(demands)}",
                    hardware={
                        h: HardwareOption(
                            units=hw_units[h] * rng.choice([1, 1, 2]), qps=round(base_qps * hw_speed[h], 1)
                        )
                        for h in options
                    },
                    demand_qps=qps,
                    latency_budget_ms=budget,
                    headroom=headroom,
                    min_regions=min_regions,
                    survive_region_loss=survive,
                    group=group,
                )
            )
            del part

    # Size pools so the estimated need is `utilization` of capacity, spread over regions by where
    # the demand comes from (every region gets some of every class).
    need: dict[str, float] = {h: 0.0 for h in hw_names}
    load: dict[str, float] = {r: 1.0 for r in region_names}
    for dep in demands:
        best = min(dep.hardware, key=lambda h: dep.hardware[h].units / dep.hardware[h].qps)
        opt = dep.hardware[best]
        total = sum(dep.demand_qps.values())
        replicas = total / ((1 - dep.headroom) * opt.qps) + dep.min_regions * 0.5
        if dep.survive_region_loss:
            replicas *= 1.5
        need[best] += replicas * opt.units
        for s, q in dep.demand_qps.items():
            load[s] += q
    total_load = sum(load.values())
    pools = []
    for r in region_names:
        share = 0.5 / regions + 0.5 * load[r] / total_load
        for h in hw_names:
            units = max(4, math.ceil(need[h] * share / utilization)) if need[h] > 0 else 8
            pools.append(
                Pool(
                    region=r, hardware=h, units=units, unit_cost=round(rng.uniform(0.8, 1.2) * hw_speed[h], 3)
                )
            )
    fleet = Fleet(
        regions=region_names,
        hardware={h: HardwareClass(kind="gpu" if h.startswith("gpu") else "cpu") for h in hw_names},
        pools=pools,
        latency_ms=latency,
    )
    return PlanningProblem(fleet=fleet, deployments=demands)


def changed_demand(problem: PlanningProblem, seed: int, change: float = 0.05) -> PlanningProblem:
    """The same problem with its demand changed: each (deployment, source) demand times a factor
    drawn uniformly from [1 - change, 1 + change], one factor per group and source (a model's
    parts serve the same traffic, so their demand moves together)."""
    rng = random.Random(seed)
    factors: dict[tuple[str, str], float] = {}
    deployments = []
    for dep in problem.deployments:
        demand = {}
        for source, qps in sorted(dep.demand_qps.items()):
            key = (dep.group or f"#{dep.name}", source)
            if key not in factors:
                factors[key] = rng.uniform(1 - change, 1 + change)
            demand[source] = qps * factors[key]
        deployments.append(dep.model_copy(update={"demand_qps": demand}))
    return problem.model_copy(update={"deployments": deployments})
