"""The global planner: Lagrangian decomposition over pools, exact per-block MIPs, and repair.

Why this shape. Deployments interact only through pool capacity (and groups, which we keep
together as blocks). The LP relaxation of the whole model is weak (replicas are integers
and min_regions / survive_region_loss force small deployments into several regions: on a
20-deployment instance it sits ~24% under the optimum) and slow at fleet scale (a
1,000-deployment LP took 32 s on 2 cores), and a monolithic MIP found no solution at 100
deployments in 30 s. So:

1. Price the pools (Lagrangian relaxation): with prices mu, every block is an independent
   small MIP, solved exactly (~20 ms each, in parallel processes). The sum of the block
   optima minus mu . capacity is a lower bound on the true optimum for any mu >= 0, and
   it pays for integrality, which the LP bound does not.
2. If the blocks' choices fit the pools, that plan is optimal for mu = 0, and otherwise
   near-optimal; when pools overflow, subgradient steps raise the prices of overfull
   pools and only the blocks using them are solved again, tightening the bound.
3. Repair: blocks are re-placed one at a time against the capacity left (hard pool rows),
   cheapest-to-move last, so the result always respects the pools when it can.

`lower_bound_method` in the result says which bound won: the Lagrangian bound, or the
optimum of the exact MIP for instances small enough to solve whole.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context

import numpy as np

from ipnext.errors import InfeasiblePlanError
from ipnext.planner.backend import solve_model
from ipnext.planner.formulation import BlockModel, build
from ipnext.planner.instance import Instance

__all__ = ["BlockChoice", "Decomposition", "decompose"]

BLOCK_TIME_LIMIT_S = 10.0
PARALLEL_MIN_BLOCKS = 64
REPAIR_SECONDS = 10.0  # beyond the decomposition's deadline
JOINT_REPAIR_SECONDS = 10.0


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


def _solve_blocks_in_worker(args: tuple[list[int], np.ndarray, float, float]) -> list[BlockChoice | None]:
    assert _WORKER_INST is not None  # set by the pool initializer
    blocks, prices, churn, limit = args
    return [solve_block(_WORKER_INST, b, prices, churn, limit) for b in blocks]


def solve_block(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    limit_s: float,
    residual: np.ndarray | None = None,
) -> BlockChoice | None:
    """The block's optimal placement at these pool prices (None if it cannot fit `residual`)."""
    model = build(inst, [block], prices=prices, churn_cost=churn, pool_capacity=residual)
    sol = solve_model(model, time_limit_s=limit_s, relative_gap=1e-9)
    if sol.values is None:
        if residual is None and sol.status == "infeasible":
            raise InfeasiblePlanError(_alone_infeasible(inst, block))
        return None
    xs = np.rint(sol.values[: model.n_x]).astype(np.int64)
    fs = sol.values[model.n_x : model.n_x + model.n_f]
    x = {int(o): int(n) for o, n in zip(model.opts, xs, strict=True) if n > 0}
    f = {int(t): float(v) for t, v in zip(model.routes, fs, strict=True) if v > 1e-9}
    cost = float(sum(inst.opt_cost[o] * n for o, n in x.items()))
    if churn and inst.problem.current is not None:
        cost += churn * float(sum(max(0, n - inst.opt_current[o]) * inst.opt_units[o] for o, n in x.items()))
    return BlockChoice(block, x, f, sol.objective, min(sol.bound, sol.objective), cost)


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
            self.executor.shutdown(cancel_futures=True)

    def solve(self, blocks: list[int], prices: np.ndarray, churn: float) -> dict[int, BlockChoice]:
        if self.executor is None or len(blocks) < PARALLEL_MIN_BLOCKS:
            results = [solve_block(self.inst, b, prices, churn, BLOCK_TIME_LIMIT_S) for b in blocks]
        else:
            size = max(8, math.ceil(len(blocks) / (self.workers * 8)))
            chunks = [blocks[i : i + size] for i in range(0, len(blocks), size)]
            results = [
                r
                for part in self.executor.map(
                    _solve_blocks_in_worker, [(c, prices, churn, BLOCK_TIME_LIMIT_S) for c in chunks]
                )
                for r in part
            ]
        out = {}
        for b, choice in zip(blocks, results, strict=True):
            if choice is None:
                raise InfeasiblePlanError(f"block {b}: no placement within its time limit")
            out[b] = choice
        return out


def usage_of(inst: Instance, choices: dict[int, BlockChoice]) -> np.ndarray:
    used = np.zeros_like(inst.pool_units)
    for choice in choices.values():
        for o, n in choice.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
    return used


def decompose(
    inst: Instance, *, churn: float, deadline: float, workers: int | None = None, max_iterations: int = 60
) -> Decomposition:
    """The Lagrangian lower bound and the cheapest block choices found that fit the pools."""
    workers = workers or os.cpu_count() or 1
    capacity = inst.pool_units
    prices = np.zeros_like(capacity)
    blocks = list(range(len(inst.blocks)))
    touches: dict[tuple[int, int], set[int]] = {}
    for o in range(len(inst.opt_d)):
        touches.setdefault((int(inst.opt_r[o]), int(inst.opt_h[o])), set()).add(
            int(inst.block_of[inst.opt_d[o]])
        )
    log: list[str] = []
    incumbent: dict[int, BlockChoice] | None = None
    with _Pool(inst, workers) as pool:
        choices = pool.solve(blocks, prices, churn)
        best = sum(c.bound for c in choices.values())
        log.append(f"prices 0: bound {best:.3f}")
        iteration = 0
        for iteration in range(1, max_iterations + 1):
            used = usage_of(inst, choices)
            gradient = used - capacity
            if not (gradient > 1e-9).any():
                if incumbent is None or _cost(choices) < _cost(incumbent):
                    incumbent = dict(choices)
                if float((prices * -gradient).sum()) < 1e-6 * max(1.0, best):
                    break  # fits, with complementary slackness: optimal for the relaxation
            if time.monotonic() > deadline:
                break
            # Polyak step towards an estimate of the optimum 2% above the best bound.
            direction = np.where((prices > 0) | (gradient > 0), gradient, 0.0)
            norm = float((direction**2).sum())
            if norm < 1e-12:
                break
            step = 0.02 * max(abs(best), 1.0) / norm
            new_prices = np.maximum(0.0, prices + step * direction)
            changed = np.argwhere(np.abs(new_prices - prices) > 1e-12)
            prices = new_prices
            affected = sorted({b for r, h in changed for b in touches.get((int(r), int(h)), ())})
            choices.update(pool.solve(affected, prices, churn))
            bound = sum(c.bound for c in choices.values()) - float((prices * capacity).sum())
            log.append(f"iteration {iteration}: {len(affected)} blocks re-solved, bound {bound:.3f}")
            best = max(best, bound)
    repaired = repair(inst, choices, churn, deadline + REPAIR_SECONDS, prices)
    if incumbent is None or _cost(repaired) < _cost(incumbent):
        incumbent = repaired
    return Decomposition(choices=incumbent, lower_bound=best, iterations=iteration, log=log)


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
        if time.monotonic() > deadline + REPAIR_SECONDS:
            return None, f"pools: repair ran out of time with {len(queue)} blocks left to place."
        b = queue.pop(0)
        choice = solve_block(inst, b, prices, churn, BLOCK_TIME_LIMIT_S, residual=np.maximum(residual, 0))
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


def _units_in(inst: Instance, choice: BlockChoice, r: int, h: int) -> float:
    return float(
        sum(n * inst.opt_units[o] for o, n in choice.x.items() if inst.opt_r[o] == r and inst.opt_h[o] == h)
    )


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
