"""`solve(problem, options) -> Plan`: the entry point of the planner (see decompose.py for why
it is shaped the way it is)."""

from __future__ import annotations

import time

from ipnext.plan import DeploymentPlacement, Plan, PlanningProblem, SolveOptions
from ipnext.planner.backend import solve_model
from ipnext.planner.decompose import decompose
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.pricing import BlockChoice, choices_from_values, usage_of

__all__ = ["solve"]

# Instances up to this many variables are first solved whole by the exact MIP.
EXACT_MAX_VARIABLES = 1500


def solve(problem: PlanningProblem, options: SolveOptions | None = None) -> Plan:
    options = options or SolveOptions()
    started = time.monotonic()
    deadline = started + options.time_limit_s
    inst = compile_problem(problem)
    churn = options.churn_cost if problem.current is not None else 0.0
    blocks = list(range(len(inst.blocks)))
    if options.exact_fallback:
        whole = build(inst, blocks, pool_capacity=inst.pool_units, churn_cost=churn)
        if len(whole.lb) <= EXACT_MAX_VARIABLES:
            sol = solve_model(whole, time_limit_s=max(1.0, 0.4 * options.time_limit_s), relative_gap=1e-9)
            if sol.status == "optimal" and sol.values is not None:
                choices = choices_from_values(inst, whole, sol.values, churn, blocks)
                return _plan(
                    inst, choices, churn, sol.bound, "exact MIP (HiGHS), solved to optimality", started
                )
    # Prices move for a little over half the time left, the bound is tightened and the plan
    # repaired in the rest; 5% stays for writing the plan.
    left = deadline - time.monotonic()
    result = decompose(
        inst,
        churn=churn,
        deadline=time.monotonic() + 0.55 * left,
        hard_deadline=deadline - 0.05 * options.time_limit_s,
        workers=options.workers,
    )
    return _plan(
        inst,
        result.choices,
        churn,
        result.lower_bound,
        f"Lagrangian bound at the column generation's best pool prices (block MIPs, {result.iterations} rounds)",
        started,
    )


def _plan(
    inst: Instance, choices: dict[int, BlockChoice], churn: float, bound: float, method: str, started: float
) -> Plan:
    placements: dict[str, DeploymentPlacement] = {}
    cost = 0.0
    moved = 0
    for b, choice in choices.items():
        fractions: dict[str, dict[str, float]] = {}
        for t, share in choice.f.items():
            s, r = inst.regions[inst.route_s[t]], inst.regions[inst.route_r[t]]
            fractions.setdefault(s, {})[r] = share
        for row in fractions.values():  # exact sums despite solver tolerance
            total = sum(row.values())
            for r in row:
                row[r] = round(row[r] / total, 9)
        for i in inst.blocks[b]:
            replicas: dict[str, dict[str, int]] = {}
            for o, n in choice.x.items():
                if inst.opt_d[o] == i:
                    replicas.setdefault(inst.regions[inst.opt_r[o]], {})[inst.hardware[inst.opt_h[o]]] = n
                    cost += float(inst.opt_cost[o] * n)
                    moved += int(max(0, n - inst.opt_current[o]) * inst.opt_units[o])
            placements[inst.problem.deployments[i].name] = DeploymentPlacement(
                replicas=replicas, fractions={s: row for s, row in fractions.items()}
            )
    if inst.problem.current is None:
        moved = 0
    objective = cost + churn * moved
    bound = min(bound, objective)
    gap = (objective - bound) / objective if objective > 0 else 0.0
    gap = 0.0 if gap < 1e-9 else gap  # solver tolerance, not a gap
    used = usage_of(inst, choices)
    assert (used <= inst.pool_units + 1e-6).all()  # repair guarantees it; a violation is a bug here
    return Plan(
        deployments=placements,
        cost=round(cost, 6),
        moved_units=moved,
        solver="ipnext-lagrangian" if "Lagrangian" in method else "exact-mip",
        revision=(inst.problem.current.revision + 1) if inst.problem.current else 1,
        objective=round(objective, 6),
        lower_bound=round(bound, 6),
        lower_bound_method=method,
        gap=gap,
        solve_seconds=round(time.monotonic() - started, 3),
        status="optimal" if gap <= 1e-9 else "feasible",
    )
