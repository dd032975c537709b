"""The pure parts of serving: app layout and Serve config, request metrics, and weighted set picking."""

from __future__ import annotations

import bisect
import importlib
import itertools
import math
import random
import subprocess
import sys
from collections import Counter
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve.schema import ServeDeploySchema

from ipnext.contracts.counters import LATENCY_LAYOUT, LEGACY_BUCKETS_MS
from ipnext.contracts.plan import Plan, PlanningProblem, demand_from_model
from ipnext.contracts.router import RouterConfig
from ipnext.planner import solve
from ipnext.serving.layout import (
    PROXY_TIMEOUT_S,
    ROUTER_IMPORT_PATH,
    SET_DEPLOYMENT,
    SET_IMPORT_PATH,
    DeployedRouter,
    SetIngressConfig,
    deployed_router,
    metrics_actor_name,
    render_router_app,
    render_serve_config,
    render_set_app,
    router_app_name,
    set_app_name,
    set_app_plan,
)
from ipnext.serving.metrics import MetricsStore, SetCounters, percentile
from ipnext.serving.traffic import PickedApps, all_finite, join_shards, pick_apps, pick_set
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import MAX_DEADLINE_SECONDS, ModelSpec, RouterSpec, SnapshotRef, SnapshotSet
from ipnext.spec.settings import PartHealthCheckSettings

MODEL = "feed-ranker"
PINNED = "/srv/ipnext/pinned"


@pytest.fixture(scope="module")
def plan(example_spec: ModelSpec, dev_fleet: Fleet) -> Plan:
    # The solved plan, with more embed replicas in us-east so counts differ per region and part.
    problem = PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(example_spec))
    base = solve(problem)
    embed = base.deployments[f"{MODEL}/embed"].model_copy(
        update={"replicas": {"us-east": {"cpu-highmem": 3}, "eu-west": {"cpu-highmem": 1}}}
    )
    return base.model_copy(
        update={"deployments": {**base.deployments, f"{MODEL}/embed": embed}, "revision": 4}
    )


@pytest.fixture(scope="module")
def snapshot_set() -> SnapshotSet:
    return SnapshotSet(
        id=f"{MODEL}@7",
        number=7,
        version="v2",
        parts={
            part: SnapshotRef(
                uri=f"file:///srv/snapshots/{MODEL}/v2/{part}.safetensors",
                sha256=("a" if part == "embed" else "b") * 64,
                snapshot_id=f"{MODEL}/{part}@v2",
            )
            for part in ("embed", "dense")
        },
        status="validated",
        published_at=datetime(2025, 1, 1, tzinfo=UTC),
    )


# --- names ------------------------------------------------------------------------------------


def test_names() -> None:
    assert set_app_name(MODEL, "us-east", 3, 2) == "feed-ranker.us-east.s3.r2"
    assert router_app_name(MODEL, "eu-west") == "feed-ranker.eu-west"
    assert metrics_actor_name(MODEL, "eu-west") == "ipnext-metrics/feed-ranker/eu-west"


# --- set apps ---------------------------------------------------------------------------------


def test_set_app_plan(example_spec: ModelSpec, snapshot_set: SnapshotSet, plan: Plan) -> None:
    app = set_app_plan(example_spec, snapshot_set, plan, "us-east", PINNED)
    assert app.name == "feed-ranker.us-east.s7.r4"
    assert app.replicas == {"embed": {"cpu-highmem": 3}, "dense": {"cpu-std": 1}}
    assert app.units == {"embed": {"cpu-highmem": 2}, "dense": {"cpu-std": 1}}
    assert app.qps == {"embed": {"cpu-highmem": 400}, "dense": {"cpu-std": 300}}
    args = app.args
    assert (args.model, args.region, args.set_id) == (MODEL, "us-east", f"{MODEL}@7")
    assert args.order == ["embed", "dense"]
    assert args.hardware == {"embed": ["cpu-highmem"], "dense": ["cpu-std"]}
    embed = args.parts["embed"]
    assert embed.factory == "ipnext.examples.click_ranker.parts:EmbeddingPart"
    assert embed.uri == snapshot_set.parts["embed"].uri
    assert embed.sha256 == "a" * 64
    assert embed.snapshot_id == f"{MODEL}/embed@v2"
    assert embed.pinned_store == PINNED
    assert embed.config == example_spec.parts["embed"].config
    assert embed.factory_prefixes == ["ipnext.examples.", "ipnext.serving.llm.part"]  # the default
    # Demand: each source's peak times the share the plan routes to us-east, headroom on top;
    # half of it at a rollout step of 50%.
    for part, hw in (("embed", "cpu-highmem"), ("dense", "cpu-std")):
        routed = plan.deployments[f"{MODEL}/{part}"].fractions
        here = sum(
            q * routed.get(s, {}).get("us-east", 0.0) for s, q in {"us-east": 60, "eu-west": 30}.items()
        )
        assert app.demand[part] == {hw: pytest.approx(here * 1.2)}
        assert here > 0
    half = set_app_plan(example_spec, snapshot_set, plan, "us-east", PINNED, scale=0.5)
    assert half.demand["dense"]["cpu-std"] == pytest.approx(app.demand["dense"]["cpu-std"] / 2)
    listed = set_app_plan(example_spec, snapshot_set, plan, "us-east", PINNED, factory_prefixes=["acme."])
    assert {p.factory_prefixes[0] for p in listed.args.parts.values()} == {"acme."}  # the worker's own list


def test_render_set_app(example_spec: ModelSpec, snapshot_set: SnapshotSet, plan: Plan) -> None:
    app = set_app_plan(example_spec, snapshot_set, plan, "us-east", PINNED)
    rendered = render_set_app(
        app, replica_num_cpus=0.25, health_check=PartHealthCheckSettings(period_s=3, timeout_s=9)
    )
    assert rendered["name"] == "feed-ranker.us-east.s7.r4"
    assert rendered["route_prefix"] is None
    assert rendered["import_path"] == SET_IMPORT_PATH == "ipnext.serving.set_app:set_app"
    assert rendered["args"]["set_id"] == f"{MODEL}@7"
    by_name = {d["name"]: d for d in rendered["deployments"]}
    assert sorted(by_name) == ["dense-cpu-std", "embed-cpu-highmem", "set"]

    embed = by_name["embed-cpu-highmem"]
    # Autoscaled (Serve refuses num_replicas beside it), rendered at the plan's bounds: the
    # writer raises max_replicas by the deployment's share of its pool's unallocated units.
    assert "num_replicas" not in embed
    assert (embed["autoscaling_config"]["min_replicas"], embed["autoscaling_config"]["max_replicas"]) == (
        3,
        3,
    )
    assert embed["autoscaling_config"]["target_ongoing_requests"] == 2
    assert (
        embed["autoscaling_config"]["upscale_delay_s"],
        embed["autoscaling_config"]["downscale_delay_s"],
    ) == (
        30,
        600,
    )
    assert embed["ray_actor_options"]["num_cpus"] == 0.25
    resources = embed["ray_actor_options"]["resources"]
    assert set(resources) == {"region:us-east", "hw:cpu-highmem"}
    assert resources["hw:cpu-highmem"] == 2
    assert 0 < resources["region:us-east"] < 1

    dense = by_name["dense-cpu-std"]
    assert dense["autoscaling_config"]["min_replicas"] == 1
    assert dense["ray_actor_options"]["resources"]["hw:cpu-std"] == 1
    assert set(dense["ray_actor_options"]["resources"]) == {"region:us-east", "hw:cpu-std"}

    # Every part deployment carries the settings' health check (Serve calls PartHost.check_health).
    for part in (embed, dense):
        assert (part["health_check_period_s"], part["health_check_timeout_s"]) == (3, 9)
    defaults = render_set_app(app, 0)["deployments"][1]
    assert (defaults["health_check_period_s"], defaults["health_check_timeout_s"]) == (5, 20)

    # A replica told to stop waits the settings' time for requests on their way (every deployment
    # of the set: Serve takes it as its drain loop); unset, Serve's own default.
    short = render_set_app(app, 0, shutdown_wait_s=0.5)
    assert {d["graceful_shutdown_wait_loop_s"] for d in short["deployments"]} == {0.5}
    assert all("graceful_shutdown_wait_loop_s" not in d for d in render_set_app(app, 0)["deployments"])
    checked = ServeDeploySchema.model_validate(render_serve_config({short["name"]: short}, "127.0.0.1", 8000))
    assert {d.graceful_shutdown_wait_loop_s for d in checked.applications[0].deployments} == {0.5}

    ingress = by_name["set"]
    assert ingress["num_replicas"] == 1
    assert set(ingress["ray_actor_options"]["resources"]) == {"region:us-east"}
    assert ingress["user_config"] == {
        "capacity": {"embed-cpu-highmem": 1200, "dense-cpu-std": 300},
        "qps_per_replica": {"embed-cpu-highmem": 400, "dense-cpu-std": 300},
    }


def test_render_set_app_in_the_other_region(
    example_spec: ModelSpec, snapshot_set: SnapshotSet, plan: Plan
) -> None:
    rendered = render_set_app(set_app_plan(example_spec, snapshot_set, plan, "eu-west", PINNED), 0)
    assert rendered["name"] == "feed-ranker.eu-west.s7.r4"
    by_name = {d["name"]: d for d in rendered["deployments"]}
    assert by_name["embed-cpu-highmem"]["autoscaling_config"]["min_replicas"] == 1
    assert all("region:eu-west" in d["ray_actor_options"]["resources"] for d in by_name.values())


def test_render_router_app() -> None:
    config = RouterConfig(
        generation=5, weights={"feed-ranker.us-east.s7.r4": 25, "feed-ranker.us-east.s6.r4": 75}
    )
    rendered = render_router_app(MODEL, "us-east", config, RouterSpec())
    assert rendered["name"] == "feed-ranker.us-east"
    assert rendered["route_prefix"] == "/us-east/models/feed-ranker"
    assert rendered["import_path"] == ROUTER_IMPORT_PATH == "ipnext.serving.router:router_app"
    assert rendered["args"] == {"model": MODEL, "region": "us-east"}  # the defaults: as before limits
    [router] = rendered["deployments"]
    assert router["name"] == "router"
    # Router replicas scale with their requests, from 1 to the setting, aiming at half their cap.
    assert "num_replicas" not in router
    scaling = router["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (
        1,
        4,
        50,
    )
    assert router["max_ongoing_requests"] == RouterSpec().max_ongoing_requests == 100  # not Serve's 5
    # A bounded queue in Serve's proxy: the next request gets 503 and Retry-After at once.
    assert router["max_queued_requests"] == 100
    assert router["backpressure_config"] == {"status_code": 503, "retry_after_s": 1}
    tight = RouterSpec(max_ongoing_requests=12, deadline_seconds=2.5, max_json_depth=8, max_replicas=2)
    rendered_tight = render_router_app(MODEL, "us-east", config, tight)
    assert rendered_tight["deployments"][0]["max_ongoing_requests"] == 12
    # A model's own ceiling on its routers wins over the platform's setting.
    assert rendered_tight["deployments"][0]["autoscaling_config"]["max_replicas"] == 2
    assert deployed_router(rendered_tight).max_replicas == 2
    # Only what differs from the defaults rides in the args (the router enforces it).
    assert rendered_tight["args"]["router"] == {
        "max_ongoing_requests": 12,
        "deadline_seconds": 2.5,
        "max_json_depth": 8,
        "max_replicas": 2,
    }
    assert router["user_config"] == {
        "generation": 5,
        "weights": {"feed-ranker.us-east.s7.r4": 25, "feed-ranker.us-east.s6.r4": 75},
    }
    assert set(router["user_config"]) == {"generation", "weights"}


def test_render_serve_config_is_a_valid_serve_deploy_schema(
    example_spec: ModelSpec, snapshot_set: SnapshotSet, plan: Plan
) -> None:
    apps = {}
    for region in ("us-east", "eu-west"):
        set_app = render_set_app(set_app_plan(example_spec, snapshot_set, plan, region, PINNED), 0)
        router = render_router_app(
            MODEL, region, RouterConfig(generation=1, weights={set_app["name"]: 100}), RouterSpec()
        )
        apps[set_app["name"]] = set_app
        apps[router["name"]] = router
    config = render_serve_config(apps, "127.0.0.1", 8000)
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.host == "127.0.0.1"
    assert schema.http_options.port == 8000
    # Serve's proxy timeout is a backstop above every deadline a router enforces (and counts).
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000, "request_timeout_s": PROXY_TIMEOUT_S}
    assert schema.http_options.request_timeout_s == PROXY_TIMEOUT_S > MAX_DEADLINE_SECONDS
    assert {a.deployments[0].max_queued_requests for a in schema.applications if a.route_prefix} == {100}
    # Part deployments are bounded at each caller too (the spec's, 100 when not given).
    part_queues = {
        d.name: d.max_queued_requests
        for a in schema.applications
        if not a.route_prefix
        for d in a.deployments
    }
    del part_queues[SET_DEPLOYMENT]  # the set's ingress: asked for its description only, left as Serve has it
    assert set(part_queues.values()) == {100}, part_queues
    tight_parts = example_spec.model_copy(
        update={
            "parts": {
                p: s.model_copy(update={"max_queued_requests": 7}) for p, s in example_spec.parts.items()
            }
        }
    )
    tight = render_set_app(set_app_plan(tight_parts, snapshot_set, plan, "us-east", PINNED), 0)
    assert {d["max_queued_requests"] for d in tight["deployments"] if d["name"] != "set"} == {7}
    names = [a["name"] for a in config["applications"]]
    assert names == sorted(apps)
    assert [a.name for a in schema.applications] == names
    prefixes = {a.name: a.route_prefix for a in schema.applications}
    assert prefixes["feed-ranker.eu-west"] == "/eu-west/models/feed-ranker"
    assert prefixes["feed-ranker.us-east.s7.r4"] is None


def test_set_description_is_what_routers_read_of_the_rendered_app(
    example_spec: ModelSpec, snapshot_set: SnapshotSet, plan: Plan
) -> None:
    app = set_app_plan(example_spec, snapshot_set, plan, "us-east", PINNED)
    rendered = render_set_app(app, 0)
    by_name = {d["name"]: d for d in rendered["deployments"]}
    # The ingress's user_config as Serve hands it over, parsed once, gives the description.
    ingress = SetIngressConfig.model_validate(by_name["set"]["user_config"])
    described = app.args.describe(ingress.capacity)
    assert described.set_id == f"{MODEL}@7"
    assert described.order == ["embed", "dense"]
    assert described.deployments == {"embed": {"embed-cpu-highmem": 1200}, "dense": {"dense-cpu-std": 300}}
    # Every deployment a router will address is one the set app deploys.
    assert {n for d in described.deployments.values() for n in d} == set(by_name) - {"set"}
    # Before the first reconfigure a deployment counts as capacity 1.
    assert app.args.describe({}).deployments["dense"] == {"dense-cpu-std": 1.0}
    # Over HTTP it is JSON, and reads back the same.
    assert type(described).model_validate(described.model_dump(mode="json")) == described


def test_deployed_router_reads_back_what_was_rendered() -> None:
    config = RouterConfig(
        generation=3, weights={"a": 40, "b": 60}, parts={"embed": {"b": 100}}, gated_part="embed"
    )
    router = RouterSpec(max_ongoing_requests=12, max_queued_requests=7, deadline_seconds=4)
    rendered = render_router_app(MODEL, "us-east", config, router)
    assert deployed_router(rendered) == DeployedRouter(
        config=config, max_ongoing_requests=12, max_queued_requests=7, router=router, max_replicas=4
    )
    # A router rendered before routers scaled reads back as one fixed replica: reconcile and
    # route_traffic see it differs and render it again.
    fixed = render_router_app(MODEL, "us-east", config, router)
    del fixed["deployments"][0]["autoscaling_config"]
    fixed["deployments"][0]["num_replicas"] = 1
    assert deployed_router(fixed).max_replicas is None
    plain = RouterConfig(generation=1, weights={"a": 100})
    assert deployed_router(render_router_app(MODEL, "us-east", plain, RouterSpec())).config == plain
    # A router rendered before queues and limits existed reads back as such: the reconcile
    # sees it differs from the spec and applies it again.
    legacy = render_router_app(MODEL, "us-east", plain, RouterSpec())
    del legacy["deployments"][0]["max_queued_requests"]
    assert deployed_router(legacy).max_queued_requests is None


def test_builder_import_paths_resolve() -> None:
    from ipnext.serving import apps

    for path in (SET_IMPORT_PATH, ROUTER_IMPORT_PATH):
        module, _, name = path.partition(":")
        builder = getattr(importlib.import_module(module), name)
        assert callable(builder)
        # Configs rendered before the split name ipnext.serving.apps: they build the same apps.
        assert getattr(apps, name) is builder


def test_traffic_choice_imports_without_ray() -> None:
    code = "import sys, ipnext.serving.traffic; assert 'ray' not in sys.modules, 'ray was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- metrics ----------------------------------------------------------------------------------


BOUNDS = LATENCY_LAYOUT.bounds()


def test_observe_puts_values_in_upper_bound_buckets() -> None:
    counters = SetCounters()
    for value in (0.05, 0.1, 4, BOUNDS[60], BOUNDS[60] * 1.0001, 200_000):
        counters.observe("latency_ms", value)
    buckets = counters.histograms["latency_ms"]
    assert len(buckets) == len(BOUNDS) + 1 == LATENCY_LAYOUT.count + 1
    assert buckets[0] == 2  # 0.05 and 0.1 (bounds are inclusive, as Prometheus' le)
    assert buckets[BOUNDS.index(next(b for b in BOUNDS if b >= 4))] == 1
    assert buckets[60] == 1 and buckets[61] == 1
    assert buckets[-1] == 1  # above the last bound
    assert sum(buckets) == 6


def test_the_layout_is_log_spaced_from_a_tenth_of_a_ms_past_two_minutes() -> None:
    assert BOUNDS[0] == 0.1 and BOUNDS[-2] < 120_000 <= BOUNDS[-1]
    ratios = [b / a for a, b in itertools.pairwise(BOUNDS)]
    assert max(ratios) <= LATENCY_LAYOUT.ratio + 1e-12 and min(ratios) > LATENCY_LAYOUT.ratio - 1e-4
    assert all(len(repr(b).replace(".", "").strip("0")) <= 6 for b in BOUNDS)  # short decimal labels


def test_plus_adds_requests_errors_and_histograms() -> None:
    a = SetCounters(requests=10, errors=1)
    a.observe("latency_ms", 3)
    b = SetCounters(requests=5, errors=2)
    b.observe("latency_ms", 3)
    b.observe("ttft_ms", 40)
    total = a.plus(b)
    assert (total.requests, total.errors) == (15, 3)
    assert total.histograms["latency_ms"][bisect.bisect_left(BOUNDS, 3)] == 2
    assert sum(total.histograms["ttft_ms"]) == 1
    assert (a.requests, sum(a.histograms["latency_ms"])) == (10, 1)  # inputs unchanged


def histogram(values: dict[float, int], legacy: bool = False) -> list[int]:
    counters = SetCounters(layout=None) if legacy else SetCounters()
    for value, count in values.items():
        for _ in range(count):
            counters.observe("m", value)
    return counters.histograms["m"]


def test_percentile_interpolates_within_the_bucket() -> None:
    lo, hi = BOUNDS[99], BOUNDS[100]
    buckets = histogram({lo / 2: 98, hi: 2})  # ranks 98 < r <= 100 fall in (lo, hi]
    assert percentile(buckets, 0.99, LATENCY_LAYOUT) == pytest.approx(lo + (hi - lo) * (99 - 98) / 2)
    assert percentile(buckets, 1.0, LATENCY_LAYOUT) == hi
    assert percentile(histogram({500_000: 3}), 0.5, LATENCY_LAYOUT) == BOUNDS[-1]  # the +Inf bucket
    assert percentile(histogram({0.01: 4}), 0.5, LATENCY_LAYOUT) == pytest.approx(0.05)  # from 0
    assert percentile([0] * (len(BOUNDS) + 1), 0.99, LATENCY_LAYOUT) is None


def test_legacy_percentile_is_the_buckets_upper_bound() -> None:
    assert percentile(histogram({10: 99, 500: 1}, legacy=True), 0.99, None) == 10
    assert percentile(histogram({10: 99, 500: 1}, legacy=True), 1.0, None) == 500
    assert percentile(histogram({10: 98, 500: 2}, legacy=True), 0.99, None) == 500
    assert percentile(histogram({3: 989, 75: 11}, legacy=True), 0.99, None) == 75
    assert percentile(histogram({50_000: 3}, legacy=True), 0.5, None) == float("inf")
    assert percentile([0] * (len(LEGACY_BUCKETS_MS) + 1), 0.99, None) is None


@settings(deadline=None, derandomize=True, max_examples=80)
@given(
    st.lists(st.floats(0.1, 120_000, exclude_min=True), min_size=1, max_size=300),
    st.sampled_from([0.5, 0.9, 0.99]),
)
def test_percentile_is_within_the_ratio_of_the_nearest_rank_value(values: list[float], q: float) -> None:
    counters = SetCounters()
    for value in values:
        counters.observe("m", value)
    result = counters.quantile_ms("m", q)
    assert result is not None
    ordered = sorted(values)
    nearest_rank = ordered[max(0, math.ceil(q * len(values)) - 1)]
    # Both lie in the bucket holding that rank, whose bounds differ by at most the ratio r (above
    # the lowest bound: below it, only the absolute error is bounded, by 0.1 ms).
    assert abs(result - nearest_rank) / nearest_rank < LATENCY_LAYOUT.ratio - 1 + 1e-12


def test_metrics_store_replaces_a_replicas_counters_and_sums_replicas() -> None:
    store = MetricsStore()
    first = SetCounters(requests=10, errors=1)
    first.observe("latency_ms", 7)
    store.push("replica-a", {"app.s1": first.model_dump()})
    # Cumulative: the next push from the same replica replaces, not adds.
    later = SetCounters(requests=25, errors=2)
    later.observe("latency_ms", 7)
    later.observe("latency_ms", 150)
    store.push("replica-a", {"app.s1": later.model_dump()})
    other = SetCounters(requests=4, errors=0)
    other.observe("latency_ms", 7)
    store.push("replica-b", {"app.s1": other.model_dump(), "app.s2": SetCounters(requests=3).model_dump()})

    snapshot = store.snapshot()
    s1 = snapshot["sets"]["app.s1"]
    assert (s1["requests"], s1["errors"]) == (29, 2)
    assert s1["histograms"]["latency_ms"][bisect.bisect_left(BOUNDS, 7)] == 2
    assert s1["histograms"]["latency_ms"][bisect.bisect_left(BOUNDS, 150)] == 1
    assert snapshot["sets"]["app.s2"] == SetCounters(requests=3).model_dump()
    assert snapshot["sets"]["app.s2"]["layout"] == LATENCY_LAYOUT.model_dump()
    # Each replica's own latest counters ride along, for gates that diff replica by replica.
    assert snapshot["replicas"]["replica-a"]["app.s1"]["requests"] == 25
    assert sorted(snapshot["replicas"]["replica-b"]) == ["app.s1", "app.s2"]


def test_metrics_store_drops_a_push_that_does_not_fit_its_layout() -> None:
    store = MetricsStore()
    good = SetCounters(requests=2)
    good.observe("latency_ms", 7)
    store.push("replica-a", {"app": good.model_dump()})
    torn = {**good.model_dump(), "histograms": {"latency_ms": [1, 2, 3]}}
    store.push("replica-a", {"app": torn})  # kept: the last good push
    assert store.snapshot()["replicas"]["replica-a"]["app"] == good.model_dump()


def test_empty_metrics_store() -> None:
    assert MetricsStore().snapshot() == {"sets": {}, "replicas": {}}


# --- pick_set ---------------------------------------------------------------------------------


def test_pick_set_single_app() -> None:
    rng = random.Random(1)
    assert {pick_set({"a": 100}, None, rng) for _ in range(200)} == {"a"}


def test_pick_set_skips_zero_weights() -> None:
    rng = random.Random(2)
    assert {pick_set({"a": 0, "b": 100}, None, rng) for _ in range(500)} == {"b"}
    assert {pick_set({"a": 0, "b": 100}, f"user-{i}", rng) for i in range(500)} == {"b"}


def test_pick_set_with_no_weights() -> None:
    rng = random.Random(3)
    assert pick_set({}, None, rng) is None
    assert pick_set({"a": 0, "b": 0}, None, rng) is None
    assert pick_set({}, "user-1", rng) is None


def test_pick_set_sticky_key() -> None:
    weights: dict[str, float] = {"a": 50, "b": 50}
    for i in range(50):
        key = f"user-{i}"
        picks = {pick_set(weights, key, random.Random(seed)) for seed in range(20)}
        assert len(picks) == 1
    # Keys still spread over both apps.
    assert {pick_set(weights, f"user-{i}", random.Random(0)) for i in range(200)} == {"a", "b"}


def test_pick_set_follows_the_weights() -> None:
    rng = random.Random(0)
    draws = Counter(pick_set({"a": 30, "b": 70}, None, rng) for _ in range(20_000))
    assert set(draws) == {"a", "b"}
    assert 0.27 <= draws["a"] / 20_000 <= 0.33


def test_pick_set_keys_follow_the_weights() -> None:
    draws = Counter(pick_set({"a": 30, "b": 70}, f"k{i}", random.Random(0)) for i in range(20_000))
    assert 0.27 <= draws["a"] / 20_000 <= 0.33


def test_non_finite_outputs_are_found_anywhere_in_the_answer() -> None:
    assert all_finite({"scores": [0.1, 0.9], "label": "x", "n": 3})
    assert not all_finite([0.1, float("nan")])
    assert not all_finite({"a": {"b": [1.0, float("inf")]}})


def test_join_shards_gathers_each_group_under_its_part() -> None:
    values = {"user": {"id": 1}, "table-shard0": [1, 2], "table-shard1": [3]}
    joined = join_shards(values, {"table": ["table-shard0", "table-shard1"]})
    assert joined == {"user": {"id": 1}, "table": [1, 2, 3]}
    with pytest.raises(RuntimeError, match="only the shards"):
        join_shards({"table-shard1": [3]}, {"table": ["table-shard0", "table-shard1"]})


# --- pick_apps (parts that roll on their own) ------------------------------------------------


def test_pick_apps_without_parts_runs_and_counts_the_set() -> None:
    config = RouterConfig(generation=3, weights={"old": 100})
    assert pick_apps(config, {"old"}, None, random.Random(1)) == PickedApps("old", "old", {})


def test_pick_apps_moves_only_the_gated_part_and_counts_by_it() -> None:
    config = RouterConfig(
        generation=4, weights={"old": 100}, parts={"embed": {"old": 70, "new": 30}}, gated_part="embed"
    )
    rng = random.Random(7)
    picks = [pick_apps(config, {"old", "new"}, None, rng) for _ in range(4000)]
    assert all(p is not None for p in picks)
    assert {p[1] for p in picks if p} == {"old"}  # the rest of the DAG never leaves the old set
    assert all(p[0] == p[2]["embed"] for p in picks if p)  # counted where embed ran
    share = sum(1 for p in picks if p and p[2]["embed"] == "new") / len(picks)
    assert 0.27 < share < 0.33, share


def test_pick_apps_keeps_moved_parts_and_skips_unreachable_apps() -> None:
    config = RouterConfig(
        generation=5,
        weights={"old": 100},
        parts={"embed": {"new": 100}, "dense": {"old": 50, "new": 50}},
        gated_part="dense",
    )
    rng = random.Random(3)
    for _ in range(200):
        picked = pick_apps(config, {"old", "new"}, None, rng)
        assert picked is not None and picked[2]["embed"] == "new"
    # An app the router has no route to yet is never drawn.
    assert {pick_apps(config, {"old"}, None, rng)[2]["dense"] for _ in range(200)} == {"old"}  # type: ignore[index]
    assert pick_apps(config, set(), None, rng) is None


def test_router_config_gated_part_needs_weights() -> None:
    with pytest.raises(ValueError, match="gated_part 'dense' has no weights"):
        RouterConfig(generation=1, weights={"old": 100}, parts={"embed": {"new": 100}}, gated_part="dense")
    assert RouterConfig(generation=1, weights={"a": 1}, parts={"e": {"b": 1}}).apps() == {"a", "b"}
