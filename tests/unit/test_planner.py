"""The first-fit baseline planner and `check_plan`, the checker every planner answers to."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.contracts.plan import Plan, PlanningProblem, demand_from_model
from ipnext.errors import InfeasiblePlanError
from ipnext.planner import check_plan
from ipnext.planner.first_fit import solve  # the first-fit baseline; the global solver has its own tests
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import HardwareOption, ModelSpec
from ipnext.spec.reading import parse_spec
from tests.unit.helpers import fleet_dict, spec_dict

EMBED = "feed-ranker/embed"
DENSE = "feed-ranker/dense"


def example_problem(fleet: Fleet, **spec_changes: Any) -> PlanningProblem:
    data = spec_dict()
    for key, value in spec_changes.items():
        data[key] = value
    spec = parse_spec(ModelSpec, data)
    return PlanningProblem(fleet=fleet, deployments=demand_from_model(spec))


def with_placement(plan: Plan, name: str, **update: Any) -> Plan:
    placement = plan.deployments[name].model_copy(update=update)
    return plan.model_copy(update={"deployments": {**plan.deployments, name: placement}})


# --- demand -----------------------------------------------------------------------------------


def test_demand_from_model(example_spec: ModelSpec) -> None:
    demand = {d.name: d for d in demand_from_model(example_spec)}
    assert sorted(demand) == [DENSE, EMBED]
    embed = demand[EMBED]
    assert embed.group == "feed-ranker"
    assert embed.demand_qps == {"us-east": 60, "eu-west": 30}
    assert embed.latency_budget_ms == 50
    assert embed.headroom == 0.2
    assert embed.min_regions == 1
    assert embed.survive_region_loss is False
    assert list(embed.hardware) == ["cpu-highmem"]
    assert list(demand[DENSE].hardware) == ["cpu-std"]


# --- solve on the dev fleet -------------------------------------------------------------------


def test_example_plan_is_valid(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet)
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    assert sorted(plan.deployments) == [DENSE, EMBED]
    assert plan.solver == "first-fit"
    assert plan.revision == 1
    assert plan.moved_units == 0
    # Each source is served in its own region (1 ms), each needs one replica.
    embed = plan.deployments[EMBED]
    assert embed.fractions == {"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 1.0}}
    assert embed.replicas == {"us-east": {"cpu-highmem": 1}, "eu-west": {"cpu-highmem": 1}}
    assert plan.deployments[DENSE].replicas == {"us-east": {"cpu-std": 1}, "eu-west": {"cpu-std": 1}}
    assert embed.serving_region("us-east") == "us-east"
    assert embed.serving_region("ap-south") is None
    # embed: 2 units x (1.6 + 1.7); dense: 1 unit x (1.0 + 1.1)
    assert plan.cost == pytest.approx(2 * 1.6 + 2 * 1.7 + 1.0 + 1.1)


def test_parts_of_a_model_share_regions_and_fractions(dev_fleet: Fleet) -> None:
    plan = solve(example_problem(dev_fleet))
    embed, dense = plan.deployments[EMBED], plan.deployments[DENSE]
    assert embed.regions() == dense.regions() == ["eu-west", "us-east"]
    assert embed.fractions == dense.fractions


def test_group_shares_routing_when_only_one_part_could_go_far(dev_fleet: Fleet) -> None:
    # Only us-east hosts cpu-highmem: the whole group must follow the embed part there.
    data = fleet_dict()
    data["pools"] = [p for p in data["pools"] if (p["region"], p["hardware"]) != ("eu-west", "cpu-highmem")]
    fleet = parse_spec(Fleet, data)
    problem = example_problem(fleet)
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    for name in (EMBED, DENSE):
        assert plan.deployments[name].fractions == {"us-east": {"us-east": 1.0}, "eu-west": {"us-east": 1.0}}
        assert plan.deployments[name].regions() == ["us-east"]


def test_survive_region_loss_uses_two_regions(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"] = {"us-east": 500}
    data["availability"]["survive_region_loss"] = True
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    for name in (EMBED, DENSE):
        assert len(plan.deployments[name].regions()) >= 2
    # Either region alone carries all 500 QPS at 80 %: embed 320/replica -> 2 per region.
    assert plan.deployments[EMBED].replicas == {"us-east": {"cpu-highmem": 2}, "eu-west": {"cpu-highmem": 2}}


def test_survive_region_loss_on_the_example(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["availability"]["survive_region_loss"] = True
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    assert all(len(plan.deployments[n].regions()) >= 2 for n in (EMBED, DENSE))


def test_min_regions_adds_a_region(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"] = {"eu-west": 10}
    data["availability"]["min_regions"] = 2
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    assert plan.deployments[EMBED].regions() == ["eu-west", "us-east"]


def test_impossible_latency_budget_is_infeasible(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet, latency_budget_ms=0.5)
    with pytest.raises(InfeasiblePlanError) as info:
        solve(problem)
    assert info.value.field == "latency_budget_ms"
    assert info.value.value == 0.5
    assert "latency_budget_ms=0.5" in str(info.value)


def test_full_pool_is_placed_around_and_no_room_anywhere_is_infeasible(dev_fleet: Fleet) -> None:
    data = fleet_dict()
    for pool in data["pools"]:
        if (pool["region"], pool["hardware"]) == ("us-east", "cpu-highmem"):
            pool["units"] = 1  # embed needs 2 units per replica
    fleet = parse_spec(Fleet, data)
    problem = example_problem(fleet)
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    assert plan.deployments[EMBED].regions() == ["eu-west"]  # us-east traffic goes 40 ms to eu-west
    for pool in data["pools"]:
        if pool["hardware"] == "cpu-highmem":
            pool["units"] = 1
    with pytest.raises(InfeasiblePlanError) as info:
        solve(example_problem(parse_spec(Fleet, data)))
    assert info.value.field == "pools"
    assert EMBED in str(info.value) and "no room" in str(info.value)


def test_pool_shared_by_two_models_runs_out(dev_fleet: Fleet) -> None:
    # 8 highmem units per region; each model's embed takes 2 per replica, so the 5th model fails.
    deployments = []
    for i in range(5):
        data = spec_dict()
        data["name"] = f"m{i}"
        deployments += demand_from_model(parse_spec(ModelSpec, data))
    with pytest.raises(InfeasiblePlanError) as info:
        solve(PlanningProblem(fleet=dev_fleet, deployments=deployments))
    assert "m4/embed" in str(info.value)
    assert (info.value.field or "").startswith("pools")
    # Four fit exactly.
    problem = PlanningProblem(fleet=dev_fleet, deployments=deployments[:8])
    assert check_plan(problem, solve(problem)) == []


def test_min_regions_beyond_the_fleet_is_infeasible(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["availability"]["min_regions"] = 3
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    with pytest.raises(InfeasiblePlanError) as info:
        solve(problem)
    assert info.value.field == "min_regions"
    assert info.value.value == 3


def test_moved_units_against_the_current_plan(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet)
    plan = solve(problem)
    again = solve(problem.model_copy(update={"current": plan}))
    assert again.moved_units == 0
    assert again.revision == plan.revision + 1
    assert again.deployments == plan.deployments

    # The current plan had no embed replica in us-east: the new one moves 1 x 2 units.
    smaller = with_placement(
        plan, EMBED, replicas={"us-east": {"cpu-highmem": 0}, "eu-west": {"cpu-highmem": 1}}
    )
    moved = solve(problem.model_copy(update={"current": smaller}))
    assert moved.moved_units == 2

    # Nothing placed before: every unit moves (embed 2 x 2, dense 1 x 2).
    empty = plan.model_copy(update={"deployments": {}})
    assert solve(problem.model_copy(update={"current": empty})).moved_units == 6


# --- check_plan catches violations -----------------------------------------------------------


def test_check_plan_catches_a_missing_replica(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet)
    plan = solve(problem)
    broken = with_placement(
        plan, EMBED, replicas={"us-east": {"cpu-highmem": 0}, "eu-west": {"cpu-highmem": 1}}
    )
    errors = check_plan(problem, broken)
    assert f"{EMBED}: us-east gets 60.0 QPS, carries 0.0" in errors
    assert any(e.startswith("group feed-ranker:") and EMBED in e for e in errors)


def test_check_plan_catches_a_partial_fraction(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet)
    plan = solve(problem)
    broken = with_placement(plan, DENSE, fractions={"us-east": {"us-east": 0.5}, "eu-west": {"eu-west": 1.0}})
    errors = check_plan(problem, broken)
    assert f"{DENSE}: fractions of us-east sum to 0.5" in errors
    assert any(e.startswith("group feed-ranker:") for e in errors)


def test_check_plan_catches_routing_beyond_the_budget(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet, latency_budget_ms=20)
    plan = solve(problem)
    far = {"us-east": {"eu-west": 1.0}, "eu-west": {"eu-west": 1.0}}
    broken = with_placement(with_placement(plan, EMBED, fractions=far), DENSE, fractions=far)
    errors = check_plan(problem, broken)
    assert f"{EMBED}: us-east->eu-west exceeds the latency budget" in errors
    assert f"{DENSE}: us-east->eu-west exceeds the latency budget" in errors


def test_check_plan_catches_an_overfull_pool_and_wrong_hardware(dev_fleet: Fleet) -> None:
    problem = example_problem(dev_fleet)
    plan = solve(problem)
    broken = with_placement(plan, EMBED, replicas={"us-east": {"cpu-highmem": 5}, "eu-west": {"cpu-std": 1}})
    errors = check_plan(problem, broken)
    assert "pool us-east/cpu-highmem: 10 units used of 8" in errors
    assert f"{EMBED}: replicas on cpu-std, which it cannot run on" in errors


def test_check_plan_catches_a_missing_deployment_and_min_regions(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["availability"]["min_regions"] = 2
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    plan = solve(problem)
    assert check_plan(problem, plan) == []
    one_region = with_placement(
        plan, DENSE, replicas={"us-east": {"cpu-std": 1}}, fractions=plan.deployments[DENSE].fractions
    )
    assert f"{DENSE}: 1 regions < min_regions 2" in check_plan(problem, one_region)
    missing = plan.model_copy(update={"deployments": {EMBED: plan.deployments[EMBED]}})
    assert f"{DENSE}: not in the plan" in check_plan(problem, missing)


def test_check_plan_catches_a_plan_that_cannot_lose_a_region(dev_fleet: Fleet) -> None:
    data = spec_dict()
    data["traffic"]["peak_qps"] = {"us-east": 500}
    data["availability"]["survive_region_loss"] = True
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(parse_spec(ModelSpec, data)))
    plan = solve(problem)
    thin = with_placement(
        plan, EMBED, replicas={"us-east": {"cpu-highmem": 2}, "eu-west": {"cpu-highmem": 1}}
    )
    assert f"{EMBED}: losing us-east leaves 320.0 < 500.0 QPS" in check_plan(problem, thin)


# --- property: solve is either infeasible or valid --------------------------------------------


@st.composite
def problems(draw: st.DrawFn) -> PlanningProblem:
    regions = [f"r{i}" for i in range(draw(st.integers(2, 4)))]
    hardware = [f"h{i}" for i in range(draw(st.integers(1, 3)))]
    cells = [(r, h) for r in regions for h in hardware]
    chosen = draw(st.lists(st.sampled_from(cells), min_size=1, max_size=len(cells), unique=True))
    pools = [
        {
            "region": r,
            "hardware": h,
            "units": draw(st.integers(1, 40)),
            "unit_cost": draw(st.floats(0, 5, allow_nan=False)),
        }
        for r, h in chosen
    ]
    latency: dict[str, dict[str, float]] = {}
    for source in regions:
        row = {}
        for target in regions:
            if draw(st.booleans()) or source == target:
                row[target] = draw(st.floats(0, 120, allow_nan=False))
        latency[source] = row
    fleet = parse_spec(
        Fleet,
        {
            "regions": regions,
            "hardware": {h: {"kind": draw(st.sampled_from(["cpu", "gpu"]))} for h in hardware},
            "pools": pools,
            "latency_ms": latency,
        },
    )
    deployments = []
    for i in range(draw(st.integers(1, 4))):
        options = draw(st.lists(st.sampled_from(hardware), min_size=1, unique=True))
        sources = draw(st.lists(st.sampled_from(regions), min_size=1, unique=True))
        deployments.append(
            DeploymentDemand(
                name=f"d{i}",
                hardware={
                    h: HardwareOption(units=draw(st.integers(1, 4)), qps=draw(st.floats(1, 500)))
                    for h in options
                },
                demand_qps={s: draw(st.one_of(st.just(0.0), st.floats(0.1, 1500))) for s in sources},
                latency_budget_ms=draw(st.floats(0.5, 150)),
                headroom=draw(st.floats(0, 0.9)),
                min_regions=draw(st.integers(1, 3)),
                survive_region_loss=draw(st.booleans()),
                group=draw(st.sampled_from([None, "g0", "g1"])),
            )
        )
    return PlanningProblem(fleet=fleet, deployments=deployments)


@settings(deadline=None, derandomize=True, max_examples=60)
@given(problems())
def test_solve_is_infeasible_or_valid(problem: PlanningProblem) -> None:
    try:
        plan = solve(problem)
    except InfeasiblePlanError as err:
        assert err.field
        return
    assert check_plan(problem, plan) == []
    assert sorted(plan.deployments) == sorted(d.name for d in problem.deployments)


def test_property_examples_include_feasible_plans() -> None:
    """Guard for the property test: its generator must not only produce infeasible problems."""
    feasible = 0

    @settings(deadline=None, derandomize=True, max_examples=60)
    @given(problems())
    def count(problem: PlanningProblem) -> None:
        nonlocal feasible
        try:
            solve(problem)
        except InfeasiblePlanError:
            return
        feasible += 1

    count()
    assert feasible >= 5
