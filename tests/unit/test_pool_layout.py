"""Shared pool apps as the Serve config holds them: their names never collide with a model's
apps, a set's parts become catalogue entries of the pools of their hardware classes, and the
rendered app is one deployment whose catalogue rides in its user_config."""

from __future__ import annotations

import pytest
from ray.serve.schema import ServeDeploySchema

from ipnext.serving.layout import PartHostArgs, SetAppArgs, is_set_app_of, render_serve_config, set_app_name
from ipnext.serving.pool_layout import (
    POOL_IMPORT_PATH,
    PoolAppArgs,
    PoolCatalogue,
    is_pool_app,
    pool_app_name,
    pool_entries,
    pool_entry_id,
    render_pool_app,
)
from ipnext.spec.settings import PoolSettings

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
    highmem = pool_entries(APP, ARGS, "cpu-highmem", {"embed": 5000, "dense": 700})
    std = pool_entries(APP, ARGS, "cpu-std", {"embed": 5000, "dense": 700})
    assert sorted(highmem) == [pool_entry_id(APP, "dense"), pool_entry_id(APP, "embed")]
    assert list(std) == [f"{APP}/dense"]
    assert std[f"{APP}/dense"].estimate_bytes == 700
    assert std[f"{APP}/dense"].key == highmem[f"{APP}/dense"].key  # one snapshot's part: one key
    with pytest.raises(ValueError, match=r"estimate_bytes: none for part\(s\) \['embed'\]"):
        pool_entries(APP, ARGS, "cpu-highmem", {"dense": 700})


def test_the_rendered_pool_app_is_valid_serve_config_with_its_catalogue() -> None:
    catalogue = PoolCatalogue(generation=4, entries=pool_entries(APP, ARGS, "cpu-std", {"dense": 700}))
    args = PoolAppArgs(region="us-east", hardware="cpu-std", pools=PoolSettings(budget_bytes=64 * 1024**2))
    app = render_pool_app(args, catalogue, replicas=2, units=1, replica_num_cpus=0)
    [deployment] = app["deployments"]
    assert (app["name"], app["import_path"], app["route_prefix"]) == (
        "ipnext-pool.us-east.cpu-std",
        POOL_IMPORT_PATH,
        None,
    )
    assert deployment["num_replicas"] == 2
    assert deployment["ray_actor_options"]["resources"] == {"region:us-east": 0.001, "hw:cpu-std": 1}
    assert PoolCatalogue.model_validate(deployment["user_config"]) == catalogue
    assert PoolAppArgs.model_validate(app["args"]) == args
    ServeDeploySchema.model_validate(render_serve_config({app["name"]: app}, "127.0.0.1", 8000))
    with pytest.raises(ValueError, match="give replicas >= 1"):
        render_pool_app(args, catalogue, replicas=0, units=1, replica_num_cpus=0)
