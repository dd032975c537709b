"""Repair's work: the joint MIPs over the blocks to move never take the whole of it, so the
one-at-a-time placement (the fast solver, milliseconds a block) always gets its turn."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from ipnext.errors import InfeasiblePlanError, PlanningTimeoutError
from ipnext.planner import repair as repair_module
from ipnext.planner.generator import generate
from ipnext.planner.instance import compile_problem
from ipnext.planner.pricing import solve_block, usage_of
from ipnext.planner.work import UNITS_PER_SECOND, Budget

SCARCE_SEED = 2  # an instance whose zero-price placement evicts (24 placements for 15 blocks)


def test_a_joint_mip_that_spends_its_work_leaves_the_one_by_one_placement_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inst = compile_problem(generate(3, 30, 4, 2, utilization=0.7))
    prices = np.zeros_like(inst.pool_units)
    # Every block at its cheapest, pools ignored: the cheap pools overflow.
    choices = {b: solve_block(inst, b, prices, 0.0, 5 * UNITS_PER_SECOND) for b in range(len(inst.blocks))}
    assert all(c is not None for c in choices.values())
    start = {b: c for b, c in choices.items() if c is not None}
    assert (usage_of(inst, start) > inst.pool_units + 1e-9).any(), "nothing to repair: pick another seed"

    joint_budgets: list[int] = []

    def joint_mip_using_all_its_work(
        inst: Any, movers: Any, residual: Any, churn: Any, budget: Budget
    ) -> None:
        joint_budgets.append(budget.left())
        budget.spend(budget.left())  # as a MIP that finds nothing in its work
        return None

    monkeypatch.setattr(repair_module, "place_jointly", joint_mip_using_all_its_work)
    budget = Budget(10 * UNITS_PER_SECOND)
    repaired = repair_module.repair(inst, start, 0.0, budget, prices)
    assert joint_budgets and sum(joint_budgets) <= budget.total // 2 + 1, joint_budgets
    assert (usage_of(inst, repaired) <= inst.pool_units + 1e-9).all()
    assert sorted(repaired) == sorted(start)


def test_without_the_joint_mip_repair_places_one_by_one_and_stops_at_the_first_circle_out_of_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`joint=False` (a fleet's first plan) never asks the joint MIP and still fits; out of
    time, repair stops at the blocks off the overfull pools (a wider circle would need more
    time still) and says how many of those were left and how long it ran."""
    inst = compile_problem(generate(3, 30, 4, 2, utilization=0.7))
    prices = np.zeros_like(inst.pool_units)
    choices = {b: solve_block(inst, b, prices, 0.0, 5 * UNITS_PER_SECOND) for b in range(len(inst.blocks))}
    start = {b: c for b, c in choices.items() if c is not None}
    assert len(start) == len(inst.blocks)
    joint_calls: list[int] = []
    monkeypatch.setattr(repair_module, "place_jointly", lambda *a, **_: joint_calls.append(1))
    repaired = repair_module.repair(inst, start, 0.0, Budget(30 * UNITS_PER_SECOND), prices, joint=False)
    assert joint_calls == []
    assert (usage_of(inst, repaired) <= inst.pool_units + 1e-9).all()
    assert sorted(repaired) == sorted(start)

    movers = repair_module.minimal_movers(inst, start, usage_of(inst, start))
    assert 0 < len(movers) < len(start)  # the first circle is not every block
    with pytest.raises(PlanningTimeoutError) as caught:
        repair_module.repair(inst, start, 0.0, Budget(0), prices, joint=False)
    message = caught.value.message
    assert f"repair still had {len(movers)} blocks to place ({len(movers)} given) after" in message, message
    assert "work units of repair" in message
    assert "short" in message, message  # the shortfall's estimate, pools or blocks

    # A caller with a plan to fall back on is not kept past the clock by the estimate.
    def no_estimate(*args: object) -> None:
        raise AssertionError("the shortfall was estimated")

    monkeypatch.setattr(repair_module, "shortfall", no_estimate)
    with pytest.raises(PlanningTimeoutError) as caught:
        repair_module.repair(inst, start, 0.0, Budget(0), prices, joint=False, explain=False)
    assert f"repair still had {len(movers)} blocks to place" in caught.value.message


def test_congestion_prices_place_each_block_once_where_zero_prices_evict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fleet's first plan places the blocks off the overfull pools at zero prices, where every
    one of them wants the same cheap pools: placed as they come, the early ones take the room
    the later ones need, which then evict them. With congestion prices (`scarcity`) the early
    ones go where there is room and each block is placed once; the placements still fit, and
    are priced at the prices given, with no bound claimed."""
    inst = compile_problem(generate(SCARCE_SEED, 60, 6, 2, utilization=0.8))
    prices = np.zeros_like(inst.pool_units)
    choices = {b: solve_block(inst, b, prices, 0.0, 5 * UNITS_PER_SECOND) for b in range(len(inst.blocks))}
    start = {b: c for b, c in choices.items() if c is not None}
    assert len(start) == len(inst.blocks)
    movers = repair_module.minimal_movers(inst, start, usage_of(inst, start))
    kept = {b: c for b, c in start.items() if b not in set(movers)}
    residual = np.maximum(inst.pool_units - usage_of(inst, kept), 0.0)
    asked: list[int] = []
    fast_into = repair_module._fast_into

    def counted(inst: Any, block: int, *args: Any) -> Any:
        asked.append(block)
        return fast_into(inst, block, *args)

    monkeypatch.setattr(repair_module, "_fast_into", counted)
    placements = {}
    for scarcity in (0.0, repair_module.FIRST_PLAN_SCARCITY):
        asked.clear()
        done = repair_module.place_one_by_one(
            inst, movers, residual, 0.0, prices, dict(kept), scarcity=scarcity
        )
        placed = done.placed
        assert placed is not None, done.why
        placements[scarcity] = (len(asked), placed)
    evicting, _ = placements[0.0]
    once, placed = placements[repair_module.FIRST_PLAN_SCARCITY]
    assert evicting > len(movers), "no eviction at zero prices: pick another seed"
    assert once == len(movers)
    plan = {**kept, **placed}
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    for c in placed.values():
        assert c.bound == -math.inf
        assert c.priced == pytest.approx(c.cost)  # at zero prices, no congestion price kept


def test_a_congestion_price_rises_as_its_pool_fills() -> None:
    inst = compile_problem(generate(3, 30, 4, 2, utilization=0.7))
    units = inst.pool_units
    price = {
        share: repair_module._congestion(inst, units * (1.0 - share), 0.2) for share in (0.0, 0.5, 0.9, 1.0)
    }
    held = units > 0
    assert (price[0.0] == 0.0).all()
    assert np.allclose(price[0.5][held], 0.2 * inst.pool_cost[held])  # u / (1 - u) = 1
    assert np.allclose(price[0.9][held], 0.2 * 9.0 * inst.pool_cost[held])
    assert (price[1.0][held] > price[0.9][held]).all() and np.isfinite(price[1.0]).all()


@pytest.mark.parametrize("congestion_first", [True, False])
def test_a_first_plan_is_repaired_the_other_way_when_the_first_way_cannot_place_it(
    monkeypatch: pytest.MonkeyPatch, congestion_first: bool
) -> None:
    """`first_plan_repair` tries the congestion prices and the old repair in the order asked,
    the second only when the first finds no placement, and only the second ends in the
    completing MIPs; out of time it stops at once."""
    calls: list[tuple[float, bool]] = []
    completing: list[bool] = []

    def first_way_fails(
        *args: Any, joint: bool = True, scarcity: float = 0.0, complete_rest: bool = True
    ) -> dict[int, Any]:
        calls.append((scarcity, joint))
        completing.append(complete_rest)
        if len(calls) == 1:
            raise InfeasiblePlanError("pools: no room (test)")
        return {}

    monkeypatch.setattr(repair_module, "repair", first_way_fails)
    repair_module.first_plan_repair(None, {}, 0.0, 0.0, None, congestion_first=congestion_first)  # type: ignore[arg-type]
    congestion, old = (repair_module.FIRST_PLAN_SCARCITY, False), (0.0, True)
    assert calls == ([congestion, old] if congestion_first else [old, congestion])
    assert completing == [False, True]

    def out_of_time(*args: Any, **kwargs: Any) -> dict[int, Any]:
        calls.append((-1.0, False))
        raise PlanningTimeoutError("no plan that fits the pools within the time limit: test")

    calls.clear()
    monkeypatch.setattr(repair_module, "repair", out_of_time)
    with pytest.raises(PlanningTimeoutError):
        repair_module.first_plan_repair(None, {}, 0.0, 0.0, None, congestion_first=congestion_first)  # type: ignore[arg-type]
    assert len(calls) == 1


def test_an_ejection_chain_that_stalls_hands_on_its_best_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evictions that only make things worse (from scratch on a 615-block instance 96% full:
    13 blocks left after 16 evictions, 105 after 138) end the chain after
    `STALL_EVICTIONS_PER_LEFT` per block left at its best, and what it hands on is that best
    state, the blocks it evicted since back where they were, not the worse state it ended in."""
    inst = compile_problem(generate(3, 80, 4, 1, utilization=0.3))  # one class: every block a holder
    blocks = list(range(len(inst.blocks)))
    fits = len(blocks) - 2  # the first placements fit; every one after finds no room
    real = repair_module._fast_into
    calls: list[int] = []

    def fast_then_none(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs) if len(calls) <= fits else (None, False)  # 10 before + fits - 10

    monkeypatch.setattr(repair_module, "_fast_into", fast_then_none)
    monkeypatch.setattr(repair_module, "solve_block", lambda *a, **k: None)
    zero = np.zeros_like(inst.pool_units)
    first = repair_module.place_one_by_one(inst, blocks[:10], inst.pool_units.copy(), 0.0, zero)
    assert first.placed is not None
    kept = dict(first.placed)  # placed before: the chain may evict these too
    residual = inst.pool_units - usage_of(inst, kept)
    done = repair_module.place_one_by_one(inst, blocks[10:], residual, 0.0, zero, kept)
    assert done.placed is None and "the ejection chain stalled" in done.why, done.why
    assert kept == first.placed  # evicted since the best state, put back
    assert len(done.partial) == fits - 10 and sorted([*kept, *done.partial, *done.left]) == blocks
    assert (usage_of(inst, {**kept, **done.partial}) <= inst.pool_units + 1e-9).all()
    stall = repair_module.STALL_EVICTIONS_PER_LEFT * len(done.left) + 20
    assert len(calls) - fits <= stall + 1  # it gave up once the stall was reached
