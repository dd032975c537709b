"""An exact placement MIP written separately from ipnext.planner (pywraplp + SCIP, plain loops):
the oracle the global planner's tests compare against (the cheapest objective, and the fewest
units moved against the current plan within a cost cap). A deployment's spare follows the
planner's rule (`planner/instance.py`): spare_replicas of its largest option in each region
it stands in."""

from __future__ import annotations

from typing import Any

from ortools.linear_solver import pywraplp

from ipnext.contracts.plan import PlanningProblem


def exact_optimum(
    problem: PlanningProblem, churn_cost: float = 0.05, time_limit_s: float = 60
) -> float | None:
    """The optimal objective, or None if the problem is infeasible."""
    built = _model(problem, time_limit_s)
    if built is None:
        return None
    solver, cost, moved = built
    solver.Minimize(cost + churn_cost * moved)
    return _solve(solver)


def exact_fewest_moves(problem: PlanningProblem, cost_cap: float, time_limit_s: float = 60) -> float | None:
    """The fewest units any plan costing at most `cost_cap` newly places against
    `problem.current` (units x replicas above the current count, summed), or None if none."""
    built = _model(problem, time_limit_s)
    if built is None:
        return None
    solver, cost, moved = built
    solver.Add(cost <= cost_cap)
    solver.Minimize(moved)
    return _solve(solver)


def _solve(solver: pywraplp.Solver) -> float | None:
    status = solver.Solve()
    if status == pywraplp.Solver.INFEASIBLE:
        return None
    assert status == pywraplp.Solver.OPTIMAL, f"oracle did not finish: status {status}"
    return float(solver.Objective().Value())


def _model(problem: PlanningProblem, time_limit_s: float) -> tuple[pywraplp.Solver, Any, Any] | None:
    """The constraints, the cost and the moved units (0 without a current plan); None when a
    source has no region within its budget."""
    fleet = problem.fleet
    solver = pywraplp.Solver.CreateSolver("SCIP")
    solver.SetTimeLimit(int(time_limit_s * 1000))
    inf = solver.infinity()
    x: dict[tuple[str, str, str], pywraplp.Variable] = {}
    f: dict[tuple[str, str, str], pywraplp.Variable] = {}
    cost: Any = 0
    moved: Any = 0
    for dep in problem.deployments:
        current = problem.current.deployments.get(dep.name) if problem.current else None
        for region in fleet.regions:
            for hw, option in dep.hardware.items():
                pool = fleet.pool(region, hw)
                if pool is None:
                    continue
                var = solver.IntVar(0, pool.units // option.units, f"x_{dep.name}_{region}_{hw}")
                x[dep.name, region, hw] = var
                cost += pool.unit_cost * option.units * var
                if problem.current is not None:
                    before = current.replicas.get(region, {}).get(hw, 0) if current else 0
                    new = solver.NumVar(0, inf, "")
                    solver.Add(new >= var - before)
                    moved += option.units * new
    groups: dict[str, list[str]] = {}
    for dep in problem.deployments:
        groups.setdefault(dep.group or f"#{dep.name}", []).append(dep.name)
    by_name = {d.name: d for d in problem.deployments}
    for key, names in groups.items():
        members = [by_name[n] for n in names]
        use = {r: solver.BoolVar(f"y_{key}_{r}") for r in fleet.regions}
        need = max(d.min_regions for d in members)
        solver.Add(sum(use.values()) >= need)
        shared: dict[tuple[str, str], pywraplp.Variable] = {}
        for dep in members:
            for source, qps in dep.demand_qps.items():
                if qps <= 0:
                    continue
                row = []
                for region in fleet.regions:
                    if fleet.latency(source, region) <= dep.latency_budget_ms:
                        var = shared.setdefault((source, region), solver.NumVar(0, 1, ""))
                        f[dep.name, source, region] = var
                        row.append(var)
                    elif (source, region) in shared:
                        solver.Add(shared[source, region] == 0)
                if not row:
                    return None
                solver.Add(sum(row) == 1)
        for dep in members:
            for region in fleet.regions:
                mine = [(hw, x[dep.name, region, hw]) for hw in dep.hardware if (dep.name, region, hw) in x]
                replicas = sum(v for _, v in mine)
                solver.Add(use[region] <= replicas)
                if len(members) > 1 or dep.spare_replicas:
                    solver.Add(replicas <= 10_000 * use[region])
                routed = sum(
                    dep.demand_qps.get(s, 0) * v
                    for (n, s, r), v in f.items()
                    if n == dep.name and r == region
                )
                # The planner's spare rule: where the deployment stands, spare_replicas replicas of
                # its largest option that a pool there can hold are held back from routing.
                largest = max(
                    (
                        dep.hardware[hw].qps
                        for hw, _ in mine
                        if (pool := fleet.pool(region, hw)) and pool.units >= dep.hardware[hw].units
                    ),
                    default=0.0,
                )
                capacity = sum(dep.hardware[hw].qps * v for hw, v in mine)
                if dep.spare_replicas:
                    capacity -= dep.spare_replicas * largest * use[region]
                solver.Add(routed <= (1 - dep.headroom) * capacity)
            if dep.survive_region_loss:
                for lost in fleet.regions:
                    solver.Add(
                        (1 - dep.headroom)
                        * sum(
                            dep.hardware[h].qps * v
                            for (n, r, h), v in x.items()
                            if n == dep.name and r != lost
                        )
                        >= sum(dep.demand_qps.values())
                    )
    for pool in fleet.pools:
        solver.Add(
            sum(
                by_name[n].hardware[h].units * v
                for (n, r, h), v in x.items()
                if r == pool.region and h == pool.hardware
            )
            <= pool.units
        )
    return solver, cost, moved
