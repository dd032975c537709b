"""Check a Plan against its problem: every constraint the planner promises, as readable violations."""

from __future__ import annotations

from collections import defaultdict

from ipnext.contracts.plan import Plan, PlanningProblem

__all__ = ["check_plan"]

_EPS = 1e-6
_REL = 1e-7  # LP solvers' feasibility tolerance: a capacity row may be over by this share


def check_plan(problem: PlanningProblem, plan: Plan) -> list[str]:
    """Every broken constraint, one line each; an empty list means the plan is valid."""
    fleet = problem.fleet
    errors: list[str] = []
    used: dict[tuple[str, str], int] = defaultdict(int)
    groups: dict[str, list[str]] = defaultdict(list)
    for dep in problem.deployments:
        placement = plan.deployments.get(dep.name)
        if placement is None:
            errors.append(f"{dep.name}: not in the plan")
            continue
        if dep.group:
            groups[dep.group].append(dep.name)
        usable = 1 - dep.headroom
        capacity: dict[str, float] = defaultdict(float)
        for region, by_hw in placement.replicas.items():
            for hw, n in by_hw.items():
                if n < 0:
                    errors.append(f"{dep.name}: negative replicas in {region}/{hw}")
                if n and hw not in dep.hardware:
                    errors.append(f"{dep.name}: replicas on {hw}, which it cannot run on")
                    continue
                if n:
                    used[(region, hw)] += n * dep.hardware[hw].units
                    capacity[region] += n * dep.hardware[hw].qps
        routed: dict[str, float] = defaultdict(float)
        for source, qps in dep.demand_qps.items():
            row = placement.fractions.get(source, {})
            if qps > 0 and abs(sum(row.values()) - 1) > _EPS:
                errors.append(f"{dep.name}: fractions of {source} sum to {sum(row.values())}")
            for region, share in row.items():
                if share < -_EPS:
                    errors.append(f"{dep.name}: negative fraction {source}->{region}")
                if share > _EPS and fleet.latency(source, region) > dep.latency_budget_ms:
                    errors.append(f"{dep.name}: {source}->{region} exceeds the latency budget")
                routed[region] += qps * share
        for region, qps in routed.items():
            if qps > usable * capacity[region] * (1 + _REL) + _EPS:
                errors.append(
                    f"{dep.name}: {region} gets {qps:.1f} QPS, carries {usable * capacity[region]:.1f}"
                )
        regions = [r for r, c in capacity.items() if c > 0]
        if len(regions) < dep.min_regions:
            errors.append(f"{dep.name}: {len(regions)} regions < min_regions {dep.min_regions}")
        if dep.survive_region_loss:
            total = sum(dep.demand_qps.values())
            for lost in fleet.regions:
                rest = sum(c for r, c in capacity.items() if r != lost)
                if usable * rest * (1 + _REL) < total - _EPS:
                    errors.append(f"{dep.name}: losing {lost} leaves {usable * rest:.1f} < {total} QPS")
    for (region, hw), units in used.items():
        pool = fleet.pool(region, hw)
        if pool is None or units > pool.units:
            errors.append(f"pool {region}/{hw}: {units} units used of {pool.units if pool else 0}")
    for group, names in groups.items():
        first = plan.deployments[names[0]]
        for name in names[1:]:
            other = plan.deployments[name]
            if other.fractions != first.fractions or other.regions() != first.regions():
                errors.append(f"group {group}: {name} differs from {names[0]} in regions or routing")
    return errors
