"""The structured block solver (`planner/block/`) against the HiGHS block MIP.

For random blocks of generated instances, at random pool prices, with and without a current
plan and churn, the fast solver's objective must equal the MIP optimum whenever it claims
optimality (else its bound must bracket it), and its placement must meet every constraint of
the block problem, checked here independently of both solvers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ipnext.contracts.plan import DeploymentPlacement, Plan, PlanningProblem
from ipnext.planner.backend import solve_model
from ipnext.planner.block import FastResult, search_block, solve_block_fast
from ipnext.planner.block.common import WORK_BUDGET
from ipnext.planner.formulation import build
from ipnext.planner.generator import family, generate
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.work import UNITS_PER_SECOND

REL = 1e-6
FEAS = 1e-7


def _ub(inst: Instance, o: int) -> int:
    i = inst.opt_d[o]
    enough = math.ceil(inst.total_demand[i] / (inst.usable[i] * inst.opt_qps[o]) - 1e-9)
    return int(min(inst.opt_cap[o], max(enough, 1)))


def _violations(inst: Instance, b: int, prices: np.ndarray, churn: float, res: FastResult) -> list[str]:
    """Every constraint of the block problem, written out on its own."""
    out = []
    members = [int(i) for i in inst.blocks[b]]
    own = {int(o) for i in members for o in inst.options_of[i]}
    cap = {(i, r): 0.0 for i in members for r in range(len(inst.regions))}
    used = set()
    for o, n in res.x.items():
        if o not in own:
            out.append(f"option {o} is not the block's")
            continue
        if n != int(n) or n < 0 or n > _ub(inst, o):
            out.append(f"option {o}: {n} replicas out of [0, {_ub(inst, o)}]")
        i, r = int(inst.opt_d[o]), int(inst.opt_r[o])
        cap[i, r] += inst.usable[i] * inst.opt_qps[o] * n
        if n > 0:
            used.add(r)
    for r in used:
        for i in members:
            if cap[i, r] <= 0:
                out.append(f"region {r} is used but member {i} has no replica there")
    if len(used) < inst.min_regions[b]:
        out.append(f"{len(used)} regions, min_regions {inst.min_regions[b]}")
    routes = [int(t) for t in inst.routes_of[b]]
    for t, v in res.f.items():
        if t not in routes:
            out.append(f"route {t} is not the block's")
        elif not -FEAS <= v <= 1 + FEAS:
            out.append(f"route {t}: fraction {v}")
    for s in {int(inst.route_s[t]) for t in routes}:
        total = sum(res.f.get(t, 0.0) for t in routes if inst.route_s[t] == s)
        if abs(total - 1) > FEAS:
            out.append(f"source {s} routes {total}")
    for i in members:
        for r in range(len(inst.regions)):
            load = sum(
                inst.demand[i, inst.route_s[t]] * res.f.get(t, 0.0) for t in routes if inst.route_r[t] == r
            )
            if load > cap[i, r] + FEAS * max(1.0, load):
                out.append(f"member {i} region {r}: load {load} over capacity {cap[i, r]}")
        if inst.survive[i]:
            total_cap = sum(cap[i, r] for r in range(len(inst.regions)))
            for lost in range(len(inst.regions)):
                need = inst.total_demand[i]
                if total_cap - cap[i, lost] < need - FEAS * max(1.0, need):
                    out.append(f"member {i} does not survive losing region {lost}")
    obj = 0.0
    for o, n in res.x.items():
        obj += (inst.opt_cost[o] + inst.opt_units[o] * prices[inst.opt_r[o], inst.opt_h[o]]) * n
        if churn > 0 and inst.problem.current is not None:
            obj += churn * inst.opt_units[o] * max(0.0, n - inst.opt_current[o])
    if abs(obj - res.objective) > 1e-9 * max(1.0, abs(obj)):
        out.append(f"objective {res.objective} is not the placement's cost {obj}")
    if res.bound > res.objective + 1e-9 * max(1.0, abs(res.objective)):
        out.append(f"bound {res.bound} above the objective {res.objective}")
    return out


def _mip_optimum(inst: Instance, b: int, prices: np.ndarray, churn: float) -> float | None:
    sol = solve_model(
        build(inst, [b], prices=prices, churn_cost=churn), work=20 * UNITS_PER_SECOND, relative_gap=1e-9
    )
    return sol.objective if sol.status == "optimal" else None


def _with_current(problem: PlanningProblem, rng: random.Random) -> PlanningProblem:
    """A current plan: the blocks' cheapest placements at zero prices, perturbed."""
    inst = compile_problem(problem)
    zero = np.zeros_like(inst.pool_units)
    placements: dict[str, DeploymentPlacement] = {}
    for b in range(len(inst.blocks)):
        res = solve_block_fast(inst, b, zero, 0.0)
        x = dict(res.x) if res is not None else {}
        for o in rng.sample(range(len(inst.opt_d)), k=len(inst.opt_d) // 20):
            if inst.block_of[inst.opt_d[o]] == b:
                x[o] = max(0, x.get(o, 0) + rng.choice([-2, -1, 1, 2]))
        for i in inst.blocks[b]:
            replicas: dict[str, dict[str, int]] = {}
            for o, n in x.items():
                if inst.opt_d[o] == i and n > 0:
                    region, hw = inst.regions[inst.opt_r[o]], inst.hardware[inst.opt_h[o]]
                    replicas.setdefault(region, {})[hw] = n
            placements[problem.deployments[i].name] = DeploymentPlacement(replicas=replicas, fractions={})
    current = Plan(deployments=placements, cost=0.0, solver="test")
    return problem.model_copy(update={"current": current})


CASES = [
    # (seed, deployments, regions, hardware, blocks checked, churn)
    (1, 40, 4, 2, 30, 0.0),
    (2, 40, 4, 2, 30, 0.3),
    (3, 24, 16, 4, 14, 0.0),
    (4, 24, 16, 4, 14, 0.2),
]


@pytest.mark.parametrize(("seed", "deployments", "regions", "hardware", "checked", "churn"), CASES)
def test_fast_block_optimum_matches_the_mip(
    seed: int, deployments: int, regions: int, hardware: int, checked: int, churn: float
) -> None:
    rng = random.Random(seed)
    problem = generate(seed, deployments, regions, hardware)
    if churn:
        problem = _with_current(problem, rng)
    inst = compile_problem(problem)
    np_rng = np.random.default_rng(seed)
    blocks = rng.sample(range(len(inst.blocks)), k=min(checked, len(inst.blocks)))
    unhandled = []
    for k, b in enumerate(blocks):
        # zero prices, or random ones on part of the pools
        prices = np.zeros_like(inst.pool_units)
        if k % 2:
            prices = np_rng.uniform(0, 2, prices.shape) * (np_rng.random(prices.shape) < 0.6)
        res = solve_block_fast(inst, b, prices, churn)
        if res is None:
            unhandled.append(b)
            continue
        assert _violations(inst, b, prices, churn, res) == [], f"block {b}"
        optimum = _mip_optimum(inst, b, prices, churn)
        if optimum is None:
            continue
        tol = REL * max(1.0, abs(optimum))
        if res.optimal:
            assert res.objective == pytest.approx(optimum, rel=REL, abs=REL), f"block {b}"
        else:
            assert res.bound <= optimum + tol and optimum <= res.objective + tol, f"block {b}"
    assert len(unhandled) <= len(blocks) // 10, f"blocks left to the MIP: {unhandled}"


def test_non_proportional_group_demand_is_left_to_the_mip() -> None:
    problem = generate(5, 30, 4, 2)
    groups: dict[str, list[int]] = {}
    for i, dep in enumerate(problem.deployments):
        if dep.group is not None:
            groups.setdefault(dep.group, []).append(i)
    members = next(m for m in groups.values() if len(m) > 1)
    deps = list(problem.deployments)
    first = deps[members[0]]
    skewed = {s: q * (2.0 if k == 0 else 1.0) for k, (s, q) in enumerate(first.demand_qps.items())}
    if len(skewed) == 1:  # one source: add a second so the shape differs
        skewed[next(r for r in problem.fleet.regions if r not in skewed)] = 5.0
    deps[members[0]] = first.model_copy(update={"demand_qps": skewed})
    inst = compile_problem(problem.model_copy(update={"deployments": deps}))
    b = int(inst.block_of[members[0]])
    assert solve_block_fast(inst, b, np.zeros_like(inst.pool_units), 0.0) is None


def test_every_block_of_a_small_fleet() -> None:
    """Every block of one fleet: exact where it says so, bracketing the optimum where its work
    budget ran out (most are exact)."""
    inst = compile_problem(generate(11, 30, 4, 2))
    prices = np.zeros_like(inst.pool_units)
    proven = 0
    for b in range(len(inst.blocks)):
        res = solve_block_fast(inst, b, prices, 0.0)
        assert res is not None, f"block {b}"
        assert _violations(inst, b, prices, 0.0, res) == []
        optimum = _mip_optimum(inst, b, prices, 0.0)
        assert optimum is not None
        if res.optimal:
            proven += 1
            assert res.objective == pytest.approx(optimum, rel=REL, abs=REL), f"block {b}"
        else:
            assert res.bound <= optimum * (1 + REL) + REL <= res.objective * (1 + REL) + 2 * REL, f"block {b}"
    assert proven >= 0.9 * len(inst.blocks)


def test_caps_give_the_optimum_within_a_residual_and_prove_when_nothing_fits() -> None:
    """Capped options (repair's room in each pool): for a block of one deployment the caps are
    the pool rows, so the capped optimum is the MIP's with those rows, and the search's proof
    that nothing fits agrees with the MIP's infeasibility."""
    inst = compile_problem(generate(7, 40, 4, 2, utilization=0.7))
    rng = np.random.default_rng(7)
    prices = np.zeros_like(inst.pool_units)
    singles = [b for b in range(len(inst.blocks)) if len(inst.blocks[b]) == 1]
    compared = proofs = 0
    for k, b in enumerate(singles[:24]):
        # Room for a random share of each pool; a third of the blocks get little room.
        room = inst.pool_units * rng.uniform(0.0, 0.05 if k % 3 == 0 else 0.4, inst.pool_units.shape)
        caps = {
            int(o): math.floor(room[inst.opt_r[o], inst.opt_h[o]] / inst.opt_units[o] + 1e-9)
            for o in inst.options_of[inst.blocks[b][0]]
        }
        res, none_fits = search_block(inst, b, prices, 0.0, caps=caps)
        model = build(inst, [b], prices=prices, pool_capacity=room)
        sol = solve_model(model, work=20 * UNITS_PER_SECOND, relative_gap=1e-9)
        if res is None:
            if none_fits:
                proofs += 1
                assert sol.status == "infeasible", f"block {b}: proof of no placement, MIP {sol.status}"
            continue
        assert not none_fits
        assert _violations(inst, b, prices, 0.0, res) == [], f"block {b}"
        assert all(n <= caps[o] for o, n in res.x.items()), f"block {b} over its caps"
        assert sol.status == "optimal", f"block {b}: a capped placement, MIP {sol.status}"
        compared += 1
        if res.optimal:
            assert res.objective == pytest.approx(sol.objective, rel=REL, abs=REL), f"block {b}"
        else:
            assert res.bound <= sol.objective * (1 + REL) + REL, f"block {b}"
    assert compared >= 8 and proofs >= 2, (compared, proofs)


# Pool prices from the second pricing round of family(308037416) (pools not named are 0). At
# them, block 73's array search grows a layer of 343,080 states: checked against its budget
# only after the layer, it charged 23M work units (1,150 times the block's budget of 20,000),
# which ended the whole planner's work limit on one block.
WIDE_LAYER_PRICES = {
    (0, 0): 0.06300000000000085,
    (0, 1): 0.1455000000000006,
    (0, 3): 0.05266082532504003,
    (1, 0): 0.08233030592734238,
    (1, 1): 0.059500000000000546,
    (1, 3): 0.1646170589228358,
    (2, 0): 0.0073303059273425245,
    (3, 0): 0.0753303059273428,
    (3, 1): 0.1204999999999997,
    (3, 2): 0.16149999999999964,
    (3, 3): 0.1669691588274695,
    (4, 1): 0.14000000000000207,
    (4, 2): 0.08293098900206396,
    (5, 1): 0.09550000000000028,
    (5, 2): 0.1099066663961164,
    (5, 3): 0.13996915882746874,
    (6, 0): 0.10533030592734328,
    (6, 3): 0.08614796773331235,
    (7, 2): 0.0028964835031025597,
}


def test_a_wide_layer_stops_at_the_budget_and_still_brackets_the_optimum() -> None:
    """The array search checks each layer's work before it does it: a block whose next layer
    would be far over the budget stops there, within its budget, with a bound and a
    placement that bracket the MIP optimum."""
    inst = compile_problem(family(308037416).problem)
    prices = np.zeros_like(inst.pool_units)
    for (r, h), p in WIDE_LAYER_PRICES.items():
        prices[r, h] = p
    res = solve_block_fast(inst, 73, prices, 0.0, budget=WORK_BUDGET)
    assert res is not None
    assert res.work <= WORK_BUDGET, res.work
    assert _violations(inst, 73, prices, 0.0, res) == []
    optimum = _mip_optimum(inst, 73, prices, 0.0)
    assert optimum is not None
    assert res.bound <= optimum * (1 + REL) + REL <= res.objective * (1 + REL) + 2 * REL
