"""A property of the construction (issue 40): on small, nearly full instances of the family
(feasible by construction, planner.generator.family), whenever the exact MIP of the whole
model finds a plan, the planner returns one, on its work limit (never the clock). The
planner runs without its exact MIP of the whole instance (`exact_fallback=False`), so its
own construction (LP rounding and repair, a plan from scratch, the completing MIPs, the
columns) is what is tried."""

from __future__ import annotations

import random

import pytest

from ipnext.contracts.plan import SolveOptions
from ipnext.planner import check_plan, solve
from ipnext.planner.backend import solve_model
from ipnext.planner.formulation import build
from ipnext.planner.generator import family
from ipnext.planner.instance import compile_problem
from ipnext.planner.work import UNITS_PER_SECOND

SEEDS = range(4000, 4020)
WORK = 2 * UNITS_PER_SECOND  # the planner's work limit on these instances
EXACT_WORK = 20 * UNITS_PER_SECOND  # the reference MIP's
HOUR = 3600.0  # the clock, far past either work limit


def _instance(seed: int):  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    return family(
        seed,
        deployments=rng.randint(12, 30),
        regions=rng.randint(3, 5),
        hardware=rng.randint(2, 3),
        fullness=rng.uniform(0.95, 0.98),
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_whenever_the_exact_mip_finds_a_plan_the_planner_returns_one(seed: int) -> None:
    inst = _instance(seed)
    compiled = compile_problem(inst.problem)
    whole = build(compiled, list(range(len(compiled.blocks))), pool_capacity=compiled.pool_units)
    exact = solve_model(whole, work=EXACT_WORK, relative_gap=1e-4)
    if exact.values is None:
        pytest.fail(f"seed {seed}: the exact MIP found no plan of a feasible instance ({exact.status})")
    plan = solve(inst.problem, SolveOptions(time_limit_s=HOUR, work_limit=WORK, exact_fallback=False))
    assert check_plan(inst.problem, plan) == []
    assert plan.stopped_by == "work"
    print(
        f"seed {seed}: {len(inst.problem.deployments)} deployments, {100 * inst.fullness:.1f}% full: "
        f"planner {plan.cost:.1f} ({plan.gap:.2%} over its bound), exact MIP {exact.objective:.1f}, "
        f"planted {inst.planted.cost:.1f}"
    )
