"""Completing a placement that repair could not finish: an exact MIP over the blocks left,
in the capacity the placed ones leave, with more of the placed blocks freed to move each time
that MIP proves (or cannot find in its work) that they do not fit, and at the end every block
over the whole pools.

Which placed blocks are freed first is the answer of an elastic LP (`lp_movers`): the whole
model's LP relaxation over the whole pools, with each placed block's replicas kept unless
removing them pays, where removing a unit costs one. The blocks it shrinks are the few whose
moving makes room for the rest; when the pools are full everywhere, the conflict is a chain
through pools the blocks left never use, which freeing the neighbours of those blocks finds
only late (on a 702-deployment instance 94.5% full, MIPs over 18, 36 and 54 freed neighbours
were all infeasible; the elastic LP named 4 blocks, and the MIP over those and the 262 left
found a plan). So, given the work, the construction ends with a plan or a proof that
none exists (the last MIP is the whole placement model); the MIPs over a few dozen blocks
that it usually ends at take seconds, where the ejection chain before it can go round the
same pools for as long as it is given.

When the work runs out first, or the proof comes, the error says which pools the blocks left
would overfill and by how much (`shortfall`): their cheapest placements with the pools
ignored, added to what the placed blocks use."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import numpy as np
import scipy.sparse as sp

from ipnext.errors import NoPlacementError, PlanningTimeoutError
from ipnext.planner.backend import root_work, solve_model
from ipnext.planner.block import search_block
from ipnext.planner.formulation import build
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import BlockChoice, alone_infeasible, block_names, choices_from_values, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock

__all__ = ["Completion", "Shortfall", "complete", "lp_movers", "shortfall"]

log = logging.getLogger("ipnext.planner.decompose")  # one logger for the decomposition's story

# The completing MIPs look for a placement that fits, at no cost (a zero objective): a plan
# that fits is what they are for, and improvement (improve.py) then makes it cheaper. With the
# cost in, HiGHS solves the root LP to optimality first: over 175 blocks of a 702-deployment
# instance 94.5% full, 32-36 s for a plan at a 2% gap (or 10% or 50%), against 8 s for one
# that fits at no cost (23% dearer on those blocks), on the 2-core machine beside CI.
# Each MIP but the last (every block) gets at most this share of the work left, so that the
# wider ones after it still get some (unless its root alone needs more).
STEP_SHARE = 0.5
# A freed ring holds this many times more blocks than the one before (first: the blocks the
# elastic LP moves, or none when it names none, so the first MIP is over the blocks left alone;
# then at least as many placed blocks as there are blocks left, those holding the most units in
# the pools the blocks left could use).
GROWTH = 2
# The shortfall report places at most this many of the blocks left (the largest), each by the
# fast block solver alone: a report must not take the time a plan needed (every block of a
# 1,000-deployment fleet's repair by the block solver and its MIP took 18 s).
SHORTFALL_BLOCKS = 25
# The elastic LP is the whole model's relaxation: solved up to this many options, on at most
# this share of the work left, by HiGHS's simplex: it needs no duals, and on a 702-deployment
# instance (18,174 options) HiGHS solved it in 0.7 s where GLOP took 6.4 s (the first plan's
# LP needs GLOP for its duals: the pool rows' duals that HiGHS returns through OR-Tools' model
# builder are not duals).
# Past 20,000 options (the first plan's LP's limit, set for GLOP) the completing MIPs of a plan
# from scratch had no movers: on a 639-deployment instance 94% full (20,448 options) the MIP
# over the 86 blocks left alone was infeasible, the next ring's root outran the work, and no
# plan came; with the elastic LP (31,486 columns, HiGHS, 1.0 s) it moved 15 placed blocks and
# the MIP over 101 blocks found a plan in 12.4 s. The family reaches about 28,000 options.
ELASTIC_MAX_OPTIONS = 50_000
ELASTIC_SHARE = 0.25
ELASTIC_SOLVER = "highs"


@dataclass(frozen=True)
class Completion:
    """What `complete` did: how many placed blocks the elastic LP named to move first, and
    the blocks each MIP freed, in order, and how each MIP ended."""

    steps: list[tuple[int, str]]  # (blocks freed, status of its MIP)
    movers: int = 0

    def describe(self) -> str:
        mips = ", ".join(f"{n} blocks: {status}" for n, status in self.steps)
        return f"{mips}; the elastic LP moved {self.movers} placed blocks first" if self.movers else mips


@dataclass(frozen=True)
class Shortfall:
    """Pools the blocks left would overfill, by how many units, and the blocks."""

    short: dict[tuple[str, str], float]  # (region, hardware) -> units missing
    blocks: list[str]
    placed: int  # of `blocks`, how many the estimate placed (the largest)
    alone: list[str]  # why each block that fits nowhere even with the pools to itself does not
    cut: bool = False  # the clock had stopped the solve before the estimate was done
    spare: list[str] = field(default_factory=list)  # of their deployments, those with spare_replicas

    def describe(self) -> str:
        pools = ", ".join(f"{r}/{h} by {units:g} units" for (r, h), units in sorted(self.short.items()))
        more = len(self.blocks) - 5
        names = ", ".join(self.blocks[:5]) + (f" and {more} more" if more > 0 else "")
        where = f"pools short: {pools}" if pools else "no pool is short for their cheapest placements alone"
        if self.cut and not self.placed:
            where = "which pools are short was not estimated (the clock had stopped the solve)"
        elif self.placed < len(self.blocks):
            clock = ", where the clock stopped the estimate" if self.cut else ""
            where += f" (for the {self.placed} largest of them{clock})"
        alone = "".join(f"; {why.rstrip('.')}" for why in self.alone)
        spare = ""
        if self.spare:
            more = len(self.spare) - 5
            spare = f"; spare_replicas counted for {', '.join(self.spare[:5])}" + (
                f" and {more} more" if more > 0 else ""
            )
        return f"{len(self.blocks)} blocks not placed ({names}){alone}{spare}; {where}"

    def fix(self) -> str:
        more = ", ".join(f"{r}/{h} +{math.ceil(units)}" for (r, h), units in sorted(self.short.items()))
        if self.cut and not self.placed and not self.alone:
            return "give it the time to say which pools are short (--time-limit)"
        fixes = [f"add capacity ({more})"] if more else []
        if self.alone or not more:
            fixes.append(
                "lower the demand of the blocks that fit nowhere, or loosen their latency budgets "
                "or min_regions"
            )
        if self.spare:
            fixes.append("lower their spare_replicas")
        return "; or ".join(fixes)


def complete(
    inst: Instance,
    placed: dict[int, BlockChoice],
    left: list[int],
    churn: float,
    budget: Budget,
) -> tuple[dict[int, BlockChoice], Completion]:
    """Every block placed: `placed` (which fit the pools) and the blocks `left`, by MIPs over
    `left` and progressively more of `placed` (first those the elastic LP moves, `lp_movers`).
    Raises NoPlacementError when that LP, or the MIP over every block given, proves that no
    placement fits, PlanningTimeoutError when `budget` runs out first; both name the shortfall."""
    left_set = set(left)
    placed = {b: c for b, c in placed.items() if b not in left_set}
    movers = lp_movers(inst, placed, churn, budget)
    if movers is None:
        gap = shortfall(inst, placed, left, churn, budget.clock)
        raise NoPlacementError(
            f"pools: no placement of the {len(placed) + len(left)} blocks fits them (even the "
            f"LP relaxation of the whole model has none); {gap.describe()}.",
            fix=gap.fix(),
        )
    moved = set(movers)
    order = movers + [b for b in _neighbours(inst, placed, left) if b not in moved]
    steps: list[tuple[int, str]] = []
    freed = len(movers)
    while True:
        whole = freed >= len(order)
        free = list(left) + order[:freed]
        freed_set = set(free)
        kept = {b: c for b, c in placed.items() if b not in freed_set}
        residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
        if budget.exhausted():
            break
        model = build(inst, free, pool_capacity=residual, churn_cost=churn)
        model = replace(model, obj=np.zeros_like(model.obj))  # any placement that fits
        # A ring whose root needs more than its share gets what it needs: every wider ring's
        # root needs more still, so the share kept for them would serve none of them.
        root = root_work(model)
        work = budget.left() if whole else max(UNITS_PER_SECOND, int(STEP_SHARE * budget.left()), root)
        if budget.cap(work) < root:  # its root alone would outrun the work: out of it
            log.debug(
                "no completing MIP over %d blocks: its root needs %d units, %d left",
                len(free),
                root_work(model),
                budget.cap(work),
            )
            break
        sol = solve_model(model, work=budget.cap(work), budget=budget)
        steps.append((len(free), sol.status))
        log.debug("completing MIP over %d blocks: %s in %d units", len(free), sol.status, sol.work)
        if sol.values is not None:
            kept.update(choices_from_values(inst, model, sol.values, churn, free))
            return kept, Completion(steps, len(movers))
        if whole:
            if sol.status == "infeasible":
                gap = shortfall(inst, placed, left, churn, budget.clock)
                raise NoPlacementError(
                    f"pools: no placement of the {len(free)} blocks fits them (the exact MIP over "
                    f"every one of them proved it); {gap.describe()}.",
                    fix=gap.fix(),
                )
            break
        freed = max(len(left), freed * GROWTH)
    gap = shortfall(inst, placed, left, churn, budget.clock)
    tried = f" (MIPs over {Completion(steps, len(movers)).describe()})" if steps else ""
    raise PlanningTimeoutError(
        f"no plan that fits the pools within the work limit: {gap.describe()}{tried}.",
        fix=f"give the planner more work (--work-limit), or more time (--time-limit) if the clock "
        f"stopped it; or {gap.fix()}",
    )


def lp_movers(
    inst: Instance, placed: dict[int, BlockChoice], churn: float, budget: Budget
) -> list[int] | None:
    """The placed blocks that the elastic LP moves (removes replicas of): the whole model's LP
    relaxation over the whole pools, where each replica of `placed` that goes costs its units
    and every block's own cost counts a thousandth as much (the LP moves as little as it can,
    and among such moves the cheaper). Largest move first; [] when the LP is too large for its
    share of `budget` or does not finish in it; None when it is infeasible (the LP keeps every
    constraint but the pools' contents, so then no plan exists)."""
    if not placed or len(inst.opt_d) > ELASTIC_MAX_OPTIONS:
        return []
    model = build(inst, list(range(len(inst.blocks))), pool_capacity=inst.pool_units, churn_cost=churn)
    held = np.zeros(model.n_x)
    for k, o in enumerate(model.opts):
        choice = placed.get(int(inst.block_of[inst.opt_d[o]]))
        if choice is not None:
            held[k] = choice.x.get(int(o), 0)
    kept = np.flatnonzero(held > 0)
    n, m = model.matrix.shape[1], len(kept)
    # One column d per held option and one row x + d >= held: d is what the LP removes.
    rows = sp.csr_matrix(
        (np.ones(2 * m), (np.repeat(np.arange(m), 2), np.column_stack([kept, n + np.arange(m)]).ravel())),
        shape=(m, n + m),
    )
    scale = 1e-3 / max(1.0, float(np.abs(model.obj).max()))
    widened = sp.hstack([model.matrix, sp.csr_matrix((model.matrix.shape[0], m))])
    elastic = replace(
        model,
        lb=np.concatenate([model.lb, np.zeros(m)]),
        ub=np.concatenate([model.ub, np.full(m, np.inf)]),
        obj=np.concatenate([model.obj * scale, inst.opt_units[model.opts[kept]].astype(np.float64)]),
        integral=np.concatenate([model.integral, np.zeros(m, dtype=bool)]),
        matrix=sp.vstack([widened, rows]).tocsr(),
        row_lb=np.concatenate([model.row_lb, held[kept]]),
        row_ub=np.concatenate([model.row_ub, np.full(m, np.inf)]),
    )
    work = max(UNITS_PER_SECOND, int(ELASTIC_SHARE * budget.left()))
    sol = solve_model(elastic, relax=True, solver=ELASTIC_SOLVER, work=budget.cap(work), budget=budget)
    log.debug("elastic LP %s in %d units", sol.status, sol.work)
    if sol.status == "infeasible":
        return None
    if sol.status != "optimal" or sol.values is None:
        return []
    removed: dict[int, float] = {}
    for col, d in zip(kept, sol.values[n:], strict=True):
        if d > 1e-6:
            o = model.opts[col]
            b = int(inst.block_of[inst.opt_d[o]])
            removed[b] = removed.get(b, 0.0) + float(d * inst.opt_units[o])
    return sorted(removed, key=lambda b: (-removed[b], b))


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


def shortfall(
    inst: Instance, placed: dict[int, BlockChoice], left: list[int], churn: float, clock: Clock | None = None
) -> Shortfall:
    """The pools that the blocks `left` (the `SHORTFALL_BLOCKS` largest), each at its cheapest
    placement with the pools ignored, overfill on top of `placed`, and by how many units:
    capacity that would let those placements stand (other placements may need less).

    With the solve's `clock`, no block is estimated once it has passed: a report after the
    clock stopped the solve must not take it past its limit (an 820-deployment instance's
    estimate of 25 blocks took 4 s, and the solve returned 7 s late). Stopped by the work limit
    (the clock not passed), the estimate is whole and reproducible."""
    left_set = set(left)
    used = usage_of(inst, {b: c for b, c in placed.items() if b not in left_set})
    largest = sorted(left, key=lambda b: -float(inst.total_demand[inst.blocks[b]].sum()))[:SHORTFALL_BLOCKS]
    zero = np.zeros_like(inst.pool_units)
    estimated = 0
    alone: list[str] = []
    cut = False
    for b in largest:
        if clock is not None and clock.passed():
            cut = True
            break
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
    deps = inst.problem.deployments
    spare = [deps[i].name for b in left for i in inst.blocks[b] if deps[i].spare_replicas]
    return Shortfall(short, [block_names(inst, b) for b in left], estimated, alone, cut, spare)
