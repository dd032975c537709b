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
   LP bound does not. A block MIP stopped at its time limit contributes HiGHS's proven
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

Time. Every step stops at its share of the time limit. A pricing round that runs out of
time keeps, for the blocks it did not reach, their last placement and the best bound proven
at prices no higher than the current ones (valid because a block's priced optimum never
falls when prices rise; see _Rounds). In pricing rounds a block the fast solver cannot prove
keeps its answer and its (looser) bound: HiGHS takes 0.4-3 s on such a block (a 1,000-
deployment fleet has about 40), so it runs only on the loosest of them at the end, in the
time left, when the bound is tightened: in the worker processes, while this process improves
the plan. A round re-solves only the blocks whose last answer a price change can affect (see
_Reuse).

`lower_bound_method` in the result says which bound won: the Lagrangian bound, or the
optimum of the exact MIP for instances small enough to solve whole.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner.backend import solve_model
from ipnext.planner.block import solve_block_fast
from ipnext.planner.formulation import BlockModel, build
from ipnext.planner.instance import Instance
from ipnext.planner.master import Master, MasterLP

__all__ = ["BlockChoice", "Decomposition", "decompose"]

BLOCK_TIME_LIMIT_S = 0.25  # per block while the prices move; HiGHS's bound at the limit is still valid
TIGHTEN_TIME_LIMIT_S = 5.0  # per block when the bound at the best prices is tightened
RETRY_TIME_LIMIT_S = 10.0  # a block that found no placement at all in BLOCK_TIME_LIMIT_S
PARALLEL_MIN_BLOCKS = 64
JOINT_REPAIR_SECONDS = 10.0
_OUT_OF_TIME = "no plan that fits the pools within the time limit"
USE_FAST_BLOCKS = True  # False: every block by the HiGHS MIP (to compare the two)
SMOOTHING = 0.5
LP_ROUNDINGS = 4
FAST_INTO_TRIES = 3
ENRICH_SHARE = 0.25  # of the time left after pricing, for more columns near the best prices
IMPROVE_PASSES = 3
MAX_SLACK_RAISES = 6  # then the columns are taken not to fit: repair decides, or names the shortfall
# Larger LPs take most of the time limit (1,000 deployments: GLOP unfinished in 9 s).
LP_PRICES_MAX_OPTIONS = 20_000
REPAIR_BLOCK_LIMIT_S = 2.0


@dataclass
class BlockChoice:
    block: int
    x: dict[int, int]  # option -> replicas
    f: dict[int, float]  # route -> fraction
    priced: float  # objective with pool prices
    bound: float  # proven lower bound of the priced objective
    cost: float  # cost + churn without prices


@dataclass
class Decomposition:
    choices: dict[int, BlockChoice]
    lower_bound: float
    iterations: int
    log: list[str] = field(default_factory=list)


# ---- one block ---------------------------------------------------------------------------

_WORKER_INST: Instance | None = None


def _init_worker(inst: Instance) -> None:
    global _WORKER_INST
    _WORKER_INST = inst


def _solve_blocks_in_worker(
    args: tuple[list[int], np.ndarray, float, float, bool],
) -> list[BlockChoice | None]:
    assert _WORKER_INST is not None  # set by the pool initializer
    blocks, prices, churn, limit, refine = args
    return [solve_block(_WORKER_INST, b, prices, churn, limit, refine=refine) for b in blocks]


def solve_block(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    limit_s: float,
    residual: np.ndarray | None = None,
    *,
    refine: bool = True,
) -> BlockChoice | None:
    """The block's optimal placement at these pool prices (None if it cannot fit `residual`).

    The combinatorial solver (block.py) answers most blocks exactly in a few milliseconds;
    a block it cannot prove within its work budget, and every block against a `residual`
    capacity (repair), goes to the HiGHS MIP, whose bound at its time limit is also valid.
    With `refine=False` an unproven answer of the fast solver is returned as it is (its bound
    is valid, only loose): HiGHS then runs only for a block the fast solver found nothing for,
    which keeps a pricing round at fleet scale to the fast solver's milliseconds."""
    fast = None
    if residual is None and USE_FAST_BLOCKS:
        fast = solve_block_fast(inst, block, prices, churn)
        if fast is not None and (fast.optimal or not refine):
            return _choice(inst, block, fast.x, fast.f, fast.objective, fast.bound, churn)
    model = build(inst, [block], prices=prices, churn_cost=churn, pool_capacity=residual)
    sol = solve_model(model, time_limit_s=limit_s, relative_gap=1e-9)
    if sol.values is None:
        if residual is None and sol.status == "infeasible":
            raise InfeasiblePlanError(_alone_infeasible(inst, block))
        if fast is not None:  # HiGHS found nothing in time: the fast solver's best and bound
            return _choice(inst, block, fast.x, fast.f, fast.objective, max(fast.bound, sol.bound), churn)
        if residual is None:
            return _rounded_relaxation(inst, block, prices, churn, sol.bound)
        return None
    if fast is not None and fast.objective < sol.objective - 1e-9:
        return _choice(inst, block, fast.x, fast.f, fast.objective, max(fast.bound, sol.bound), churn)
    xs = np.rint(sol.values[: model.n_x]).astype(np.int64)
    fs = sol.values[model.n_x : model.n_x + model.n_f]
    x = {int(o): int(n) for o, n in zip(model.opts, xs, strict=True) if n > 0}
    f = {int(t): float(v) for t, v in zip(model.routes, fs, strict=True) if v > 1e-9}
    bound = max(sol.bound, fast.bound) if fast is not None else sol.bound
    return _choice(inst, block, x, f, sol.objective, bound, churn)


def _rounded_relaxation(
    inst: Instance, block: int, prices: np.ndarray, churn: float, bound: float
) -> BlockChoice | None:
    """A placement of the block when neither solver found one in time: its LP relaxation with
    replicas rounded up. Rounding up only adds capacity, and the relaxation puts replicas of
    every member wherever the block stands, so the result meets every row but the pools; its
    bound is the better of the relaxation's value and `bound`."""
    model = build(inst, [block], prices=prices, churn_cost=churn)
    sol = solve_model(model, relax=True, solver="glop", time_limit_s=5.0)
    if sol.values is None or sol.status != "optimal":
        return None
    values = sol.values.copy()
    values[: model.n_x] = np.ceil(values[: model.n_x] - 1e-6)
    x = {int(o): int(n) for o, n in zip(model.opts, values[: model.n_x], strict=True) if n > 0}
    f = {
        int(t): float(v)
        for t, v in zip(model.routes, values[model.n_x : model.n_x + model.n_f], strict=True)
        if v > 1e-9
    }
    choice = _choice(inst, block, x, f, math.inf, max(bound, sol.objective), churn)
    choice.priced = choice.cost + _price_of(inst, x, prices)
    choice.bound = min(choice.bound, choice.priced)
    return choice


def _price_of(inst: Instance, x: dict[int, int], prices: np.ndarray) -> float:
    """What the pool prices add to a placement's cost."""
    return float(sum(n * inst.opt_units[o] * prices[inst.opt_r[o], inst.opt_h[o]] for o, n in x.items()))


def _prohibitive(inst: Instance) -> float:
    """A pool price no placement pays when it has any other way."""
    return 10.0 * float(inst.pool_cost.max()) + 1.0


def _choice(
    inst: Instance,
    block: int,
    x: dict[int, int],
    f: dict[int, float],
    priced: float,
    bound: float,
    churn: float,
) -> BlockChoice:
    cost = float(sum(inst.opt_cost[o] * n for o, n in x.items()))
    if churn and inst.problem.current is not None:
        cost += churn * float(sum(max(0, n - inst.opt_current[o]) * inst.opt_units[o] for o, n in x.items()))
    return BlockChoice(block, x, f, priced, min(bound, priced), cost)


# ---- the whole fleet ---------------------------------------------------------------------


class _Pool:
    """Solves many blocks, in worker processes when there are enough of them."""

    def __init__(self, inst: Instance, workers: int) -> None:
        self.inst = inst
        self.workers = workers
        self.executor: ProcessPoolExecutor | None = None

    def __enter__(self) -> _Pool:
        if self.workers > 1 and len(self.inst.blocks) >= PARALLEL_MIN_BLOCKS:
            self.executor = ProcessPoolExecutor(
                self.workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=(self.inst,)
            )
        return self

    def __exit__(self, *exc: object) -> None:
        if self.executor is not None:
            # Chunks still running past a deadline would hold both cores (and shutdown would
            # wait for them) while the plan is built: stop the workers instead.
            processes = list(getattr(self.executor, "_processes", {}).values())
            self.executor.shutdown(wait=False, cancel_futures=True)
            for process in processes:
                process.terminate()

    def submit(
        self, blocks: list[int], prices: np.ndarray, churn: float, limit_s: float, refine: bool, size: int
    ) -> _Jobs:
        """Send `blocks` to the workers, `size` to a chunk, without waiting (see _gather)."""
        assert self.executor is not None
        return {
            self.executor.submit(
                _solve_blocks_in_worker, (blocks[i : i + size], prices, churn, limit_s, refine)
            ): blocks[i : i + size]
            for i in range(0, len(blocks), size)
        }

    def solve(
        self,
        blocks: list[int],
        prices: np.ndarray,
        churn: float,
        limit_s: float = BLOCK_TIME_LIMIT_S,
        *,
        refine: bool = True,
        deadline: float = math.inf,
    ) -> dict[int, BlockChoice]:
        """Every block of `blocks` priced at `prices`; past `deadline` the blocks not yet
        answered are left out of the result (the caller keeps their earlier columns and
        bounds), so a round at fleet scale never runs over the planner's time limit."""
        results: dict[int, BlockChoice | None] = {}
        if self.executor is None or len(blocks) < 2 * self.workers:
            for b in blocks:
                if time.monotonic() > deadline:
                    break
                results[b] = solve_block(self.inst, b, prices, churn, limit_s, refine=refine)
        else:
            # Small chunks: a deadline drops only what is unfinished, and HiGHS solves (seconds
            # each) go one block to a chunk.
            size = 1 if refine and limit_s >= 1.0 else max(4, math.ceil(len(blocks) / (self.workers * 32)))
            results = _gather(self.submit(blocks, prices, churn, limit_s, refine, size), deadline)
        out = {}
        for b, choice in results.items():
            if choice is None and time.monotonic() < deadline:
                # No placement found yet (not infeasible: that raised already).
                choice = solve_block(self.inst, b, prices, churn, RETRY_TIME_LIMIT_S)
            if choice is None:
                if deadline < math.inf:
                    continue
                raise PlanningTimeoutError(
                    f"{_names(self.inst, b)}: the block solver found no placement in {RETRY_TIME_LIMIT_S:g} s.",
                    fix="give the planner more time (--time-limit)",
                )
            out[b] = choice
        return out


_Jobs = dict[Future[list[BlockChoice | None]], list[int]]  # a chunk's future -> its blocks


def _gather(jobs: _Jobs, deadline: float) -> dict[int, BlockChoice | None]:
    """The answers of the chunks that finished by `deadline`; the others are dropped (one
    already running finishes in its worker)."""
    timeout = None if deadline == math.inf else max(0.0, deadline - time.monotonic())
    done, pending = wait(jobs, timeout=timeout)
    for future in pending:
        future.cancel()
    results: dict[int, BlockChoice | None] = {}
    for future in done:
        results.update(zip(jobs[future], future.result(), strict=True))
    return results


def usage_of(inst: Instance, choices: dict[int, BlockChoice]) -> np.ndarray:
    used = np.zeros_like(inst.pool_units)
    for choice in choices.values():
        for o, n in choice.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
    return used


class _Reuse:
    """Which blocks a pricing round must solve again. A block's last answer stays its answer
    when, since it was found, no price changed on a pool the answer uses and no price fell
    on any pool the block may use: the answer's priced value is the same, every other
    placement's has not fallen, and its bound is still valid. Exact, and it skips most blocks
    of a round when only a few pools are priced (a fleet's congested pools)."""

    def __init__(self, inst: Instance, choices: dict[int, BlockChoice], prices: np.ndarray) -> None:
        self.inst = inst
        h = inst.pool_units.shape[1]
        self.block_pools = [
            np.unique(
                np.concatenate(
                    [inst.opt_r[inst.options_of[i]] * h + inst.opt_h[inst.options_of[i]] for i in members]
                )
            )
            for members in inst.blocks
        ]
        self.last: dict[int, BlockChoice] = {}
        self.used: dict[int, np.ndarray] = {}
        self.at: dict[int, np.ndarray] = {}
        self.update(choices, prices)

    def update(self, solved: dict[int, BlockChoice], prices: np.ndarray) -> None:
        h = self.inst.pool_units.shape[1]
        flat = prices.ravel().copy()
        for b, c in solved.items():
            self.last[b] = c
            self.used[b] = np.fromiter(
                (int(self.inst.opt_r[o]) * h + int(self.inst.opt_h[o]) for o in c.x), dtype=np.int64
            )
            self.at[b] = flat

    def stale(self, prices: np.ndarray) -> list[int]:
        flat = prices.ravel()
        out = []
        for b, pools in enumerate(self.block_pools):
            seen = self.at[b]
            used = self.used[b]
            if (np.abs(flat[used] - seen[used]) > 1e-12).any() or (flat[pools] < seen[pools] - 1e-12).any():
                out.append(b)
        return out

    def unchanged(self, stale: list[int]) -> dict[int, BlockChoice]:
        skip = set(stale)
        return {b: c for b, c in self.last.items() if b not in skip}


class _Rounds:
    """The block bounds of every pricing round, to bound a block a later round did not reach.

    A block's priced optimum never falls when prices rise (every placement costs at least as
    much), so a bound proven at prices p' stays valid at any prices p >= p'; the first round
    (zero prices, or the LP's) is below nearly every later one on most pools."""

    def __init__(self, inst: Instance) -> None:
        self.inst = inst
        self.history: list[tuple[np.ndarray, dict[int, float]]] = []

    def add(self, prices: np.ndarray, solved: dict[int, BlockChoice]) -> None:
        self.history.append((prices.copy(), {b: c.bound for b, c in solved.items()}))

    def complete(
        self, solved: dict[int, BlockChoice], prices: np.ndarray, earlier: dict[int, BlockChoice]
    ) -> dict[int, BlockChoice]:
        """`solved`, plus each block it lacks with its earlier placement re-priced at `prices`;
        every block's bound is the best still valid there (minus infinity when none is)."""
        inst = self.inst
        valid = [bounds for seen, bounds in self.history if (seen <= prices + 1e-12).all()]
        out: dict[int, BlockChoice] = {}
        for b, c in earlier.items():
            carried = max((v[b] for v in valid if b in v), default=-math.inf)
            if b in solved:
                c = solved[b]
                out[b] = BlockChoice(b, c.x, c.f, c.priced, min(max(c.bound, carried), c.priced), c.cost)
                continue
            at_prices = c.cost + _price_of(inst, c.x, prices)
            out[b] = BlockChoice(b, c.x, c.f, at_prices, min(carried, at_prices), c.cost)
        return out


def decompose(
    inst: Instance,
    *,
    churn: float,
    deadline: float,
    hard_deadline: float | None = None,
    workers: int | None = None,
    max_iterations: int = 200,
) -> Decomposition:
    """The Lagrangian lower bound and the cheapest block choices found that fit the pools.

    Column generation until `deadline`: the master LP's pool duals price the pools, every
    block is solved at those prices (its optimum is a new column, and the sum of the block
    bounds minus prices . capacity a lower bound). Then the bound is tightened at the best
    prices, and the plan chosen from the columns (`_from_columns`), by `hard_deadline`."""
    hard_deadline = hard_deadline if hard_deadline is not None else deadline + JOINT_REPAIR_SECONDS
    workers = workers or os.cpu_count() or 1
    capacity = inst.pool_units
    blocks = list(range(len(inst.blocks)))
    log: list[str] = []
    master = Master(inst)
    iteration = 0
    started = time.monotonic()
    with _Pool(inst, workers) as pool:
        prices, rounded = _lp_prices(inst, churn, deadline, log)
        for c in rounded:
            master.add(c, c.cost)
        # The first round must answer every block (each needs a column and a bound); later
        # rounds stop at `deadline` and carry the blocks they did not reach.
        choices = pool.solve(blocks, prices, churn, refine=False, deadline=hard_deadline)
        missing = [b for b in blocks if b not in choices]
        if missing:
            raise PlanningTimeoutError(
                f"{_OUT_OF_TIME}: the first pricing round reached {len(choices)} of {len(blocks)} blocks "
                f"({_names(inst, missing[0])} among those left).",
                fix="give the planner more time (--time-limit)",
            )
        rounds = _Rounds(inst)
        rounds.add(prices, choices)
        reuse = _Reuse(inst, choices, prices)
        best = sum(c.bound for c in choices.values()) - float((prices * capacity).sum())
        best_prices, best_blocks = prices.copy(), dict(choices)
        for c in choices.values():
            master.add(c, c.cost)
        log.append(f"first prices: bound {best:.3f} ({time.monotonic() - started:.1f}s)")
        _debug(log)
        lp = master.solve_lp()
        smoothing = SMOOTHING
        raises = 0
        for iteration in range(1, max_iterations + 1):
            if lp.slack <= 1e-9 and lp.objective - best <= 1e-7 * max(1.0, abs(best)):
                break  # the master LP meets the bound: nothing left for prices to find
            if time.monotonic() > deadline:
                break
            # Smoothed prices (Wentges): part way from the best prices so far to the LP's duals,
            # which jump about while few columns exist.
            prices = smoothing * best_prices + (1 - smoothing) * lp.prices if best > 0 else lp.prices
            stale = reuse.stale(prices)
            fresh = pool.solve(stale, prices, churn, refine=False, deadline=deadline)
            reuse.update(fresh, prices)
            solved = {**reuse.unchanged(stale), **fresh}
            choices = rounds.complete(solved, prices, best_blocks)
            bound = sum(c.bound for c in choices.values()) - float((prices * capacity).sum())
            rounds.add(prices, solved)
            if bound > best:
                best, best_prices, best_blocks = bound, prices.copy(), choices
            added = sum(master.add(c, c.cost) for c in fresh.values())
            lp = master.solve_lp()
            log.append(
                f"iteration {iteration}: {len(fresh)} of {len(stale)} changed blocks priced ({len(blocks)} in all), "
                f"{added} new columns, "
                f"master LP {lp.objective:.3f} (slack {lp.slack:.3g}), bound {bound:.3f}, best {best:.3f} "
                f"({time.monotonic() - started:.1f}s)"
            )
            _debug(log)
            if len(fresh) < len(stale):
                break  # out of time mid-round
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
        # A plan first (at fleet scale building it can take most of what is left), then the
        # bound is tightened in half of the time that remains, then the plan improved.
        if lp.slack <= 1e-9:  # else the duals are the slack's, no guide to placements
            until = time.monotonic() + ENRICH_SHARE * (hard_deadline - time.monotonic())
            around = best_prices if best_prices.any() else lp.prices
            added = _enrich(inst, pool, master, around, churn, until)
            lp = master.solve_lp()
            log.append(
                f"enriched by {added} columns: master LP {lp.objective:.3f} ({time.monotonic() - started:.1f}s)"
            )
            _debug(log)
        plan = _from_columns(inst, master, lp, churn, prices, hard_deadline, log)
        log.append(f"plan cost {_cost(plan):.3f} ({time.monotonic() - started:.1f}s)")
        _debug(log)
        loose = _loose(best_blocks)
        if pool.executor is not None and loose:
            # The workers tighten the bound (HiGHS on the loosest blocks) while this process
            # improves the plan: neither waits for the other.
            jobs = pool.submit(loose, best_prices, churn, TIGHTEN_TIME_LIMIT_S, refine=True, size=1)
            plan = _improve(inst, plan, best_prices, best_blocks, churn, hard_deadline, log)
            solved = {b: c for b, c in _gather(jobs, hard_deadline).items() if c is not None}
            best = _tightened(inst, best_prices, best_blocks, solved, log) or best
        else:
            best = _tighten(inst, pool, best_prices, best_blocks, churn, hard_deadline, log) or best
            plan = _improve(inst, plan, best_prices, best_blocks, churn, hard_deadline, log, pool=pool)
    if os.environ.get("IPNEXT_PLANNER_DEBUG"):
        print("\n".join(log))
    return Decomposition(choices=plan, lower_bound=best, iterations=iteration, log=log)


def _lp_prices(
    inst: Instance, churn: float, deadline: float, log: list[str]
) -> tuple[np.ndarray, list[BlockChoice]]:
    """First pool prices: the duals of the whole model's LP relaxation, when it is small enough
    to solve in a fraction of the time (zero prices otherwise). Near-full pools are then
    priced from the first round, instead of after many rounds of overfull columns.

    Also a column per block from the LP's solution, replicas rounded up: each is a valid
    placement of its block (rounding up only adds capacity, and a region holds replicas of
    every member wherever the LP put any), and together they sit close to what fits the
    pools, which the blocks' own optima at any single prices often do not."""
    prices = np.zeros_like(inst.pool_units)
    if len(inst.opt_d) > LP_PRICES_MAX_OPTIONS:
        return prices, []
    started = time.monotonic()
    model = build(inst, list(range(len(inst.blocks))), pool_capacity=inst.pool_units, churn_cost=churn)
    limit = max(1.0, 0.25 * (deadline - started))
    sol = solve_model(model, relax=True, solver="glop", time_limit_s=limit)
    if sol.status == "optimal":  # the duals of an unfinished LP are no prices
        for (r, h), dual in sol.pool_duals.items():
            prices[r, h] = dual
    log.append(
        f"LP relaxation {sol.status} in {time.monotonic() - started:.1f}s: {sol.objective:.3f}, "
        f"{int((prices > 0).sum())} pools priced"
    )
    _debug(log)
    columns: list[BlockChoice] = []
    blocks = list(range(len(inst.blocks)))
    capacity = inst.pool_units.copy()
    # Rounding up overfills pools that the LP filled; solve again with those pools shrunk by
    # the overflow, a few times, so that some rounded plan fits (near-full pools need it).
    for attempt in range(LP_ROUNDINGS):
        if sol.values is None:
            break
        values = sol.values.copy()
        values[: model.n_x] = np.ceil(values[: model.n_x] - 1e-6)
        rounded = choices_from_values(inst, model, values, churn, blocks)
        columns.extend(rounded.values())
        overflow = np.maximum(usage_of(inst, rounded) - inst.pool_units, 0.0)
        log.append(f"LP rounding {attempt + 1}: overflows pools by {overflow.sum():g} units")
        _debug(log)
        if not overflow.any() or time.monotonic() > started + limit:
            break
        capacity = np.maximum(capacity - overflow, 0.0)
        model = build(inst, blocks, pool_capacity=capacity, churn_cost=churn)
        sol = solve_model(model, relax=True, solver="glop", time_limit_s=limit)
    return prices, columns


def _debug(log: list[str]) -> None:
    if os.environ.get("IPNEXT_PLANNER_DEBUG") and log:
        print(log[-1], flush=True)


def _improve(
    inst: Instance,
    plan: dict[int, BlockChoice],
    prices: np.ndarray,
    priced: dict[int, BlockChoice],
    churn: float,
    hard_deadline: float,
    log: list[str],
    size: int = 8,
    pool: _Pool | None = None,
) -> dict[int, BlockChoice]:
    """Large neighbourhood search: free a few blocks at a time and place them together by an
    exact MIP in the capacity the others leave, keeping the result when it is cheaper. Blocks
    go in order of regret: how much more their placement costs at the best prices than their
    optimum there (the gap to the bound is the sum of the regrets and the prices' unused
    capacity, so that is where the cost is). With worker processes, as many disjoint
    neighbourhoods as there are workers are solved at once; the better results are kept
    while together they fit the pools."""
    plan = dict(plan)
    executor = pool.executor if pool is not None else None
    width = pool.workers if pool is not None and executor is not None else 1

    def attempt(batch: list[list[int]]) -> int:
        """Solve the neighbourhoods of `batch` (disjoint) and keep what helps; how many did."""
        jobs = []
        for movers in batch:
            kept = {b: c for b, c in plan.items() if b not in set(movers)}
            residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
            jobs.append((movers, residual, churn, hard_deadline))
        if executor is not None and len(jobs) > 1:
            results = list(executor.map(_place_jointly_in_worker, jobs))
        else:
            results = [_place_jointly(inst, *job) for job in jobs]
        gains = []
        for movers, placed in zip(batch, results, strict=True):
            if placed is not None:
                gain = sum(plan[b].cost for b in movers) - _cost(placed)
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
        return c.cost + _price_of(inst, c.x, prices) - priced[b].bound

    before = _cost(plan)
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
            if time.monotonic() + 1.0 > hard_deadline:
                break
            if any(set(movers) & set(other) for other in batch) and (found := flush()):
                better += found
                seen.clear()  # the others' neighbourhoods changed with it
            seen.add(key)
            batch.append(movers)
            if len(batch) == width and (found := flush()):
                better += found
                seen.clear()
        if batch and time.monotonic() + 1.0 <= hard_deadline:
            better += flush()
        batch = []
        improved += better
        if not better:
            break
    idle = float((prices * (inst.pool_units - usage_of(inst, plan))).sum())
    log.append(
        f"gap at the best prices: regret {sum(regret(b) for b in plan):.3f}, idle priced capacity {idle:.3f}"
    )
    log.append(
        f"improve: {tried} neighbourhoods of {size} blocks by regret, {improved} better, "
        f"cost {before:.3f} -> {_cost(plan):.3f}"
    )
    return plan


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


def _enrich(
    inst: Instance, pool: _Pool, master: Master, prices: np.ndarray, churn: float, deadline: float
) -> int:
    """More columns near the best prices, for the IP that picks the plan: the LP mixes a few
    blocks' columns, and an integral plan needs other placements of them and of their
    neighbours on the same pools. Each priced pool is, in turn, priced out and made free,
    and every block that may use it is solved at those prices."""
    users: dict[int, list[int]] = {}
    for o in range(len(inst.opt_d)):
        p = int(inst.opt_r[o]) * inst.pool_units.shape[1] + int(inst.opt_h[o])
        users.setdefault(p, []).append(int(inst.block_of[inst.opt_d[o]]))
    prohibitive = _prohibitive(inst)
    added = 0
    for p in np.argsort(-prices.ravel()):
        if prices.flat[p] <= 1e-9 or time.monotonic() > deadline:
            break
        blocks = sorted(set(users.get(int(p), [])))
        for value in (prohibitive, 0.0):
            trial = prices.copy()
            trial.flat[p] = value
            for c in pool.solve(blocks, trial, churn, refine=False, deadline=deadline).values():
                added += master.add(c, c.cost)
    return added


def _from_columns(
    inst: Instance,
    master: Master,
    lp: MasterLP,
    churn: float,
    prices: np.ndarray,
    hard_deadline: float,
    log: list[str],
) -> dict[int, BlockChoice]:
    """A plan out of the columns: blocks the master LP takes whole keep that column; the few it
    mixes get theirs from an IP over their columns in the capacity left; if that has no
    solution, an IP over every block's columns, then a greedy choice (`_greedy_columns`); if
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
    log.append(f"columns: slack {lp.slack:.3g}, least residual {residual.min():.3g}, {len(mixed)} mixed")
    _debug(log)
    if lp.slack <= 1e-9 and (residual >= -1e-9).all():
        chosen = master.solve_ip(mixed, np.maximum(residual, 0.0), limit) if mixed else {}
        if chosen is not None:
            log.append(f"plan: {len(whole)} blocks as the master LP has them, {len(mixed)} by IP")
            return {**whole, **{b: master.columns[c].choice for b, c in chosen.items()}}
        # The mixed blocks' columns do not fit what the others leave: choose every block's
        # column together (the IP's freedom to move a whole block is what the rounding lacks).
        chosen = master.solve_ip(list(range(len(inst.blocks))), inst.pool_units.ravel(), limit)
        if chosen is not None:
            log.append("plan: every block by IP over the columns")
            _debug(log)
            return {b: master.columns[c].choice for b, c in chosen.items()}
        placed = _greedy_columns(inst, master, mixed, whole, churn, prices, hard_deadline)
        if placed is not None:
            log.append(f"plan: {len(whole)} blocks as the master LP has them, {len(mixed)} greedily")
            _debug(log)
            return placed
    if lp.slack > 1e-9:  # the columns cannot fit: place every block greedily
        placed = _greedy_columns(
            inst, master, list(range(len(inst.blocks))), {}, churn, prices, hard_deadline
        )
        if placed is not None:
            log.append("plan: every block greedily (the columns do not fit the pools)")
            return placed
    log.append(f"plan: repair ({len(mixed)} mixed blocks, slack {lp.slack:.3g})")
    _debug(log)
    return repair(inst, rounded, churn, hard_deadline, prices)


def _greedy_columns(
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
    _debug([f"greedy: {len(mixed) - len(left)} of {len(mixed)} blocks by a column"])
    if not left:
        return plan
    placed, why = _place_one_by_one(inst, left, np.maximum(residual, 0.0), churn, prices, plan, hard_deadline)
    _debug([f"one by one: {len(left)} blocks, {why or 'placed'}"])
    if placed is None:
        return None
    plan.update(placed)
    return plan


def _loose(choices: dict[int, BlockChoice]) -> list[int]:
    """Blocks whose bound is below their answer, loosest first."""
    return sorted(
        (b for b, c in choices.items() if c.priced - c.bound > 1e-6 * max(1.0, abs(c.priced))),
        key=lambda b: choices[b].bound - choices[b].priced,
    )


def _tighten(
    inst: Instance,
    pool: _Pool,
    prices: np.ndarray,
    choices: dict[int, BlockChoice],
    churn: float,
    hard_deadline: float,
    log: list[str],
) -> float | None:
    """Solve again, with a longer limit, the blocks whose bound is loosest at `prices`, in
    half of the time left (improvement takes the rest). Returns the improved Lagrangian
    bound, or None if nothing was re-solved."""
    stop = time.monotonic() + (hard_deadline - time.monotonic()) / 2
    loose = _loose(choices)
    if not loose or time.monotonic() + 1.0 > stop:
        return None
    limit = max(0.3, min(TIGHTEN_TIME_LIMIT_S, stop - time.monotonic()))
    return _tightened(inst, prices, choices, pool.solve(loose, prices, churn, limit, deadline=stop), log)


def _tightened(
    inst: Instance,
    prices: np.ndarray,
    choices: dict[int, BlockChoice],
    solved: dict[int, BlockChoice],
    log: list[str],
) -> float | None:
    """The Lagrangian bound at `prices` with the better bounds of `solved` taken in."""
    if not solved:
        return None
    for b, c in solved.items():
        if c.bound > choices[b].bound:
            choices[b] = c
    bound = sum(c.bound for c in choices.values()) - float((prices * inst.pool_units).sum())
    log.append(f"tightened {len(solved)} loose blocks: bound {bound:.3f}")
    _debug(log)
    return bound


def _cost(choices: dict[int, BlockChoice]) -> float:
    return sum(c.cost for c in choices.values())


def repair(
    inst: Instance, choices: dict[int, BlockChoice], churn: float, deadline: float, prices: np.ndarray
) -> dict[int, BlockChoice]:
    """Make the choices fit the pools. Blocks are taken off the overfull pools and re-placed
    into the capacity the others leave, together by one MIP (hard pool rows) or, if that
    cannot finish in time, one by one, least flexible first. When they cannot fit, the
    circle widens: every block on the congested hardware classes, then every block."""
    used = usage_of(inst, choices)
    if (used <= inst.pool_units + 1e-9).all():
        return dict(choices)
    overfull = [(int(r), int(h)) for r, h in np.argwhere(used > inst.pool_units + 1e-9)]
    congested_hw = {h for _, h in overfull}
    circles = [
        _minimal_movers(inst, choices, used),
        [b for b, c in choices.items() if any(inst.opt_h[o] in congested_hw for o in c.x)],
        list(choices),
    ]
    last_error = ""
    for jointly in (True, False):
        for movers in circles:
            kept = {b: c for b, c in choices.items() if b not in set(movers)}
            residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
            if jointly:
                if time.monotonic() > deadline:
                    continue
                placed = _place_jointly(inst, movers, residual, churn, deadline)
            else:
                placed, last_error = _place_one_by_one(inst, movers, residual, churn, prices, kept, deadline)
            if placed is not None:
                kept.update(placed)
                return kept
    if last_error.startswith(_OUT_OF_TIME):
        raise PlanningTimeoutError(last_error, fix="give the planner more time (--time-limit)")
    raise InfeasiblePlanError(last_error or "pools: the blocks cannot be placed within the pools' capacity.")


def _minimal_movers(inst: Instance, choices: dict[int, BlockChoice], used: np.ndarray) -> list[int]:
    """Blocks off each overfull pool, biggest users first, only until it fits."""
    used = used.copy()
    movers: list[int] = []
    for r, h in np.argwhere(used > inst.pool_units + 1e-9):
        users = sorted(
            (
                b
                for b in choices
                if b not in movers and any(inst.opt_r[o] == r and inst.opt_h[o] == h for o in choices[b].x)
            ),
            key=lambda b: -_units_in(inst, choices[b], r, h),
        )
        for b in users:
            if used[r, h] <= inst.pool_units[r, h] + 1e-9:
                break
            for o, n in choices[b].x.items():
                used[inst.opt_r[o], inst.opt_h[o]] -= n * inst.opt_units[o]
            movers.append(b)
    return movers


def choices_from_values(
    inst: Instance, model: BlockModel, values: np.ndarray, churn: float, blocks: list[int]
) -> dict[int, BlockChoice]:
    """Per-block choices out of a solved model of several blocks."""
    out = {b: BlockChoice(b, {}, {}, 0.0, 0.0, 0.0) for b in blocks}
    for o, n in zip(model.opts, np.rint(values[: model.n_x]).astype(np.int64), strict=True):
        if n > 0:
            c = out[int(inst.block_of[inst.opt_d[o]])]
            c.x[int(o)] = int(n)
            c.cost += float(inst.opt_cost[o] * n)
            if churn and inst.problem.current is not None:
                c.cost += churn * float(max(0, n - inst.opt_current[o]) * inst.opt_units[o])
    for t, v in zip(model.routes, values[model.n_x : model.n_x + model.n_f], strict=True):
        if v > 1e-9:
            out[int(inst.route_b[t])].f[int(t)] = float(v)
    return out


def _place_jointly_in_worker(
    args: tuple[list[int], np.ndarray, float, float],
) -> dict[int, BlockChoice] | None:
    assert _WORKER_INST is not None  # set by the pool initializer
    return _place_jointly(_WORKER_INST, *args)


def _place_jointly(
    inst: Instance, movers: list[int], residual: np.ndarray, churn: float, deadline: float
) -> dict[int, BlockChoice] | None:
    joint = build(inst, movers, pool_capacity=residual, churn_cost=churn)
    limit = max(1.0, min(JOINT_REPAIR_SECONDS, deadline - time.monotonic()))
    sol = solve_model(joint, time_limit_s=limit, relative_gap=1e-4)
    if sol.values is None:
        return None
    return choices_from_values(inst, joint, sol.values, churn, movers)


def _place_one_by_one(
    inst: Instance,
    movers: list[int],
    residual: np.ndarray,
    churn: float,
    prices: np.ndarray,
    kept: dict[int, BlockChoice] | None = None,
    deadline: float = float("inf"),
) -> tuple[dict[int, BlockChoice] | None, str]:
    """Place blocks one at a time into `residual`. A block that does not fit evicts the most
    flexible blocks from the pools it could use (kept ones included) and they queue again:
    a bounded ejection chain."""
    residual = residual.copy()
    placed: dict[int, BlockChoice] = {}
    kept = kept if kept is not None else {}

    def flexibility(b: int) -> int:
        return sum(len(inst.options_of[i]) for i in inst.blocks[b])

    queue = sorted(movers, key=flexibility)
    evictions = 0
    limit = 5 * len(movers) + 20
    while queue:
        if time.monotonic() > deadline:
            return None, f"{_OUT_OF_TIME}: repair still had {len(queue)} of {len(movers)} blocks to place."
        b = queue.pop(0)
        seconds = max(0.25, min(REPAIR_BLOCK_LIMIT_S, deadline - time.monotonic()))
        choice = _fast_into(inst, b, prices, churn, residual)
        if choice is None:
            choice = solve_block(inst, b, prices, churn, seconds, residual=np.maximum(residual, 0))
        if choice is None:
            pools = {
                (int(inst.opt_r[o]), int(inst.opt_h[o])) for i in inst.blocks[b] for o in inst.options_of[i]
            }
            holders = [
                (c, owner)
                for owner in (placed, kept)
                for c in owner.values()
                if any((int(inst.opt_r[o]), int(inst.opt_h[o])) in pools for o in c.x)
            ]
            if not holders or evictions >= limit:
                return None, _shortfall(inst, b, residual)
            holders.sort(key=lambda item: -flexibility(item[0].block))
            for c, owner in holders[:2]:
                del owner[c.block]
                for o, n in c.x.items():
                    residual[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
                queue.append(c.block)
                evictions += 1
            queue.insert(0, b)
            continue
        placed[b] = choice
        for o, n in choice.x.items():
            residual[inst.opt_r[o], inst.opt_h[o]] -= n * inst.opt_units[o]
    return placed, ""


def _fast_into(
    inst: Instance, block: int, prices: np.ndarray, churn: float, residual: np.ndarray
) -> BlockChoice | None:
    """The fast solver's placement of the block in `residual`, if a cheap one exists: pools
    too full for even one more replica are priced out, then those its answer overfills, a
    few times. None when that does not fit (the caller then asks the MIP with hard rows)."""
    smallest: dict[int, float] = {}  # per pool, the fewest units one replica of the block takes
    for i in inst.blocks[block]:
        for o in inst.options_of[i]:
            p = int(inst.opt_r[o]) * residual.shape[1] + int(inst.opt_h[o])
            smallest[p] = min(smallest.get(p, math.inf), float(inst.opt_units[o]))
    banned = residual <= 0
    for p, units in smallest.items():  # not even one replica fits there
        if residual.flat[p] < units:
            banned.flat[p] = True
    prohibitive = _prohibitive(inst)
    for _ in range(FAST_INTO_TRIES):
        fast = solve_block_fast(inst, block, prices + prohibitive * banned, churn)
        if fast is None:
            return None
        used = np.zeros_like(residual)
        for o, n in fast.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
        over = used > residual + 1e-9
        if not over.any():
            choice = _choice(inst, block, fast.x, fast.f, fast.objective, -math.inf, churn)
            choice.priced = choice.cost + _price_of(inst, fast.x, prices)
            return choice
        banned |= over
    return None


def _units_in(inst: Instance, choice: BlockChoice, r: int, h: int) -> float:
    return float(
        sum(n * inst.opt_units[o] for o, n in choice.x.items() if inst.opt_r[o] == r and inst.opt_h[o] == h)
    )


def _names(inst: Instance, block: int) -> str:
    return ", ".join(inst.problem.deployments[i].name for i in inst.blocks[block])


def _alone_infeasible(inst: Instance, block: int) -> str:
    """Why a block cannot be placed even with the whole fleet to itself."""
    lines = []
    for i in inst.blocks[block]:
        dep = inst.problem.deployments[i]
        opts = inst.options_of[i]
        carry = float(sum(inst.opt_cap[o] * inst.opt_qps[o] for o in opts) * inst.usable[i])
        total = float(inst.total_demand[i])
        pools = sorted({f"{inst.regions[inst.opt_r[o]]}/{inst.hardware[inst.opt_h[o]]}" for o in opts})
        if carry < total:
            lines.append(
                f"{dep.name} needs {total:g} QPS, every pool it may use ({', '.join(pools)}) together "
                f"carries at most {carry:g} with headroom: short by {total - carry:g} QPS"
            )
    detail = "; ".join(lines) or (
        f"{', '.join(inst.problem.deployments[i].name for i in inst.blocks[block])}: the pools near its "
        "sources are too small for its min_regions / survive_region_loss / latency budget"
    )
    return f"pools: {detail}."


def _shortfall(inst: Instance, block: int, residual: np.ndarray) -> str:
    members = inst.blocks[block]
    names = ", ".join(inst.problem.deployments[i].name for i in members)
    need: dict[str, float] = {}
    for i in members:
        dep = inst.problem.deployments[i]
        for hw, option in dep.hardware.items():
            replicas = math.ceil(sum(dep.demand_qps.values()) / ((1 - dep.headroom) * option.qps))
            need[hw] = max(need.get(hw, 0), replicas * option.units)
    free = {h: float(residual[:, inst.hardware.index(h)].sum()) for h in need if h in inst.hardware}
    detail = ", ".join(
        f"{h}: needs ~{need[h]:g} units, {free.get(h, 0):g} free fleet-wide" for h in sorted(need)
    )
    return f"pools: {names} cannot be placed in the capacity left ({detail})."
