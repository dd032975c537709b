"""Fewest moves within a cost budget: the MIP that a replan's second phase solves (over a few
blocks at a time) and that `bench/planner.py --rows replan` solves whole as the reference.

Moved units are counted as `Plan.moved_units` counts them: units newly placed on a (deployment,
region, hardware) against the current plan, sum of max(0, after - before) x units.
"""

from __future__ import annotations

import logging

import numpy as np
import scipy.sparse as sp

from ipnext.planner.backend import solve_model
from ipnext.planner.formulation import BlockModel, build
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, choices_from_values, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = ["fewer_moves", "fewest_moves", "fewest_moves_model", "moved_units_of"]

log = logging.getLogger(__name__)

NEIGHBOURHOOD = 8  # blocks placed again together per MIP when moves are cut on the scalable path
NEIGHBOURHOOD_WORK = 5 * UNITS_PER_SECOND  # one neighbourhood's MIP (once 5 s)
MIN_NEIGHBOURHOOD_WORK = UNITS_PER_SECOND // 2


def _tie_break(cap: float) -> float:
    """A cost weight that only breaks ties: the whole cost under it is worth half a unit moved
    (moved units are whole numbers), so the fewest moves come first, then the cheapest."""
    return 0.5 / max(cap, 1e-9)


def fewest_moves(
    inst: Instance, cap: float, churn: float, work: int, budget: Budget | None = None
) -> tuple[dict[int, BlockChoice] | None, bool]:
    """The whole model: the fewest moved units of any plan costing at most `cap` (the cheapest
    of those), as block choices, or None when HiGHS found none in `work` units (charged to
    `budget`); and whether that is proven the fewest."""
    blocks = list(range(len(inst.blocks)))
    model = fewest_moves_model(
        inst, blocks, cost_cap=cap, pool_capacity=inst.pool_units, cost_weight=_tie_break(cap)
    )
    sol = solve_model(model, work=work, budget=budget, relative_gap=1e-9)
    if sol.values is None:
        return None, False
    return choices_from_values(inst, model, sol.values, churn, blocks), sol.status == "optimal"


def fewer_moves(
    inst: Instance, plan: dict[int, BlockChoice], cap: float, churn: float, budget: Budget
) -> dict[int, BlockChoice]:
    """Large-neighbourhood search for fewer moved units at a cost of at most `cap`: blocks
    that move units, most first, are freed `NEIGHBOURHOOD` at a time and placed again by the
    fewest-moves MIP in the pool capacity and the cost the others leave; a result is kept
    when it moves fewer units (or as many, cheaper). `plan` must cost at most `cap`."""
    plan = dict(plan)

    def moves(b: int) -> int:
        return moved_units_of(inst, plan[b].x)

    def cost(b: int) -> float:
        return float(sum(inst.opt_cost[o] * n for o, n in plan[b].x.items()))

    before = sum(moves(b) for b in plan)
    tried = kept = 0
    for _ in range(3):
        movers = sorted((b for b in plan if moves(b) > 0), key=lambda b: -moves(b))
        if not movers:
            break
        better = 0
        for start in range(0, len(movers), NEIGHBOURHOOD):
            if budget.left() < MIN_NEIGHBOURHOOD_WORK or budget.exhausted():
                break
            free = movers[start : start + NEIGHBOURHOOD]
            others = {b: c for b, c in plan.items() if b not in set(free)}
            residual = np.maximum(inst.pool_units - usage_of(inst, others), 0.0)
            room = cap - sum(cost(b) for b in others)
            model = fewest_moves_model(
                inst, free, cost_cap=room, pool_capacity=residual, cost_weight=_tie_break(cap)
            )
            sol = solve_model(model, work=budget.cap(NEIGHBOURHOOD_WORK), budget=budget, relative_gap=1e-9)
            tried += 1
            if sol.values is None:
                continue
            placed = choices_from_values(inst, model, sol.values, churn, free)
            old = (sum(moves(b) for b in free), sum(cost(b) for b in free))
            new_moves = sum(moved_units_of(inst, c.x) for c in placed.values())
            new_cost = sum(float(sum(inst.opt_cost[o] * n for o, n in c.x.items())) for c in placed.values())
            if (new_moves, new_cost) < (old[0], old[1] - 1e-9) and new_cost <= room + 1e-6:
                plan.update(placed)
                better += 1
        kept += better
        if not better:
            break
    log.debug(
        "fewer moves: %d neighbourhoods, %d kept, moved units %d -> %d",
        tried,
        kept,
        before,
        sum(moves(b) for b in plan),
    )
    return plan


def fewest_moves_model(
    inst: Instance,
    blocks: list[int],
    *,
    cost_cap: float,
    pool_capacity: np.ndarray,
    cost_weight: float = 0.0,
) -> BlockModel:
    """The placement model of `blocks` whose objective is the units they newly place against
    the current plan (plus `cost_weight` x their cost: a tie-break when it is small), with one
    more row: their cost (replicas x units x unit cost) at most `cost_cap`. Needs
    `inst.problem.current`."""
    if inst.problem.current is None:
        raise ValueError("fewest_moves_model: the problem has no current plan to count moves against")
    model = build(inst, blocks, pool_capacity=pool_capacity, churn_cost=1.0)  # z columns: the moves
    z0 = model.n_x + model.n_f + model.n_y
    obj = np.zeros_like(model.obj)
    obj[z0:] = inst.opt_units[model.opts]
    obj[: model.n_x] = cost_weight * inst.opt_cost[model.opts]
    cost_row = sp.csr_matrix(
        (inst.opt_cost[model.opts], (np.zeros(model.n_x, dtype=np.int64), np.arange(model.n_x))),
        shape=(1, model.matrix.shape[1]),
    )
    model.obj = obj
    model.matrix = sp.vstack([model.matrix, cost_row], format="csr")
    model.row_lb = np.append(model.row_lb, -np.inf)
    model.row_ub = np.append(model.row_ub, cost_cap)
    return model


def moved_units_of(inst: Instance, x: dict[int, int]) -> int:
    """Units that option counts `x` (option -> replicas) newly place against the current plan."""
    return int(sum(max(0, n - inst.opt_current[o]) * inst.opt_units[o] for o, n in x.items()))
