"""Autoscaling inside the plan's envelope, pure: each deployment's floor is its plan's replicas
(a rollout step's share of them), its ceiling its share of the pool's unallocated units, and no
pool's ceilings ever sum past its units; routers weigh deployments by the replicas that run; a
first placement is solved against what other models' plans leave."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.activities.plan import residual_fleet
from ipnext.contracts.plan import Plan, PlanningProblem, demand_from_model
from ipnext.errors import InfeasiblePlanError
from ipnext.planner import solve
from ipnext.policy.rollout_steps import RolloutStep, new_set_scales, old_set_scales
from ipnext.serving.layout import (
    PoolEnvelope,
    SetDescription,
    SetIngressConfig,
    burst_bounds,
    plan_bounds,
    pool_usage,
    render_set_app,
    running_replicas,
    set_app_plan,
)
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSet
from ipnext.spec.settings import AutoscalingSettings

PINNED = "/srv/ipnext/pinned"
DEV_POOLS = {"us-east": {"cpu-std": 16, "cpu-highmem": 8}, "eu-west": {"cpu-std": 16, "cpu-highmem": 8}}


def snapshot_set(model: str, number: int) -> SnapshotSet:
    return SnapshotSet(
        id=f"{model}@{number}",
        number=number,
        version=f"v{number}",
        parts={
            part: SnapshotRef(
                uri=f"file:///srv/snapshots/{model}/{part}.safetensors",
                sha256="a" * 64,
                snapshot_id=f"{model}/{part}@v{number}",
            )
            for part in ("embed", "dense")
        },
        status="validated",
        published_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


def model(spec: ModelSpec, name: str) -> ModelSpec:
    return spec.model_copy(update={"name": name})


def with_replicas(plan: Plan, spec: ModelSpec, replicas: dict[str, dict[str, dict[str, int]]]) -> Plan:
    """`plan` with the given part -> region -> hardware -> replicas."""
    deployments = dict(plan.deployments)
    for part, by_region in replicas.items():
        name = f"{spec.name}/{part}"
        deployments[name] = deployments[name].model_copy(update={"replicas": by_region})
    return plan.model_copy(update={"deployments": deployments})


def rendered(spec: ModelSpec, plan: Plan, number: int = 1, scale: float = 1.0, **kw: Any) -> dict[str, Any]:
    app = set_app_plan(spec, snapshot_set(spec.name, number), plan, "us-east", PINNED, scale)
    return render_set_app(app, 0, autoscaling=AutoscalingSettings(**kw))


def bounds(app: dict[str, Any]) -> dict[str, tuple[int, int]]:
    return {
        d["name"]: (d["autoscaling_config"]["min_replicas"], d["autoscaling_config"]["max_replicas"])
        for d in app["deployments"]
        if "autoscaling_config" in d
    }


@pytest.fixture(scope="module")
def plan(example_spec: ModelSpec, dev_fleet: Fleet) -> Plan:
    base = solve(PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(example_spec)))
    return with_replicas(
        base,
        example_spec,
        {"embed": {"us-east": {"cpu-highmem": 2}}, "dense": {"us-east": {"cpu-std": 4}}},
    )


def test_the_delays_and_look_back_are_settings(example_spec: ModelSpec, plan: Plan) -> None:
    app = rendered(example_spec, plan, upscale_delay_s=1, downscale_delay_s=3, look_back_period_s=2)
    scaling = next(d["autoscaling_config"] for d in app["deployments"] if d["name"] == "dense-cpu-std")
    assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"], scaling["look_back_period_s"]) == (
        1,
        3,
        2,
    )
    assert "num_replicas" not in next(d for d in app["deployments"] if d["name"] == "dense-cpu-std")


def test_one_model_bursts_into_its_pools_unallocated_units(example_spec: ModelSpec, plan: Plan) -> None:
    app = rendered(example_spec, plan)
    assert bounds(app) == {"embed-cpu-highmem": (2, 2), "dense-cpu-std": (4, 4)}  # the plan's bounds
    envelope = PoolEnvelope(pools=DEV_POOLS, burst=1.0)
    bounded = burst_bounds({app["name"]: app}, envelope)[app["name"]]
    # embed: 2 replicas x 2 units of 8 -> 4 units free -> 2 more; dense: 4 x 1 of 16 -> 12 more.
    assert bounds(bounded) == {"embed-cpu-highmem": (2, 4), "dense-cpu-std": (4, 16)}
    half = burst_bounds({app["name"]: app}, envelope.model_copy(update={"burst": 0.5}))[app["name"]]
    assert bounds(half) == {"embed-cpu-highmem": (2, 3), "dense-cpu-std": (4, 10)}
    none = burst_bounds({app["name"]: app}, envelope.model_copy(update={"burst": 0.0}))[app["name"]]
    assert bounds(none) == bounds(app)
    # A writer with no envelope yet (restarted) keeps every deployment at its floor.
    assert bounds(burst_bounds({app["name"]: app}, None)[app["name"]]) == bounds(app)
    # What the writer adopts from Serve reads back as the record renders it.
    assert plan_bounds(bounded) == app
    assert app == rendered(example_spec, plan)  # burst_bounds copies; the input is unchanged


def for_model(
    spec: ModelSpec, plan: Plan, name: str, replicas: dict[str, dict[str, dict[str, int]]]
) -> tuple[ModelSpec, Plan]:
    """`spec` and `plan` as model `name`'s, with the given part -> region -> hw -> replicas."""
    renamed = model(spec, name)
    deployments = {f"{name}/{key.split('/', 1)[1]}": d for key, d in plan.deployments.items()}
    return renamed, with_replicas(plan.model_copy(update={"deployments": deployments}), renamed, replicas)


def test_two_models_share_a_pools_burst_by_their_floors(example_spec: ModelSpec, plan: Plan) -> None:
    a = rendered(*for_model(example_spec, plan, "alpha", {}))
    b = rendered(
        *for_model(
            example_spec,
            plan,
            "beta",
            {"embed": {"us-east": {"cpu-highmem": 1}}, "dense": {"us-east": {"cpu-std": 8}}},
        )
    )
    apps = {a["name"]: a, b["name"]: b}
    assert pool_usage(apps) == {("us-east", "cpu-highmem"): 6, ("us-east", "cpu-std"): 12}
    assert pool_usage(apps, skip_model="alpha") == {("us-east", "cpu-highmem"): 2, ("us-east", "cpu-std"): 8}
    bounded = burst_bounds(apps, PoolEnvelope(pools=DEV_POOLS))
    # cpu-std: floors 4 + 8 of 16 -> 4 free, a third and two thirds; cpu-highmem: 2 free units,
    # alpha's 4 of 6 floor units -> 1.33 units, under one 2-unit replica; beta's 0.67 neither.
    assert bounds(bounded[a["name"]]) == {"embed-cpu-highmem": (2, 2), "dense-cpu-std": (4, 5)}
    assert bounds(bounded[b["name"]]) == {"embed-cpu-highmem": (1, 1), "dense-cpu-std": (8, 10)}


def test_a_rollouts_sets_each_scale_within_their_share(example_spec: ModelSpec, plan: Plan) -> None:
    """A step moves the floors (min_replicas); old and new sets each burst by their floors'
    share, and together never past the pool."""
    parts = list(example_spec.parts)
    step = RolloutStep(index=1, number=2, of=3, percent=50)
    new = rendered(example_spec, plan, number=2, scale=new_set_scales(step, parts)["dense"])
    old_scale = (old_set_scales(step, dict.fromkeys(parts, 1.0)) or {})["dense"]
    old = rendered(example_spec, plan, number=1, scale=old_scale)
    assert bounds(new)["dense-cpu-std"][0] == bounds(old)["dense-cpu-std"][0] == 2
    bounded = burst_bounds({new["name"]: new, old["name"]: old}, PoolEnvelope(pools=DEV_POOLS))
    assert bounds(bounded[new["name"]])["dense-cpu-std"] == (2, 8)
    assert bounds(bounded[old["name"]])["dense-cpu-std"] == (2, 8)


def test_a_full_pool_leaves_every_deployment_at_its_floor(example_spec: ModelSpec, plan: Plan) -> None:
    app = rendered(example_spec, plan)
    full = {"us-east": {"cpu-std": 4, "cpu-highmem": 3}}  # over-full: floors 4 and 4 units
    assert bounds(burst_bounds({app["name"]: app}, PoolEnvelope(pools=full))[app["name"]]) == bounds(app)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    floors=st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4)), min_size=1, max_size=6),
    units=st.integers(1, 64),
    burst=st.floats(0, 1),
)
def test_the_ceilings_of_a_pool_never_sum_past_its_units(
    floors: list[tuple[int, int]], units: int, burst: float
) -> None:
    apps = {
        f"m{i}.us-east.s1.r1": {
            "name": f"m{i}.us-east.s1.r1",
            "import_path": "ipnext.serving.set_app:set_app",
            "args": {"model": f"m{i}", "region": "us-east"},
            "deployments": [
                {
                    "name": "p-cpu-std",
                    "autoscaling_config": {"min_replicas": floor, "max_replicas": floor},
                    "ray_actor_options": {"resources": {"region:us-east": 0.001, "hw:cpu-std": size}},
                }
            ],
        }
        for i, (floor, size) in enumerate(floors)
    }
    bounded = burst_bounds(apps, PoolEnvelope(pools={"us-east": {"cpu-std": units}}, burst=burst))
    ceilings = [
        (d["autoscaling_config"]["min_replicas"], d["autoscaling_config"]["max_replicas"], floors[i][1])
        for i, app in enumerate(bounded.values())
        for d in app["deployments"]
    ]
    assert all(lo <= hi for lo, hi, _ in ceilings)
    taken = sum(lo * size for lo, _, size in ceilings)
    assert sum(hi * size for _, hi, size in ceilings) <= max(units, taken)


def test_capacity_follows_the_running_replicas() -> None:
    ingress = SetIngressConfig(
        capacity={"dense-cpu-std": 600, "dense-cpu-highmem": 400},
        qps_per_replica={"dense-cpu-std": 300, "dense-cpu-highmem": 200},
    )
    running = running_replicas({"dense-cpu-std": {"RUNNING": 5, "STARTING": 1}, "set": {"RUNNING": 1}})
    assert running == {"dense-cpu-std": 5, "set": 1}
    # 5 running std replicas, none known for highmem: the plan's capacity holds for it.
    assert ingress.running_capacity(running) == {"dense-cpu-std": 1500, "dense-cpu-highmem": 400}
    assert ingress.running_capacity({}) == ingress.capacity
    # An ingress rendered before per-replica QPS existed keeps the plan's capacity.
    assert SetIngressConfig(capacity={"dense-cpu-std": 600}).running_capacity(running) == {
        "dense-cpu-std": 600
    }


def test_a_first_placement_is_solved_against_the_residual_pools(
    example_spec: ModelSpec, dev_fleet: Fleet
) -> None:
    taken = {("us-east", "cpu-highmem"): 8, ("us-east", "cpu-std"): 10}
    fleet = residual_fleet(dev_fleet, taken)
    assert fleet.pool("us-east", "cpu-highmem") is None  # full: left out
    assert fleet.pool("us-east", "cpu-std").units == 6  # type: ignore[union-attr]
    plan = solve(PlanningProblem(fleet=fleet, deployments=demand_from_model(example_spec)))
    embed = plan.deployments[f"{example_spec.name}/embed"]
    assert embed.replicas.get("us-east", {}).get("cpu-highmem", 0) == 0  # nothing lands in the full pool
    for name, placement in plan.deployments.items():
        part = name.split("/", 1)[1]
        for region, by_hw in placement.replicas.items():
            for hw, n in by_hw.items():
                pool = fleet.pool(region, hw)
                assert n == 0 or (
                    pool is not None and n * example_spec.parts[part].hardware[hw].units <= pool.units
                )
    everything = {(p.region, p.hardware): p.units for p in dev_fleet.pools}
    with pytest.raises(InfeasiblePlanError, match="every pool"):
        residual_fleet(dev_fleet, everything)


def test_a_router_weighs_a_parts_deployments_by_what_its_set_answers_now() -> None:
    from ipnext.serving.set_routes import SetRoute

    route = SetRoute.__new__(SetRoute)  # its handles need Serve; what they are does not matter
    # Built in the sorted order of the deployments' names: highmem, then std (the plan's 400, 600).
    route.deployments = {"dense": (["highmem handle", "std handle"], [400.0, 600.0])}  # type: ignore[list-item]
    described = SetDescription(
        set_id="m@1",
        dag=[("input", "dense"), ("dense", "output")],
        order=["dense"],
        deployments={"dense": {"dense-cpu-highmem": 400.0, "dense-cpu-std": 1500.0}},
    )
    route.follow(described)
    assert route.deployments["dense"] == (["highmem handle", "std handle"], [400.0, 1500.0])
    # A description that no longer names the same deployments leaves the weights alone.
    route.follow(described.model_copy(update={"deployments": {"dense": {"dense-cpu-std": 9.0}}}))
    assert route.deployments["dense"][1] == [400.0, 1500.0]
