"""The completing MIPs (planner/complete.py): what repair leaves is placed by an exact MIP,
with the placed blocks the elastic LP moves freed first (or, without it, the neighbours of
the blocks left, more each time they do not fit), and when nothing fits the error proves it
and names the pool short and by how much."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from ipnext.contracts.plan import PlanningProblem
from ipnext.errors import NoPlacementError, PlanningTimeoutError
from ipnext.planner import complete as complete_module
from ipnext.planner.backend import solve_model
from ipnext.planner.complete import complete
from ipnext.planner.first_plan import first_plan, lp_start
from ipnext.planner.formulation import build
from ipnext.planner.generator import family
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.pricing import BlockChoice, choices_from_values, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet, HardwareClass, Pool
from ipnext.spec.model import HardwareOption


def _problem(far_units: int) -> PlanningProblem:
    """Two regions, one hardware class. `wide` may serve from either region (its budget
    reaches both); `near` only from r0. Each needs two replicas, and two fill r0."""
    fleet = Fleet(
        regions=["r0", "r1"],
        hardware={"cpu": HardwareClass(kind="cpu")},
        pools=[
            Pool(region="r0", hardware="cpu", units=2, unit_cost=1.0),
            Pool(region="r1", hardware="cpu", units=far_units, unit_cost=2.0),
        ],
        latency_ms={"r0": {"r0": 1.0, "r1": 20.0}, "r1": {"r0": 20.0, "r1": 1.0}},
    )

    def deployment(name: str, budget: float, qps: float) -> DeploymentDemand:
        return DeploymentDemand(
            name=name,
            hardware={"cpu": HardwareOption(units=1, qps=10.0)},
            demand_qps={"r0": qps},
            latency_budget_ms=budget,
            headroom=0.0,
        )

    return PlanningProblem(
        fleet=fleet, deployments=[deployment("wide", 30.0, 20.0), deployment("near", 5.0, 20.0)]
    )


def _wide_in_r0(inst: Instance) -> dict[int, BlockChoice]:
    """`wide` placed where it blocks `near`: both its replicas in r0 (r1 closed to it)."""
    only_r0 = inst.pool_units.copy()
    only_r0[inst.regions.index("r1"), :] = 0
    model = build(inst, [0], pool_capacity=only_r0)
    sol = solve_model(model, work=UNITS_PER_SECOND)
    assert sol.values is not None
    return choices_from_values(inst, model, sol.values, 0.0, [0])


def test_the_elastic_lp_frees_the_placed_block_in_the_way() -> None:
    inst = compile_problem(_problem(far_units=2))
    placed = _wide_in_r0(inst)
    assert (usage_of(inst, placed) == [[2], [0]]).all()
    plan, how = complete(inst, placed, [1], 0.0, Budget(10 * UNITS_PER_SECOND))
    assert sorted(plan) == [0, 1]
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    # The LP moves `wide` out of r0, so the first MIP places both: wide in r1, near in r0.
    assert how.movers == 1 and [n for n, _ in how.steps] == [2], how
    r1 = inst.regions.index("r1")
    assert sum(n for o, n in plan[0].x.items() if inst.opt_r[o] == r1) == 2


@pytest.fixture
def no_elastic_lp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The completion as on a fleet too large for the elastic LP: neighbours freed in rings."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.complete"), "ELASTIC_MAX_OPTIONS", 0)


@pytest.mark.usefixtures("no_elastic_lp")
def test_without_the_elastic_lp_blocks_that_do_not_fit_free_their_neighbours() -> None:
    inst = compile_problem(_problem(far_units=2))
    placed = _wide_in_r0(inst)
    plan, how = complete(inst, placed, [1], 0.0, Budget(10 * UNITS_PER_SECOND))
    assert sorted(plan) == [0, 1]
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    # `near` alone in what `wide` left: infeasible; with `wide` freed, wide moves to r1.
    assert how.movers == 0 and [n for n, _ in how.steps] == [1, 2]
    assert how.steps[0][1] == "infeasible" and how.steps[1][1] in ("optimal", "feasible")


@pytest.mark.parametrize(
    ("elastic", "proof"),
    [
        (True, "even the LP relaxation of the whole model has none"),
        (False, "the exact MIP over every one of them proved it"),
    ],
    ids=["by-the-elastic-lp", "by-the-last-mip"],
)
def test_when_no_placement_fits_it_is_proven_and_the_pool_short_is_named(
    elastic: bool, proof: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not elastic:  # as on a fleet too large for the elastic LP: the MIP over every block proves it
        monkeypatch.setattr(importlib.import_module("ipnext.planner.complete"), "ELASTIC_MAX_OPTIONS", 0)
    inst = compile_problem(_problem(far_units=1))
    placed = _wide_in_r0(inst)
    with pytest.raises(NoPlacementError) as caught:
        complete(inst, placed, [1], 0.0, Budget(10 * UNITS_PER_SECOND))
    message = caught.value.message
    assert proof in message, message
    assert "r0/cpu by 2 units" in message, message  # near's two replicas, beside wide's two
    assert caught.value.fix == "add capacity (r0/cpu +2)"


def test_out_of_work_it_says_what_it_tried_and_what_would_fix_it() -> None:
    inst = compile_problem(_problem(far_units=2))
    placed = _wide_in_r0(inst)
    budget = Budget(0)
    with pytest.raises(Exception) as caught:
        complete(inst, placed, [1], 0.0, budget)
    assert type(caught.value).__name__ == "PlanningTimeoutError"
    assert "1 blocks not placed (near); pools short: r0/cpu by 2 units" in str(caught.value)
    assert "--work-limit" in str(caught.value.fix)  # type: ignore[attr-defined]
    assert np.isfinite(inst.pool_units).all()


def test_after_the_clock_stopped_the_solve_the_report_estimates_nothing_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The shortfall's estimate solves the largest blocks left again (seconds at fleet scale):
    after the clock, none is solved, so the solve ends inside its limit, and the report says
    that the pools were not estimated, not that none is short."""
    inst = compile_problem(_problem(far_units=2))
    placed = _wide_in_r0(inst)
    solved: list[int] = []
    real = complete_module.search_block
    monkeypatch.setattr(complete_module, "search_block", lambda *a, **k: solved.append(1) or real(*a, **k))
    with pytest.raises(PlanningTimeoutError) as caught:
        complete(inst, placed, [1], 0.0, Budget(10 * UNITS_PER_SECOND, Clock.after(0.0)))
    assert solved == []
    assert "1 blocks not placed (near); which pools are short was not estimated" in caught.value.message
    assert "pools short" not in caught.value.message
    assert "--time-limit" in str(caught.value.fix)
    gap = complete_module.shortfall(inst, placed, [1], 0.0, Clock.after(3600.0))  # the clock not passed
    assert gap.short == {("r0", "cpu"): 2.0} and not gap.cut


def test_the_first_plan_places_what_the_lp_rounding_overfills_by_the_completing_mips() -> None:
    """A small family instance 97% full whose LP rounding overfills two pools: the blocks off
    them are placed again by the completing MIPs, with the placed blocks the elastic LP moves
    freed beside them, and the plan fits every pool."""
    inst = compile_problem(family(8, deployments=60, regions=4, hardware=2, fullness=0.97).problem)
    budget = Budget(40 * UNITS_PER_SECOND)
    plan, how = first_plan(inst, lp_start(inst, 0.0, budget), 0.0, budget, budget)
    assert plan is not None, how
    assert sorted(plan) == list(range(len(inst.blocks)))
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    assert "the LP rounding overfilled pools by" in how and "the elastic LP moved" in how, how


def test_the_completing_mips_of_the_first_plan_keep_to_their_share_of_the_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first plan's completing MIPs run on a budget capped at COMPLETE_CLOCK_SHARE of the
    clock (work.Budget.clock_capped, which binds only when the clock will stop the solve); the
    cap is tested in test_planner_work."""
    first_plan_module = importlib.import_module("ipnext.planner.first_plan")
    asked: list[float] = []
    capped = Budget.clock_capped

    def recorded(self: Budget, fraction: float) -> Budget:
        asked.append(fraction)
        return capped(self, fraction)

    monkeypatch.setattr(Budget, "clock_capped", recorded)
    inst = compile_problem(family(8, deployments=60, regions=4, hardware=2, fullness=0.97).problem)
    budget = Budget(40 * UNITS_PER_SECOND)
    plan, how = first_plan(inst, lp_start(inst, 0.0, budget), 0.0, budget, budget)
    assert plan is not None and "placed by exact MIPs" in how, how
    assert asked == [first_plan_module.COMPLETE_CLOCK_SHARE]


@pytest.mark.parametrize("roundings", [2, 3])
def test_no_lp_is_solved_after_the_last_rounding(monkeypatch: pytest.MonkeyPatch, roundings: int) -> None:
    """Each LP after the relaxation makes one rounding; none is solved once the last rounding
    is made (one was, and its answer thrown away: 13.6 s of a 60 s clock on an 820-deployment
    instance). Seed 1's roundings all overflow, so every one is made."""
    first_plan_module = importlib.import_module("ipnext.planner.first_plan")
    monkeypatch.setattr(first_plan_module, "LP_ROUNDINGS", roundings)
    solved: list[str] = []

    def counted(*args: object, **kwargs: object) -> object:
        solved.append(str(kwargs.get("solver")))
        return solve_model(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(first_plan_module, "solve_model", counted)
    inst = compile_problem(family(1, deployments=60, regions=4, hardware=2, fullness=0.97).problem)
    start = lp_start(inst, 0.0, Budget(10**9))
    assert len(start.rounded) == roundings
    assert solved == ["glop"] + ["highs"] * (roundings - 1)


def test_past_the_priced_lps_size_the_lp_is_solved_by_highs_for_its_roundings_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between LP_PRICES_MAX_OPTIONS and LP_ROUNDING_MAX_OPTIONS (made 0 and 10**9 here) the
    whole model's LP is solved by HiGHS: the same bound as GLOP's and roundings, but no prices
    (HiGHS's row values through OR-Tools are not duals). Past both, no LP at all."""
    first_plan_module = importlib.import_module("ipnext.planner.first_plan")
    inst = compile_problem(family(1, deployments=60, regions=4, hardware=2, fullness=0.97).problem)
    priced = lp_start(inst, 0.0, Budget(10**9))
    solved: list[str] = []

    def counted(*args: object, **kwargs: object) -> object:
        solved.append(str(kwargs.get("solver")))
        return solve_model(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(first_plan_module, "solve_model", counted)
    monkeypatch.setattr(first_plan_module, "LP_PRICES_MAX_OPTIONS", 0)
    unpriced = lp_start(inst, 0.0, Budget(10**9))
    assert solved and set(solved) == {"highs"}
    assert priced.bound is not None and unpriced.bound == pytest.approx(priced.bound, rel=1e-6)
    assert (priced.prices > 0).any() and not unpriced.prices.any()
    assert unpriced.rounded and len(unpriced.columns) >= len(inst.blocks)
    monkeypatch.setattr(first_plan_module, "LP_ROUNDING_MAX_OPTIONS", 0)
    solved.clear()
    none = lp_start(inst, 0.0, Budget(10**9))
    assert solved == [] and none.rounded == [] and none.bound is None
