"""The global planner: column generation over pools (Dantzig-Wolfe), per-block MIPs as the
pricing step, a plan chosen from the columns, and large-neighbourhood improvement.

Why this shape. Deployments interact only through pool capacity (and groups, which we keep
together as blocks). The LP relaxation of the whole model is weak (replicas are integers
and min_regions / survive_region_loss force small deployments into several regions: on a
20-deployment instance it sits ~24% under the optimum) and slow at fleet scale (a
1,000-deployment LP took 32 s on 2 cores), and a monolithic MIP found no solution at 100
deployments in 30 s. So:

1. Price the pools: with prices mu, every block is an independent small MIP (in parallel
   processes). The sum of the block optima minus mu . capacity is a lower bound on the true
   optimum for any mu >= 0 (the Lagrangian bound), and it pays for integrality, which the
   LP bound does not. A block MIP stopped at its work limit contributes HiGHS's proven
   bound, so the sum stays a valid bound.
2. The prices come from a master LP over every block placement found so far (columns; see
   master.py), not from subgradient steps: its pool duals are the best prices for the
   columns known, which converges in a handful of rounds where subgradient steps took
   dozens (on the 100-deployment benchmark: 7 rounds to a bound within 0.5% of the plan).
3. The plan: first more columns near the best prices (each priced pool in turn priced out
   and made free: the rounding needs other placements of the mixed blocks and of their
   neighbours). The master LP takes all but a few blocks whole; the rest are chosen by an
   IP over their columns in the capacity left (else an IP over every block's columns, else
   a greedy choice that places what no column fits one block at a time). Then blocks with
   the largest regret at the best prices are freed a few at a time and placed together by
   an exact MIP against the capacity the others leave. Repair (below) only runs when
   nothing else fits.

4. The bound, on instances of at most FLEET_BLOCKS blocks whose column generation settled
   (its bound is the master LP's): one branch on a block the LP mixes, each side with its own
   column generation, proves the smaller of the two sides' bounds (branch.py says why that holds
   and why it can exceed the master LP's), in at most BRANCH_SHARE of the time left; the plan is
   improved in the rest. On the 100-deployment bench row: 3186.02 -> 3188.07, against a plan of
   3189.70 (SCIP proved 3188.61 in 400 s). The sides' columns fill the pools in new ways, so the
   plan is chosen again from every column before it is improved.

Work. Every step stops at its share of the work limit (work.py: rounds, DP steps, HiGHS nodes
and simplex iterations, each charged by what it was given or its size, never by how long it
took), so the plan depends on the problem and the limit alone; the wall clock is the user's
outer stop, and a result it cut says so. A pricing round that runs out of work keeps, for the
blocks it did not reach, their last placement and the best bound proven
at prices no higher than the current ones (valid because a block's priced optimum never
falls when prices rise; see rounds.Rounds). In pricing rounds a block the fast solver cannot prove
keeps its answer and its (looser) bound: HiGHS takes 0.4-3 s on such a block (a 1,000-
deployment fleet has about 40), so it runs only on the loosest of them at the end, in the
work left, when the bound is tightened: in the worker processes, while this process improves
the plan. A round re-solves only the blocks whose last answer a price change can affect (see
rounds.Reuse).

At fleet scale (past FLEET_BLOCKS) the LP relaxation is too large to round into a first plan,
so the first round's answers, made to fit by repair (at congestion prices first past
CONGESTION_FIRST_BLOCKS, first_plan.py), are it; its columns also give the master LP
a way to fit the pools, so its prices are real duals from the first round rather than the
slack's. Two more things there. A round priced while the master's columns do not fit the
pools (past SLACK_WORK_BLOCKS, when that repair failed, until the rounds find columns that
fit) gives the fast solver only SLACK_WORK per block: its prices are the slack's, its bound
far below zero whatever it proves, and what it must find is placements that fit. And the fast
solver's unproven placements can cost far more than the
optimum, so HiGHS runs twice more: on the loosest blocks of the first round whose prices the
columns fit (`_loosest_by_mip`), and, once the workers' tightened blocks are in, their
placements join the columns and the plan is chosen again (`_chosen_again`).

`lower_bound_method` in the result says which bound won: the Lagrangian bound (and the branch,
when it raised it), or the optimum of the exact MIP for instances small enough to solve whole.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.branch import branched_bound
from ipnext.planner.columns import cheaper_from_columns, enrich, from_columns
from ipnext.planner.first_plan import first_plan, fitted_first_round, lp_start
from ipnext.planner.improve import TIGHTEN_FLEET_WORK, improve, loose, plan_cost, tighten, tightened
from ipnext.planner.instance import Instance
from ipnext.planner.master import Master
from ipnext.planner.pool import Jobs, Pool, gather
from ipnext.planner.pricing import BlockChoice, block_names
from ipnext.planner.repair import OUT_OF_TIME
from ipnext.planner.rounds import Reuse, Rounds
from ipnext.planner.work import Budget

__all__ = ["BlockChoice", "Decomposition", "decompose"]

log = logging.getLogger(__name__)

SMOOTHING = 0.5
ENRICH_SHARE = 0.25  # of the work left after pricing, for more columns near the best prices
# Of the work limit, the most the first plan (LP rounding, repaired) may take before pricing starts.
FIRST_PLAN_SHARE = 0.3
MAX_SLACK_RAISES = 6  # then the columns are taken not to fit: repair decides, or names the shortfall
# A branch for a better bound (branch.py): on instances of at most FLEET_BLOCKS blocks whose
# master LP fits the pools, in this share of the work left after the plan is built.
BRANCH_SHARE = 0.35
# At fleet scale the plan is chosen again once the workers' exact block answers are in (every
# one is waited for: each is work-limited). The workers get the loosest blocks whose MIPs'
# work together is at most this share of the work left when they are sent (they run beside
# this process, on the other cores).
TIGHTEN_JOBS_SHARE = 1.0
# At fleet scale, the first round at prices the master's columns fit also solves its this
# many loosest blocks by the HiGHS block MIP, in at most as much work again as the round took.
MIP_BLOCKS_IN_ROUND = 8
# The fast block solver's work budget per block in a fleet's rounds before the columns fit
# (WORK_BUDGET otherwise). On the 10,000-deployment row those rounds then take 29-31 s instead
# of 37-41 s, the fourth fits the pools, and the plan comes from fitting columns in 10 s instead
# of placing 981 blocks one at a time in 58 s (21.3% -> 8.0%).
SLACK_WORK = 5_000
# ... past this many blocks. At 1,000 deployments (701 blocks), before their first plan came
# from the first round, the columns fit by the fourth round either way, and with the smaller
# budget the plan out of them did not fit in time in 5 runs of 10 (with the full budget, 1 of
# 13), so there the rounds keep WORK_BUDGET. Now the first plan's columns fit from the first
# round on both rows, and only a fleet whose first plan's repair failed has rounds priced at
# the slack's prices.
SLACK_WORK_BLOCKS = 3_000


@dataclass
class Decomposition:
    choices: dict[int, BlockChoice]
    lower_bound: float
    iterations: int
    # How the plan was made when it is the first plan (the column generation's ran out of time):
    # None when the plan came out of the columns.
    first_plan: str | None = None
    # What the bound was branched on when a branch raised it (branch.py).
    branch: str | None = None


def decompose(
    inst: Instance,
    *,
    churn: float,
    budget: Budget,
    pricing_share: float = 1.0,
    fitting_share: float | None = None,
    workers: int | None = None,
    max_iterations: int = 200,
) -> Decomposition:
    """The Lagrangian lower bound and the cheapest block choices found that fit the pools.

    Column generation until `pricing_share` of `budget` is spent: the master LP's pool duals
    price the pools, every block is solved at those prices (its optimum is a new column, and
    the sum of the block bounds minus prices . capacity a lower bound). Then the bound is
    tightened at the best prices, and the plan chosen from the columns (`columns.from_columns`),
    in the rest. Once the master's columns fit the pools, rounds may go on until
    `fitting_share` (when larger): a plan from columns that fit is quick to choose, where one
    from columns that do not places most blocks one at a time. Every step is charged to
    `budget` (work.py), so the result depends on the work alone, unless its clock fires.
    Progress is logged at debug level."""
    workers = workers or os.cpu_count() or 1
    capacity = inst.pool_units
    blocks = list(range(len(inst.blocks)))
    master = Master(inst, budget)
    iteration = 0
    pricing = budget.until(pricing_share)
    with Pool(inst, workers) as pool:
        start = lp_start(inst, churn, pricing)
        prices = start.prices
        for c in start.columns:
            master.add(c, c.cost)
        # The anytime plan: whatever happens later, this one is returned if nothing better is.
        first, first_how = first_plan(inst, start, churn, budget.until(FIRST_PLAN_SHARE), budget)
        _first_plan_logged(first is not None, first_how, budget)
        for c in (first or {}).values():  # columns that fit the pools together: no slack needed
            master.add(c, c.cost)
        # The first round must answer every block (each needs a column and a bound); later
        # rounds stop at the pricing's share and carry the blocks they did not reach.
        round_started, round_clock = budget.spent, time.monotonic()
        choices = pool.solve(blocks, prices, churn, refine=False, budget=budget)
        first_round_work = budget.spent - round_started
        per_block = first_round_work / max(1, len(choices))  # a round's pace, in work
        per_block_s = (time.monotonic() - round_clock) / max(1, len(choices))  # and in time
        missing = [b for b in blocks if b not in choices]
        if missing:
            if first is not None and start.bound is not None:
                return Decomposition(first, max(start.bound, 0.0), 0, first_how)
            raise PlanningTimeoutError(
                f"{OUT_OF_TIME}{_by_clock(budget)}: the first pricing round reached {len(choices)} of "
                f"{len(blocks)} blocks ({block_names(inst, missing[0])} among those left) in "
                f"{budget.spent:,} work units, and no first plan was made ({first_how}).",
                fix=_more(budget),
            )
        if first is None and inst.fleet and not start.rounded:
            # No LP rounding at fleet scale: the first round's answers, made to fit.
            # It may take what work is left: without it there is no plan until the columns fit.
            first, first_how = fitted_first_round(inst, choices, churn, prices, budget)
            _first_plan_logged(first is not None, first_how, budget)
            for c in (first or {}).values():
                master.add(c, c.cost)
        branch: str | None = None
        rounds = Rounds(inst)
        rounds.add(prices, choices)
        reuse = Reuse(inst, choices, prices)
        best = sum(c.bound for c in choices.values()) - float((prices * capacity).sum())
        best_prices, best_blocks = prices.copy(), dict(choices)
        for c in choices.values():
            master.add(c, c.cost)
        log.debug("first prices: bound %.3f (%d units)", best, budget.spent)
        lp = master.solve_lp()
        smoothing = SMOOTHING
        raises = 0
        mipped = False  # the loosest blocks of a round were solved by the MIP
        fitting = budget.until(max(pricing_share, fitting_share or pricing_share))
        for iteration in range(1, max_iterations + 1):
            if lp.slack <= 1e-9 and lp.objective - best <= 1e-7 * max(1.0, abs(best)):
                break  # the master LP meets the bound: nothing left for prices to find
            until = fitting if lp.slack <= 1e-9 else pricing
            if until.exhausted():
                break
            # Smoothed prices (Wentges): part way from the best prices so far to the LP's duals,
            # which jump about while few columns exist.
            prices = smoothing * best_prices + (1 - smoothing) * lp.prices if best > 0 else lp.prices
            stale = reuse.stale(prices)
            if inst.fleet and lp.slack <= 1e-9 and per_block * len(stale) > until.left():
                # A round cut short proves little (the blocks it misses keep bounds from lower
                # prices): at fleet scale its time goes to the plan and the tightening instead.
                # While the columns do not fit, a part round still brings columns that help
                # them fit. On smaller instances the rounds run to their share as before (with
                # this stop, 300-tight gave 9 plans of 10 in one repeat; without it, 10 of 10).
                log.debug(
                    "iteration %d: %d blocks would not be priced in the work left", iteration, len(stale)
                )
                break
            if inst.fleet and lp.slack <= 1e-9 and until.clock_cuts(per_block_s * len(stale)):
                # The same when the clock, not the work, will stop the solve: without this a
                # 751-deployment instance priced to 51 s of its 60, and the plan from the
                # columns ran out of time (its first plan came back, 22% over its bound).
                log.debug(
                    "iteration %d: %d blocks would not be priced in the time left", iteration, len(stale)
                )
                break
            round_started, round_clock = budget.spent, time.monotonic()
            fitted = lp.slack <= 1e-9
            # While the columns do not fit, a round's bound is of no use (the prices are the
            # slack's, and the bound far below zero): at fleet scale its blocks need placements
            # that move them off the overfull pools, not proofs, so a smaller work budget.
            work = SLACK_WORK if len(inst.blocks) > SLACK_WORK_BLOCKS and not fitted else WORK_BUDGET
            fresh = pool.solve(stale, prices, churn, refine=False, budget=until, work=work)
            if fresh:
                per_block = (budget.spent - round_started) / len(fresh)
                per_block_s = (time.monotonic() - round_clock) / len(fresh)
            if inst.fleet and fitted and not mipped and len(fresh) == len(stale):
                # The first round at prices the columns fit: its loosest blocks by the MIP too.
                fast_work = budget.spent - round_started
                fresh.update(_loosest_by_mip(pool, fresh, prices, churn, until.part(fast_work)))
                mipped = True
            reuse.update(fresh, prices)
            solved = {**reuse.unchanged(stale), **fresh}
            choices = rounds.complete(solved, prices, best_blocks)
            bound = sum(c.bound for c in choices.values()) - float((prices * capacity).sum())
            rounds.add(prices, solved)
            if bound > best:
                best, best_prices, best_blocks = bound, prices.copy(), choices
            added = sum(master.add(c, c.cost) for c in fresh.values())
            lp = master.solve_lp()
            log.debug(
                "iteration %d: %d of %d changed blocks priced (%d in all), %d new columns, "
                "master LP %.3f (slack %.3g), bound %.3f, best %.3f (%d units)",
                iteration,
                len(fresh),
                len(stale),
                len(blocks),
                added,
                lp.objective,
                lp.slack,
                bound,
                best,
                budget.spent,
            )
            if len(fresh) < len(stale):
                break  # out of work mid-round
            if not added:
                if smoothing > 0:
                    smoothing = 0.0  # nothing new at the smoothed prices: take the LP's own
                elif lp.slack > 1e-9 and raises < MAX_SLACK_RAISES:
                    master.slack_cost *= 4  # the columns cannot fit yet at this slack cost
                    raises += 1
                    lp = master.solve_lp()
                else:
                    break  # every block's optimum at the LP's prices is in the master already
            else:
                smoothing = SMOOTHING
        # More columns near the best prices, then a plan. Small instances then tighten the bound
        # (and branch) before improving the plan; at fleet scale the workers tighten it while
        # this process builds the plan (when the columns fit the pools) and improves it.
        if lp.slack <= 1e-9:  # else the duals are the slack's, no guide to placements
            around = best_prices if best_prices.any() else lp.prices
            added = enrich(inst, pool, master, around, churn, budget.share(ENRICH_SHARE))
            lp = master.solve_lp()
            log.debug("enriched by %d columns: master LP %.3f (%d units)", added, lp.objective, budget.spent)
        loosest = loose(best_blocks)
        branching = lp.slack <= 1e-9 and not inst.fleet

        def submit() -> Jobs | None:
            """The workers tighten the bound (HiGHS on the loosest blocks) while this process
            builds or improves the plan: neither waits for the other. As many of the loosest as
            TIGHTEN_FLEET_WORK each takes to spend TIGHTEN_JOBS_SHARE of the work left (never a
            count of workers: the blocks tightened must not depend on the machine's cores)."""
            if branching or pool.executor is None or not loosest:
                return None
            count = max(1, int(TIGHTEN_JOBS_SHARE * budget.left()) // TIGHTEN_FLEET_WORK)
            return pool.submit(
                loosest[:count], best_prices, churn, TIGHTEN_FLEET_WORK, True, 1, clock=budget.clock
            )

        # Columns that do not fit leave the plan to place blocks one at a time: it needs the cores.
        jobs = submit() if lp.slack <= 1e-9 else None
        how: str | None = None
        try:
            plan = from_columns(inst, master, lp, churn, prices, budget, explain=first is None)
        except PlanningTimeoutError as err:
            if first is None:
                raise PlanningTimeoutError(
                    f"{err.message} No first plan either: the first pricing round took "
                    f"{first_round_work:,} work units, then {first_how}.",
                    fix=_more(budget),
                ) from None
            plan, how = first, first_how
        if first is not None and plan_cost(first) < plan_cost(plan):
            plan, how = first, first_how
        log.debug("plan cost %.3f (%d units)", plan_cost(plan), budget.spent)
        exact_columns = jobs is not None  # sent before the plan: fleet scale, columns that fit
        if jobs is None:
            jobs = submit()
        if branching:
            # Small enough to branch (branch.py): the bound first (tightened, then branched on in
            # at most BRANCH_SHARE of the work left), then the plan improved in the rest.
            until = budget.share(BRANCH_SHARE)
            best = tighten(inst, pool, best_prices, best_blocks, churn, until) or best
            settled = lp.objective - best <= 1e-6 * max(1.0, abs(best))  # the bound is the LP's
            if settled and plan_cost(plan) - best > 1e-6 * max(1.0, abs(best)):
                branched = branched_bound(inst, master, lp, pool, churn, until)
                if branched is not None and branched[0] > best:
                    best, branch = branched
                # The sides' columns fill the pools in ways the rounds' did not: choose again.
                plan = cheaper_from_columns(inst, master, plan, budget)
            plan = improve(inst, plan, best_prices, best_blocks, churn, budget, pool=pool).plan
        elif exact_columns and jobs is not None:
            # Fleet scale, columns that fit. The workers' answers are better placements as well
            # as better bounds: where the fast solver cannot prove a block, its placement can
            # cost far more than the optimum (1,000 row, zero prices: 889 over on 39 blocks),
            # and those dear columns are what the master LP mixes. So the plan waits for them
            # and is chosen again from the columns they join; improvement, which finds little
            # at this size (no better neighbourhood in 11 s on the 1,000 row), gets what is left.
            # Every job is waited for (each is work-limited) and charged in the order sent.
            solved = _gathered(jobs, budget)
            best = tightened(inst, best_prices, best_blocks, solved) or best
            plan = _chosen_again(inst, master, solved, plan, churn, prices, budget)
            plan = improve(inst, plan, best_prices, best_blocks, churn, budget).plan
        elif jobs is not None:
            # The workers' answers are charged once they are in, so improvement here is given
            # what is left before them, whichever finishes first.
            tightening = budget.detached()
            plan = improve(inst, plan, best_prices, best_blocks, churn, budget).plan
            solved = _gathered(jobs, tightening)
            best = tightened(inst, best_prices, best_blocks, solved) or best
        else:
            best = tighten(inst, pool, best_prices, best_blocks, churn, budget) or best
            plan = improve(inst, plan, best_prices, best_blocks, churn, budget, pool=pool).plan
    if start.bound is not None and start.bound > best:  # both are proven; the larger is the tighter
        best, branch = start.bound, None
    return Decomposition(choices=plan, lower_bound=best, iterations=iteration, first_plan=how, branch=branch)


def _first_plan_logged(found: bool, how: str, budget: Budget) -> None:
    """The first plan's record, at debug level; `found` and `work` travel as the record's
    attributes (`first_plan`, `work`): the bench times the first plan by them."""
    extra = {"first_plan": found, "work": budget.spent}
    log.debug("first plan: %s (%d units)", how, budget.spent, extra=extra)


def _by_clock(budget: Budget) -> str:
    return " (stopped by the clock: not reproducible)" if budget.stopped_by_clock else ""


def _more(budget: Budget) -> str:
    if budget.stopped_by_clock:
        return "give the planner more time (--time-limit): the clock stopped it before its work limit"
    return "give the planner more work (--work-limit)"


def _gathered(jobs: Jobs, budget: Budget) -> dict[int, BlockChoice]:
    """The answers of the workers' jobs (every one waited for, or those done by the clock),
    charged to `budget` in the order sent; those past its end are left out."""
    solved: dict[int, BlockChoice] = {}
    for b, c in gather(jobs, budget.clock).items():
        if budget.exhausted():
            break
        if c is not None:
            budget.spend(c.work)
            solved[b] = c
    return solved


def _loosest_by_mip(
    pool: Pool, fresh: dict[int, BlockChoice], prices: np.ndarray, churn: float, budget: Budget
) -> dict[int, BlockChoice]:
    """The MIP_BLOCKS_IN_ROUND loosest blocks of a round's answers solved again by the HiGHS
    block MIP (TIGHTEN_FLEET_WORK each; those past `budget` are left out).

    Where the fast solver cannot prove a block (groups with survive_region_loss), its placement
    can cost far more than the optimum, and those dear columns are what the master LP mixes:
    its objective and the plan then sit well above what the columns could give. On the
    1,000-deployment row the first round that fits answers four of eight such blocks this way,
    together 1,052 cheaper (priced) and their bounds 188 higher; by the next round the master
    LP is 42,212 where it was 42,897 without them, and the plan follows."""
    todo = loose(fresh)[:MIP_BLOCKS_IN_ROUND]
    exact = pool.solve(todo, prices, churn, TIGHTEN_FLEET_WORK, refine=True, budget=budget)
    log.debug(
        "%d of %d loose blocks by the MIP: bounds %+.3f, placements %+.3f",
        len(exact),
        len(todo),
        sum(c.bound - fresh[b].bound for b, c in exact.items()),
        sum(c.priced - fresh[b].priced for b, c in exact.items()),
    )
    return exact


def _chosen_again(
    inst: Instance,
    master: Master,
    solved: dict[int, BlockChoice],
    plan: dict[int, BlockChoice],
    churn: float,
    prices: np.ndarray,
    budget: Budget,
) -> dict[int, BlockChoice]:
    """The plan chosen again from the columns once the blocks of `solved` (answers of the
    HiGHS block MIP) have joined them, when that is cheaper; else `plan`."""
    added = sum(master.add(c, c.cost) for c in solved.values())
    if not added:
        return plan
    lp = master.solve_lp()
    if lp.slack > 1e-9:
        return plan
    try:
        again = from_columns(inst, master, lp, churn, prices, budget, explain=False)
    except (PlanningTimeoutError, InfeasiblePlanError):
        return plan
    log.debug(
        "%d exact columns: master LP %.3f, plan %.3f against %.3f",
        added,
        lp.objective,
        plan_cost(again),
        plan_cost(plan),
    )
    return again if plan_cost(again) < plan_cost(plan) - 1e-9 else plan
