"""The search over a block's runs: one run per declared vector of the survive members' largest
capacities, taken in order of a Lagrangian bound until it reaches the incumbent, each run in
Python first and in arrays once it outgrows that, all within one work budget."""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy.optimize import linprog

from ipnext.planner.block.arrays import search_arrays
from ipnext.planner.block.bounds import RunRegion, options_of, prepare, screen
from ipnext.planner.block.common import (
    BEAM,
    EASY_WORK,
    FEW_DECLARATIONS,
    LP_WORK,
    NP_WORK_SCALE,
    PROBES,
    RECENT_MULTS,
    WORK_BUDGET,
    Chosen,
    FastResult,
    Outcome,
    below,
)
from ipnext.planner.block.placement import objective, placement
from ipnext.planner.block.run import Run
from ipnext.planner.block.structure import Block, build_block
from ipnext.planner.instance import Instance


def solve_block_fast(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    *,
    budget: int = WORK_BUDGET,
    caps: dict[int, int] | None = None,
) -> FastResult | None:
    """The block's optimal placement at these pool prices (see the package's docstring), or
    None for a block the search does not handle, has no placement, or found none in `budget`.
    `caps` (per option) bounds each option's replicas below what its pool holds."""
    return search_block(inst, block, prices, churn, budget=budget, caps=caps)[0]


def search_block(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    *,
    budget: int = WORK_BUDGET,
    caps: dict[int, int] | None = None,
) -> tuple[FastResult | None, bool]:
    """`solve_block_fast`'s answer, and whether a None is a proof that the block has no
    placement (under `caps`): no candidate region, or every run searched to its end without
    one. Repair uses the proof to skip the MIP, which takes seconds to say the same."""
    blk = build_block(inst, block, prices, churn, caps)
    if blk is None:
        return None, False
    if not blk.regions:
        return None, True
    search = _Search(blk)
    result = search.solve(budget)
    return result, result is None and search.exhausted


class _Search:
    """The incumbent, the work spent and the row prices found, across the runs of one block."""

    def __init__(self, blk: Block) -> None:
        self.blk = blk
        self.best_cost = math.inf
        self.best_chosen: Chosen | None = None
        self.work = self.peak = self.n_runs = 0
        self.mults: list[list[float]] = []  # multipliers found so far: valid in every run
        self.exhausted = False  # every run was searched to its end (or bounded out)

    def solve(self, budget: int) -> FastResult | None:
        """One run per declared vector of the survive members' largest region capacities, for
        the vectors whose Lagrangian bound is under the incumbent (a block without survive
        members is one run)."""
        blk = self.blk
        root = _root_bound(blk)
        if not blk.n_sv:
            unresolved = self.exact_run((), root, budget)
        else:
            unresolved = self.declared_runs(root, budget)
        self.exhausted = unresolved == math.inf and self.best_chosen is None
        if self.best_chosen is None:
            return None
        sol = placement(blk, self.best_chosen)
        if sol is None:
            return None
        x, f = sol
        obj = objective(blk, x)
        optimal = unresolved >= below(self.best_cost)
        bound = obj if optimal else min(obj, unresolved)
        return FastResult(x, f, obj, bound, optimal, self.work, self.peak, self.n_runs)

    def declared_runs(self, root: float, budget: int) -> float:
        """The runs of a block with survive members, most promising declaration first; returns
        the least lower bound of what was not searched to the end (inf if nothing was left)."""
        blk = self.blk
        regions, n_sv, big_w = blk.regions, blk.n_sv, blk.big_w
        unresolved = math.inf
        cands = [sorted({c for g in regions for c, _ in g.svlev[s]}) for s in range(n_sv)]
        hard = math.prod(len(c) for c in cands) > FEW_DECLARATIONS
        # prices to order the declarations by: a survive unit at its cheapest rate, or,
        # with many declarations, the LP of the loosest one (every level, the least sum)
        lam0 = [0.0] * blk.n_con + [min(g.rate_sv[s] for g in regions) for s in range(n_sv)] + [0.0]
        if hard:
            found = self.multipliers(prepare(blk, tuple(c[-1] for c in cands)), [big_w + c[0] for c in cands])
            if found is not None:
                lam0 = found
                self.mults.append(lam0)
        order = screen(blk, cands, lam0)
        probes = list(itertools.islice(order, PROBES))
        for _, _, mvec in probes:  # quick incumbents from the most promising declarations
            run = Run(blk, mvec)
            if hard:
                lam = self.multipliers(run.regs, run.targets)
                if lam is None:
                    continue
                run.add_multipliers(lam)
            self.absorb(run.search_py(BEAM, self.best_cost, max(0, budget - self.work)))
        if self.best_chosen is None:  # the loosest caps: most likely to hold some placement
            run = Run(blk, tuple(c[-1] for c in cands))
            self.absorb(run.search_py(4 * BEAM, self.best_cost, max(0, budget - self.work)))
        for sep, coupled, mvec in itertools.chain(probes, order):
            sep = max(sep, root)  # no later declaration has a lower bound
            if sep >= below(self.best_cost):
                break
            if self.work > budget:
                unresolved = min(unresolved, sep)
                break
            if coupled >= below(self.best_cost):
                continue
            unresolved = min(unresolved, self.exact_run(mvec, max(sep, coupled), budget))
        return unresolved

    def exact_run(self, mvec: tuple[float, ...], lb: float, budget: int) -> float:
        """Search the run with these declared largest capacities (every placement it finds
        survives), updating the incumbent; returns a lower bound of the run's optimum if it
        was cut short, else inf. Small runs go in Python; one that outgrows that is priced by
        an LP and searched again in arrays."""
        run = Run(self.blk, mvec)
        self.work += len(run.regs)
        for known in self.mults[:1] + self.mults[1:][-RECENT_MULTS:]:
            self.work += len(run.regs)
            lb = max(lb, run.add_multipliers(known))
            if lb >= below(self.best_cost):
                return math.inf
        if lb >= below(self.best_cost):
            return math.inf
        self.n_runs += 1
        if self.best_chosen is None:
            self.absorb(run.search_py(BEAM, self.best_cost, max(0, budget - self.work)))
        out = run.search_py(0, self.best_cost, max(0, min(EASY_WORK, budget - self.work)))
        self.absorb(out)
        if out.left == math.inf or self.work >= budget:
            return out.left
        lam = self.multipliers(run.regs, run.targets)
        if lam is not None:
            self.mults.append(lam)
            if run.add_multipliers(lam) >= below(self.best_cost):
                return math.inf
        big = search_arrays(run, 0, self.best_cost, NP_WORK_SCALE * (budget - self.work))
        big.work //= NP_WORK_SCALE
        self.absorb(big)
        return big.left

    def absorb(self, out: Outcome) -> None:
        self.work += out.work
        self.peak = max(self.peak, out.peak)
        if out.chosen is not None and out.cost < self.best_cost:
            self.best_cost, self.best_chosen = out.cost, out.chosen

    def multipliers(self, regs: list[RunRegion], targets: list[float]) -> list[float] | None:
        """Row prices from the LP over the regions' options (the dual of its covering rows)."""
        blk = self.blk
        n_con, n_sv = blk.n_con, blk.n_sv
        k = n_con + n_sv + 1
        costs: list[float] = []
        cols: list[list[float]] = []
        region_of: list[int] = []
        for pos, rr in enumerate(regs):
            for cost, ell, caps in options_of(blk, rr):
                col = [ell if rr.g.cmask >> c & 1 else 0.0 for c in range(n_con)]
                col.extend(caps)
                col.append(1.0)
                cols.append(col)
                costs.append(cost)
                region_of.append(pos)
        if not cols:
            return None
        cover = np.asarray(cols).T
        region = np.zeros((len(regs), len(cols)))
        region[region_of, np.arange(len(cols))] = 1.0
        need = np.asarray([*blk.con_w, *targets, float(blk.m_need)])
        res = linprog(
            np.asarray(costs),
            A_ub=np.vstack([-cover, region]),
            b_ub=np.concatenate([-need, np.ones(len(regs))]),
            bounds=(0, None),
            method="highs",
        )
        self.work += LP_WORK
        if res.status != 0:
            return None
        lam = np.maximum(0.0, -np.asarray(res.ineqlin.marginals[:k], dtype=float))
        return [float(v) for v in lam]


def _root_bound(blk: Block) -> float:
    """A lower bound on the block's optimum: its cheapest min_regions presences, or the
    cheapest routing of every source's traffic."""
    bases = sorted(g.lopts[0][1] + sum(lev[0][1] for lev in g.svlev) for g in blk.regions)
    root = sum(bases[: blk.m_need]) if len(bases) >= blk.m_need else math.inf
    flow = 0.0
    for a in range(blk.n_src):
        rho = min((g.rate_l for g in blk.regions if g.smask >> a & 1), default=math.inf)
        flow += rho * blk.ws[a]
    return max(root, flow)
