"""The metrics hub (serving/metrics_hub.py): one actor per region that holds the metrics stores of
many models. As a plain object, each store answers as a bare MetricsStore would, saves its demand
where the model's own actor would, and adopts routers' first pushes after a restart; names and
methods outside the store's surface are refused. One test on a local Ray finds a hub's store and a
model's own actor by the same call."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ipnext.contracts.counters import SetCounters
from ipnext.policy.demand import load_history
from ipnext.serving import metrics as store_module
from ipnext.serving.layout import metrics_actor_name
from ipnext.serving.llm.vllm_metrics import EngineStats
from ipnext.serving.metrics import DemandPlace, MetricsStore, demand_file, store_key
from ipnext.serving.metrics_hub import (
    STORE_METHODS,
    MetricsHub,
    StoreRef,
    drop_stores,
    find_stores,
    hub_actor_name,
    hub_store,
)
from ipnext.serving.prometheus_text import FamilySpec, SeriesTally

pytestmark = pytest.mark.timeout(60)

REGION = "us-east"
ALPHA = metrics_actor_name("alpha", REGION)
BETA = metrics_actor_name("beta", REGION)
T0 = 1_700_000_000.0
_REQUESTS = FamilySpec(name="ipnext_requests_total", kind="counter", help="Requests", labels=("model",))


@pytest.fixture(autouse=True)
def _frozen_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Demand reports read the wall clock: one fixed instant, so two stores' reports compare."""
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=lambda: T0, monotonic=time.monotonic))


def _counters(requests: int, errors: int = 0) -> dict[str, dict[str, Any]]:
    counters = SetCounters(requests=requests, errors=errors)
    counters.observe("latency_ms", 7)
    return {"alpha.us-east.s1.r0": counters.model_dump()}


def _series(n: int) -> dict[str, Any]:
    tally = SeriesTally()
    for _ in range(n):
        tally.inc(_REQUESTS, ("alpha",))
    return tally.state().model_dump()


def _feed(push: Any) -> None:
    """The same pushes, into a hub's store or a bare one (`push(method, *args)`)."""
    push("push", "r1", _counters(10, 1))
    push("push", "r2", _counters(4))
    push("push_demand", "r1", {"us-east": 30, "eu-west": 2})
    push("push_demand", "r1", {"us-east": 42, "eu-west": 2})
    push("push_engine_stats", "r1", EngineStats().model_dump())
    push("push_series", "p1", _series(3))


def test_the_forwarded_methods_are_the_stores_public_ones_and_a_ref_has_each() -> None:
    public = {name for name in vars(MetricsStore) if not name.startswith("_")}
    assert set(STORE_METHODS) == public
    assert all(hasattr(StoreRef, name) for name in STORE_METHODS)


def test_a_store_is_made_on_its_first_call_and_answers_as_a_bare_store(tmp_path: Path) -> None:
    hub = MetricsHub(REGION, demand_dir=str(tmp_path), save_seconds=3600)
    assert hub.stores() == [] and not hub.holds(ALPHA)
    bare = MetricsStore()
    _feed(lambda method, *args: hub.call(ALPHA, method, *args))
    _feed(lambda method, *args: getattr(bare, method)(*args))
    assert hub.holds(ALPHA) and not hub.holds(BETA)
    assert hub.stores() == [ALPHA]
    assert hub.call(ALPHA, "snapshot") == bare.snapshot()
    assert hub.call(ALPHA, "snapshot")["sets"]["alpha.us-east.s1.r0"]["requests"] == 14
    assert hub.call(ALPHA, "demand", 5.0) == bare.demand(5.0)
    assert hub.call(ALPHA, "demand", window_seconds=5.0) == bare.demand(5.0)
    assert hub.call(ALPHA, "engine_stats") == bare.engine_stats() is not None
    assert hub.call(ALPHA, "series") == bare.series()
    # Stores are apart: another model's store starts empty.
    assert hub.call(BETA, "snapshot") == {"sets": {}, "replicas": {}}
    assert hub.stores() == [ALPHA, BETA]


@pytest.mark.parametrize("method", ["holds", "drop", "_store", "__init__", "__class__", "snapshots"])
def test_a_method_that_is_not_a_stores_is_refused_by_name(method: str) -> None:
    hub = MetricsHub(REGION)
    with pytest.raises(ValueError, match=rf"method '{method}' is not a metrics store's: use one of push, "):
        hub.call(ALPHA, method)
    assert hub.stores() == []


@pytest.mark.parametrize(
    ("store", "says"),
    [
        ("alpha/us-east", "not a metrics store name: expected 'ipnext-metrics/<model>/<region>'"),
        ("ipnext-metrics/Alpha/us-east", "not a metrics store name"),
        ("ipnext-metrics/alpha/us-east/x", "not a metrics store name"),
        (hub_actor_name(REGION), "not a metrics store name"),
        (metrics_actor_name("alpha", "eu-west"), r"of region 'eu-west', not of this hub's region 'us-east'"),
    ],
)
def test_a_store_name_of_another_shape_or_region_is_refused(store: str, says: str) -> None:
    hub = MetricsHub(REGION)
    for attempt in (lambda: hub.call(store, "snapshot"), lambda: hub.holds(store), lambda: hub.drop(store)):
        with pytest.raises(ValueError, match=says):
            attempt()
    assert hub.stores() == []
    with pytest.raises(ValueError, match=says):  # refused before any Ray call
        hub_store(REGION, store)


def test_a_hub_of_a_malformed_region_is_refused() -> None:
    with pytest.raises(ValueError, match=r"region 'US East' is not a region name"):
        MetricsHub("US East")


def test_hub_names_never_parse_as_a_models_store() -> None:
    assert store_key(hub_actor_name(REGION)) is None
    assert store_key(ALPHA) == ("alpha", REGION)


def test_drop_saves_the_demand_where_the_models_own_actor_would_and_forgets_the_store(tmp_path: Path) -> None:
    hub = MetricsHub(REGION, demand_dir=str(tmp_path), save_seconds=3600)  # no save on push
    hub.call(ALPHA, "push_demand", "r1", {"us-east": 40})
    hub.call(BETA, "push", "r1", _counters(1))
    saved = demand_file(tmp_path, "alpha", REGION)
    assert not saved.exists()
    assert hub.drop(ALPHA) is True
    assert hub.stores() == [BETA] and not hub.holds(ALPHA)
    history = load_history(saved)
    assert history is not None and history.replicas == {"r1": {"us-east": 40}}
    assert hub.drop(ALPHA) is False
    # Made again (the model came back), the store loads what was saved.
    assert hub.call(ALPHA, "demand", 5.0)["sources"]["us-east"]["requests"] == 40


def _counted_after_a_restart(call: Any) -> int:
    """What a store counts of a router that had served 5000 requests before the restart, then 12."""
    call("push_demand", "r1", {"us-east": 5000})
    call("push_demand", "r1", {"us-east": 5012})
    return int(call("demand", 5.0)["sources"]["us-east"]["requests"])


def test_a_restarted_hub_adopts_each_routers_first_push_as_a_restarted_actor_does(tmp_path: Path) -> None:
    restarted = MetricsHub(REGION, demand_dir=str(tmp_path / "a"), reconstructed=True)
    fresh = MetricsHub(REGION, demand_dir=str(tmp_path / "b"), reconstructed=False)
    assert _counted_after_a_restart(lambda method, *args: restarted.call(ALPHA, method, *args)) == 12
    assert _counted_after_a_restart(lambda method, *args: fresh.call(ALPHA, method, *args)) == 5012
    # The same rule as a model's own actor that Ray restarted without a saved history.
    bare = MetricsStore(place=DemandPlace(None, 5.0, reconstructed=True))
    assert _counted_after_a_restart(lambda method, *args: getattr(bare, method)(*args)) == 12
    # With a saved history there is a baseline: a router it never saw counts from zero, as there.
    assert restarted.drop(ALPHA)
    again = MetricsHub(REGION, demand_dir=str(tmp_path / "a"), reconstructed=True)
    again.call(ALPHA, "push_demand", "r2", {"us-east": 7})
    assert again.call(ALPHA, "demand", 5.0)["sources"]["us-east"]["requests"] == 12 + 7


def test_a_store_is_given_its_place_or_its_path_never_both() -> None:
    with pytest.raises(ValueError, match="give `place`, or `demand_path` and `save_seconds`, not both"):
        MetricsStore("/tmp/x.json", place=DemandPlace(None, 5.0))


class _Method:
    def __init__(self, calls: list[tuple[Any, ...]], name: str) -> None:
        self._calls, self._name = calls, name

    def remote(self, *args: Any, **kwargs: Any) -> str:
        self._calls.append((self._name, args, kwargs))
        return "object-ref"


def test_a_ref_forwards_to_its_hub_or_calls_its_own_actor() -> None:
    calls: list[tuple[Any, ...]] = []
    hub = SimpleNamespace(call=_Method(calls, "call"))
    own = SimpleNamespace(snapshot=_Method(calls, "snapshot"), demand=_Method(calls, "demand"))
    assert StoreRef(ALPHA, hub, pooled=True).push.remote("r1", {"a": {}}) == "object-ref"
    StoreRef(ALPHA, hub, pooled=True).demand.remote(window_seconds=60.0)
    StoreRef(ALPHA, own, pooled=False).snapshot.remote()
    StoreRef(ALPHA, own, pooled=False).demand.remote(60.0)
    assert calls == [
        ("call", (ALPHA, "push", "r1", {"a": {}}), {}),
        ("call", (ALPHA, "demand"), {"window_seconds": 60.0}),
        ("snapshot", (), {}),
        ("demand", (60.0,), {}),
    ]
    with pytest.raises(AttributeError):
        StoreRef(ALPHA, hub, pooled=True).holds  # type: ignore[attr-defined]  # noqa: B018 - not a store's method


@pytest.mark.timeout(120)
def test_on_ray_a_hubs_store_and_a_models_own_actor_are_both_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from ipnext.serving.layout import RAY_NAMESPACE

    # The actors' processes inherit this: their demand files go to the test's folder.
    monkeypatch.setenv("IPNEXT_DEMAND_DIR", str(tmp_path))
    ray.init(num_cpus=1, include_dashboard=False, namespace=RAY_NAMESPACE)
    try:
        assert find_stores("alpha", REGION) == []
        ray.get(hub_store(REGION, ALPHA).push.remote("r1", _counters(10, 1)))
        (found,) = find_stores("alpha", REGION)
        assert found.pooled and found.store == ALPHA
        assert ray.get(found.snapshot.remote())["sets"]["alpha.us-east.s1.r0"]["requests"] == 10
        assert ray.get(found.demand.remote(window_seconds=5.0))["sources"] == {}  # keywords pass too
        assert find_stores("beta", REGION) == []  # the hub runs, but holds no store of beta

        own: Any = (
            ray.remote(MetricsStore)
            .options(name=ALPHA, namespace=RAY_NAMESPACE, lifetime="detached", num_cpus=0)
            .remote()
        )
        ray.get(own.push.remote("r2", _counters(3)))
        both = find_stores("alpha", REGION)
        assert [ref.pooled for ref in both] == [False, True]
        requests = [ray.get(ref.snapshot.remote())["sets"]["alpha.us-east.s1.r0"]["requests"] for ref in both]
        assert requests == [3, 10]

        assert drop_stores("alpha", REGION) == 2
        assert find_stores("alpha", REGION) == []
        assert drop_stores("alpha", REGION) == 0
    finally:
        ray.shutdown()


def test_push_many_takes_every_models_push_in_one_call_as_their_own_pushes_would(tmp_path: Path) -> None:
    hub = MetricsHub(REGION, demand_dir=str(tmp_path), save_seconds=3600)
    bare = MetricsStore()
    bare.push("r1", _counters(10, 1))
    bare.push_demand("r1", {"us-east": 30})
    bare.push_series("p1", _series(3))
    pushes = {
        ALPHA: {
            "replica": "r1",
            "counters": _counters(10, 1),
            "demand": {"us-east": 30},
            "series": _series(3),
        },
        BETA: {"replica": "r9", "counters": _counters(2), "demand": {}, "series": None},
        "ipnext-metrics/gamma/eu-west": {"replica": "r1", "counters": {}},  # another region's: refused
        metrics_actor_name("delta", REGION): {"counters": {}},  # no replica key: refused
    }
    assert hub.push_many("p1", pushes) == 2
    assert hub.call(ALPHA, "snapshot") == bare.snapshot()
    assert hub.call(ALPHA, "series") == bare.series()
    assert hub.call(BETA, "snapshot")["sets"]["alpha.us-east.s1.r0"]["requests"] == 2
    assert hub.stores() == [ALPHA, BETA]
