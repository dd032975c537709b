"""The anytime plan (decompose.py's first plan): made before the pricing rounds, so that a
work limit never leaves the planner with nothing, and returned when nothing better is ready.

`lp_start` solves the whole model's LP relaxation when it is small enough (its duals are the
first pool prices, its bound the first bound; past `LP_PRICES_MAX_OPTIONS`, by HiGHS for its
values and bound alone) and rounds it up a few times. `first_plan`
then tries, each only when the one before gives up: the rounding that overflows the pools
least, its blocks off the overfull pools placed again by the completing MIPs (complete.py);
a plan from scratch (`repair.from_scratch`), completed the same way. A fleet has no LP rounding and
starts from scratch (past `LP_ROUNDING_MAX_OPTIONS`); when that fails too,
`fitted_first_round` repairs the first pricing round's answers.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ipnext.errors import InfeasiblePlanError, NoPlacementError, PlanningTimeoutError
from ipnext.planner.backend import solve_model
from ipnext.planner.complete import complete
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, choices_from_values, rounded_up, usage_of
from ipnext.planner.repair import OUT_OF_TIME, Unplaced, first_plan_repair, from_scratch, minimal_movers
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = ["LPStart", "first_plan", "fitted_first_round", "lp_start"]

log = logging.getLogger("ipnext.planner.decompose")  # one logger for the decomposition's story

# A rounding after the second is not solved when, at the last one's time, it would end past the
# LP's share of the time (work.Budget.clock_cuts, only when the clock will stop the solve
# first): shrunk twice by the overflow, the pools of an 820-deployment instance 95.5% full left
# no placement, and HiGHS took 20.7 s to prove the third rounding's LP infeasible (the second
# took 4.2 s); the first plan then never came.
LP_ROUNDINGS = 4
# Larger LPs take most of the time limit (1,000 deployments: GLOP unfinished in 9 s).
LP_PRICES_MAX_OPTIONS = 20_000
# Past it, up to this many options, the LP is solved by HiGHS's simplex for its roundings (and
# its bound) alone; the first prices stay zero (the pool rows' duals HiGHS returns through
# OR-Tools' model builder are not duals, complete.py). A rounding makes a fleet's first plan
# sooner and cheaper than a plan from scratch, which may not finish in the first plan's work
# (measured: docs/architecture/planner.md, the first plan's ways).
LP_ROUNDING_MAX_OPTIONS = 50_000
LP_PRICES_SHARE = 0.25  # of the pricing's work, the most the whole model's LP relaxation takes
# The completing MIPs may take the decomposition's work up to this share of it: a plan comes
# before a better bound (the LP relaxation's stands in). At the first plan's 30%, one of 20
# small nearly-full instances of the property test had none.
COMPLETE_SHARE = 0.7
# When the clock will stop the solve before its work limit (work.Budget.clock_capped), the
# completing MIPs also stop at this share of the time, so that a plan from scratch still has
# the rest: on an 820-deployment instance 95.5% full, a completing MIP over 89 blocks charged
# 4.3 M units ran 23 s and found nothing, and the clock stopped the solve with no plan, where a
# plan from scratch alone came at 34 s beside a test run.
COMPLETE_CLOCK_SHARE = 0.5
# A fleet past this many blocks (no LP rounding) skips the plan from scratch: at 6,885 blocks
# (the 10,000 row) it would cost about a pricing round's work (31-51 s) before the first
# round, whose answers repaired at congestion prices were that row's measured first plan
# (55 s). The plan from scratch was measured up to 682 blocks (3.4 M units, 17.7 s).
SCRATCH_MAX_BLOCKS = 3_000
# A fleet's first round's answers are repaired at congestion prices first past this many blocks
# (`repair.first_plan_repair`); up to it, at the first prices first. On the 10,000 row (6,885
# blocks) only the congestion prices place them (55 s; at zero prices the evictions went on past
# 300 s). On the 1,000 row (701 blocks) both do (4 s and 10 s); the plans the rounds then made
# from the zero-price one were 3.27-3.87% over their bounds in five runs, from the congestion
# one 3.84-3.98% in four. The runs vary that much from timing alone, but until more runs
# tell them apart that row keeps the repair it was measured with.
CONGESTION_FIRST_BLOCKS = 3_000


@dataclass
class LPStart:
    """What the whole model's LP relaxation gives the decomposition before any pricing round."""

    prices: np.ndarray
    columns: list[BlockChoice]
    rounded: list[dict[int, BlockChoice]]  # each rounding's whole plan, in the order made
    bound: float | None  # the LP's optimum, a lower bound of the MIP's; None when unsolved


def lp_start(inst: Instance, churn: float, budget: Budget) -> LPStart:
    """First pool prices: the duals of the whole model's LP relaxation, when it is small enough
    to solve in a fraction of the time (zero prices otherwise). Near-full pools are then
    priced from the first round, instead of after many rounds of overfull columns.

    Also a column per block from the LP's solution, replicas rounded up: each is a valid
    placement of its block (rounding up only adds capacity, a region holds replicas of every
    member wherever the LP put any, and `pricing.rounded_up` adds what a spare asks where the
    LP stood the block only fractionally), and together they sit close to what fits the
    pools, which the blocks' own optima at any single prices often do not."""
    prices = np.zeros_like(inst.pool_units)
    if len(inst.opt_d) > LP_ROUNDING_MAX_OPTIONS:
        return LPStart(prices, [], [], None)
    priced = len(inst.opt_d) <= LP_PRICES_MAX_OPTIONS  # GLOP, for its duals; else HiGHS, values only
    started = budget.spent
    lp_budget = budget.share(LP_PRICES_SHARE)
    model = build(inst, list(range(len(inst.blocks))), pool_capacity=inst.pool_units, churn_cost=churn)
    limit = max(UNITS_PER_SECOND, lp_budget.left())
    sol = solve_model(model, relax=True, solver="glop" if priced else "highs", work=limit, budget=budget)
    bound = None
    if sol.status == "optimal":  # the duals of an unfinished LP are no prices
        if priced:
            for (r, h), dual in sol.pool_duals.items():
                prices[r, h] = dual
        bound = float(sol.objective)
    log.debug(
        "LP relaxation %s in %d units: %.3f, %d pools priced",
        sol.status,
        budget.spent - started,
        sol.objective,
        int((prices > 0).sum()),
    )
    columns: list[BlockChoice] = []
    plans: list[dict[int, BlockChoice]] = []
    blocks = list(range(len(inst.blocks)))
    capacity = inst.pool_units.copy()
    # Rounding up overfills pools that the LP filled; solve again with those pools shrunk by
    # the overflow, a few times, so that some rounded plan fits (near-full pools need it).
    lp_seconds = 0.0  # how long the last rounding's LP took
    for attempt in range(LP_ROUNDINGS):
        if sol.values is None:
            break
        rounded = choices_from_values(inst, model, rounded_up(inst, model, sol.values), churn, blocks)
        columns.extend(rounded.values())
        plans.append(rounded)
        overflow = np.maximum(usage_of(inst, rounded) - inst.pool_units, 0.0)
        log.debug("LP rounding %d: overflows pools by %g units", attempt + 1, overflow.sum())
        if not overflow.any() or attempt + 1 == LP_ROUNDINGS or lp_budget.exhausted():
            break
        if lp_budget.clock_cuts(lp_seconds):  # the last one's time again would end past its share
            break
        capacity = np.maximum(capacity - overflow, 0.0)
        model = build(inst, blocks, pool_capacity=capacity, churn_cost=churn)
        # Only its values are used (the prices are the first LP's duals): HiGHS's simplex,
        # 1.3-1.6 s where GLOP took 4.8 s on 679- and 702-deployment instances.
        solving = time.monotonic()
        sol = solve_model(model, relax=True, solver="highs", work=limit, budget=budget)
        lp_seconds = time.monotonic() - solving
    return LPStart(prices, columns, plans, bound)


def first_plan(
    inst: Instance, start: LPStart, churn: float, budget: Budget, whole: Budget
) -> tuple[dict[int, BlockChoice] | None, str]:
    """A plan that fits the pools, made in the first seconds so that a work limit never leaves
    the planner with nothing. Each way only when the one before gives up: the LP rounding that
    overflows the pools least, with the blocks off its overfull pools (`repair.minimal_movers`)
    placed again by the completing MIPs (complete.py), which free more of the others as they
    need; a plan built from scratch, every block one at a time at congestion prices
    (`repair.from_scratch`), with what it left placed by the completing MIPs when they did not
    run yet (no LP rounding). The completing MIPs may take up to `COMPLETE_SHARE` of the
    decomposition's `whole` budget (a plan first: the LP's bound stands in for the pricing's).
    None, with why, when none finishes; NoPlacementError when a completing MIP proves that no
    plan exists. (Before the completing MIPs, the rounding's movers were placed again one at a
    time at congestion prices, on up to a third of the first plan's work: on six 415-802-
    deployment instances 92-95% full, the first plans came at 19-43 s that way, at 10-24 s
    without it, on the 2-core machine's 60 s clock.)"""
    started = budget.spent
    tried: list[str] = []
    completed = False  # whether the completing MIPs had their turn
    if not start.rounded:
        tried.append("no LP rounding (the LP relaxation is too large or unsolved)")
    else:

        def overflow(plan: dict[int, BlockChoice]) -> float:
            return float(np.maximum(usage_of(inst, plan) - inst.pool_units, 0.0).sum())

        least = min(start.rounded, key=overflow)
        over = overflow(least)
        if over == 0.0:
            return least, "the LP relaxation rounded up"
        movers = minimal_movers(inst, least, usage_of(inst, least))
        off = set(movers)
        kept = {b: c for b, c in least.items() if b not in off}
        tried.append(f"the LP rounding overfilled pools by {over:g} units ({len(movers)} blocks off them)")
        done, why = _completed(inst, kept, movers, churn, whole, started, budget, tried)
        if done is not None:
            return done, why
        tried.append(why)
        completed = True
    if not start.rounded and len(inst.blocks) > SCRATCH_MAX_BLOCKS:
        # A plan from scratch costs about a pricing round, which a fleet this large needs
        # anyway: its first plan is that round's answers, repaired (fitted_first_round).
        return None, f"{tried[0]}; past {SCRATCH_MAX_BLOCKS:,} blocks, no plan from scratch"
    try:
        plan = from_scratch(inst, churn, budget)
    except Unplaced as err:  # out of its work too
        tried.append(f"placed from scratch, {len(err.left)} blocks were left")
        if completed:  # the completing MIPs had their work: what is left of it is the rounds'
            return None, f"{'; '.join(tried)}; nothing in {budget.spent - started:,} work units"
        done, why = _completed(inst, err.placed, err.left, churn, whole, started, budget, tried)
        return done, why if done is not None else f"{'; '.join(tried)}; {why}"
    return plan, f"placed from scratch in {budget.spent - started:,} work units ({'; '.join(tried)})"


def _completed(
    inst: Instance,
    placed: dict[int, BlockChoice],
    left: list[int],
    churn: float,
    whole: Budget,
    started: int,
    budget: Budget,
    tried: list[str],
) -> tuple[dict[int, BlockChoice] | None, str]:
    """The blocks `left` placed beside `placed` by the completing MIPs (complete.py) on up to
    `COMPLETE_SHARE` of the decomposition's `whole` budget: the plan, or None and why."""
    try:
        plan, how = complete(
            inst, placed, left, churn, whole.until(COMPLETE_SHARE).clock_capped(COMPLETE_CLOCK_SHARE)
        )
    except NoPlacementError:
        raise  # proven over every block and the whole pools: no plan exists, nothing else to try
    except (PlanningTimeoutError, InfeasiblePlanError) as err:
        return None, f"the completing MIPs found nothing in {budget.spent - started:,} work units: {err}"
    return plan, (
        f"{'; '.join(tried)}; the {len(left)} left placed by exact MIPs ({how.describe()}), "
        f"in {budget.spent - started:,} work units"
    )


def fitted_first_round(
    inst: Instance, choices: dict[int, BlockChoice], churn: float, prices: np.ndarray, budget: Budget
) -> tuple[dict[int, BlockChoice] | None, str]:
    """A fleet's first plan: the first pricing round's answers (every block at its cheapest at
    the first prices, which overfill the cheap pools), repaired one block at a time, at
    congestion prices or at the first prices (`CONGESTION_FIRST_BLOCKS` says which is tried
    first; the joint MIP over hundreds of blocks finds nothing in time at this size: 34 s for
    nothing on the 1,000-deployment row). Its columns fit the pools, so the master LP has
    prices, not the slack's, from the first round on. On the bench's fleet rows (zero first
    prices) the repair takes 7.5 s at 1,000 deployments (196 blocks to place, at the first
    prices; 3.9 s at congestion prices) and 55 s at 10,000 (1,540, at congestion prices),
    where the first plan used to wait for the columns to fit (213 s). None, with why, when the
    repair does not finish in `budget`."""
    started = budget.spent
    try:
        plan = first_plan_repair(
            inst,
            choices,
            churn,
            budget,
            prices,
            joint=False,
            congestion_first=len(inst.blocks) > CONGESTION_FIRST_BLOCKS,
        )
    except PlanningTimeoutError as err:
        why = err.message.removeprefix(f"{OUT_OF_TIME}: ").rstrip(".")
        return None, f"the first round's answers were not repaired in time ({why})"
    except InfeasiblePlanError as err:
        return None, f"the first round's answers could not be repaired ({err.message.rstrip('.')})"
    return plan, f"the first round's answers, repaired in {budget.spent - started:,} work units"
