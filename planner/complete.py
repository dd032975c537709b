"""Completing a placement that repair could not finish: an exact MIP over the blocks left,
in the capacity the placed ones leave, with more of the placed blocks freed to move each time
that MIP proves (or cannot find in its work) that they do not fit, and at the end every block
over the whole pools. So, given the work, the construction ends with a plan or a proof that
none exists (the last MIP is the whole placement model); the MIPs over a few dozen blocks
that it usually ends at take seconds, where the ejection chain before it can go round the
same pools for as long as it is given.

When the work runs out first, or the proof comes, the error says which pools the blocks left
would overfill and by how much (`shortfall`): their cheapest placements with the pools
ignored, added to what the placed blocks use."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ipnext.errors import NoPlacementError, PlanningTimeoutError
from ipnext.planner.backend import root_work, solve_model
from ipnext.planner.block import search_block
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, alone_infeasible, block_names, choices_from_values, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = ["COMPLETE_GAP", "Completion", "Shortfall", "complete", "shortfall"]

# The completing MIPs stop within this share of their optimum: a plan that fits is what they
# are for; improvement (improve.py) makes it cheaper afterwards.
COMPLETE_GAP = 0.02
# Each MIP but the last (every block) gets at most this share of the work left, so that the
# wider ones after it still get some.
STEP_SHARE = 0.5
# A freed ring holds this many times more blocks than the one before (first: as many placed
# blocks as there are blocks left, those holding the most units in the pools they could use).
GROWTH = 2
# The shortfall report places at most this many of the blocks left (the largest), each by the
# fast block solver alone: a report must not take the time a plan needed (every block of a
# 1,000-deployment fleet's repair by the block solver and its MIP took 18 s).
SHORTFALL_BLOCKS = 25


@dataclass(frozen=True)
class Completion:
    """What `complete` did: the blocks each MIP freed, in order, and how each MIP ended."""

    steps: list[tuple[int, str]]  # (blocks freed, status of its MIP)

    def describe(self) -> str:
        return ", ".join(f"{n} blocks: {status}" for n, status in self.steps)


@dataclass(frozen=True)
class Shortfall:
    """Pools the blocks left would overfill, by how many units, and the blocks."""

    short: dict[tuple[str, str], float]  # (region, hardware) -> units missing
    blocks: list[str]
    placed: int  # of `blocks`, how many the estimate placed (the largest)
    alone: list[str]  # why each block that fits nowhere even with the pools to itself does not

    def describe(self) -> str:
        pools = ", ".join(f"{r}/{h} by {units:g} units" for (r, h), units in sorted(self.short.items()))
        more = len(self.blocks) - 5
        names = ", ".join(self.blocks[:5]) + (f" and {more} more" if more > 0 else "")
        where = f"pools short: {pools}" if pools else "no pool is short for their cheapest placements alone"
        if self.placed < len(self.blocks):
            where += f" (for the {self.placed} largest of them)"
        alone = "".join(f"; {why.rstrip('.')}" for why in self.alone)
        return f"{len(self.blocks)} blocks not placed ({names}){alone}; {where}"

    def fix(self) -> str:
        more = ", ".join(f"{r}/{h} +{math.ceil(units)}" for (r, h), units in sorted(self.short.items()))
        fixes = [f"add capacity ({more})"] if more else []
        if self.alone or not more:
            fixes.append(
                "lower the demand of the blocks that fit nowhere, or loosen their latency budgets "
                "or min_regions"
            )
        return "; or ".join(fixes)


def complete(
    inst: Instance,
    placed: dict[int, BlockChoice],
    left: list[int],
    churn: float,
    budget: Budget,
) -> tuple[dict[int, BlockChoice], Completion]:
    """Every block placed: `placed` (which fit the pools) and the blocks `left`, by MIPs over
    `left` and progressively more of `placed`. Raises NoPlacementError when the MIP over
    every block given proves that no placement fits, PlanningTimeoutError when `budget` runs
    out first; both name the shortfall."""
    placed = {b: c for b, c in placed.items() if b not in set(left)}
    order = _neighbours(inst, placed, left)
    steps: list[tuple[int, str]] = []
    freed = 0
    while True:
        whole = freed >= len(order)
        free = list(left) + order[:freed]
        kept = {b: c for b, c in placed.items() if b not in set(free)}
        residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
        if budget.exhausted():
            break
        model = build(inst, free, pool_capacity=residual, churn_cost=churn)
        work = budget.left() if whole else max(UNITS_PER_SECOND, int(STEP_SHARE * budget.left()))
        if budget.cap(work) < root_work(model):
            break  # its root alone would outrun the work (and so the clock): out of work
        sol = solve_model(model, work=budget.cap(work), budget=budget, relative_gap=COMPLETE_GAP)
        steps.append((len(free), sol.status))
        if sol.values is not None:
            kept.update(choices_from_values(inst, model, sol.values, churn, free))
            return kept, Completion(steps)
        if whole:
            if sol.status == "infeasible":
                gap = shortfall(inst, placed, left, churn)
                raise NoPlacementError(
                    f"pools: no placement of the {len(free)} blocks fits them (the exact MIP over "
                    f"every one of them proved it); {gap.describe()}.",
                    fix=gap.fix(),
                )
            break
        freed = max(len(left), freed * GROWTH)
    gap = shortfall(inst, placed, left, churn)
    tried = f" (MIPs over {Completion(steps).describe()})" if steps else ""
    raise PlanningTimeoutError(
        f"no plan that fits the pools within the work limit: {gap.describe()}{tried}.",
        fix=f"give the planner more work (--work-limit), or more time (--time-limit) if the clock "
        f"stopped it; or {gap.fix()}",
    )


def _neighbours(inst: Instance, placed: dict[int, BlockChoice], left: list[int]) -> list[int]:
    """The placed blocks, those holding the most units in the pools the blocks `left` could
    use first (the ones whose moving makes room for them), then the rest by their units."""
    wanted = np.zeros_like(inst.pool_units, dtype=bool)
    for b in left:
        for i in inst.blocks[b]:
            wanted[inst.opt_r[inst.options_of[i]], inst.opt_h[inst.options_of[i]]] = True

    def order(b: int) -> tuple[float, float, int]:
        c = placed[b]
        inside = sum(n * inst.opt_units[o] for o, n in c.x.items() if wanted[inst.opt_r[o], inst.opt_h[o]])
        return -float(inside), -float(sum(n * inst.opt_units[o] for o, n in c.x.items())), b

    return sorted(placed, key=order)


def shortfall(inst: Instance, placed: dict[int, BlockChoice], left: list[int], churn: float) -> Shortfall:
    """The pools that the blocks `left` (the `SHORTFALL_BLOCKS` largest), each at its cheapest
    placement with the pools ignored, overfill on top of `placed`, and by how many units:
    capacity that would let those placements stand (other placements may need less)."""
    used = usage_of(inst, {b: c for b, c in placed.items() if b not in set(left)})
    largest = sorted(left, key=lambda b: -float(inst.total_demand[inst.blocks[b]].sum()))[:SHORTFALL_BLOCKS]
    zero = np.zeros_like(inst.pool_units)
    estimated = 0
    alone: list[str] = []
    for b in largest:
        answer, none_fits = search_block(inst, b, zero, churn)
        if answer is None:  # no placement at all (said why), or none in the fast solver's budget
            if none_fits:
                alone.append(alone_infeasible(inst, b))
            continue
        estimated += 1
        for o, n in answer.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
    over = np.maximum(used - inst.pool_units, 0.0)
    short = {
        (inst.regions[int(r)], inst.hardware[int(h)]): float(over[r, h]) for r, h in np.argwhere(over > 1e-9)
    }
    return Shortfall(short, [block_names(inst, b) for b in left], estimated, alone)
