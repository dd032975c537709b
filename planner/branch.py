"""A proven bound above column generation's: one branch on a block the master LP mixes.

Why. Once pricing finds nothing new, the master LP's optimum is the Dantzig-Wolfe bound, the
best any pool prices give. The optimum can lie above it, because the LP may split a block
between placements to fill a pool exactly, which no plan can do. On the 100-deployment bench
row the bound was 3186.02 and the plan 3189.70 (0.115%), while SCIP, given 400 s on the whole
model, proved 3188.61: most of that gap is the bound's.

How. Pick a block b the LP mixes and a pool p where the LP's units of b are fractional, u (the
pair whose two sides' LPs over the columns already known rise the least at worst). Every plan
has b's units in p either at most floor(u) or at least ceil(u). On either side, for any prices
mu >= 0,

    sum over the other blocks of their priced optimum at mu
        + b's priced optimum at mu with its units in p on that side
        - mu . capacity

is a lower bound of every plan on that side (the pool rows relaxed, as in decompose.py; the
side's row is kept, on b alone). So the smaller of the two sides' best bounds bounds every plan.
Each side runs its own column generation: its master LP holds every column but b's on the other
side, its duals are the next prices, the other blocks are priced as in a round (their proven
bounds), and b by the HiGHS block MIP with the side's row (its bound at the time limit is
proven too). A side with no placement of b at all bounds nothing and is left out (+inf).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from ipnext.planner.backend import solve_model
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance
from ipnext.planner.master import Master, MasterLP
from ipnext.planner.pool import Pool
from ipnext.planner.pricing import BlockChoice, block_names, priced_choice
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = ["Side", "branched_bound"]

log = logging.getLogger(__name__)

MAX_CANDIDATES = 12  # (block, pool) pairs whose sides' LPs are compared
SIDE_ROUNDS = 30
SIDE_BLOCK_WORK = 2 * UNITS_PER_SECOND  # the branched block's MIP, per round (once 2 s)
MIN_SIDE_BLOCK_WORK = UNITS_PER_SECOND // 10


@dataclass(frozen=True)
class Side:
    """Plans where `block`'s units in flat pool `pool` are at most (`at_most`) or at least `units`."""

    block: int
    pool: int
    units: int
    at_most: bool

    def holds(self, used: float) -> bool:
        return used <= self.units + 1e-9 if self.at_most else used >= self.units - 1e-9


def branched_bound(
    inst: Instance, master: Master, lp: MasterLP, pool: Pool, churn: float, budget: Budget
) -> tuple[float, str] | None:
    """The smaller of the two sides' bounds of the best branch found (module docstring), with
    what was branched on; None when the LP mixes no block or a side was not bounded in `budget`."""
    started = budget.spent
    candidates = _fractional(master, lp)[:MAX_CANDIDATES]
    if not candidates:
        return None
    scored = []
    for block, p, used in candidates:
        sides = (Side(block, p, math.floor(used), True), Side(block, p, math.ceil(used), False))
        scored.append((min(_side_lp(master, s).objective for s in sides), sides))
    estimate, sides = max(scored, key=lambda item: item[0])
    log.debug(
        "master LP %.3f; branch on block %d, pool %d (units <= %d | >= %d): "
        "the sides' LPs over known columns %.3f",
        lp.objective,
        sides[0].block,
        sides[0].pool,
        sides[0].units,
        sides[1].units,
        estimate,
    )
    bounds = []
    for k, side in enumerate(sides):
        # Each side gets half of what is left when it starts.
        bound = _side_bound(inst, master, pool, churn, side, budget.share(1 / (len(sides) - k)))
        if bound is None:
            return None
        bounds.append(bound)
    log.debug("branched bound %.3f (sides %s) in %d work units", min(bounds), bounds, budget.spent - started)
    side = sides[0]
    h = inst.pool_units.shape[1]
    pool_name = f"{inst.regions[side.pool // h]}/{inst.hardware[side.pool % h]}"
    return min(
        bounds
    ), f"{block_names(inst, side.block)}'s units in {pool_name} <= {side.units} or >= {side.units + 1}"


def _fractional(master: Master, lp: MasterLP) -> list[tuple[int, int, float]]:
    """(block, flat pool, LP units) where a mixed block's units are fractional, most fractional first."""
    out = []
    for block, cols in enumerate(master.of_block):
        used = [c for c in cols if c < len(lp.weights) and lp.weights[c] > 1e-9]
        if len(used) < 2:
            continue
        units: dict[int, float] = {}
        for c in used:
            col = master.columns[c]
            for p, n in zip(col.pools.tolist(), col.units.tolist(), strict=True):
                units[p] = units.get(p, 0.0) + float(lp.weights[c]) * n
        for p, u in units.items():
            if abs(u - round(u)) > 1e-6:
                out.append((block, p, u))
    return sorted(out, key=lambda item: -min(item[2] - math.floor(item[2]), math.ceil(item[2]) - item[2]))


def _units_in(master: Master, column: int, pool: int) -> float:
    col = master.columns[column]
    hits = np.flatnonzero(col.pools == pool)
    return float(col.units[hits].sum())


def _side_columns(master: Master, side: Side) -> list[int]:
    return [
        c
        for c, col in enumerate(master.columns)
        if col.block != side.block or side.holds(_units_in(master, c, side.pool))
    ]


def _side_lp(master: Master, side: Side) -> MasterLP:
    cols = _side_columns(master, side)
    if not any(master.columns[c].block == side.block for c in cols):
        return MasterLP(math.inf, np.zeros_like(master.inst.pool_units), np.zeros(0), 0.0)
    return master.solve_lp(cols)


def _side_bound(
    inst: Instance, master: Master, pool: Pool, churn: float, side: Side, budget: Budget
) -> float | None:
    """The side's best Lagrangian bound over its column generation's prices (module docstring);
    +inf when the side holds no placement of the block; None if no round finished in time."""
    best: float | None = None
    others = [b for b in range(len(inst.blocks)) if b != side.block]
    capacity = inst.pool_units
    for _ in range(SIDE_ROUNDS):
        if budget.exhausted():
            break
        lp = _side_lp(master, side)
        own = _priced_on_side(
            inst, side, lp.prices, churn, max(MIN_SIDE_BLOCK_WORK, budget.cap(SIDE_BLOCK_WORK)), budget
        )
        if own is None:
            return math.inf  # no placement of the block on this side: no plan to bound
        if isinstance(own, float):
            break  # its MIP found neither a placement nor a bound in time
        choices = pool.solve(others, lp.prices, churn, refine=True, budget=budget)
        if len(choices) < len(others):
            break
        bound = sum(c.bound for c in choices.values()) + own.bound - float((lp.prices * capacity).sum())
        best = bound if best is None else max(best, bound)
        added = sum(master.add(c, c.cost) for c in choices.values()) + master.add(own, own.cost)
        if not added or lp.objective - best <= 1e-7 * max(1.0, abs(best)):
            break
    return best


def _priced_on_side(
    inst: Instance, side: Side, prices: np.ndarray, churn: float, work: int, budget: Budget
) -> BlockChoice | float | None:
    """The block's priced optimum at `prices` with its units in the side's pool on that side
    (the block MIP with that one pool row); None when no placement is on that side; -inf (a
    float) when the MIP found nothing in `work` units."""
    h = inst.pool_units.shape[1]
    key = (side.pool // h, side.pool % h)
    room = np.full_like(inst.pool_units, np.inf)
    model = build(inst, [side.block], pool_capacity=room, prices=prices, churn_cost=churn)
    row = model.pool_rows.get(key)
    if row is None:  # the block cannot use the pool at all: 0 units
        if not side.holds(0.0):
            return None
    elif side.at_most:
        model.row_ub[row] = side.units
    else:
        model.row_lb[row] = side.units
    sol = solve_model(model, work=work, budget=budget, relative_gap=1e-9)
    if sol.status == "infeasible":
        return None
    if sol.values is None:
        return -math.inf
    xs = np.rint(sol.values[: model.n_x]).astype(np.int64)
    fs = sol.values[model.n_x : model.n_x + model.n_f]
    x = {int(o): int(n) for o, n in zip(model.opts, xs, strict=True) if n > 0}
    f = {int(t): float(v) for t, v in zip(model.routes, fs, strict=True) if v > 1e-9}
    return priced_choice(inst, side.block, x, f, sol.objective, sol.bound, churn)
