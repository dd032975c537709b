"""Making block choices fit the pools: blocks are taken off the overfull pools and placed
again in the capacity the others leave, together by one MIP or one at a time with a bounded
ejection chain; when nothing fits, the error names the shortfall."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner.block import search_block
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.complete import complete, shortfall
from ipnext.planner.instance import Instance
from ipnext.planner.pricing import (
    BlockChoice,
    block_names,
    place_jointly,
    priced_choice,
    repriced,
    solve_block,
    usage_of,
)
from ipnext.planner.work import UNITS_PER_SECOND, Budget

__all__ = [
    "FIRST_PLAN_SCARCITY",
    "OUT_OF_TIME",
    "SCRATCH_SCARCITY",
    "Unplaced",
    "first_plan_repair",
    "from_scratch",
    "minimal_movers",
    "place_one_by_one",
    "repair",
]

OUT_OF_TIME = "no plan that fits the pools within the work limit"
REPAIR_BLOCK_WORK = 2 * UNITS_PER_SECOND  # a block's MIP in the room left (once 2 s)
MIN_REPAIR_BLOCK_WORK = UNITS_PER_SECOND // 4
JOINT_SHARE = 0.5  # of the repair's work, the most its joint MIPs take
PLACE_WORK = 100  # placing one block of the queue, beside its solver's work (the bookkeeping)
# The fast solver's budget for a block it could not answer in the room left, before the MIP:
# on the 1,000-deployment row's repair it cut the MIP's turns from 57 to 18 (16.9 s -> 1.4 s).
RETRY_WORK = 5 * WORK_BUDGET
# A first plan's repair places blocks at the first prices (zero on a fleet), where every block
# wants the same cheap pools. A price that rises as a pool fills (`scarcity` x its unit cost
# x u / (1 - u), u the share of the pool in use) sends the blocks placed first to where there
# is room, and leaves the full pools to the blocks that have nowhere else to go. On the first round's
# answers of the bench's fleet rows (zero prices): 1,000 deployments, 196 blocks to place: 3.9 s
# and no eviction with 0.2, 9.9 s and 84 evictions without; 10,000 deployments, 1,540 blocks:
# 54 s and no eviction with 0.2, and without, still 478 to place after 300 s of evictions.
# The placements also cost less (1,000: 46,485 against 48,196). 0.1 evicted 6 and 8 blocks,
# 0.5 and 1.0 none but cost more (48,264, 49,985).
FIRST_PLAN_SCARCITY = 0.2
# The ejection chain gives up after this many evictions per block it was given (plus 20), and
# the completing MIPs (complete.py) place what is left.
EJECTIONS_PER_BLOCK = 1
# It also gives up when this many evictions per block left at its best (plus 20) have not
# brought it below that best, and hands the best state on, not the last: from scratch on a
# 615-block instance 96% full, 13 blocks were left after 16 evictions (3 M work units), then
# 105 after 138 (5 M), and 63 after 628 (14 M).
STALL_EVICTIONS_PER_LEFT = 2
# A plan from scratch (`from_scratch`) places every block at congestion prices this steep: with
# the pools empty at first, a gentle price lets the first blocks take the cheap pools that the
# later ones need. From scratch at 1.0, a 682-block, 98%-full instance of the family was
# placed in 3.4 M work units (17.7 s), at 0.2 in 17 M (56 s, most of it evictions); the
# 300-tight family's seed 2, which the LP rounding's repair could not place, in 0.45 M at 1.0
# and not at 0.5.
SCRATCH_SCARCITY = 1.0


def repair(
    inst: Instance,
    choices: dict[int, BlockChoice],
    churn: float,
    budget: Budget,
    prices: np.ndarray,
    *,
    joint: bool = True,
    scarcity: float = 0.0,
    complete_rest: bool = True,
    explain: bool = True,
) -> dict[int, BlockChoice]:
    """Make the choices fit the pools. Blocks are taken off the overfull pools and re-placed
    into the capacity the others leave, together by one MIP (hard pool rows, in at most
    `JOINT_SHARE` of the work; not with `joint=False`) or, if that cannot finish in time, one
    by one, largest first (with pool prices raised by `scarcity` as pools fill, see
    `place_one_by_one`). The joint MIP's circle widens when it finds nothing: every block on
    the congested hardware classes, then every block. What the one-by-one placement cannot
    place, `complete.complete` does, or proves that nothing can (with `complete_rest=False`,
    `Unplaced` instead, out of work too, for a caller with another way to try first). Out of
    work, the PlanningTimeoutError says which pools were short by how much; with
    `explain=False` it does not, for a caller that has a plan to return instead: estimating
    the shortfall solves the largest blocks left again, 1-2 s at fleet scale, after the
    clock has run out (a 923-deployment instance returned 3.3 s late)."""
    used = usage_of(inst, choices)
    if (used <= inst.pool_units + 1e-9).all():
        return dict(choices)
    overfull = [(int(r), int(h)) for r, h in np.argwhere(used > inst.pool_units + 1e-9)]
    congested_hw = {h for _, h in overfull}
    circles = [
        minimal_movers(inst, choices, used),
        [b for b, c in choices.items() if any(inst.opt_h[o] in congested_hw for o in c.x)],
        list(choices),
    ]
    # The joint MIPs share the first part of the work: one that runs to the end would leave
    # nothing for the one-by-one placement, which the fast solver makes in milliseconds a block
    # (300-tight in 60 s: "repair still had 208 of 208 blocks to place", none tried).
    started = budget.spent
    joint_budget = budget.share(JOINT_SHARE)
    for movers in circles if joint else []:
        if joint_budget.exhausted():
            break
        kept = {b: c for b, c in choices.items() if b not in set(movers)}
        residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
        placed = place_jointly(inst, movers, residual, churn, joint_budget)
        if placed is not None:
            kept.update(placed)
            return kept
    # One by one, the blocks off the overfull pools; what that leaves, the completing MIPs
    # place with more and more of the others freed (complete.py), to a plan or a proof.
    movers = circles[0]
    kept = {b: c for b, c in choices.items() if b not in set(movers)}
    residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
    done = place_one_by_one(inst, movers, residual, churn, prices, kept, budget, scarcity=scarcity)
    if done.placed is not None:
        kept.update(done.placed)
        return kept
    partial = {**kept, **done.partial}
    if not complete_rest:
        raise Unplaced(done.why, partial, done.left)
    if done.why.startswith(OUT_OF_TIME):
        if not explain:
            raise PlanningTimeoutError(done.why, fix=_MORE)
        gap = shortfall(inst, partial, done.left, churn, budget.clock)
        raise PlanningTimeoutError(
            f"{done.why[:-1]} after {budget.spent - started:,} work units of repair"
            f"{_BY_CLOCK if budget.stopped_by_clock else ''}; {gap.describe()}.",
            fix=f"{_MORE}; or {gap.fix()}",
        )
    placed_all, _ = complete(inst, partial, done.left, churn, budget)
    return placed_all


_BY_CLOCK = " (stopped by the clock: not reproducible)"
_MORE = "give the planner more work (--work-limit), or more time (--time-limit) if the clock stopped it"


def first_plan_repair(
    inst: Instance,
    choices: dict[int, BlockChoice],
    churn: float,
    budget: Budget,
    prices: np.ndarray,
    *,
    joint: bool = True,
    congestion_first: bool = True,
) -> dict[int, BlockChoice]:
    """The repair of a first plan, two ways: one block at a time at congestion prices
    (`FIRST_PLAN_SCARCITY`), and `repair` as before (the joint MIP, not with `joint=False`,
    then one at a time at `prices`). The second runs when the first cannot place the blocks
    (its ejection chain gives up), and then the completing MIPs (complete.py) place what it
    cannot; `congestion_first` says which goes first. Placed at
    congestion prices, 300-tight's LP rounding is repaired in 9.5 s, where the joint MIP and
    the placement at the LP's prices after it found nothing in 16 s. On small instances they
    are not always better: on 22 instances of 40-60 deployments, 4-6 regions, pools 70-80%
    full, they evicted fewer blocks in 6 (two placed only with them), more in 2 (one placed
    only without them). Out of time, it raises as `repair` does."""

    def congested(complete_rest: bool) -> dict[int, BlockChoice]:
        return repair(
            inst,
            choices,
            churn,
            budget,
            prices,
            joint=False,
            scarcity=FIRST_PLAN_SCARCITY,
            complete_rest=complete_rest,
        )

    def plain(complete_rest: bool) -> dict[int, BlockChoice]:
        return repair(inst, choices, churn, budget, prices, joint=joint, complete_rest=complete_rest)

    first, second = (congested, plain) if congestion_first else (plain, congested)
    try:
        return first(False)  # what it cannot place, the second way tries before the completing MIPs
    except (Unplaced, InfeasiblePlanError):
        return second(True)


def from_scratch(inst: Instance, churn: float, budget: Budget) -> dict[int, BlockChoice]:
    """A plan built from empty pools: every block placed one at a time, largest first, at
    congestion prices (`SCRATCH_SCARCITY`). Needs no LP and no pricing round. When the
    ejection chain or the work runs out, `Unplaced` says what was placed and what was not
    (first_plan.py then hands the rest to the completing MIPs)."""
    zero = np.zeros_like(inst.pool_units)
    blocks = list(range(len(inst.blocks)))
    done = place_one_by_one(
        inst, blocks, inst.pool_units.copy(), churn, zero, {}, budget, scarcity=SCRATCH_SCARCITY
    )
    if done.placed is None:
        raise Unplaced(done.why, done.partial, done.left)
    return done.placed


class Unplaced(Exception):
    """The one-by-one placement gave up (its ejection chain or its work ran out) before the
    completing MIPs were asked: `placed` fits the pools, `left` are the blocks it did not place.
    Planner-internal: its callers (first_plan_repair, first_plan) always catch it."""

    def __init__(self, why: str, placed: dict[int, BlockChoice], left: list[int]) -> None:
        super().__init__(why)
        self.message = why
        self.placed = placed
        self.left = left


def minimal_movers(inst: Instance, choices: dict[int, BlockChoice], used: np.ndarray) -> list[int]:
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


def place_one_by_one(
    inst: Instance,
    movers: list[int],
    residual: np.ndarray,
    churn: float,
    prices: np.ndarray,
    kept: dict[int, BlockChoice] | None = None,
    budget: Budget | None = None,
    *,
    scarcity: float = 0.0,
) -> OneByOne:
    """Place blocks one at a time into `residual`, largest first (by the fewest units a block
    could need: placed while there is most room, the large ones leave the small the gaps, as in
    first-fit decreasing). For the 196 blocks off the 1,000-deployment row's overfull pools,
    least flexible first (what this replaced) placed blocks 385 times and asked the MIP 18
    times, in 15 s; largest first, 322 times and 7, in 10 s. A block that does not fit evicts
    the most flexible blocks from the pools it could use (kept ones included) and they queue
    again: a bounded ejection chain. With `scarcity` > 0 each block is placed at `prices` plus a
    congestion price on every pool (`FIRST_PLAN_SCARCITY`'s comment), so few blocks need
    evicting; the placements keep no bound (it would be at those prices) and are priced at
    `prices`. Returns the placements, or None, why, and where it stopped (`OneByOne`)."""
    budget = budget if budget is not None else Budget(1 << 62)
    residual = residual.copy()
    placed: dict[int, BlockChoice] = {}
    kept = kept if kept is not None else {}

    def flexibility(b: int) -> int:
        return sum(len(inst.options_of[i]) for i in inst.blocks[b])

    def need(b: int) -> float:  # the fewest units the block's demand takes
        return float(
            sum(
                min(
                    inst.total_demand[i] * inst.opt_units[o] / (inst.usable[i] * inst.opt_qps[o])
                    for o in inst.options_of[i]
                )
                for i in inst.blocks[b]
            )
        )

    queue = sorted(movers, key=lambda b: -need(b))
    evictions = 0
    limit = EJECTIONS_PER_BLOCK * len(movers) + 20
    best: _Best | None = None  # the state with the fewest blocks left, before an eviction

    def back_to_best(why: str) -> OneByOne:
        """Give up at the best state seen (fewest left), when it is better than this one."""
        if best is None or len(best.queue) >= len(queue):
            return OneByOne(None, why, placed, queue)
        kept.clear()
        kept.update(best.kept)
        return OneByOne(None, why, best.placed, best.queue)

    while queue:
        if budget.exhausted():
            # Evicted blocks queue again, so more may be left than were given ("7 of 5").
            given = f"{len(movers)} given" + (f", {evictions} evictions" if evictions else "")
            left = min(len(queue), len(best.queue)) if best is not None else len(queue)
            why = f"{OUT_OF_TIME}: repair still had {left} blocks to place ({given})."
            return back_to_best(why)
        b = queue.pop(0)
        budget.spend(PLACE_WORK)
        mip_work = max(MIN_REPAIR_BLOCK_WORK, budget.cap(REPAIR_BLOCK_WORK))
        at = prices + _congestion(inst, residual, scarcity) if scarcity > 0 else prices
        choice, none_fits = _fast_into(inst, b, at, churn, residual, budget)
        if choice is None and not none_fits:
            choice = solve_block(
                inst, b, at, churn, mip_work, residual=np.maximum(residual, 0), ledger=budget
            )
        if choice is not None and scarcity > 0:
            choice.bound = -math.inf
            choice = repriced(inst, choice, prices)
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
                queue.insert(0, b)
                return back_to_best(_shortfall(inst, b, residual))
            if best is None or len(queue) + 1 < len(best.queue):
                best = _Best(dict(placed), dict(kept), [b, *queue], evictions)
            elif evictions - best.evictions >= STALL_EVICTIONS_PER_LEFT * len(best.queue) + 20:
                queue.insert(0, b)
                return back_to_best(
                    f"the ejection chain stalled: {evictions - best.evictions} evictions left no "
                    f"fewer than the {len(best.queue)} blocks of its best state."
                )
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
    return OneByOne(placed, "", placed, [])


@dataclass
class _Best:
    """The ejection chain's best state (`place_one_by_one`): what was placed and kept, and
    the queue, before the eviction at which it had the fewest blocks left."""

    placed: dict[int, BlockChoice]
    kept: dict[int, BlockChoice]
    queue: list[int]
    evictions: int


@dataclass
class OneByOne:
    """What `place_one_by_one` did: `placed` is every block's placement, or None, with `why`,
    when it gave up; then `partial` holds what it had placed and `left` the blocks it had not
    (the `kept` it was given lost the blocks it evicted)."""

    placed: dict[int, BlockChoice] | None
    why: str
    partial: dict[int, BlockChoice]
    left: list[int]


def _congestion(inst: Instance, residual: np.ndarray, scarcity: float) -> np.ndarray:
    """Each pool's congestion price: `scarcity` x its unit cost x u / (1 - u), u the share of
    the pool in use (capped at 0.999, where the price is 999 times the scaled cost)."""
    units = inst.pool_units
    free = np.divide(residual, units, out=np.zeros_like(units), where=units > 0)
    used = np.clip(1.0 - free, 0.0, 0.999)
    return scarcity * inst.pool_cost * used / (1.0 - used)


def _fast_into(
    inst: Instance, block: int, prices: np.ndarray, churn: float, residual: np.ndarray, budget: Budget
) -> tuple[BlockChoice | None, bool]:
    """The fast solver's placement of the block in `residual`: each option capped at the
    replicas its pool has room for, so a block of one deployment always fits (a group's
    members share pools: where their placement overfills one, every pool's room is shared out
    among the members by their demand and the block solved once more). None when there is no
    such placement or the fast solver cannot answer the block (the caller then asks the MIP
    with hard rows); with True when the search proved that nothing fits (every option at its
    pool's whole room relaxes the pool rows, so no placement there is none at all)."""
    members = [int(i) for i in inst.blocks[block]]
    demand = inst.total_demand[members]
    total = float(demand.sum())
    by_demand = {
        i: float(d) / total if total > 0 else 1.0 / len(members) for i, d in zip(members, demand, strict=True)
    }

    def room(o: int) -> float:
        return max(0.0, float(residual[inst.opt_r[o], inst.opt_h[o]]))

    for k, share in enumerate(({i: 1.0 for i in members}, by_demand)):
        caps = {
            int(o): math.floor(share[i] * room(o) / float(inst.opt_units[o]) + 1e-9)
            for i in members
            for o in inst.options_of[i]
        }
        fast, none_fits = search_block(inst, block, prices, churn, caps=caps)
        budget.spend(fast.work if fast is not None else WORK_BUDGET)
        if fast is None and not none_fits:  # the budget ran out: more of it is still cheaper than the MIP
            fast, none_fits = search_block(inst, block, prices, churn, caps=caps, budget=RETRY_WORK)
            budget.spend(fast.work if fast is not None else RETRY_WORK)
        if fast is None:
            return None, none_fits and k == 0
        used = np.zeros_like(residual)
        for o, n in fast.x.items():
            used[inst.opt_r[o], inst.opt_h[o]] += n * inst.opt_units[o]
        if not (used > residual + 1e-9).any():
            return repriced(
                inst, priced_choice(inst, block, fast.x, fast.f, math.inf, -math.inf, churn), prices
            ), False
    return None, False


def _units_in(inst: Instance, choice: BlockChoice, r: int, h: int) -> float:
    return float(
        sum(n * inst.opt_units[o] for o, n in choice.x.items() if inst.opt_r[o] == r and inst.opt_h[o] == h)
    )


def _shortfall(inst: Instance, block: int, residual: np.ndarray) -> str:
    need: dict[str, float] = {}
    for i in inst.blocks[block]:
        dep = inst.problem.deployments[i]
        for hw, option in dep.hardware.items():
            replicas = math.ceil(sum(dep.demand_qps.values()) / ((1 - dep.headroom) * option.qps))
            need[hw] = max(need.get(hw, 0), replicas * option.units)
    free = {h: float(residual[:, inst.hardware.index(h)].sum()) for h in need if h in inst.hardware}
    detail = ", ".join(
        f"{h}: needs ~{need[h]:g} units, {free.get(h, 0):g} free fleet-wide" for h in sorted(need)
    )
    return f"pools: {block_names(inst, block)} cannot be placed in the capacity left ({detail})."
