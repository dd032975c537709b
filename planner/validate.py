"""Check a Plan against its problem: every constraint the planner promises, as readable violations.

The spare (`spare_replicas` k) is checked as promised, whatever the solver: in every region a
deployment routes traffic to, its replicas less the k largest of them carry that traffic under
the headroom. (The planner's own rule, a spare of the largest option there, implies it.)"""

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
        held: dict[str, float] = {}  # region -> QPS of its spare_replicas largest replicas
        for region, by_hw in placement.replicas.items():
            sizes: list[tuple[float, int]] = []
            for hw, n in by_hw.items():
                if n < 0:
                    errors.append(f"{dep.name}: negative replicas in {region}/{hw}")
                if n and hw not in dep.hardware:
                    errors.append(f"{dep.name}: replicas on {hw}, which it cannot run on")
                    continue
                if n:
                    used[(region, hw)] += n * dep.hardware[hw].units
                    capacity[region] += n * dep.hardware[hw].qps
                    sizes.append((dep.hardware[hw].qps, n))
            if dep.spare_replicas:
                held[region] = _largest(sizes, dep.spare_replicas)
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
            # what the region carries once it has lost its spare_replicas largest replicas
            left = usable * (capacity[region] - held.get(region, 0.0))
            if qps <= left * (1 + _REL) + _EPS:
                continue
            if dep.spare_replicas and capacity[region] > 0:
                k = dep.spare_replicas
                errors.append(
                    f"{dep.name}: {region} gets {qps:.1f} QPS, carries {left:.1f} once it loses its {k} "
                    f"largest replica(s) (spare_replicas {k}); fix: add replicas in {region} until losing "
                    f"any {k} leaves {qps / usable:.1f} QPS of replicas, or route less there"
                )
            else:
                errors.append(f"{dep.name}: {region} gets {qps:.1f} QPS, carries {left:.1f}")
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


def _largest(sizes: list[tuple[float, int]], k: int) -> float:
    """The QPS of the `k` largest replicas of (QPS per replica, replicas) (all, if fewer)."""
    total = 0.0
    for qps, n in sorted(sizes, reverse=True):
        take = min(n, k)
        total += take * qps
        k -= take
        if k == 0:
            break
    return total
