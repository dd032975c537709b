"""`solve(problem, options) -> Plan`: the entry point of the planner (see decompose.py for why
it is shaped the way it is).

A replan (a current plan and a churn cost above zero) has two phases: the cheapest plan and a
proven lower bound of its cost, from scratch; then the fewest units moved against the current
plan by any plan that costs at most `REPLAN_COST_SLACK` more than that bound (the cheapest of
those). Weighing moves into one objective at a fixed churn cost (what the planner did before)
either moved many units to save a few cents or paid for stability it did not need: on the
20-deployment replan benchmark it moved up to 6x the units that a plan within 1% of the
optimum needs."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from ipnext.contracts.plan import DeploymentPlacement, Plan, PlanningProblem, SolveOptions
from ipnext.errors import NoPlacementError, PlanningTimeoutError
from ipnext.planner.backend import solve_model
from ipnext.planner.complete import shortfall
from ipnext.planner.decompose import Decomposition, decompose
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.moves import fewer_moves, fewest_moves, moved_units_of
from ipnext.planner.pricing import BlockChoice, choices_from_values, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock

__all__ = ["STOPPED_BY_CLOCK", "solve"]

# What a plan's method says when the time limit, not the work limit, cut a phase of its solve.
STOPPED_BY_CLOCK = "stopped by the clock: not reproducible"

# The measurements behind each value below: docs/architecture/planner.md, "The solve's shares".
# Instances up to this many variables are first solved whole by the exact MIP, in this share of
# the work limit; when it does not close, its best plan and bound are a candidate beside the
# decomposition's.
EXACT_MAX_VARIABLES = 1500
EXACT_SHARE = {"replan": 0.4, "scratch": 0.2}
# A replan may cost this share more than the proven lower bound of the cheapest plan (so at
# most this share more than the optimum) to move fewer units.
REPLAN_COST_SLACK = 0.01
# Up to this many options the second phase tries the whole fewest-moves MIP before neighbourhoods.
WHOLE_MOVES_MAX_OPTIONS = 20_000
# Of a replan's work left on the scalable path, the first phase's share (whole fewest-moves MIP,
# or neighbourhoods at fleet scale, where the second runs in the work kept for writing the plan).
REPLAN_SCRATCH_SHARE = {"whole": 0.6, "neighbourhoods": 1.0}
# Of the decomposition's work, the pricing rounds' share; past FLEET_BLOCKS blocks, once the
# master's columns fit the pools, more.
PRICING_SHARE = 0.55
PRICING_SHARE_FLEET = 0.7
# The search stops this share of `time_limit_s` before it, so that the step in flight when the
# clock fires and the plan's assembly end inside the limit, not past it.
FINISH_SHARE = 0.02


Solver = Literal["exact-mip", "ipnext-lagrangian"]


@dataclass(frozen=True)
class Candidate:
    """A plan one method found and the lower bound of the cost it proved, said for people in
    `method` and by name in `solver`; `solve` returns the cheapest plan with the highest bound."""

    choices: dict[int, BlockChoice]
    bound: float
    method: str
    solver: Solver


def solve(problem: PlanningProblem, options: SolveOptions | None = None) -> Plan:
    options = options or SolveOptions()
    started = time.monotonic()  # for the plan's solve_seconds: a report, never a limit
    budget = Budget(options.work_limit, Clock.after((1 - FINISH_SHARE) * options.time_limit_s))
    total = budget.total
    inst = compile_problem(problem)
    churn = options.churn_cost if problem.current is not None else 0.0
    replan = churn > 0
    blocks = list(range(len(inst.blocks)))
    end = budget.until(0.95)  # the rest is the fleet second phase's reserve
    unfinished: Candidate | None = None  # an exact MIP's best plan and bound when it did not close
    if options.exact_fallback:
        # A replan's first phase is the cheapest plan: no churn in the objective.
        whole = build(inst, blocks, pool_capacity=inst.pool_units, churn_cost=0.0 if replan else churn)
        if len(whole.lb) <= EXACT_MAX_VARIABLES:
            share = EXACT_SHARE["replan" if replan else "scratch"]
            work = max(UNITS_PER_SECOND, int(share * total))
            sol = solve_model(whole, work=work, budget=budget, relative_gap=1e-9)
            if sol.status == "optimal" and sol.values is not None:
                choices = choices_from_values(inst, whole, sol.values, churn, blocks)
                exact = Candidate(choices, sol.bound, "exact MIP (HiGHS), solved to optimality", "exact-mip")
                if replan:
                    choices = _fewer_moves(inst, choices, sol.bound, churn, end)
                    method = f"exact MIP (HiGHS) of the cost, solved to optimality{_SECOND_PHASE}"
                    exact = Candidate(choices, sol.bound, method, "exact-mip")
                return _plan(inst, exact, churn, started, budget)
            if sol.status == "infeasible":  # proven over every block and the whole pools
                gap = shortfall(inst, {}, blocks, churn, budget.clock)
                raise NoPlacementError(
                    f"pools: no placement of the {len(blocks)} blocks fits them (the exact MIP over every "
                    f"one of them proved it); {gap.describe()}.",
                    fix=gap.fix(),
                )
            if sol.values is not None:  # kept beside the decomposition's, and for a replan's first phase
                choices = choices_from_values(inst, whole, sol.values, churn, blocks)
                method = "exact MIP (HiGHS) of the cost, stopped at its work limit"
                unfinished = Candidate(choices, max(sol.bound, 0.0), method, "exact-mip")  # costs are >= 0
    # Prices move for a little over half the work left, the bound is tightened and the plan
    # repaired in the rest; 5% stays in reserve. A replan's first phase has a share.
    # At fleet scale a replan's first phase is the one-objective replan (cost + churn x moves):
    # its plan already moves few units, and the neighbourhoods only cut them further, where a
    # cheapest plan from scratch would leave them most of the moves to undo.
    fleet_scale = replan and not _whole_moves(inst)
    left = budget.left()
    if replan:
        left = int(left * REPLAN_SCRATCH_SHARE["neighbourhoods" if fleet_scale else "whole"])
    part = budget.part(max(0, left - int(0.05 * total)))
    scale = left / max(1, part.total)  # the shares below are of `left`, as they were of the time
    try:
        result = decompose(
            inst,
            churn=churn if fleet_scale else 0.0 if replan else churn,
            budget=part,
            pricing_share=min(1.0, PRICING_SHARE * scale),
            fitting_share=min(1.0, (PRICING_SHARE_FLEET if inst.fleet else PRICING_SHARE) * scale),
            workers=options.workers,
        )
    except PlanningTimeoutError:
        if unfinished is None or fleet_scale:
            raise
        chosen = unfinished
    else:
        found = [_decomposed(result, budget)]
        if unfinished is not None and not fleet_scale:  # the better plan and bound of the two
            found.append(unfinished)
        chosen = _chosen(inst, found)
    choices, bound, method = chosen.choices, chosen.bound, chosen.method
    if fleet_scale:  # the bound is the one objective's, no bound of the cost
        choices = _fewer_moves(inst, choices, 0.0, churn, budget.until(0.98))
        method += f", then fewer moved units within {50 * REPLAN_COST_SLACK:g}% of that plan's cost"
    elif replan:
        choices = _fewer_moves(inst, choices, bound, churn, end)
        method += _SECOND_PHASE
    return _plan(inst, Candidate(choices, bound, method, chosen.solver), churn, started, budget)


def _decomposed(result: Decomposition, budget: Budget) -> Candidate:
    """The decomposition's plan and bound as a candidate (decompose.py says what each means)."""
    if result.iterations == 0 and result.first_plan:  # the first pricing round ran out of work
        out = "time" if budget.stopped_by_clock else "work"
        method = f"the LP relaxation's optimum; the plan: {result.first_plan}, the pricing out of {out}"
    else:
        method = (
            "Lagrangian bound at the column generation's best pool prices "
            f"(block MIPs, {result.iterations} rounds)"
        )
        if result.branch:
            method += f", the smaller of its two sides' when branched on {result.branch}"
        if result.first_plan:
            method += f"; the plan: {result.first_plan} (the columns' was not better in its work)"
    return Candidate(result.choices, result.lower_bound, method, "ipnext-lagrangian")


def _chosen(inst: Instance, candidates: list[Candidate]) -> Candidate:
    """The cheapest plan of the candidates with the highest bound any of them proved (every
    bound is a lower bound of the same optimum); the method and solver are the bound's."""
    cheapest = min(candidates, key=lambda c: _total_cost(inst, c.choices))
    highest = max(candidates, key=lambda c: c.bound)
    return Candidate(cheapest.choices, highest.bound, highest.method, highest.solver)


_SECOND_PHASE = f", then the fewest moved units found within {100 * REPLAN_COST_SLACK:g}% of its bound"


def _fewer_moves(
    inst: Instance, cheapest: dict[int, BlockChoice], bound: float, churn: float, end: Budget
) -> dict[int, BlockChoice]:
    """A replan's second phase: the fewest moved units found in `end` among plans costing at
    most `REPLAN_COST_SLACK` more than `bound`, a proven lower bound of the cost. When the
    cheapest plan found is further than half the slack from the bound (the bound may be the
    loose one), within half the slack of that plan instead."""
    found = _total_cost(inst, cheapest)
    tolerance = 1e-6 * max(1.0, found)  # the solver's feasibility tolerance on the cost row
    cap = max((1 + REPLAN_COST_SLACK) * bound, (1 + REPLAN_COST_SLACK / 2) * found) - tolerance
    cap = max(cap, found)
    choices, proven = cheapest, False
    if _whole_moves(inst):
        # The fewest-moves MIP is far easier than the cheapest-plan one (the current plan
        # nearly fits the new demand): whole, it closed in about a second at 100 deployments.
        whole, proven = fewest_moves(inst, cap, churn, max(UNITS_PER_SECOND, int(0.7 * end.left())), end)
        if whole is not None and _moves(inst, whole) <= _moves(inst, choices):
            choices = whole
    if not proven:
        choices = fewer_moves(inst, choices, cap, churn, end)
    return choices


def _whole_moves(inst: Instance) -> bool:
    return len(inst.opt_d) <= WHOLE_MOVES_MAX_OPTIONS


def _moves(inst: Instance, choices: dict[int, BlockChoice]) -> int:
    return sum(moved_units_of(inst, c.x) for c in choices.values())


def _total_cost(inst: Instance, choices: dict[int, BlockChoice]) -> float:
    return float(sum(inst.opt_cost[o] * n for c in choices.values() for o, n in c.x.items()))


def _plan(inst: Instance, chosen: Candidate, churn: float, started: float, budget: Budget) -> Plan:
    choices, bound, method = chosen.choices, chosen.bound, chosen.method
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
    stopped_by: Literal["work", "clock"] = "clock" if budget.stopped_by_clock else "work"
    if stopped_by == "clock":
        method += f"; {STOPPED_BY_CLOCK}"
    return Plan(
        deployments=placements,
        cost=round(cost, 6),
        moved_units=moved,
        solver=chosen.solver,
        revision=(inst.problem.current.revision + 1) if inst.problem.current else 1,
        objective=round(objective, 6),
        lower_bound=round(bound, 6),
        lower_bound_method=method,
        gap=gap,
        solve_seconds=round(time.monotonic() - started, 3),
        status="optimal" if gap <= 1e-9 else "feasible",
        stopped_by=stopped_by,
        work_units=budget.spent,
    )
