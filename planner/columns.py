"""A plan out of the column generation's columns: more columns near the best prices, then
the master LP's whole blocks with an IP (or a greedy choice) for the blocks it mixes, and
repair when the columns cannot fit the pools."""

from __future__ import annotations

import logging
import time

import numpy as np

from ipnext.planner.improve import plan_cost
from ipnext.planner.instance import Instance
from ipnext.planner.master import Master, MasterLP
from ipnext.planner.pool import Pool
from ipnext.planner.pricing import BlockChoice, prohibitive, usage_of
from ipnext.planner.repair import place_one_by_one, repair

__all__ = ["cheaper_from_columns", "enrich", "from_columns", "greedy_columns"]

log = logging.getLogger(__name__)

# The IP over every block's columns: past FLEET_BLOCKS blocks it gets at most this (the
# 1,000-deployment row: nothing in 5.9 s, where the greedy choice then placed every block in 2 s).
WHOLE_IP_FLEET_S = 1.0
# After a branch: the IP over every column again, in at most this and a quarter of the time left
# (100-deployment bench row: 3200.52 -> 3191.81 in 0.3 s, and improvement then found 3189.70).
AGAIN_LIMIT_S = 5.0


def enrich(
    inst: Instance, pool: Pool, master: Master, prices: np.ndarray, churn: float, deadline: float
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
        if prices.flat[p] <= 1e-9 or time.monotonic() > deadline:
            break
        blocks = sorted(set(users.get(int(p), [])))
        for value in (price_out, 0.0):
            trial = prices.copy()
            trial.flat[p] = value
            for c in pool.solve(blocks, trial, churn, refine=False, deadline=deadline).values():
                added += master.add(c, c.cost)
    return added


def from_columns(
    inst: Instance,
    master: Master,
    lp: MasterLP,
    churn: float,
    prices: np.ndarray,
    hard_deadline: float,
) -> dict[int, BlockChoice]:
    """A plan out of the columns: blocks the master LP takes whole keep that column; the few it
    mixes get theirs from an IP over their columns in the capacity left; if that has no
    solution, an IP over every block's columns, then a greedy choice (`greedy_columns`); if
    the columns cannot fit at all, the greedy choice over every block, then repair."""
    heaviest: dict[int, tuple[float, int]] = {}
    for c, w in enumerate(lp.weights):
        b = master.columns[c].block
        if w > heaviest.get(b, (-1.0, -1))[0]:
            heaviest[b] = (float(w), c)
    rounded = {b: master.columns[c].choice for b, (_, c) in heaviest.items()}
    mixed = sorted(b for b, (w, _) in heaviest.items() if w < 1 - 1e-6)
    whole = {b: c for b, c in rounded.items() if b not in set(mixed)}
    residual = (inst.pool_units - usage_of(inst, whole)).ravel()
    limit = max(1.0, (hard_deadline - time.monotonic()) / 3)
    log.debug("columns: slack %.3g, least residual %.3g, %d mixed", lp.slack, residual.min(), len(mixed))
    if lp.slack <= 1e-9 and (residual >= -1e-9).all():
        chosen = master.solve_ip(mixed, np.maximum(residual, 0.0), limit) if mixed else {}
        if chosen is not None:
            log.debug("plan: %d blocks as the master LP has them, %d by IP", len(whole), len(mixed))
            return {**whole, **{b: master.columns[c].choice for b, c in chosen.items()}}
        # The mixed blocks' columns do not fit what the others leave: choose every block's
        # column together (the IP's freedom to move a whole block is what the rounding lacks).
        whole_limit = min(limit, WHOLE_IP_FLEET_S) if inst.fleet else limit
        chosen = master.solve_ip(list(range(len(inst.blocks))), inst.pool_units.ravel(), whole_limit)
        if chosen is not None:
            log.debug("plan: every block by IP over the columns")
            return {b: master.columns[c].choice for b, c in chosen.items()}
        placed = greedy_columns(inst, master, mixed, whole, churn, prices, hard_deadline)
        if placed is not None:
            log.debug("plan: %d blocks as the master LP has them, %d greedily", len(whole), len(mixed))
            return placed
    if lp.slack > 1e-9:  # the columns cannot fit: place every block greedily
        placed = greedy_columns(inst, master, list(range(len(inst.blocks))), {}, churn, prices, hard_deadline)
        if placed is not None:
            log.debug("plan: every block greedily (the columns do not fit the pools)")
            return placed
    log.debug("plan: repair (%d mixed blocks, slack %.3g)", len(mixed), lp.slack)
    return repair(inst, rounded, churn, hard_deadline, prices)


def cheaper_from_columns(
    inst: Instance, master: Master, plan: dict[int, BlockChoice], hard_deadline: float
) -> dict[int, BlockChoice]:
    """The cheapest choice of one column per block that fits the pools (an IP over every
    column, stopped at its limit), when it is cheaper than `plan`; else `plan`."""
    limit = min(AGAIN_LIMIT_S, (hard_deadline - time.monotonic()) / 4)
    if limit <= 0.1:
        return plan
    chosen = master.solve_ip(list(range(len(inst.blocks))), inst.pool_units.ravel(), limit)
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
    hard_deadline: float,
) -> dict[int, BlockChoice] | None:
    """When no IP over the mixed blocks' columns was found in time: each mixed block, least
    flexible first, takes its cheapest column that fits what is left; the blocks no column
    fits are placed one by one against the capacity left (evicting others if they must)."""
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
    placed, why = place_one_by_one(inst, left, np.maximum(residual, 0.0), churn, prices, plan, hard_deadline)
    log.debug("one by one: %d blocks, %s", len(left), why or "placed")
    if placed is None:
        return None
    plan.update(placed)
    return plan
