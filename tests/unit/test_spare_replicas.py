"""A spare replica per part and region (`availability.spare_replicas`): carried from the model
spec into the demand, placed and priced by every solver path (the exact MIP, the scalable path,
first-fit), held to by `check_plan`, and spare 0 leaves every plan as it was."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ipnext.contracts.plan import DeploymentPlacement, Plan, PlanningProblem, demand_from_model
from ipnext.errors import InfeasiblePlanError, NoPlacementError, SpecError
from ipnext.planner import check_plan, first_fit, solve
from ipnext.planner.backend import solve_model
from ipnext.planner.block import solve_block_fast
from ipnext.planner.formulation import build
from ipnext.planner.generator import generate
from ipnext.planner.instance import Instance, compile_problem
from ipnext.planner.pricing import choices_from_values, rounded_up
from ipnext.planner.solve import Candidate, _plan
from ipnext.planner.work import UNITS_PER_SECOND, Budget
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet, HardwareClass, Pool
from ipnext.spec.model import AvailabilitySpec, HardwareOption, ModelSpec, check_against_fleet
from ipnext.spec.reading import parse_spec
from tests.unit.exact_mip import exact_optimum
from tests.unit.helpers import spec_dict, work_options

TOL = 1e-6
EXACT = work_options(5, workers=1)
SCALABLE = work_options(5, exact_fallback=False, workers=1)
CPU = HardwareOption(units=1, qps=100)  # 80 QPS under the default headroom (0.2)


def _fleet(units: dict[str, int] | None = None, gpu: bool = False) -> Fleet:
    """Regions a and b, 30 ms apart (c far from both, no pools), a cpu pool in each (a
    cheaper), and with `gpu` a gpu pool in a."""
    units = units or {"a": 8, "b": 8}
    pools = [
        Pool(region=r, hardware="cpu", units=n, unit_cost=1.0 if r == "a" else 1.2) for r, n in units.items()
    ]
    if gpu:
        pools.append(Pool(region="a", hardware="gpu", units=16, unit_cost=1.0))
    return Fleet(
        regions=["a", "b", "c"],
        hardware={"cpu": HardwareClass(kind="cpu"), "gpu": HardwareClass(kind="gpu")},
        pools=pools,
        latency_ms={
            "a": {"a": 1, "b": 30, "c": 200},
            "b": {"a": 30, "b": 1, "c": 200},
            "c": {"a": 200, "b": 200, "c": 1},
        },
    )


def _dep(name: str = "m/p", spare: int = 1, **changes: object) -> DeploymentDemand:
    """Load that one cpu replica carries in each of a and b (60 and 50 QPS of its 80), served
    where it comes from (10 ms budget)."""
    data: dict[str, object] = {
        "name": name,
        "hardware": {"cpu": CPU},
        "demand_qps": {"a": 60, "b": 50},
        "latency_budget_ms": 10,
        "spare_replicas": spare,
    }
    data.update(changes)
    return DeploymentDemand.model_validate(data)


def _units(problem: PlanningProblem, plan: Plan) -> dict[tuple[str, str], int]:
    used: dict[tuple[str, str], int] = {}
    for dep in problem.deployments:
        for region, by_hw in plan.deployments[dep.name].replicas.items():
            for hw, n in by_hw.items():
                used[region, hw] = used.get((region, hw), 0) + n * dep.hardware[hw].units
    return used


# --- the spec carries it ------------------------------------------------------------------------


def test_the_spec_field_defaults_to_zero_is_bounded_and_reaches_the_demand() -> None:
    assert AvailabilitySpec().spare_replicas == 0
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="spare_replicas"):
            AvailabilitySpec(spare_replicas=bad)
    data = spec_dict()
    data["availability"]["spare_replicas"] = 2
    demand = demand_from_model(parse_spec(ModelSpec, data))
    assert {d.spare_replicas for d in demand} == {2}
    assert {d.spare_replicas for d in demand_from_model(parse_spec(ModelSpec, spec_dict()))} == {0}


def test_what_the_whole_fleet_serves_counts_the_spare(dev_fleet: Fleet) -> None:
    # embed: 4 replicas of 400 QPS per region, one of them the spare: 2 x 1200 x 0.8 = 1920.
    data = spec_dict()
    data["availability"]["spare_replicas"] = 1
    data["traffic"]["peak_qps"] = {"us-east": 1920}
    check_against_fleet(parse_spec(ModelSpec, data), dev_fleet)
    data["traffic"]["peak_qps"] = {"us-east": 1921}
    with pytest.raises(SpecError) as info:
        check_against_fleet(parse_spec(ModelSpec, data), dev_fleet)
    assert "part embed serves at most 1920 qps" in str(info.value)
    assert "availability.spare_replicas 1 in each region" in str(info.value)
    assert "lower availability.spare_replicas" in str(info.value)


# --- every solver path places and prices it -----------------------------------------------------


@pytest.mark.parametrize("path", ["exact", "scalable", "first-fit"])
def test_each_region_with_replicas_holds_its_load_and_a_spare(path: str) -> None:
    alone = PlanningProblem(fleet=_fleet(), deployments=[_dep(spare=0)])
    spared = PlanningProblem(fleet=_fleet(), deployments=[_dep(spare=1)])

    def planned(problem: PlanningProblem) -> Plan:
        if path == "first-fit":
            return first_fit.solve(problem)
        return solve(problem, EXACT if path == "exact" else SCALABLE)

    without, plan = planned(alone), planned(spared)
    assert check_plan(spared, plan) == []
    assert without.deployments["m/p"].replicas == {"a": {"cpu": 1}, "b": {"cpu": 1}}
    # One hardware option: a second replica in each region, in the pools and in the cost.
    assert plan.deployments["m/p"].replicas == {"a": {"cpu": 2}, "b": {"cpu": 2}}
    assert _units(spared, plan) == {("a", "cpu"): 2, ("b", "cpu"): 2}
    assert plan.cost == pytest.approx(2 * 1.0 + 2 * 1.2) and without.cost == pytest.approx(1.0 + 1.2)
    if path != "first-fit":
        assert plan.status == "optimal" and plan.objective == pytest.approx(exact_optimum(spared), rel=TOL)


def test_the_spare_is_one_replica_of_the_largest_option_the_region_offers() -> None:
    # In a, a gpu replica (4 units, 1000 QPS) is the largest: a holds back 1000 QPS, whatever it
    # places; a gpu and a cpu replica cost 5, eleven cpu replicas (1,075 QPS needed) 11.
    gpu = HardwareOption(units=4, qps=1000)
    problem = PlanningProblem(fleet=_fleet(gpu=True), deployments=[_dep(hardware={"cpu": CPU, "gpu": gpu})])
    plan = solve(problem, EXACT)
    assert check_plan(problem, plan) == []
    a = plan.deployments["m/p"].replicas["a"]
    capacity = sum(n * {"cpu": 100, "gpu": 1000}[hw] for hw, n in a.items())
    assert 0.8 * (capacity - 1000) >= 60 - TOL
    assert plan.objective == pytest.approx(exact_optimum(problem), rel=TOL)
    assert plan.objective == pytest.approx(solve(problem, SCALABLE).objective, rel=TOL)


# --- a pool that cannot hold the spare ----------------------------------------------------------


def test_a_deployment_no_pool_can_hold_with_its_spare_is_refused_naming_the_spare() -> None:
    # a's pool holds one replica: it carries nothing beside a spare, and b is 30 ms away.
    problem = PlanningProblem(fleet=_fleet({"a": 1}), deployments=[_dep(demand_qps={"a": 60})])
    with pytest.raises(InfeasiblePlanError) as info:
        solve(problem, EXACT)
    assert info.value.field == "spare_replicas" and info.value.value == 1
    assert "m/p: with spare_replicas=1" in str(info.value) and "lower spare_replicas" in str(info.value)


@pytest.mark.parametrize("options", [EXACT, SCALABLE], ids=["exact", "scalable"])
def test_a_spare_the_shared_pool_cannot_hold_makes_the_plan_infeasible_and_says_so(options: object) -> None:
    # a's pool has 2 units: m/one takes 1, m/two needs 2 with its spare.
    fleet = _fleet({"a": 2, "b": 8})
    problem = PlanningProblem(
        fleet=fleet,
        deployments=[_dep("m/one", spare=0, demand_qps={"a": 60}), _dep("m/two", demand_qps={"a": 60})],
    )
    with pytest.raises(NoPlacementError) as info:
        solve(problem, options)  # type: ignore[arg-type]
    message = str(info.value)
    assert "spare_replicas counted for m/two" in message and "a/cpu by 1 units" in message, message
    assert "lower their spare_replicas" in message, message
    fits = problem.model_copy(
        update={"deployments": [problem.deployments[0], _dep("m/two", spare=0, demand_qps={"a": 60})]}
    )
    assert check_plan(fits, solve(fits, options)) == []  # type: ignore[arg-type]


# --- the validator ------------------------------------------------------------------------------


def _by_hand(problem: PlanningProblem, name: str, replicas: dict[str, dict[str, int]]) -> Plan:
    dep = next(d for d in problem.deployments if d.name == name)
    fractions = {s: {s: 1.0} for s in dep.demand_qps}
    placement = DeploymentPlacement(replicas=replicas, fractions=fractions)
    return Plan(deployments={name: placement}, cost=0.0, solver="by hand")


def test_check_plan_refuses_a_plan_without_the_spare() -> None:
    problem = PlanningProblem(fleet=_fleet(), deployments=[_dep()])
    thin = _by_hand(problem, "m/p", {"a": {"cpu": 1}, "b": {"cpu": 2}})
    assert check_plan(problem, thin) == [
        "m/p: a gets 60.0 QPS, carries 0.0 once it loses its 1 largest replica(s) (spare_replicas 1); "
        "fix: add replicas in a until losing any 1 leaves 75.0 QPS of replicas, or route less there"
    ]
    assert check_plan(problem, _by_hand(problem, "m/p", {"a": {"cpu": 2}, "b": {"cpu": 2}})) == []
    # Without a spare the same thin plan is valid.
    assert check_plan(PlanningProblem(fleet=_fleet(), deployments=[_dep(spare=0)]), thin) == []


def test_check_plan_takes_the_largest_replicas_off() -> None:
    # a: one gpu (1000 QPS) and two cpu replicas (100 each): losing the gpu leaves 200 x 0.8 = 160.
    gpu = HardwareOption(units=4, qps=1000)
    mixed = {"a": {"gpu": 1, "cpu": 2}, "b": {"cpu": 2}}
    for load, spare, errors in [(160, 1, 0), (161, 1, 1), (80, 2, 0), (81, 2, 1)]:
        dep = _dep(spare=spare, hardware={"cpu": CPU, "gpu": gpu}, demand_qps={"a": load, "b": 50})
        if spare == 2:
            mixed["b"] = {"cpu": 3}
        problem = PlanningProblem(fleet=_fleet(gpu=True), deployments=[dep])
        found = check_plan(problem, _by_hand(problem, "m/p", mixed))
        assert len(found) == errors and all("m/p: a gets" in e for e in found), (load, spare, found)


# --- spare 0 changes nothing --------------------------------------------------------------------


def test_spare_zero_changes_no_plan() -> None:
    """The instance's optimum as the planner found it before spare_replicas existed (92.779,
    the oracle's too), by both paths, and the same plan with every spare written out as 0."""
    problem = generate(7, 12, 3, 2)
    zeros = problem.model_copy(
        update={"deployments": [d.model_copy(update={"spare_replicas": 0}) for d in problem.deployments]}
    )
    for options in (EXACT, SCALABLE):
        plan, again = solve(problem, options), solve(zeros, options)
        assert plan.objective == pytest.approx(92.779, abs=1e-6)
        assert again.deployments == plan.deployments and again.objective == plan.objective
    assert exact_optimum(problem) == pytest.approx(92.779, rel=TOL)


# --- the block solver and the LP rounding -------------------------------------------------------


def _with_spares(seed: int, deployments: int, regions: int, hardware: int, loose: int) -> Instance:
    """A generated instance with a spare of 1 or 2 on most deployments and its pools `loose`
    times larger (the generator sized them for no spare)."""
    rng = random.Random(seed)
    problem = generate(seed, deployments, regions, hardware)
    deps = [
        d.model_copy(update={"spare_replicas": rng.choice([1, 2])}) if rng.random() < 0.7 else d
        for d in problem.deployments
    ]
    pools = [p.model_copy(update={"units": p.units * loose}) for p in problem.fleet.pools]
    fleet = problem.fleet.model_copy(update={"pools": pools})
    return compile_problem(problem.model_copy(update={"deployments": deps, "fleet": fleet}))


@pytest.mark.parametrize(
    ("seed", "deployments", "regions", "hardware"), [(1, 30, 4, 2), (3, 16, 8, 3), (5, 24, 4, 3)]
)
def test_the_fast_block_solver_meets_the_spare_at_the_mip_optimum(
    seed: int, deployments: int, regions: int, hardware: int
) -> None:
    """Blocks with spares (some with survive_region_loss, groups, several options), at zero and
    random prices: the fast solver's placement holds every spare and, where it claims the
    optimum, costs what the MIP's does."""
    inst = _with_spares(seed, deployments, regions, hardware, loose=20)
    rng = np.random.default_rng(seed)
    survive_spared = 0
    for b in range(len(inst.blocks)):
        prices = (
            rng.uniform(0, 2, inst.pool_units.shape) * (rng.random(inst.pool_units.shape) < 0.6)
            if b % 2
            else np.zeros_like(inst.pool_units)
        )
        res = solve_block_fast(inst, b, prices, 0.0)
        assert res is not None, f"block {b}"
        survive_spared += any(inst.survive[i] and inst.spare[i].any() for i in inst.blocks[b])
        capacity: dict[tuple[int, int], float] = {}
        for o, n in res.x.items():
            key = (int(inst.opt_d[o]), int(inst.opt_r[o]))
            capacity[key] = capacity.get(key, 0.0) + float(inst.usable[key[0]] * inst.opt_qps[o] * n)
        for (i, r), held in capacity.items():
            routes = [int(t) for t in inst.routes_of[b] if inst.route_r[t] == r]
            load = sum(inst.demand[i, inst.route_s[t]] * res.f.get(t, 0.0) for t in routes)
            assert load <= held - inst.spare[i, r] + 1e-7 * max(1.0, load), (
                f"block {b}: deployment {i} in {r}"
            )
        sol = solve_model(build(inst, [b], prices=prices), work=20 * UNITS_PER_SECOND, relative_gap=1e-9)
        assert sol.status == "optimal"
        if res.optimal:
            assert res.objective == pytest.approx(sol.objective, rel=TOL, abs=TOL), f"block {b}"
        else:
            assert (
                res.bound
                <= sol.objective + TOL * max(1, sol.objective)
                <= res.objective + 2 * TOL * max(1, sol.objective)
            )
    assert survive_spared > 0  # the survive members' levels, whole in the sums, net in routing, were searched


def test_the_lp_rounded_up_adds_the_spares_a_fractional_region_left_out() -> None:
    """Where the LP stands a block in a region fractionally it holds that fraction of the spare;
    rounding up stands it there whole, so `rounded_up` adds what the spare asks."""
    inst = _with_spares(3, 12, 3, 2, loose=50)
    blocks = list(range(len(inst.blocks)))
    model = build(inst, blocks, pool_capacity=inst.pool_units)
    sol = solve_model(model, relax=True, solver="glop", work=10 * UNITS_PER_SECOND)
    assert sol.values is not None
    ceiled = sol.values.copy()
    ceiled[: model.n_x] = np.ceil(ceiled[: model.n_x] - 1e-6)

    def as_plan(values: np.ndarray) -> Plan:
        choices = choices_from_values(inst, model, values, 0.0, blocks)
        return _plan(
            inst, Candidate(choices, 0.0, "test", "ipnext-lagrangian"), 0.0, time.monotonic(), Budget(1)
        )

    assert any("spare_replicas" in e for e in check_plan(inst.problem, as_plan(ceiled)))
    assert check_plan(inst.problem, as_plan(rounded_up(inst, model, sol.values))) == []


# --- property: every plan holds the spare, at the optimum of the spare rule ---------------------


@st.composite
def spared_problems(draw: st.DrawFn) -> PlanningProblem:
    problem = generate(
        draw(st.integers(0, 10_000)),
        draw(st.integers(1, 3)),
        draw(st.integers(2, 3)),
        draw(st.integers(1, 2)),
        utilization=draw(st.sampled_from([0.2, 0.4])),  # room for spares the generator did not size for
    )
    spares = draw(
        st.lists(st.integers(0, 2), min_size=len(problem.deployments), max_size=len(problem.deployments))
    )
    deps = [
        d.model_copy(update={"spare_replicas": k}) for d, k in zip(problem.deployments, spares, strict=True)
    ]
    return problem.model_copy(update={"deployments": deps})


@settings(deadline=None, derandomize=True, max_examples=20, suppress_health_check=[HealthCheck.too_slow])
@given(problem=spared_problems())
def test_every_plan_holds_the_spare_and_costs_the_optimum(problem: PlanningProblem) -> None:
    optimum = exact_optimum(problem)
    try:
        plan = solve(problem, SCALABLE)
    except InfeasiblePlanError:
        assert optimum is None, "the planner gave up on a feasible instance"
        return
    assert optimum is not None, "the planner returned a plan for an infeasible instance"
    assert check_plan(problem, plan) == []
    assert plan.objective == pytest.approx(optimum, rel=TOL)
