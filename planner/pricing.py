"""One block at pool prices, the pricing step of the decomposition: its placement (a
BlockChoice) by the fast block solver or the HiGHS MIP, and block choices read out of a
solved model of several blocks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ipnext.errors import InfeasiblePlanError
from ipnext.planner.backend import root_work, solve_model
from ipnext.planner.block import solve_block_fast
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.formulation import BlockModel, build
from ipnext.planner.instance import Instance
from ipnext.planner.work import UNITS_PER_SECOND, Budget, Clock

__all__ = [
    "BlockChoice",
    "block_names",
    "choices_from_values",
    "place_jointly",
    "price_of",
    "priced_choice",
    "prohibitive",
    "relaxation_bound",
    "repriced",
    "rounded_up",
    "solve_block",
    "usage_of",
]

USE_FAST_BLOCKS = True  # False: every block by the HiGHS MIP (to compare the two)
JOINT_REPAIR_WORK = 10 * UNITS_PER_SECOND  # a joint MIP of blocks (once 10 s)
RELAXATION_WORK = UNITS_PER_SECOND  # a block's LP takes a few hundred of these
ROUNDED_RELAXATION_WORK = 5 * UNITS_PER_SECOND
LP_TOLERANCE = 1e-6  # what GLOP's optimum may sit above the LP's true one, relative


@dataclass
class BlockChoice:
    block: int
    x: dict[int, int]  # option -> replicas
    f: dict[int, float]  # route -> fraction
    priced: float  # objective with pool prices
    bound: float  # proven lower bound of the priced objective
    cost: float  # cost + churn without prices
    work: int = 0  # the work units the solve that found it was charged (work.py)


def solve_block(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    mip_work: int,
    residual: np.ndarray | None = None,
    *,
    refine: bool = True,
    work: int = WORK_BUDGET,
    clock: Clock | None = None,
    ledger: Budget | None = None,
) -> BlockChoice | None:
    """The block's optimal placement at these pool prices (None if it cannot fit `residual`).

    The combinatorial solver (block/) answers most blocks exactly in a few milliseconds;
    a block it cannot prove within its work budget, and every block against a `residual`
    capacity (repair), goes to the HiGHS MIP, whose bound at its time limit is also valid.
    With `refine=False` an unproven answer of the fast solver is returned as it is, its bound
    raised to the block's LP relaxation where that is higher (both are valid, only loose):
    HiGHS then runs only for a block the fast solver found nothing for, which keeps a pricing
    round at fleet scale to the fast solver's milliseconds.

    `work` is the fast solver's budget and `mip_work` the MIP's; the answer's `work` says what
    the call was charged, which is fixed by its inputs (a worker's answer is charged by the
    pool). `ledger`, when given, is charged too; `clock` is the outer stop."""
    spent = Budget(1 << 62, clock or (ledger.clock if ledger is not None else Clock()))
    choice = _solve_block(inst, block, prices, churn, mip_work, residual, refine, work, spent)
    if ledger is not None:
        ledger.spend(spent.spent)
    if choice is not None:
        choice.work = spent.spent
    return choice


def _solve_block(
    inst: Instance,
    block: int,
    prices: np.ndarray,
    churn: float,
    mip_work: int,
    residual: np.ndarray | None,
    refine: bool,
    work: int,
    spent: Budget,
) -> BlockChoice | None:
    fast = None
    if residual is None and USE_FAST_BLOCKS:
        fast = solve_block_fast(inst, block, prices, churn, budget=work)
        spent.spend(fast.work if fast is not None else work)
        if fast is not None and fast.optimal:
            return priced_choice(inst, block, fast.x, fast.f, fast.objective, fast.bound, churn)
        if fast is not None and not refine:
            bound = max(fast.bound, relaxation_bound(inst, block, prices, churn, spent))
            return priced_choice(inst, block, fast.x, fast.f, fast.objective, bound, churn)
    model = build(inst, [block], prices=prices, churn_cost=churn, pool_capacity=residual)
    sol = solve_model(model, work=mip_work, budget=spent, relative_gap=1e-9)
    if sol.values is None:
        if residual is None and sol.status == "infeasible":
            raise InfeasiblePlanError(alone_infeasible(inst, block))
        if fast is not None:  # HiGHS found nothing in time: the fast solver's best and bound
            return priced_choice(
                inst, block, fast.x, fast.f, fast.objective, max(fast.bound, sol.bound), churn
            )
        if residual is None:
            return _rounded_relaxation(inst, block, prices, churn, sol.bound, spent)
        return None
    if fast is not None and fast.objective < sol.objective - 1e-9:
        return priced_choice(inst, block, fast.x, fast.f, fast.objective, max(fast.bound, sol.bound), churn)
    xs = np.rint(sol.values[: model.n_x]).astype(np.int64)
    fs = sol.values[model.n_x : model.n_x + model.n_f]
    x = {int(o): int(n) for o, n in zip(model.opts, xs, strict=True) if n > 0}
    f = {int(t): float(v) for t, v in zip(model.routes, fs, strict=True) if v > 1e-9}
    bound = max(sol.bound, fast.bound) if fast is not None else sol.bound
    return priced_choice(inst, block, x, f, sol.objective, bound, churn)


def relaxation_bound(
    inst: Instance, block: int, prices: np.ndarray, churn: float, budget: Budget | None = None
) -> float:
    """The block's LP relaxation at these prices: a lower bound of its priced optimum (minus
    infinity when the LP is not solved). Where the fast solver runs out of work on a block
    with survive_region_loss groups, the least bound of the declarations it did not finish
    can sit far below this (1,000-deployment bench row, zero prices: 34 such blocks, their
    bounds 483 higher in all with it, in 0.12 s together)."""
    model = build(inst, [block], prices=prices, churn_cost=churn)
    sol = solve_model(model, relax=True, solver="glop", work=RELAXATION_WORK, budget=budget)
    if sol.status != "optimal":
        return -math.inf
    return sol.objective - LP_TOLERANCE * max(1.0, abs(sol.objective))


def _rounded_relaxation(
    inst: Instance, block: int, prices: np.ndarray, churn: float, bound: float, budget: Budget
) -> BlockChoice | None:
    """A placement of the block when neither solver found one in time: its LP relaxation with
    replicas rounded up (`rounded_up`). Rounding up only adds capacity, and the relaxation puts
    replicas of every member wherever the block stands, so the result meets every row but the
    pools; its bound is the better of the relaxation's value and `bound`."""
    model = build(inst, [block], prices=prices, churn_cost=churn)
    sol = solve_model(model, relax=True, solver="glop", work=ROUNDED_RELAXATION_WORK, budget=budget)
    if sol.values is None or sol.status != "optimal":
        return None
    values = rounded_up(inst, model, sol.values)
    x = {int(o): int(n) for o, n in zip(model.opts, values[: model.n_x], strict=True) if n > 0}
    f = {
        int(t): float(v)
        for t, v in zip(model.routes, values[model.n_x : model.n_x + model.n_f], strict=True)
        if v > 1e-9
    }
    return repriced(
        inst, priced_choice(inst, block, x, f, math.inf, max(bound, sol.objective), churn), prices
    )


def rounded_up(inst: Instance, model: BlockModel, values: np.ndarray) -> np.ndarray:
    """An LP solution of `model` with its replicas rounded up, and more where a spare asks for
    them: the LP holds only y[b,r] of a spare where a block stands fractionally, rounding up
    stands it there whole. The replicas added are the cheapest per QPS of the deployment's
    options there, up to what its pool holds (then past it: the pool then overflows, and the
    plan is repaired like any rounding that does). Enough always fits under the options'
    bounds: the LP's capacity row there holds y times (their capacity less the spare)."""
    out = values.copy()
    out[: model.n_x] = np.ceil(out[: model.n_x] - 1e-6)
    if not inst.spare.any():
        return out
    x = out[: model.n_x]
    cols: dict[tuple[int, int], list[int]] = {}
    for k, o in enumerate(model.opts):
        i, r = int(inst.opt_d[o]), int(inst.opt_r[o])
        if inst.spare[i, r] > 0:
            cols.setdefault((i, r), []).append(k)
    if not cols:
        return out
    routed: dict[tuple[int, int], float] = {}
    for k, t in enumerate(model.routes):
        share = float(out[model.n_x + k])
        if share > 0:
            r = int(inst.route_r[t])
            for i in inst.blocks[int(inst.route_b[t])]:
                routed[i, r] = routed.get((i, r), 0.0) + float(inst.demand[i, inst.route_s[t]]) * share
    for (i, r), ks in cols.items():
        if not any(x[k] > 0 for k in ks):
            continue
        alpha = float(inst.usable[i])
        short = routed.get((i, r), 0.0) + float(inst.spare[i, r])
        short -= alpha * float(sum(inst.opt_qps[model.opts[k]] * x[k] for k in ks))
        by_price = sorted(ks, key=lambda k: float(inst.opt_cost[model.opts[k]] / inst.opt_qps[model.opts[k]]))
        for k in by_price:
            if short <= 1e-9 * max(1.0, float(inst.spare[i, r])):
                break
            o = model.opts[k]
            per = alpha * float(inst.opt_qps[o])
            more = math.ceil(short / per - 1e-9)
            if k != by_price[-1]:  # the last option takes what is left, past its pool if need be
                more = min(more, max(0.0, float(inst.opt_cap[o]) - x[k]))
            x[k] += more
            short -= more * per
    return out


def repriced(inst: Instance, choice: BlockChoice, prices: np.ndarray) -> BlockChoice:
    """`choice` (a placement no solver priced) with its priced value worked out from its cost."""
    choice.priced = choice.cost + price_of(inst, choice.x, prices)
    choice.bound = min(choice.bound, choice.priced)
    return choice


def price_of(inst: Instance, x: dict[int, int], prices: np.ndarray) -> float:
    """What the pool prices add to a placement's cost."""
    return float(sum(n * inst.opt_units[o] * prices[inst.opt_r[o], inst.opt_h[o]] for o, n in x.items()))


def prohibitive(inst: Instance) -> float:
    """A pool price no placement pays when it has any other way."""
    return 10.0 * float(inst.pool_cost.max()) + 1.0


def priced_choice(
    inst: Instance,
    block: int,
    x: dict[int, int],
    f: dict[int, float],
    priced: float,
    bound: float,
    churn: float,
) -> BlockChoice:
    """The block's choice of this placement, with its cost (and churn) worked out."""
    cost = float(sum(inst.opt_cost[o] * n for o, n in x.items()))
    if churn and inst.problem.current is not None:
        cost += churn * float(sum(max(0, n - inst.opt_current[o]) * inst.opt_units[o] for o, n in x.items()))
    return BlockChoice(block, x, f, priced, min(bound, priced), cost)


def usage_of(inst: Instance, choices: dict[int, BlockChoice]) -> np.ndarray:
    """Units the choices take from each pool, (regions, hardware)."""
    used = np.zeros_like(inst.pool_units)
    for choice in choices.values():
        for o, n in choice.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
    return used


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


def place_jointly(
    inst: Instance, movers: list[int], residual: np.ndarray, churn: float, budget: Budget
) -> dict[int, BlockChoice] | None:
    """The blocks `movers` placed together by one MIP in the `residual` pool capacity (None if
    it found no placement in its work, at most `JOINT_REPAIR_WORK`), charged to `budget`."""
    joint = build(inst, movers, pool_capacity=residual, churn_cost=churn)
    limit = max(UNITS_PER_SECOND, budget.cap(JOINT_REPAIR_WORK))
    if limit < root_work(joint):
        return None  # its root alone would outrun the work: on 300-deployment instances, the clock
    sol = solve_model(joint, work=limit, budget=budget, relative_gap=1e-4)
    if sol.values is None:
        return None
    return choices_from_values(inst, joint, sol.values, churn, movers)


def block_names(inst: Instance, block: int) -> str:
    return ", ".join(inst.problem.deployments[i].name for i in inst.blocks[block])


def alone_infeasible(inst: Instance, block: int) -> str:
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
    spare = any(inst.problem.deployments[i].spare_replicas for i in inst.blocks[block])
    detail = "; ".join(lines) or (
        f"{block_names(inst, block)}: the pools near its "
        "sources are too small for its min_regions / survive_region_loss / latency budget"
        + (" / spare_replicas" if spare else "")
    )
    return f"pools: {detail}."
