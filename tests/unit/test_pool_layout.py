"""Shared pool apps as the Serve config holds them: their names never collide with a model's
apps, a set's parts become catalogue entries of the pools of their hardware classes, and the
rendered app is one deployment whose catalogue rides in its user_config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ray.serve.schema import ServeDeploySchema

from ipnext.contracts.router import RouterConfig
from ipnext.policy.spec_update import UpdateKind, diff_specs
from ipnext.serving.layout import (
    PartHostArgs,
    PoolEnvelope,
    SetAppArgs,
    SetAppPlan,
    burst_bounds,
    deployed_router,
    is_set_app_of,
    pool_usage,
    render_router_app,
    render_serve_config,
    set_app_name,
    with_keys_file,
    without_keys_file,
)
from ipnext.serving.pool_layout import (
    POOL_IMPORT_PATH,
    PoolAppArgs,
    PoolCatalogue,
    PooledSet,
    PoolFold,
    PoolRouterArgs,
    PoolRouterConfig,
    fold_pools,
    is_placeholder,
    is_pool_app,
    pool_app_name,
    pool_entries,
    pool_entry_id,
    pool_size,
    pooled_model,
    pooled_units,
    render_pool_app,
    render_pooled_router,
    render_pooled_set,
    serving_apps,
    unfold_pools,
)
from ipnext.spec.model import ModelSpec, RouterSpec, load_model_spec
from ipnext.spec.settings import PoolSettings

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(60)


def host(part: str, app: str) -> PartHostArgs:
    return PartHostArgs(
        model="ranker",
        part=part,
        factory="ipnext.examples.click_ranker.parts:DensePart",
        uri="file:///snapshots/x",
        sha256=part[0] * 64,
        snapshot_id=f"{part}-v1",
        pinned_store="/pinned",
        region="us-east",
        app=app,
    )


APP = set_app_name("ranker", "us-east", 1, 3)
ARGS = SetAppArgs(
    model="ranker",
    region="us-east",
    set_id="ranker@1",
    dag=[("input", "embed"), ("embed", "dense"), ("dense", "output")],
    order=["embed", "dense"],
    parts={"embed": host("embed", APP), "dense": host("dense", APP)},
    hardware={"embed": ["cpu-highmem"], "dense": ["cpu-std", "cpu-highmem"]},
)


def test_pool_names_are_never_a_models_apps() -> None:
    name = pool_app_name("us-east", "cpu-std")
    assert is_pool_app(name)
    assert not is_pool_app(APP) and not is_pool_app("ranker.us-east") and not is_pool_app("ipnext-routing")
    assert not is_set_app_of(name, "ipnext-pool")  # a model may even be called that


def test_a_sets_parts_become_entries_of_their_hardware_pools() -> None:
    highmem = pool_entries(APP, ARGS, "cpu-highmem")
    std = pool_entries(APP, ARGS, "cpu-std")
    assert sorted(highmem) == [pool_entry_id(APP, "dense"), pool_entry_id(APP, "embed")]
    assert list(std) == [f"{APP}/dense"]
    assert std[f"{APP}/dense"].estimate_bytes == 0  # the replica reads its pinned file's size
    assert std[f"{APP}/dense"].key == highmem[f"{APP}/dense"].key  # one snapshot's part: one key


def test_the_rendered_pool_app_is_valid_serve_config_with_its_catalogue() -> None:
    catalogue = PoolCatalogue(entries=pool_entries(APP, ARGS, "cpu-std"))
    args = PoolAppArgs(region="us-east", hardware="cpu-std", pools=PoolSettings(budget_bytes=64 * 1024**2))
    app = render_pool_app(args, catalogue, replicas=2, units=1, replica_num_cpus=0)
    [deployment] = app["deployments"]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (
        "ipnext-pool.us-east.cpu-std",
        POOL_IMPORT_PATH,
        None,
    )
    scaling = deployment["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (2, 2)  # the writer raises the max
    assert deployment["ray_actor_options"]["resources"] == {"region:us-east": 0.001, "hw:cpu-std": 1}
    assert PoolCatalogue.model_validate(deployment["user_config"]) == catalogue
    assert PoolAppArgs.model_validate(app["args"]) == args
    ServeDeploySchema.model_validate(render_serve_config({app["name"]: app}, "127.0.0.1", 8000))
    with pytest.raises(ValueError, match="give replicas >= 1"):
        render_pool_app(args, catalogue, replicas=0, units=1, replica_num_cpus=0)


def plan_of(model: str, set_number: int = 1, hardware: str = "cpu-std") -> SetAppPlan:
    app = set_app_name(model, "us-east", set_number, 1)
    args = ARGS.model_copy(
        update={
            "model": model,
            "set_id": f"{model}@{set_number}",
            "parts": {p: h.model_copy(update={"model": model, "app": app}) for p, h in ARGS.parts.items()},
            "hardware": {"embed": [hardware], "dense": [hardware]},
        }
    )
    return SetAppPlan(
        name=app,
        args=args,
        replicas={"embed": {hardware: 1}, "dense": {hardware: 2}},
        units={"embed": {hardware: 2}, "dense": {hardware: 1}},
        qps={"embed": {hardware: 400.0}, "dense": {hardware: 300.0}},
    )


def pooled_apps() -> dict[str, dict[str, Any]]:
    apps: dict[str, dict[str, Any]] = {}
    for model in ("alpha", "beta"):
        placeholder = render_pooled_set(plan_of(model))
        apps[placeholder["name"]] = placeholder
        router = render_pooled_router(
            model, "us-east", RouterConfig(generation=3, weights={placeholder["name"]: 100.0}), RouterSpec()
        )
        apps[router["name"]] = router
    beta2 = render_pooled_set(plan_of("beta", 2, hardware="cpu-highmem"))
    apps[beta2["name"]] = beta2
    return apps


def test_placeholders_fold_into_one_pool_per_hardware_and_one_router_per_region() -> None:
    dedicated = {"gamma.us-east": {"name": "gamma.us-east", "import_path": "x:y", "args": {}}}
    folded = fold_pools({**pooled_apps(), **dedicated}, PoolFold())
    assert sorted(folded) == [
        "gamma.us-east",
        "ipnext-pool.us-east.cpu-highmem",
        "ipnext-pool.us-east.cpu-std",
        "ipnext-pooled.us-east.router",
    ]
    assert folded["gamma.us-east"] == dedicated["gamma.us-east"]
    [std] = folded["ipnext-pool.us-east.cpu-std"]["deployments"]
    catalogue = PoolCatalogue.model_validate(std["user_config"])
    assert sorted(catalogue.entries) == [
        "alpha.us-east.s1.r1/dense",
        "alpha.us-east.s1.r1/embed",
        "beta.us-east.s1.r1/dense",
        "beta.us-east.s1.r1/embed",
    ]
    floor = std["autoscaling_config"]["min_replicas"]
    assert (floor, std["ray_actor_options"]["resources"]["hw:cpu-std"]) == (2, 2)
    router = folded["ipnext-pooled.us-east.router"]
    assert router["route_prefix"] == "/us-east/models"
    config = PoolRouterConfig.model_validate(router["deployments"][0]["user_config"])
    assert sorted(config.routers) == ["alpha", "beta"] and len(config.sets) == 3
    # Deterministic: the same placeholders in another order render the same config.
    shuffled = dict(reversed(list({**pooled_apps(), **dedicated}.items())))
    assert fold_pools(shuffled, PoolFold()) == folded
    ServeDeploySchema.model_validate(render_serve_config(folded, "127.0.0.1", 8000))


def test_a_restarted_writer_gets_every_placeholder_back_from_the_pool_router() -> None:
    apps = pooled_apps()
    as_serve_holds = json.loads(json.dumps(fold_pools(apps, PoolFold())))
    assert unfold_pools(as_serve_holds) == apps
    router = apps["alpha.us-east"]
    assert deployed_router(router).config.weights == {"alpha.us-east.s1.r1": 100.0}
    assert serving_apps(router) == ["ipnext-pooled.us-east.router"]
    assert serving_apps(apps["beta.us-east.s2.r1"]) == [
        "ipnext-pooled.us-east.router",
        "ipnext-pool.us-east.cpu-highmem",
    ]
    assert all(is_placeholder(app) for app in apps.values())


def test_a_pooled_set_describes_itself_at_its_planned_capacity() -> None:
    described = PooledSet.model_validate(render_pooled_set(plan_of("alpha"))["args"]).describe()
    assert described.deployments == {"embed": {"embed-cpu-std": 400.0}, "dense": {"dense-cpu-std": 600.0}}


@pytest.mark.parametrize(
    ("path", "model"),
    [
        ("/us-east/models/alpha/predict", "alpha"),
        ("/us-east/models/alpha", "alpha"),
        ("/alpha/predict", "alpha"),
        ("/us-east/models/", None),
    ],
)
def test_the_pool_router_finds_the_model_in_the_path(path: str, model: str | None) -> None:
    assert pooled_model(path, "us-east") == model


def test_a_spec_says_pooled_and_a_change_of_it_is_a_new_set() -> None:
    spec = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml")
    pooled = spec.model_copy(update={"serving": "pooled"})
    assert pooled.pooled() and not spec.pooled()
    diff = diff_specs(spec, ModelSpec.model_validate(pooled.model_dump()))
    assert diff.kind is UpdateKind.NEW_SET and diff.changes == ['serving: "dedicated" -> "pooled"']
    llm = load_model_spec(REPO / "examples" / "llm" / "model.yaml")
    with pytest.raises(ValueError, match="serving: pooled: an LLM part"):
        ModelSpec.model_validate({**llm.model_dump(), "serving": "pooled"})


def test_the_pool_router_is_a_door_that_checks_api_keys() -> None:
    folded = fold_pools(pooled_apps(), PoolFold())
    keyed = with_keys_file(folded, "/keys.json")
    router = keyed["ipnext-pooled.us-east.router"]
    assert PoolRouterArgs.model_validate(router["args"]).keys_file == "/keys.json"
    assert "keys_file" not in keyed["ipnext-pool.us-east.cpu-std"]["args"]  # a pool answers no HTTP
    assert without_keys_file(router) == folded["ipnext-pooled.us-east.router"]


def sized(model: str, demand: float, part_bytes: int, replicas: int = 1) -> PooledSet:
    """A one-part pooled set on cpu-std: 100 QPS a replica, `demand` QPS planned here."""
    plan = plan_of(model)
    plan = plan.model_copy(
        update={
            "replicas": {"dense": {"cpu-std": replicas}},
            "units": {"dense": {"cpu-std": 1}},
            "qps": {"dense": {"cpu-std": 100.0}},
            "demand": {"dense": {"cpu-std": demand}},
        }
    )
    return PooledSet.model_validate(render_pooled_set(plan, {"dense": part_bytes})["args"])


def test_a_pool_is_sized_by_its_models_plans_demand_and_bytes() -> None:
    """The most of: any part's own plan (availability), the parts' summed demand at their QPS
    per replica (many small models add up), their pinned bytes over a replica's budget."""
    mb = 1024**2
    small = {f"m{i}.us-east.s1.r1": sized(f"m{i}", demand=30.0, part_bytes=5 * mb) for i in range(10)}
    size = pool_size(small, "cpu-std", budget_bytes=64 * mb)
    # 10 x 30 QPS over 100 a replica: 3 replicas by demand; 50 MB in 64 MB: 1 by memory.
    assert (size.by_plan, size.by_demand, size.by_memory, size.replicas) == (1, 3, 1, 3)
    heavy = {f"h{i}.us-east.s1.r1": sized(f"h{i}", demand=1.0, part_bytes=40 * mb) for i in range(5)}
    size = pool_size(heavy, "cpu-std", budget_bytes=64 * mb)
    assert (size.by_demand, size.by_memory, size.replicas) == (1, 4, 4)  # 200 MB in 64 MB budgets
    spare = {"s.us-east.s1.r1": sized("s", demand=1.0, part_bytes=mb, replicas=2)}
    assert pool_size(spare, "cpu-std", budget_bytes=64 * mb).replicas == 2  # its plan's 2 stand
    assert pool_size(small, "cpu-highmem", budget_bytes=64 * mb).replicas == 1  # no part there: the floor


def test_the_fold_renders_each_pool_at_its_size_and_the_planner_counts_it() -> None:
    apps = {
        name: {"name": name, "import_path": "ipnext:pooled-set", "args": pooled.model_dump(mode="json")}
        for i in range(10)
        for name, pooled in [(f"m{i}.us-east.s1.r1", sized(f"m{i}", demand=30.0, part_bytes=1024))]
    }
    folded = fold_pools(apps, PoolFold())
    [pool] = folded["ipnext-pool.us-east.cpu-std"]["deployments"]
    assert pool["autoscaling_config"]["min_replicas"] == 3
    assert pooled_units(apps) == {("us-east", "cpu-std"): 3}  # what dedicated plans must leave


def test_a_pool_bursts_inside_the_envelope_as_a_part_deployment_does() -> None:
    """The writer raises a pool's max_replicas to its share of its hardware's unallocated units
    (`burst_bounds`), and counts the pool's floor as taken (`pool_usage`)."""
    catalogue = PoolCatalogue(entries=pool_entries(APP, ARGS, "cpu-std"))
    args = PoolAppArgs(region="us-east", hardware="cpu-std")
    pool = render_pool_app(args, catalogue, replicas=2, units=1, replica_num_cpus=0)
    apps = {pool["name"]: pool}
    assert pool_usage(apps) == {("us-east", "cpu-std"): 2}
    envelope = PoolEnvelope(pools={"us-east": {"cpu-std": 6}}, burst=0.5)
    [deployment] = burst_bounds(apps, envelope)[pool["name"]]["deployments"]
    assert deployment["autoscaling_config"]["min_replicas"] == 2
    assert deployment["autoscaling_config"]["max_replicas"] == 4  # 2 + half of the 4 spare units
    full = PoolEnvelope(pools={"us-east": {"cpu-std": 2}}, burst=1.0)
    [capped] = burst_bounds(apps, full)[pool["name"]]["deployments"]
    assert capped["autoscaling_config"]["max_replicas"] == 2  # the plans fill it: no burst


def test_a_model_moving_to_dedicated_stays_in_its_pool_router_until_its_pooled_set_goes() -> None:
    """Make before break: alpha's last rollout step gave it a router of its own (Serve starts it
    now) while its old pooled set is still held. The pool router keeps routing alpha by the new
    router's weights until the old set goes; a restarted writer holds the app, not a placeholder."""
    apps = pooled_apps()
    moved = RouterConfig(generation=4, weights={"alpha.us-east.s2.r1": 100.0})
    own = render_router_app("alpha", "us-east", moved, RouterSpec(max_ongoing_requests=7))
    apps["alpha.us-east"] = own
    folded = fold_pools(apps, PoolFold())
    router = folded["ipnext-pooled.us-east.router"]
    config = PoolRouterConfig.model_validate(router["deployments"][0]["user_config"])
    assert config.routers["alpha"].config == moved
    assert config.routers["alpha"].router.max_ongoing_requests == 7
    assert folded["alpha.us-east"] == own  # and the router of its own runs beside
    held = unfold_pools(json.loads(json.dumps(folded)))
    assert held["alpha.us-east"]["import_path"] == own["import_path"] and not is_placeholder(
        held["alpha.us-east"]
    )
    # Its old set gone, the pool router forgets it.
    del apps["alpha.us-east.s1.r1"]
    after = PoolRouterConfig.model_validate(
        fold_pools(apps, PoolFold())["ipnext-pooled.us-east.router"]["deployments"][0]["user_config"]
    )
    assert sorted(after.routers) == ["beta"]


def test_a_parts_pinned_size_is_its_file_or_zero(tmp_path: Path) -> None:
    """What a pool reserves for a part while it loads, and what sizes pools by memory."""
    from ipnext.store.pinned import pinned_path, pinned_size

    sha = "ab" * 32
    file = pinned_path(tmp_path, sha)
    file.parent.mkdir(parents=True)
    file.write_bytes(b"x" * 1234)
    assert pinned_size(tmp_path, sha) == 1234
    assert pinned_size(tmp_path, sha, checkpoint=True) == 0  # its manifest is not there
    assert pinned_size(tmp_path, "cd" * 32) == 0
