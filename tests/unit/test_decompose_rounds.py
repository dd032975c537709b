"""The pieces that keep the decomposition inside its work limit at fleet scale: bounds carried
from earlier pricing rounds, rounds cut short when their work is spent, the rounded-relaxation placement
of a block no solver answered, and the greedy plan out of the columns."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ipnext.contracts.plan import Plan
from ipnext.errors import PlanningTimeoutError
from ipnext.planner import check_plan, pricing, solve
from ipnext.planner.columns import cheaper_from_columns, enrich, greedy_columns, swap_columns
from ipnext.planner.generator import generate
from ipnext.planner.improve import improve, plan_cost
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.master import Master
from ipnext.planner.pool import PARALLEL_MIN_BLOCKS, Pool
from ipnext.planner.pricing import BlockChoice, _rounded_relaxation, solve_block, usage_of
from ipnext.planner.rounds import Reuse, Rounds
from ipnext.planner.solve import Candidate, _plan
from ipnext.planner.work import UNITS_PER_SECOND, Budget
from tests.unit.helpers import work_options


def _instance(seed: int = 7, deployments: int = 24) -> Instance:
    return compile_problem(generate(seed, deployments, 4, 2, utilization=0.6))


def _exact(inst: Instance, block: int, prices: np.ndarray) -> BlockChoice:
    """The block's proven optimum at `prices` (the HiGHS MIP, no fast solver shortcut)."""
    choice = solve_block(inst, block, prices, 0.0, 30 * UNITS_PER_SECOND)
    assert choice is not None and choice.priced - choice.bound <= 1e-6 * max(1.0, choice.priced)
    return choice


def _columns_at_several_prices() -> tuple[Instance, Master, np.ndarray]:
    """A 40-deployment instance and a master holding every block's answer at zero prices and
    at four random ones (so the blocks have several columns each), with the zero prices."""
    inst = compile_problem(generate(5, 40, 4, 2, utilization=0.6))
    zero = np.zeros_like(inst.pool_units)
    master = Master(inst)
    rng = np.random.default_rng(0)
    for prices in [zero] + [rng.uniform(0.0, 2.0, zero.shape) * inst.pool_cost for _ in range(4)]:
        for b in range(len(inst.blocks)):
            c = solve_block(inst, b, prices, 0.0, 5 * UNITS_PER_SECOND, refine=False)
            assert c is not None
            master.add(c, c.cost)
    return inst, master, zero


def test_a_carried_bound_stays_below_the_optimum_at_higher_prices() -> None:
    inst = _instance()
    zero = np.zeros_like(inst.pool_units)
    first = {b: _exact(inst, b, zero) for b in range(len(inst.blocks))}
    rounds = Rounds(inst)
    rounds.add(zero, first)
    higher = inst.pool_cost * np.random.default_rng(3).uniform(0.0, 0.8, inst.pool_units.shape)
    carried = rounds.complete({}, higher, first)  # no block re-solved at the higher prices
    for b, c in carried.items():
        optimum = _exact(inst, b, higher).priced
        assert c.bound == pytest.approx(first[b].bound)
        assert c.bound <= optimum + 1e-6 * max(1.0, optimum)
        # The carried placement is re-priced: its priced value is what it costs at `higher`.
        expected = c.cost + sum(
            n * inst.opt_units[o] * higher[inst.opt_r[o], inst.opt_h[o]] for o, n in c.x.items()
        )
        assert c.priced == pytest.approx(expected)


def test_a_bound_from_higher_prices_is_not_carried_to_lower_ones() -> None:
    inst = _instance()
    high = inst.pool_cost.copy()
    at_high = {b: _exact(inst, b, high) for b in range(len(inst.blocks))}
    rounds = Rounds(inst)
    rounds.add(high, at_high)
    carried = rounds.complete({}, np.zeros_like(high), at_high)
    assert all(c.bound == -np.inf for c in carried.values())
    # A block solved in the round keeps the better of its own bound and what is carried.
    solved = {0: _exact(inst, 0, high * 2)}
    merged = rounds.complete(solved, high * 2, at_high)
    assert merged[0].bound == pytest.approx(max(solved[0].bound, at_high[0].bound))


def test_a_round_with_no_work_left_answers_no_block() -> None:
    inst = _instance()
    zero = np.zeros_like(inst.pool_units)
    with Pool(inst, workers=1) as pool:
        assert pool.solve(list(range(len(inst.blocks))), zero, 0.0, budget=Budget(0)) == {}
        full = pool.solve(list(range(len(inst.blocks))), zero, 0.0, refine=False)
    assert sorted(full) == list(range(len(inst.blocks)))


def _assert_valid_alone(inst: Instance, choice: BlockChoice) -> None:
    """`choice` meets every constraint but the pools: checked as the plan of a problem holding
    only its block, with room in every pool."""
    deps = [inst.problem.deployments[i] for i in inst.blocks[choice.block]]
    pools = [p.model_copy(update={"units": p.units * 1000}) for p in inst.problem.fleet.pools]
    alone = inst.problem.model_copy(
        update={"deployments": deps, "fleet": inst.problem.fleet.model_copy(update={"pools": pools})}
    )
    sub = compile_problem(alone)
    # The same options and routes, indexed in the one-block instance.
    options = {}
    for k, i in enumerate(inst.blocks[choice.block]):
        options.update({int(a): int(o) for a, o in zip(inst.options_of[i], sub.options_of[k], strict=True)})
    shares = {(int(inst.route_s[t]), int(inst.route_r[t])): v for t, v in choice.f.items()}
    routes = {int(t): (int(sub.route_s[t]), int(sub.route_r[t])) for t in sub.routes_of[0]}
    f = {t: shares[key] for t, key in routes.items() if key in shares}
    x = {options[o]: n for o, n in choice.x.items()}
    plan = _as_plan(sub, {0: BlockChoice(0, x, f, 0.0, 0.0, choice.cost)})
    assert check_plan(alone, plan) == [], choice.block


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_rounded_relaxation_is_a_valid_placement_with_a_valid_bound(seed: int) -> None:
    inst = _instance(seed)
    prices = inst.pool_cost * 0.3
    for b in range(len(inst.blocks)):
        rounded = _rounded_relaxation(inst, b, prices, 0.0, -np.inf, Budget(5 * UNITS_PER_SECOND))
        assert rounded is not None
        assert rounded.bound <= _exact(inst, b, prices).priced + 1e-6
        _assert_valid_alone(inst, rounded)


def test_enrich_adds_valid_placements_that_keep_off_a_priced_out_pool() -> None:
    inst = _instance(4, 30)
    master = Master(inst)
    zero = np.zeros_like(inst.pool_units)
    for b in range(len(inst.blocks)):
        c = solve_block(inst, b, zero, 0.0, 5 * UNITS_PER_SECOND, refine=False)
        assert c is not None
        master.add(c, c.cost)
    before = len(master.columns)
    used = usage_of(inst, {c.block: c.choice for c in master.columns})
    busiest = np.unravel_index(int(np.argmax(used / np.maximum(inst.pool_units, 1))), used.shape)
    prices = zero.copy()
    prices[busiest] = 0.5 * inst.pool_cost[busiest]
    with Pool(inst, workers=1) as pool:
        added = enrich(inst, pool, master, prices, 0.0, Budget(60 * UNITS_PER_SECOND))
    assert added == len(master.columns) - before > 0
    new = [master.columns[k] for k in range(before, len(master.columns))]
    for col in new:
        _assert_valid_alone(inst, col.choice)
    # Some new placement keeps off the pool that was priced out.
    flat = busiest[0] * inst.pool_units.shape[1] + busiest[1]
    assert any(flat not in col.pools for col in new)


def test_greedy_columns_fit_the_pools() -> None:
    inst = compile_problem(generate(5, 40, 4, 2, utilization=0.6))
    zero = np.zeros_like(inst.pool_units)
    master = Master(inst)
    for scale in (0.0, 0.5, 1.0, 2.0):
        for b in range(len(inst.blocks)):
            c = solve_block(inst, b, zero + scale * inst.pool_cost, 0.0, 5 * UNITS_PER_SECOND, refine=False)
            assert c is not None
            master.add(c, c.cost)
    plan = greedy_columns(
        inst, master, list(range(len(inst.blocks))), {}, 0.0, zero, Budget(60 * UNITS_PER_SECOND)
    )
    assert plan is not None and sorted(plan) == list(range(len(inst.blocks)))
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    report = _as_plan(inst, plan)
    assert check_plan(inst.problem, report) == []


def test_choosing_again_from_every_column_keeps_the_cheaper_plan_and_fits_the_pools() -> None:
    """After a branch the plan is chosen again by the IP over every column: a plan of dearer
    columns is replaced by the cheapest choice, and the cheapest is kept."""
    inst, master, zero = _columns_at_several_prices()
    blocks = list(range(len(inst.blocks)))
    greedy = greedy_columns(inst, master, blocks, {}, 0.0, zero, Budget(60 * UNITS_PER_SECOND))
    assert greedy is not None
    for c in greedy.values():  # some choice of the columns then fits the pools
        master.add(c, c.cost)
    chosen = master.solve_ip(blocks, inst.pool_units.ravel(), 30 * UNITS_PER_SECOND)
    assert chosen is not None
    cheapest = {b: master.columns[c].choice for b, c in chosen.items()}
    # Dearer columns where they still fit the others.
    dear = dict(cheapest)
    for b in blocks:
        for c in sorted(master.of_block[b], key=lambda c: -master.columns[c].cost):
            trial = {**dear, b: master.columns[c].choice}
            if (usage_of(inst, trial) <= inst.pool_units + 1e-9).all():
                dear = trial
                break
    assert plan_cost(dear) > plan_cost(cheapest) + 1e-6  # the instance leaves room to do better
    again = cheaper_from_columns(inst, master, dear, Budget(60 * UNITS_PER_SECOND))
    assert plan_cost(again) == pytest.approx(plan_cost(cheapest))
    assert (usage_of(inst, again) <= inst.pool_units + 1e-9).all()
    assert check_plan(inst.problem, _as_plan(inst, again)) == []
    assert plan_cost(cheapest) <= plan_cost(greedy) + 1e-6
    assert cheaper_from_columns(inst, master, cheapest, Budget(60 * UNITS_PER_SECOND)) is cheapest  # kept


def test_a_block_reused_across_rounds_is_still_optimal_at_the_new_prices() -> None:
    inst = _instance(6, 30)
    zero = np.zeros_like(inst.pool_units)
    exact = {b: _exact(inst, b, zero) for b in range(len(inst.blocks))}
    reuse = Reuse(inst, exact, zero)
    used = usage_of(inst, exact)
    busiest = np.unravel_index(int(np.argmax(used)), used.shape)
    higher = zero.copy()
    higher[busiest] = 0.7 * inst.pool_cost[busiest]
    stale = reuse.stale(higher)
    users = [b for b, c in exact.items() if any((inst.opt_r[o], inst.opt_h[o]) == busiest for o in c.x)]
    assert users and set(users) <= set(stale)
    assert len(stale) < len(inst.blocks)
    for b, c in reuse.unchanged(stale).items():
        assert c.priced == pytest.approx(_exact(inst, b, higher).priced, rel=1e-6)
    # Once answered at `higher`, a block is stale again when that price falls back, if it
    # may use the pool; the blocks last answered at zero prices are not.
    reuse.update({b: _exact(inst, b, higher) for b in stale}, higher)
    assert reuse.stale(higher) == []
    could = _blocks_on(inst, busiest)
    assert sorted(reuse.stale(zero)) == sorted(b for b in stale if b in could)


def _blocks_on(inst: Instance, pool: tuple[np.intp, ...]) -> set[int]:
    return {
        int(inst.block_of[inst.opt_d[o]])
        for o in range(len(inst.opt_d))
        if (inst.opt_r[o], inst.opt_h[o]) == pool
    }


def test_improving_two_neighbourhoods_at_once_keeps_the_plan_within_the_pools() -> None:
    """With two workers, disjoint neighbourhoods are solved at once against the same plan; the
    results are kept only while together they still fit the pools."""
    inst = compile_problem(generate(2, 100, 4, 2, utilization=0.5))
    zero = np.zeros_like(inst.pool_units)
    master = Master(inst)
    for scale in (0.0, 1.0, 3.0):
        for b in range(len(inst.blocks)):
            c = solve_block(inst, b, zero + scale * inst.pool_cost, 0.0, 5 * UNITS_PER_SECOND, refine=False)
            assert c is not None
            master.add(c, c.cost)
    start = greedy_columns(
        inst, master, list(range(len(inst.blocks))), {}, 0.0, zero, Budget(60 * UNITS_PER_SECOND)
    )
    assert start is not None
    prices = inst.pool_cost * 0.2
    priced = {}
    for b in range(len(inst.blocks)):
        answer = solve_block(inst, b, prices, 0.0, 5 * UNITS_PER_SECOND, refine=False)
        assert answer is not None
        priced[b] = answer
    with Pool(inst, workers=2) as pool:
        assert pool.executor is not None
        result = improve(inst, start, prices, priced, 0.0, Budget(3 * UNITS_PER_SECOND), pool=pool)
    better = result.plan
    assert sorted(better) == sorted(start)
    assert result.tried >= 2  # the first two disjoint neighbourhoods went to the workers together
    assert (usage_of(inst, better) <= inst.pool_units + 1e-9).all()
    assert sum(c.cost for c in better.values()) < sum(c.cost for c in start.values())
    assert check_plan(inst.problem, _as_plan(inst, better)) == []


HOLDER = """
import sys, time
from ipnext.planner.generator import generate
from ipnext.planner.instance import compile_problem
from ipnext.planner.pool import Pool

if __name__ == "__main__":
    inst = compile_problem(generate(7, 200, 4, 2, utilization=0.6))
    with Pool(inst, workers=2) as pool:
        assert pool.executor is not None
        list(pool.executor.map(abs, [1, 2, 3, 4]))  # both workers started
        print(" ".join(str(p) for p in pool.executor._processes), flush=True)
        time.sleep(600)  # killed here, mid-solve: the pool's exit never runs
"""


def test_a_killed_planner_leaves_no_worker_behind(tmp_path: Path) -> None:
    """Issue 22: worker processes are stopped and cleaned, also when the planner's own process
    is killed (SIGKILL: nothing of it runs). Each worker sees its parent gone and ends."""
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    holder = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        workers = [int(p) for p in holder.stdout.readline().split()]
        assert len(workers) == 2, workers
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in workers):
        time.sleep(0.2)
    assert not [p for p in workers if _alive(p)], "workers outlived their killed planner"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_an_unproven_block_in_a_round_keeps_the_better_of_the_fast_bound_and_its_lp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pricing round (refine=False) takes the fast solver's answer where it runs out of work;
    its bound is raised to the block's LP relaxation, and stays at or below the optimum."""
    inst = compile_problem(generate(1, 40, 6, 3, utilization=0.5))
    block, zero = 21, np.zeros_like(inst.pool_units)
    real = pricing.solve_block_fast
    monkeypatch.setattr(pricing, "solve_block_fast", lambda *a, **_: real(*a, budget=200))
    fast = real(inst, block, zero, 0.0, budget=200)
    assert fast is not None and not fast.optimal  # the seam: an unproven fast answer
    lp = pricing.relaxation_bound(inst, block, zero, 0.0)
    assert lp > fast.bound + 1.0  # the instance is one where the LP is the better bound
    choice = solve_block(inst, block, zero, 0.0, 30 * UNITS_PER_SECOND, refine=False)
    assert choice is not None and choice.x == fast.x
    assert choice.bound == pytest.approx(lp)
    monkeypatch.undo()
    assert choice.bound <= _exact(inst, block, zero).priced + 1e-6


def test_at_fleet_scale_the_workers_tighten_bounds_while_the_plan_is_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past FLEET_BLOCKS blocks (made 0 here) the loosest blocks go to HiGHS in the workers as
    soon as pricing ends, and their bounds are taken in after the plan is built and improved.
    Every block is made to count as loose, so that there is work for them."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.instance"), "FLEET_BLOCKS", 0)
    decompose_module = importlib.import_module("ipnext.planner.decompose")
    monkeypatch.setattr(decompose_module, "loose", lambda choices: sorted(choices))
    taken: list[int] = []
    real_tightened = decompose_module.tightened

    def spy(inst: Instance, prices: np.ndarray, choices: dict, solved: dict) -> float | None:
        taken.append(len(solved))
        return real_tightened(inst, prices, choices, solved)

    monkeypatch.setattr(decompose_module, "tightened", spy)
    problem = generate(2, 100, 4, 2, utilization=0.6)
    assert len(compile_problem(problem).blocks) >= PARALLEL_MIN_BLOCKS  # the workers run
    plan = solve(problem, work_options(10, exact_fallback=False, workers=2))
    assert check_plan(problem, plan) == []
    assert taken and taken[0] > 0, taken  # the workers' answers were taken in
    assert plan.lower_bound is not None and plan.lower_bound <= plan.objective + 1e-6


def test_the_loosest_blocks_of_a_round_by_the_mip_are_cheaper_and_tighter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At fleet scale the first round that fits solves its loosest blocks again by the MIP: with
    the fast solver's work cut, its answers there are dearer and looser than the MIP's, and
    what comes back is never dearer nor looser, and on some block strictly better."""
    decompose_module = importlib.import_module("ipnext.planner.decompose")
    inst = compile_problem(generate(1, 40, 6, 3, utilization=0.5))
    zero = np.zeros_like(inst.pool_units)
    real = pricing.solve_block_fast
    monkeypatch.setattr(pricing, "solve_block_fast", lambda *a, **k: real(*a, **{**k, "budget": 200}))
    fresh = {
        b: solve_block(inst, b, zero, 0.0, 30 * UNITS_PER_SECOND, refine=False)
        for b in range(len(inst.blocks))
    }
    round_answers = {b: c for b, c in fresh.items() if c is not None}
    with Pool(inst, 1) as pool:
        exact = decompose_module._loosest_by_mip(
            pool, round_answers, zero, 0.0, Budget(60 * UNITS_PER_SECOND)
        )
    assert exact, "no loose block was solved again"
    assert len(exact) <= decompose_module.MIP_BLOCKS_IN_ROUND
    for b, c in exact.items():
        assert c.priced <= round_answers[b].priced + 1e-6
        assert c.bound >= round_answers[b].bound - 1e-6
        assert c.bound <= c.priced + 1e-6
    assert any(
        c.priced < round_answers[b].priced - 1e-6 or c.bound > round_answers[b].bound + 1e-6
        for b, c in exact.items()
    )


def test_at_fleet_scale_the_plan_is_chosen_again_with_the_workers_placements(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past FLEET_BLOCKS blocks (made 0 here) the first round that fits sends its loosest blocks
    to the MIP, and the workers' tightened blocks join the columns before the plan is chosen
    again; the plan kept is never dearer than the one first built, and fits the pools."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.instance"), "FLEET_BLOCKS", 0)
    decompose_module = importlib.import_module("ipnext.planner.decompose")
    monkeypatch.setattr(decompose_module, "loose", lambda choices: sorted(choices))
    mipped: list[int] = []
    again: list[tuple[int, float, float]] = []
    real_mip, real_again = decompose_module._loosest_by_mip, decompose_module._chosen_again

    def mip_spy(*args: object) -> dict[int, BlockChoice]:
        out = real_mip(*args)  # type: ignore[arg-type]
        mipped.append(len(out))
        return out

    def again_spy(inst: Instance, master: Master, solved: dict, plan: dict, *rest: object) -> dict:
        out = real_again(inst, master, solved, plan, *rest)  # type: ignore[arg-type]
        again.append((len(solved), plan_cost(plan), plan_cost(out)))
        return out

    monkeypatch.setattr(decompose_module, "_loosest_by_mip", mip_spy)
    monkeypatch.setattr(decompose_module, "_chosen_again", again_spy)
    problem = generate(2, 100, 4, 2, utilization=0.6)
    plan = solve(problem, work_options(20, exact_fallback=False, workers=2))
    assert check_plan(problem, plan) == []
    assert mipped == [mipped[0]] and mipped[0] > 0, mipped  # once, in the first round that fits
    assert len(again) == 1 and again[0][0] > 0, again
    assert again[0][2] <= again[0][1] + 1e-9
    assert plan.lower_bound is not None and plan.lower_bound <= plan.objective + 1e-6


def test_swapping_columns_makes_an_overfull_choice_fit() -> None:
    """Blocks left on their cheapest columns overfill the pools; swapping blocks' columns (the
    least extra cost per unit of overflow cut) ends with every block on one of its own columns
    and the pools holding them all; with no time left it gives nothing rather than a part."""
    inst, master, zero = _columns_at_several_prices()
    blocks = list(range(len(inst.blocks)))
    fitting = greedy_columns(inst, master, blocks, {}, 0.0, zero, Budget(60 * UNITS_PER_SECOND))
    assert fitting is not None
    for c in fitting.values():  # some choice of the columns fits the pools
        master.add(c, c.cost)
    # The blocks that take most units come off and go back on their cheapest columns.
    left = sorted(blocks, key=lambda b: -sum(c.units.sum() for c in master.columns if c.block == b))[:32]
    kept = {
        b: next(
            master.columns[c].choice for c in master.of_block[b] if master.columns[c].choice.x == fitting[b].x
        )
        for b in blocks
        if b not in left
    }
    cheapest = {b: min(master.of_block[b], key=lambda c: master.columns[c].cost) for b in left}
    usage = usage_of(inst, {**kept, **{b: master.columns[c].choice for b, c in cheapest.items()}})
    assert (usage > inst.pool_units + 1e-9).any()  # they do not fit on their cheapest columns
    plan = swap_columns(inst, master, kept, left, Budget(60 * UNITS_PER_SECOND))
    assert plan is not None and sorted(plan) == blocks
    assert all(any(master.columns[c].choice is plan[b] for c in master.of_block[b]) for b in blocks)
    assert (usage_of(inst, plan) <= inst.pool_units + 1e-9).all()
    assert check_plan(inst.problem, _as_plan(inst, plan)) == []
    assert swap_columns(inst, master, kept, left, Budget(0)) is None


def test_at_fleet_scale_the_first_round_made_to_fit_is_the_plan_when_the_columns_give_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without an LP rounding (the LP relaxation is too large at fleet scale: made so here) and
    without a plan from scratch (made to fail here: see the next test), the first round's
    answers, repaired, are the first plan: they fit the pools, and when choosing from the
    columns then runs out of time the solve returns that plan, never nothing. The repair runs
    at congestion prices first, as on a fleet past CONGESTION_FIRST_BLOCKS (the repair at the
    first prices has its own tests in test_repair.py)."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.instance"), "FLEET_BLOCKS", 0)
    decompose_module = importlib.import_module("ipnext.planner.decompose")
    first_plan_module = importlib.import_module("ipnext.planner.first_plan")
    monkeypatch.setattr(first_plan_module, "LP_ROUNDING_MAX_OPTIONS", 0)
    monkeypatch.setattr(first_plan_module, "CONGESTION_FIRST_BLOCKS", 0)
    repair_module = importlib.import_module("ipnext.planner.repair")
    scarcities: list[float] = []
    real_repair = repair_module.repair

    def repair_spy(*args: object, **kwargs: object) -> object:
        scarcities.append(float(kwargs.get("scarcity", 0.0)))  # type: ignore[arg-type]
        return real_repair(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(repair_module, "repair", repair_spy)
    firsts: list[tuple[Instance, dict[int, BlockChoice] | None, str]] = []
    real_first = decompose_module.fitted_first_round

    def first_spy(inst: Instance, *args: object) -> tuple[dict[int, BlockChoice] | None, str]:
        plan, how = real_first(inst, *args)  # type: ignore[arg-type]
        firsts.append((inst, plan, how))
        return plan, how

    explained: list[object] = []

    def out_of_time(*args: object, **kwargs: object) -> None:
        explained.append(kwargs.get("explain"))
        raise PlanningTimeoutError("no plan that fits the pools within the time limit: test")

    def nothing_from_scratch(inst: Instance, *args: object, **kwargs: object) -> None:
        raise repair_module.Unplaced("test", {}, list(range(len(inst.blocks))))

    monkeypatch.setattr(decompose_module, "fitted_first_round", first_spy)
    monkeypatch.setattr(decompose_module, "from_columns", out_of_time)
    monkeypatch.setattr(first_plan_module, "from_scratch", nothing_from_scratch)
    monkeypatch.setattr(first_plan_module, "complete", out_of_time)
    problem = generate(2, 100, 4, 2, utilization=0.6)
    plan = solve(problem, work_options(10, exact_fallback=False, workers=2))
    assert len(firsts) == 1, firsts
    inst, first, how = firsts[0]
    assert first is not None, how
    assert sorted(first) == list(range(len(inst.blocks)))
    assert (usage_of(inst, first) <= inst.pool_units + 1e-9).all()
    assert check_plan(problem, plan) == []
    assert "the first round's answers, repaired" in plan.lower_bound_method, plan.lower_bound_method
    assert plan.objective <= plan_cost(first) + 1e-6  # that plan, or a better one from improvement
    assert scarcities[:1] == [repair_module.FIRST_PLAN_SCARCITY], scarcities
    assert explained[-1] is False  # with a first plan to return, no shortfall is estimated


def _as_plan(inst: Instance, choices: dict[int, BlockChoice]) -> Plan:
    """The choices written as a plan (for check_plan), as solve() writes its own."""
    return _plan(inst, Candidate(choices, 0.0, "test", "ipnext-lagrangian"), 0.0, time.monotonic(), Budget(1))


def test_an_ip_whose_root_costs_more_than_its_work_is_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """HiGHS's root is not bounded by its node limit: an IP over the columns given less work
    than its root costs (`root_work`) answers None without running."""
    inst, master, _ = _columns_at_several_prices()
    blocks = list(range(len(inst.blocks)))
    master_module = importlib.import_module("ipnext.planner.master")
    real = master_module.solve_model
    ran: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        ran.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(master_module, "solve_model", counted)
    assert master.solve_ip(blocks, inst.pool_units.ravel(), 1_000) is None
    assert ran == []
    master.solve_ip(blocks, inst.pool_units.ravel(), 30 * UNITS_PER_SECOND)
    assert ran == [1]


def test_without_an_lp_rounding_the_first_plan_is_built_from_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet (no LP rounding) gets its first plan before the first pricing round, every block
    placed one at a time at congestion prices: when choosing from the columns then runs out of
    time, that plan comes back, and it fits the pools. Its placements are the master's
    columns from the start, so the master LP fits the pools without slack from then on."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.instance"), "FLEET_BLOCKS", 0)
    decompose_module = importlib.import_module("ipnext.planner.decompose")
    monkeypatch.setattr(importlib.import_module("ipnext.planner.first_plan"), "LP_ROUNDING_MAX_OPTIONS", 0)
    firsts: list[dict[int, BlockChoice]] = []
    real_first = decompose_module.first_plan

    def first_spy(*args: Any) -> Any:
        plan, how = real_first(*args)
        firsts.append(plan)
        return plan, how

    added: list[BlockChoice] = []
    real_add = Master.add

    def add_spy(self: Master, choice: BlockChoice, cost: float) -> Any:
        added.append(choice)
        return real_add(self, choice, cost)

    monkeypatch.setattr(decompose_module, "first_plan", first_spy)
    monkeypatch.setattr(Master, "add", add_spy)

    def out_of_time(*args: object, **kwargs: object) -> None:
        raise PlanningTimeoutError("no plan that fits the pools within the time limit: test")

    monkeypatch.setattr(decompose_module, "from_columns", out_of_time)
    problem = generate(2, 100, 4, 2, utilization=0.6)
    plan = solve(problem, work_options(10, exact_fallback=False, workers=2))
    assert check_plan(problem, plan) == []
    assert "the plan: placed from scratch in" in plan.lower_bound_method, plan.lower_bound_method
    assert firsts and firsts[0] is not None
    assert all(any(c is a for a in added) for c in firsts[0].values())
