"""One metrics door: the routing app's keyed `GET /metrics` serves ipnext's own series beside
vLLM's names, from what the (model, region) metrics actors hold. The replicas' recorders
(serving/export.py) tally what they record, the actor (`MetricsStore`) sums the processes'
tallies, and the scrape renders them; parsed back with prometheus_client's own parser, the
figures are those recorded, under the names and labels Ray's export gave them. An actor that is
missing, fails or is slow costs its own series only, and the scrape says so."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipnext.contracts.counters import LATENCY_LAYOUT, SetCounters, histogram_quantile
from ipnext.contracts.routing import RoutingDocument, RoutingTable
from ipnext.serving import export
from ipnext.serving import metrics as store_module
from ipnext.serving.llm.vllm_metrics import BUCKETS, COUNTERS, GAUGES, EngineStats
from ipnext.serving.metrics import MetricsStore
from ipnext.serving.prometheus_text import (
    ACTOR_UP,
    REPLICA_LABEL,
    ActorFigures,
    FamilySpec,
    ProcessSeries,
    SeriesState,
    SeriesTally,
)
from ipnext.serving.routing_app import metrics_exposition

pytestmark = pytest.mark.timeout(60)

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]
APP, OLD_APP = "m.us-east.s2.r0", "m.us-east.s1.r0"
LATENCIES = [0.4, 3.0, 12.5, 12.5, 40.0, 95.0, 310.0, 2_000.0, 200_000.0]


def samples(text: str) -> Samples:
    """Sample name -> {labels: value}, by prometheus_client's parser (the `_created` samples
    prometheus_client adds to its own counters left out: Ray's export has none)."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def families(text: str) -> dict[str, str]:
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def ray_like(registry: prometheus_client.CollectorRegistry) -> SimpleNamespace:
    """Stand-ins for `ray.util.metrics` that keep what the recorders give Ray in a
    prometheus_client registry, under the names and tags they give it (Ray's endpoint puts `ray_`
    in front; that prefix is the one difference the door was meant to drop)."""

    made_by_name: dict[str, Any] = {}

    def made(kind: type[Any], name: str, description: str, tag_keys: tuple[str, ...], **kw: Any) -> Any:
        # As Ray's: a metric declared again in the process (another replica object) is the same one.
        if name not in made_by_name:
            made_by_name[name] = kind(name, description, labelnames=tag_keys, registry=registry, **kw)
        return made_by_name[name]

    class Counter:
        def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
            self._m = made(prometheus_client.Counter, name, description, tag_keys)

        def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
            self._m.labels(**(tags or {})).inc(value)

    class Histogram:
        def __init__(
            self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...] = ()
        ) -> None:
            self._m = made(prometheus_client.Histogram, name, description, tag_keys, buckets=boundaries)

        def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
            self._m.labels(**(tags or {})).observe(value)

    class Gauge:
        def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
            self._m = made(prometheus_client.Gauge, name, description, tag_keys)

        def set(self, value: float, tags: dict[str, str] | None = None) -> None:
            self._m.labels(**(tags or {})).set(value)

    return SimpleNamespace(Counter=Counter, Histogram=Histogram, Gauge=Gauge)


def document(model: str, regions: list[str], generative: bool = False) -> RoutingDocument:
    share = 1 / len(regions)
    return RoutingDocument(
        model=model,
        generation=1,
        ttl_seconds=30,
        routes={r: dict.fromkeys(regions, share) for r in regions},
        generative=generative,
    )


def answering(figures: dict[tuple[str, str], ActorFigures | None]) -> Callable[..., Any]:
    """A fake of the routing app's actor call: each (model, region) answers its figures (None:
    no actor); a region absent from `figures` never answers."""

    async def ask(model: str, region: str, generative: bool) -> ActorFigures | None:
        if (model, region) not in figures:
            await asyncio.Event().wait()
        return figures[model, region]

    return ask


def two_router_processes_and_a_part(monkeypatch: pytest.MonkeyPatch) -> tuple[MetricsStore, SetCounters, str]:
    """What one region's replicas record and push: two router processes' requests (one also
    sheds, fails, and picks variants) and an LLM part's latency and status; the Ray-side records
    go into a registry, returned as its exposition."""
    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(export, "metrics", ray_like(registry))
    store = MetricsStore()
    gate = SetCounters()  # what the routers push for the gates, counted on the same requests
    first, second = ProcessSeries(), ProcessSeries()
    for i, latency in enumerate(LATENCIES):
        router = export.RouterPrometheus(first if i % 2 else second)
        router.record("m", "us-east", APP, latency)
        gate.requests += 1
        gate.observe("latency_ms", latency)
    router = export.RouterPrometheus(first)
    router.record("m", "us-east", APP, None)  # a failed request: counted, and an error
    router.record("m", "us-east", OLD_APP, 7.0)
    router.record_shed("m", "us-east", APP)
    router.record_variant("m", "us-east", APP, "ranker", "big", None)
    router.record_variant("m", "us-east", APP, "ranker", "small", "timeout")
    part = export.PartPrometheus("m", "us-east", APP, "lm", second)
    part.observe("ttft_ms", 30.0)
    part.gauges(
        {"running": 2, "kv_cache_usage": 0.25, "healthy": True, "ttft_ms": {"p50": 1.0}, "bad-name": 1}
    )
    for process in (first, second):
        tally = process.get("ipnext-metrics/m/us-east")
        assert tally is not None
        store.push_series(process.key, tally.state().model_dump())
    return store, gate, prometheus_client.generate_latest(registry).decode()


async def test_the_door_serves_what_the_replicas_recorded_under_rays_names_beside_vllms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store, gate, ray_exposition = two_router_processes_and_a_part(monkeypatch)
    engine = EngineStats()
    engine.observe_request(0.0, [0.1, 0.2, 0.25], prompt_tokens=5, generated=3)
    store.push_engine_stats("lm-1", engine.model_dump())
    table = RoutingTable(documents={"m": document("m", ["us-east"], generative=True)})
    ask = answering(
        {("m", "us-east"): ActorFigures(SeriesState.model_validate(store.series()), store.engine_stats())}
    )

    text = (await metrics_exposition(table, ask, wait_s=5)).decode()
    got, kinds = samples(text), families(text)

    # vLLM's names are all still there, with the model's figures.
    assert {name: kinds.get(name) for name in [*BUCKETS, *COUNTERS, *GAUGES]} == {
        **dict.fromkeys(BUCKETS, "histogram"),
        **dict.fromkeys(COUNTERS, "counter"),
        **dict.fromkeys(GAUGES, "gauge"),
    }
    assert got["vllm:generation_tokens_total"][key(model_name="m")] == 3
    # ipnext's series: counters end in _total, the histograms keep the gates' layout.
    assert {n: t for n, t in kinds.items() if n.startswith("ipnext_")} == {
        "ipnext_requests": "counter",
        "ipnext_errors": "counter",
        "ipnext_shed": "counter",
        "ipnext_variant_requests": "counter",
        "ipnext_variant_fallbacks": "counter",
        "ipnext_latency_ms": "histogram",
        "ipnext_ttft_ms": "histogram",
        "ipnext_part_running": "gauge",
        "ipnext_part_kv_cache_usage": "gauge",
        ACTOR_UP: "gauge",
    }
    labels = {"model": "m", "region": "us-east", "set_app": APP}
    assert got["ipnext_requests_total"] == {
        key(**labels): len(LATENCIES) + 1,
        key(**{**labels, "set_app": OLD_APP}): 1,
    }
    assert got["ipnext_errors_total"] == {key(**labels): 1}
    assert got["ipnext_shed_total"] == {key(**labels): 1}
    assert got["ipnext_variant_requests_total"] == {
        key(**labels, choice="ranker", variant="big"): 1,
        key(**labels, choice="ranker", variant="small"): 1,
    }
    assert got["ipnext_variant_fallbacks_total"] == {key(**labels, choice="ranker", reason="timeout"): 1}
    buckets = sorted(
        (float(dict(k)["le"]), v)
        for k, v in got["ipnext_latency_ms_bucket"].items()
        if dict(k)["set_app"] == APP
    )
    assert [le for le, _ in buckets] == [*LATENCY_LAYOUT.bounds(), math.inf]
    assert got["ipnext_latency_ms_count"][key(**labels)] == len(LATENCIES) == buckets[-1][1]
    assert got["ipnext_latency_ms_sum"][key(**labels)] == pytest.approx(sum(LATENCIES))
    # A dashboard's p99 over the scraped buckets is the gate's, on the same requests.
    finite = [(le, v) for le, v in buckets]
    counts = [int(b - a) for (_, a), (_, b) in zip([(0.0, 0.0), *finite[:-1]], finite, strict=True)]
    for q in (0.5, 0.99):
        assert histogram_quantile(q, LATENCY_LAYOUT.bounds(), counts) == gate.quantile_ms("latency_ms", q)
    part = {**labels, "part": "lm"}
    assert got["ipnext_ttft_ms_count"] == {key(**part): 1}
    [(running_labels, running)] = got["ipnext_part_running"].items()
    assert running == 2 and dict(running_labels)[REPLICA_LABEL].count(":") == 2
    assert {k: v for k, v in running_labels if k != REPLICA_LABEL} == part
    assert got[ACTOR_UP] == {key(model="m", region="us-east"): 1}
    assert "# ipnext:" not in text

    # The same names, labels and values as the recorders gave Ray (a gauge adds `replica`).
    door = {name: rows for name, rows in got.items() if name.startswith("ipnext_") and name != ACTOR_UP}
    ray_side = samples(ray_exposition)
    for name, rows in door.items():
        if name.startswith("ipnext_part_"):
            rows = {tuple(p for p in k if p[0] != REPLICA_LABEL): v for k, v in rows.items()}
        assert rows.keys() == ray_side[name].keys(), name
        assert rows == pytest.approx(ray_side[name]), name
    assert door.keys() == ray_side.keys()


async def test_a_missing_failing_or_slow_actor_costs_its_own_series_and_is_named() -> None:
    """m answers in us-east and has no actor in eu-west; g (generative) answers in us-east, never
    in eu-west; h's actor fails. The scrape answers within its wait with what answered: m's and
    g's us-east series, `ipnext_metrics_actor_up` 1 or 0 for each, and a comment saying why for
    each left out. g's vLLM figures are left out whole (a sum short of one region would go
    down: a false counter reset); vLLM's families are still declared."""
    tally = SeriesTally()
    requests = FamilySpec(
        name="ipnext_requests_total", kind="counter", help="Requests served", labels=("model",)
    )
    tally.inc(requests, ("m",), 4)
    m_series = tally.state()
    g_tally = SeriesTally()
    g_tally.inc(requests, ("g",), 2)
    engine = EngineStats()
    engine.observe_request(0.0, [0.1], prompt_tokens=5, generated=1)
    cancelled: list[str] = []

    async def ask(model: str, region: str, generative: bool) -> ActorFigures | None:
        if model == "h":
            raise RuntimeError("actor died\nwith a long story")
        if region == "us-east":
            series = m_series if model == "m" else g_tally.state()
            return ActorFigures(series, engine.model_dump() if generative else None)
        if model == "m":
            return None
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(f"{model}/{region}")
            raise
        raise AssertionError("unreachable")

    table = RoutingTable(
        documents={
            "m": document("m", ["us-east", "eu-west"]),
            "g": document("g", ["us-east", "eu-west"], generative=True),
            "h": document("h", ["us-east"]),
        }
    )
    text = (await metrics_exposition(table, ask, wait_s=0.2)).decode()
    for _ in range(3):  # the cancelled ask runs its handler
        await asyncio.sleep(0)
    got, kinds = samples(text), families(text)
    assert cancelled == ["g/eu-west"]  # the slow actor was given up on, not waited for
    assert got["ipnext_requests_total"] == {key(model="m"): 4, key(model="g"): 2}
    assert got[ACTOR_UP] == {
        key(model="m", region="us-east"): 1,
        key(model="m", region="eu-west"): 0,
        key(model="g", region="us-east"): 1,
        key(model="g", region="eu-west"): 0,
        key(model="h", region="us-east"): 0,
    }
    assert all(kinds[name] for name in [*BUCKETS, *COUNTERS, *GAUGES])
    assert not any(name.startswith("vllm:") for name in got), "g's vLLM figures are short of eu-west"
    notes = [line for line in text.splitlines() if line.startswith("# ipnext:")]
    assert notes == [
        "# ipnext: metrics actor of model g in region eu-west: left out: did not answer within 0.2 s",
        "# ipnext: metrics actor of model h in region us-east: left out: failed: RuntimeError: actor died",
        "# ipnext: metrics actor of model m in region eu-west: left out: no metrics actor "
        "(no replica of the region has pushed to one)",
    ]


async def test_an_actor_of_an_older_version_still_gives_its_vllm_figures() -> None:
    engine = EngineStats()
    engine.observe_request(0.0, [0.1], prompt_tokens=5, generated=1)
    table = RoutingTable(documents={"g": document("g", ["us-east"], generative=True)})
    ask = answering({("g", "us-east"): ActorFigures(None, engine.model_dump())})
    text = (await metrics_exposition(table, ask, wait_s=5)).decode()
    got = samples(text)
    assert got["vllm:generation_tokens_total"] == {key(model_name="g"): 1}
    assert got[ACTOR_UP] == {key(model="g", region="us-east"): 1}
    assert "# ipnext: metrics actor of model g in region us-east: answered without ipnext series" in text


def test_the_actor_keeps_a_gone_replicas_counts_drops_its_gauges_and_malformed_pushes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Counters summed over every process that pushed never go down when one goes quiet; its
    gauges (a moment) leave after SERIES_GAUGES_STALE_S; garbage is dropped, the last good push
    staying; a family two versions declare differently keeps one declaration."""
    requests = FamilySpec(
        name="ipnext_requests_total", kind="counter", help="Requests served", labels=("model",)
    )
    running = FamilySpec(name="ipnext_part_running", kind="gauge", help="running", labels=("model",))
    store = MetricsStore()
    for process, (n, now_running) in {"a": (3, 1.0), "b": (5, 2.0)}.items():
        tally = SeriesTally()
        tally.inc(requests, ("m",), n)
        tally.set(running, ("m",), now_running)
        store.push_series(process, tally.state().model_dump())
    store.push_series("b", {"families": {"x": {"kind": "histogram"}}})  # garbage: b's last push stays
    other = requests.model_copy(update={"labels": ("model", "zone")})
    store.push_series(
        "c", {"families": {other.name: {**other.model_dump(), "samples": [{"labels": ["m", "z"]}]}}}
    )
    state = SeriesState.model_validate(store.series())
    [counted] = state.families["ipnext_requests_total"].samples
    assert (counted.labels, counted.value) == (("m",), 8)  # c's declaration of the family lost to a's
    gauges = {s.labels: s.value for s in state.families["ipnext_part_running"].samples}
    assert gauges == {("m", "a"): 1.0, ("m", "b"): 2.0}

    tally = SeriesTally()
    tally.inc(requests, ("m",), 6)
    store.push_series("b", tally.state().model_dump())  # b pushes again: its latest replaces
    later = store_module.time.monotonic() + store_module.SERIES_GAUGES_STALE_S + 1
    monkeypatch.setattr(
        store_module, "time", SimpleNamespace(monotonic=lambda: later, time=store_module.time.time)
    )
    state = SeriesState.model_validate(store.series())
    assert [s.value for s in state.families["ipnext_requests_total"].samples] == [9]
    assert "ipnext_part_running" not in state.families


def test_a_family_spec_refuses_what_prometheus_would() -> None:
    good = {"name": "ipnext_x_total", "kind": "counter", "help": "x", "labels": ("model",)}
    FamilySpec.model_validate(good)
    for bad in (
        {**good, "name": "ipnext_x"},  # a counter not ending in _total
        {**good, "name": "ipnext-x_total"},
        {**good, "labels": ("model", "model")},
        {**good, "labels": ("le",)},
        {**good, "kind": "histogram", "name": "ipnext_x_ms"},  # a histogram without bounds
        {**good, "kind": "histogram", "name": "ipnext_x_ms", "bounds": (2.0, 1.0)},
    ):
        with pytest.raises(ValueError, match="ipnext"):
            FamilySpec.model_validate(bad)
