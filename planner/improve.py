"""After a plan is chosen: large-neighbourhood improvement (blocks freed a few at a time and
placed together by an exact MIP), and tightening the lower bound by solving the loosest
blocks again with a longer limit."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ipnext.planner.instance import Instance
from ipnext.planner.pool import Pool, place_jointly_in_worker
from ipnext.planner.pricing import JOINT_REPAIR_WORK, BlockChoice, place_jointly, price_of, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = [
    "TIGHTEN_FLEET_WORK",
    "TIGHTEN_WORK",
    "Improvement",
    "improve",
    "loose",
    "plan_cost",
    "tighten",
    "tightened",
]

log = logging.getLogger(__name__)

TIGHTEN_WORK = 5 * UNITS_PER_SECOND  # per block when the bound at the best prices is tightened
# At fleet scale, where the workers tighten while the plan improves: more blocks in that time.
# HiGHS proved most loose blocks of the 1,000-deployment row in 0.4-1 s (a few need 20 s).
TIGHTEN_FLEET_WORK = 3 * UNITS_PER_SECOND // 2
# A neighbourhood is tried only while at least this much is left (once a second).
NEIGHBOURHOOD_MIN_WORK = UNITS_PER_SECOND
IMPROVE_PASSES = 3


@dataclass
class Improvement:
    plan: dict[int, BlockChoice]
    tried: int  # neighbourhoods solved
    better: int  # of those, kept because they made the plan cheaper


def improve(
    inst: Instance,
    plan: dict[int, BlockChoice],
    prices: np.ndarray,
    priced: dict[int, BlockChoice],
    churn: float,
    budget: Budget,
    size: int = 8,
    pool: Pool | None = None,
) -> Improvement:
    """Large neighbourhood search: free a few blocks at a time and place them together by an
    exact MIP in the capacity the others leave, keeping the result when it is cheaper. Blocks
    go in order of regret: how much more their placement costs at the best prices than their
    optimum there (the gap to the bound is the sum of the regrets and the prices' unused
    capacity, so that is where the cost is). With worker processes, as many disjoint
    neighbourhoods as there are workers are solved at once; the better results are kept
    while together they fit the pools. Each joint MIP is given its work before any is solved
    and charged after, in the batch's order, so a batch's answers do not depend on which
    worker finished first."""
    plan = dict(plan)
    executor = pool.executor if pool is not None else None
    width = pool.workers if pool is not None and executor is not None else 1

    def attempt(batch: list[list[int]]) -> int:
        """Solve the neighbourhoods of `batch` (disjoint) and keep what helps; how many did."""
        jobs = []
        for movers in batch:
            kept = {b: c for b, c in plan.items() if b not in set(movers)}
            residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
            jobs.append((movers, residual, churn, budget.detached(budget.cap(JOINT_REPAIR_WORK))))
        if executor is not None and len(jobs) > 1:
            answers = list(executor.map(place_jointly_in_worker, jobs))
        else:
            answers = [(place_jointly(inst, *job), job[3].spent) for job in jobs]
        results = []
        for placed, spent in answers:
            budget.spend(spent)
            results.append(placed)
        gains = []
        for movers, placed in zip(batch, results, strict=True):
            if placed is not None:
                gain = sum(plan[b].cost for b in movers) - plan_cost(placed)
                if gain > 1e-9:
                    gains.append((gain, placed))
        kept_count = 0
        for _, placed in sorted(gains, key=lambda item: -item[0]):
            trial = {**plan, **placed}
            if (usage_of(inst, trial) <= inst.pool_units + 1e-9).all():  # each fit alone; together?
                plan.update(placed)
                kept_count += 1
        return kept_count

    def regret(b: int) -> float:
        c = plan[b]
        return c.cost + price_of(inst, c.x, prices) - priced[b].bound

    before = plan_cost(plan)
    tried = improved = 0
    seen: set[tuple[int, ...]] = set()
    batch: list[list[int]] = []

    def flush() -> int:
        """Try the neighbourhoods of `batch` together; how many helped."""
        nonlocal tried, batch
        found = attempt(batch)
        tried, batch = tried + len(batch), []
        return found

    for _ in range(IMPROVE_PASSES):
        better = 0
        for movers in _neighbourhoods(inst, plan, prices, regret, size):
            key = tuple(sorted(movers))
            if key in seen:
                continue
            if budget.left() < NEIGHBOURHOOD_MIN_WORK or budget.exhausted():
                break
            if any(set(movers) & set(other) for other in batch) and (found := flush()):
                better += found
                seen.clear()  # the others' neighbourhoods changed with it
            seen.add(key)
            batch.append(movers)
            if len(batch) == width and (found := flush()):
                better += found
                seen.clear()
        if batch and budget.left() >= NEIGHBOURHOOD_MIN_WORK and not budget.exhausted():
            better += flush()
        batch = []
        improved += better
        if not better:
            break
    idle = float((prices * (inst.pool_units - usage_of(inst, plan))).sum())
    log.debug(
        "gap at the best prices: regret %.3f, idle priced capacity %.3f", sum(regret(b) for b in plan), idle
    )
    log.debug(
        "improve: %d neighbourhoods of %d blocks by regret, %d better, cost %.3f -> %.3f",
        tried,
        size,
        improved,
        before,
        plan_cost(plan),
    )
    return Improvement(plan, tried, improved)


def _neighbourhoods(
    inst: Instance,
    plan: dict[int, BlockChoice],
    prices: np.ndarray,
    regret: Callable[[int], float],
    size: int,
) -> Iterator[list[int]]:
    """Blocks to free together: first by regret, `size` at a time; then, for each congested
    pool (priced, or at least 95% used), its users and then the blocks that could use it,
    most regret first, `size` at a time."""
    scores = {b: regret(b) for b in plan}
    order = sorted((b for b in plan if scores[b] > 1e-6 * max(1.0, plan[b].cost)), key=lambda b: -scores[b])
    for start in range(0, len(order), size):
        yield order[start : start + size]
    blocks_at: dict[tuple[int, int], set[int]] = {}
    for o in range(len(inst.opt_d)):
        blocks_at.setdefault((int(inst.opt_r[o]), int(inst.opt_h[o])), set()).add(
            int(inst.block_of[inst.opt_d[o]])
        )
    used = usage_of(inst, plan)
    congested = np.argwhere((prices > 1e-9) | (used >= 0.95 * inst.pool_units))
    for r, h in sorted(congested.tolist(), key=lambda rh: -float(prices[rh[0], rh[1]])):
        # Its users, then the blocks that could move into it (an exchange needs both sides).
        users = [b for b, c in plan.items() if any(inst.opt_r[o] == r and inst.opt_h[o] == h for o in c.x)]
        users.sort(key=lambda b: -scores[b])
        could = [b for b in plan if b not in set(users) and b in blocks_at.get((r, h), set())]
        could.sort(key=lambda b: -scores[b])
        users += could
        for start in range(0, len(users), size):
            yield users[start : start + size]


def loose(choices: dict[int, BlockChoice]) -> list[int]:
    """Blocks whose bound is below their answer, loosest first."""
    return sorted(
        (b for b, c in choices.items() if c.priced - c.bound > 1e-6 * max(1.0, abs(c.priced))),
        key=lambda b: choices[b].bound - choices[b].priced,
    )


def tighten(
    inst: Instance,
    pool: Pool,
    prices: np.ndarray,
    choices: dict[int, BlockChoice],
    churn: float,
    budget: Budget,
) -> float | None:
    """Solve again, with a larger MIP budget, the blocks whose bound is loosest at `prices`, in
    half of the work left (improvement takes the rest). Returns the improved Lagrangian
    bound, or None if nothing was re-solved."""
    half = budget.share(0.5)
    loosest = loose(choices)
    if not loosest or half.left() < UNITS_PER_SECOND or half.exhausted():
        return None
    mip_work = max(UNITS_PER_SECOND * 3 // 10, half.cap(TIGHTEN_WORK))
    return tightened(inst, prices, choices, pool.solve(loosest, prices, churn, mip_work, budget=half))


def tightened(
    inst: Instance,
    prices: np.ndarray,
    choices: dict[int, BlockChoice],
    solved: dict[int, BlockChoice],
) -> float | None:
    """The Lagrangian bound at `prices` with the better bounds of `solved` taken in."""
    if not solved:
        return None
    for b, c in solved.items():
        if c.bound > choices[b].bound:
            choices[b] = c
    bound = sum(c.bound for c in choices.values()) - float((prices * inst.pool_units).sum())
    log.debug("tightened %d loose blocks: bound %.3f", len(solved), bound)
    return bound


def plan_cost(choices: dict[int, BlockChoice]) -> float:
    return sum(c.cost for c in choices.values())
