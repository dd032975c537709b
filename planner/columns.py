"""A plan out of the column generation's columns: more columns near the best prices, then
the master LP's whole blocks with an IP (or a greedy choice) for the blocks it mixes, and
repair when the columns cannot fit the pools."""

from __future__ import annotations

import logging

import numpy as np

from ipnext.planner.improve import plan_cost
from ipnext.planner.instance import Instance
from ipnext.planner.master import Master, MasterLP
from ipnext.planner.pool import Pool
from ipnext.planner.pricing import BlockChoice, prohibitive, usage_of
from ipnext.planner.repair import place_one_by_one, repair
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = ["cheaper_from_columns", "enrich", "from_columns", "greedy_columns", "swap_columns"]

log = logging.getLogger(__name__)

# The IPs over the mixed blocks' columns and over every block's: past FLEET_BLOCKS blocks each
# gets at most this (once 1 s; the 1,000-deployment row: the second found nothing in 5.9 s,
# where the greedy choice then placed every block in 2 s).
WHOLE_IP_FLEET_WORK = UNITS_PER_SECOND
# Swapping columns to fit what the greedy choice left: at most this share of the work left
# (placing blocks one at a time gets the rest when the swaps find no fit).
SWAP_SHARE = 1 / 3
NEAR_IP_WORK = 2 * UNITS_PER_SECOND  # when no single swap helps: the IP over the blocks on the overfull pools
# After a branch: the IP over every column again, in at most this and a quarter of the work left
# (100-deployment bench row: 3200.52 -> 3191.81 in 0.3 s, and improvement then found 3189.70).
AGAIN_WORK = 5 * UNITS_PER_SECOND
MIN_IP_WORK = UNITS_PER_SECOND // 10


def enrich(
    inst: Instance, pool: Pool, master: Master, prices: np.ndarray, churn: float, budget: Budget
) -> int:
    """More columns near the best prices, for the IP that picks the plan: the LP mixes a few
    blocks' columns, and an integral plan needs other placements of them and of their
    neighbours on the same pools. Each priced pool is, in turn, priced out and made free,
    and every block that may use it is solved at those prices. Returns how many were added."""
    users: dict[int, list[int]] = {}
    for o in range(len(inst.opt_d)):
        p = int(inst.opt_r[o]) * inst.pool_units.shape[1] + int(inst.opt_h[o])
        users.setdefault(p, []).append(int(inst.block_of[inst.opt_d[o]]))
    price_out = prohibitive(inst)
    added = 0
    for p in np.argsort(-prices.ravel()):
        if prices.flat[p] <= 1e-9 or budget.exhausted():
            break
        blocks = sorted(set(users.get(int(p), [])))
        for value in (price_out, 0.0):
            trial = prices.copy()
            trial.flat[p] = value
            for c in pool.solve(blocks, trial, churn, refine=False, budget=budget).values():
                added += master.add(c, c.cost)
    return added


def from_columns(
    inst: Instance,
    master: Master,
    lp: MasterLP,
    churn: float,
    prices: np.ndarray,
    budget: Budget,
    *,
    explain: bool = True,
) -> dict[int, BlockChoice]:
    """A plan out of the columns: blocks the master LP takes whole keep that column; the few it
    mixes get theirs from an IP over their columns in the capacity left; if that has no
    solution, an IP over every block's columns, then a greedy choice (`greedy_columns`); if
    the columns cannot fit at all, the greedy choice over every block, then repair (`explain`
    as there)."""
    heaviest: dict[int, tuple[float, int]] = {}
    for c, w in enumerate(lp.weights):
        b = master.columns[c].block
        if w > heaviest.get(b, (-1.0, -1))[0]:
            heaviest[b] = (float(w), c)
    rounded = {b: master.columns[c].choice for b, (_, c) in heaviest.items()}
    mixed = sorted(b for b, (w, _) in heaviest.items() if w < 1 - 1e-6)
    whole = {b: c for b, c in rounded.items() if b not in set(mixed)}
    residual = (inst.pool_units - usage_of(inst, whole)).ravel()
    limit = max(UNITS_PER_SECOND, budget.left() // 3)
    log.debug("columns: slack %.3g, least residual %.3g, %d mixed", lp.slack, residual.min(), len(mixed))
    if lp.slack <= 1e-9 and (residual >= -1e-9).all():
        # At fleet scale the IPs get little time: when they find nothing (the 1,000 row: the
        # mixed blocks' IP ran 5 s to no plan in one run of four), placing blocks one at a time
        # needs it, and a plan that runs out of time there is no plan at all.
        ip_limit = min(limit, WHOLE_IP_FLEET_WORK) if inst.fleet else limit
        chosen = master.solve_ip(mixed, np.maximum(residual, 0.0), ip_limit, budget) if mixed else {}
        if chosen is not None:
            log.debug("plan: %d blocks as the master LP has them, %d by IP", len(whole), len(mixed))
            return {**whole, **{b: master.columns[c].choice for b, c in chosen.items()}}
        # The mixed blocks' columns do not fit what the others leave: choose every block's
        # column together (the IP's freedom to move a whole block is what the rounding lacks).
        # Below fleet scale it may take half the time left: on 300-tight it needed 1.7-5 s of
        # the 5.7 s a third gave, and ran out in one of nine logged runs; the greedy choice
        # that followed cost 5,908 against 5,847, and improvement (what the rest of the time
        # is for) took it only to 5,890.
        whole_limit = ip_limit if inst.fleet else max(UNITS_PER_SECOND, budget.left() // 2)
        chosen = master.solve_ip(list(range(len(inst.blocks))), inst.pool_units.ravel(), whole_limit, budget)
        if chosen is not None:
            log.debug("plan: every block by IP over the columns")
            return {b: master.columns[c].choice for b, c in chosen.items()}
        placed = greedy_columns(inst, master, mixed, whole, churn, prices, budget)
        if placed is not None:
            log.debug("plan: %d blocks as the master LP has them, %d greedily", len(whole), len(mixed))
            return placed
    if lp.slack > 1e-9:  # the columns cannot fit: place every block greedily
        placed = greedy_columns(inst, master, list(range(len(inst.blocks))), {}, churn, prices, budget)
        if placed is not None:
            log.debug("plan: every block greedily (the columns do not fit the pools)")
            return placed
    log.debug("plan: repair (%d mixed blocks, slack %.3g)", len(mixed), lp.slack)
    return repair(inst, rounded, churn, budget, prices, explain=explain)


def sum_units(master: Master, cols: list[int], size: int) -> np.ndarray:
    """The units the columns `cols` take, per pool (flat)."""
    total = np.zeros(size)
    for c in cols:
        np.add.at(total, master.columns[c].pools, master.columns[c].units)
    return total


def swap_columns(
    inst: Instance,
    master: Master,
    plan: dict[int, BlockChoice],
    left: list[int],
    budget: Budget,
) -> dict[int, BlockChoice] | None:
    """`plan` with the blocks of `left` on the columns that overfill least, made to fit by swapping
    blocks' columns: while a pool is overfull, the swap of one block's column (any block on an
    overfull pool, for another of its columns) that cuts the total overflow at the least extra
    cost per unit cut. No MIP: each step is arithmetic over those blocks' columns. When no
    single swap helps, the blocks on the overfull pools choose their columns together by an IP
    (at most NEAR_IP_WORK). None when that finds nothing either, or `budget` is spent (a swap
    weighed is a work unit); else a plan that fits.

    Placing what the greedy choice left one block at a time (a MIP per block, evicting others
    when it does not fit) can take longer than the time left at fleet scale (the 1,000 row: no
    plan in two runs of five, after 11 s on seven blocks). The LP had room for those blocks
    by mixing columns; the swaps find it by moving other blocks to other columns."""
    col_of: dict[int, int] = {}
    for b, choice in plan.items():
        col_of[b] = next(c for c in master.of_block[b] if master.columns[c].choice is choice)
    capacity = inst.pool_units.ravel()
    usage = sum_units(master, list(col_of.values()), capacity.size)
    for b in left:  # each on the column that overfills least, the cheaper on a tie

        def added(c: int) -> tuple[float, float]:
            col = master.columns[c]
            before = usage[col.pools] - capacity[col.pools]
            after = before + col.units
            return float((np.maximum(after, 0.0) - np.maximum(before, 0.0)).sum()), col.cost

        col_of[b] = min(master.of_block[b], key=added)
        np.add.at(usage, master.columns[col_of[b]].pools, master.columns[col_of[b]].units)
    users: dict[int, set[int]] = {}
    for b, c in col_of.items():
        for p in master.columns[c].pools:
            users.setdefault(int(p), set()).add(b)
    steps = 0
    while True:
        over = usage - capacity
        if over.max() <= 1e-9:
            log.debug("swaps: %d blocks placed by %d swaps", len(left), steps)
            return {b: master.columns[c].choice for b, c in col_of.items()}
        if budget.exhausted():
            return None
        total = float(np.maximum(over, 0.0).sum())
        on_over = set().union(*(users.get(int(p), set()) for p in np.flatnonzero(over > 1e-9)))
        best: tuple[float, float, int, int] | None = None  # (extra cost per unit cut, -cut, ...)
        for b in sorted(on_over):
            old = master.columns[col_of[b]]
            for c in master.of_block[b]:
                if c == col_of[b]:
                    continue
                new = master.columns[c]
                trial = over.copy()
                np.subtract.at(trial, old.pools, old.units)
                np.add.at(trial, new.pools, new.units)
                cut = total - float(np.maximum(trial, 0.0).sum())
                budget.spend(1 + len(old.pools) + len(new.pools))
                if cut <= 1e-9:
                    continue
                key = ((new.cost - old.cost) / cut, -cut, b, c)
                if best is None or key < best:
                    best = key
        if best is None:
            # No single swap helps: the blocks on the overfull pools choose their columns
            # together, by an IP in the capacity the other blocks leave.
            near = sorted(on_over)
            others = [c for b, c in col_of.items() if b not in on_over]
            free = np.maximum(capacity - sum_units(master, others, capacity.size), 0.0)
            limit = budget.cap(NEAR_IP_WORK)
            chosen = master.solve_ip(near, free, limit, budget) if limit > MIN_IP_WORK // 2 else None
            log.debug(
                "swaps: none cuts the overflow of %.3g units after %d swaps; the IP over the %d "
                "blocks on overfull pools %s",
                total,
                steps,
                len(near),
                "fits them" if chosen is not None else "found nothing",
            )
            if chosen is None:
                return None
            col_of.update(chosen)
            return {b: master.columns[c].choice for b, c in col_of.items()}
        _, _, b, c = best
        old, new = master.columns[col_of[b]], master.columns[c]
        np.subtract.at(usage, old.pools, old.units)
        np.add.at(usage, new.pools, new.units)
        for p in old.pools:
            users[int(p)].discard(b)
        for p in new.pools:
            users.setdefault(int(p), set()).add(b)
        col_of[b] = c
        steps += 1


def cheaper_from_columns(
    inst: Instance, master: Master, plan: dict[int, BlockChoice], budget: Budget
) -> dict[int, BlockChoice]:
    """The cheapest choice of one column per block that fits the pools (an IP over every
    column, stopped at its limit), when it is cheaper than `plan`; else `plan`."""
    limit = min(AGAIN_WORK, budget.left() // 4)
    if limit <= MIN_IP_WORK or budget.exhausted():
        return plan
    chosen = master.solve_ip(list(range(len(inst.blocks))), inst.pool_units.ravel(), limit, budget)
    if chosen is None:
        return plan
    again = {b: master.columns[c].choice for b, c in chosen.items()}
    log.debug("every column again: %.3f against the plan's %.3f", plan_cost(again), plan_cost(plan))
    return again if plan_cost(again) < plan_cost(plan) - 1e-9 else plan


def greedy_columns(
    inst: Instance,
    master: Master,
    mixed: list[int],
    whole: dict[int, BlockChoice],
    churn: float,
    prices: np.ndarray,
    budget: Budget,
) -> dict[int, BlockChoice] | None:
    """When no IP over the mixed blocks' columns was found in time: each mixed block, least
    flexible first, takes its cheapest column that fits what is left; the blocks no column
    fits are, at fleet scale, first fitted by swapping columns (`swap_columns`), else placed one
    by one against the capacity left (evicting others if they must)."""
    plan = dict(whole)
    residual = inst.pool_units - usage_of(inst, plan)
    flat = residual.ravel()  # a view: updates reach `residual`
    left: list[int] = []
    for b in sorted(mixed, key=lambda b: len(master.of_block[b])):
        for c in sorted(master.of_block[b], key=lambda c: master.columns[c].cost):
            col = master.columns[c]
            if (flat[col.pools] >= col.units - 1e-9).all():
                flat[col.pools] -= col.units
                plan[b] = col.choice
                break
        else:
            left.append(b)
    log.debug("greedy: %d of %d blocks by a column", len(mixed) - len(left), len(mixed))
    if not left:
        return plan
    if inst.fleet:  # smaller instances place them one at a time in the time they have
        swapped = swap_columns(inst, master, plan, left, budget.share(SWAP_SHARE))
        if swapped is not None:
            return swapped
    done = place_one_by_one(inst, left, np.maximum(residual, 0.0), churn, prices, plan, budget)
    log.debug("one by one: %d blocks, %s", len(left), done.why or "placed")
    if done.placed is None:
        return None
    plan.update(done.placed)
    return plan
