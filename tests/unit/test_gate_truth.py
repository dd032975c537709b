"""Gates judge the truth: a gate's p99 is Prometheus' `histogram_quantile` over the one bucket
layout the exporter also uses, so it is within the ratio r of the true p99 and equal to what a
dashboard computes from the scraped histogram; counters recorded on the legacy bounds (old
workflow histories) are still read by the legacy rule."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipnext.contracts.counters import LATENCY_LAYOUT, LEGACY_BUCKETS_MS, SetCounters
from ipnext.contracts.rollout import GateReading
from ipnext.policy.gates import evaluate_gates, judge_window, window_counters
from ipnext.spec.model import GateSpec

R = LATENCY_LAYOUT.ratio
BOUNDS = LATENCY_LAYOUT.bounds()
# Bucket indices from the lowest to the highest finite bound: sub-ms, ms, 100s of ms, seconds, 2 min.
EDGES = [1, 40, 120, 160, 200, 240, len(BOUNDS) - 1]


def p99_gate(samples: list[float], limit: float) -> GateReading:
    """The `latency_p99_ms` gate with `max: limit` on a new set that served `samples`."""
    new = SetCounters(requests=len(samples))
    for value in samples:
        new.observe("latency_ms", value)
    [reading] = evaluate_gates(
        [GateSpec(metric="latency_p99_ms", max=limit)], "r", new, SetCounters(), min_requests=10
    )
    return reading


def nearest_rank(samples: list[float], q: float) -> float:
    return sorted(samples)[math.ceil(q * len(samples)) - 1]


# --- (a) a true p99 within 2(r - 1) of the limit is judged on the right side of it ---------------


@pytest.mark.parametrize("i", EDGES)
def test_a_true_p99_at_limit_times_1_minus_2_r_minus_1_passes(i: int) -> None:
    lower, upper = BOUNDS[i - 1], BOUNDS[i]
    true_p99 = math.nextafter(lower, math.inf)  # at the lower edge of bucket (lower, upper]
    limit = true_p99 / (1 - 2 * (R - 1))
    # The 990th of 1000 samples (the p99) alone in its bucket: the interpolation reads the bucket's
    # upper edge, the most it can overstate a p99 at the lower edge.
    samples = [lower / 4] * 989 + [true_p99] + [upper * 4] * 10
    assert nearest_rank(samples, 0.99) == true_p99
    reading = p99_gate(samples, limit)
    print(f"bucket {i}: true p99 {true_p99:.6g} ms, gate {reading.value:.6g} ms, limit {limit:.6g} ms")
    assert reading.judged and not reading.breached
    assert reading.value == pytest.approx(upper, rel=1e-12)
    assert reading.value is not None and abs(reading.value - true_p99) / true_p99 < R - 1


@pytest.mark.parametrize("i", EDGES)
def test_a_true_p99_at_limit_times_1_plus_2_r_minus_1_breaches(i: int) -> None:
    lower, upper = BOUNDS[i - 1], BOUNDS[i]
    true_p99 = upper  # at the upper edge of bucket (lower, upper]
    limit = true_p99 / (1 + 2 * (R - 1))
    # The p99 is the first of 11 samples at the bucket's upper edge: the interpolation reads just
    # above the lower edge, the most it can understate it.
    samples = [lower / 4] * 989 + [upper] * 11
    assert nearest_rank(samples, 0.99) == true_p99
    reading = p99_gate(samples, limit)
    print(f"bucket {i}: true p99 {true_p99:.6g} ms, gate {reading.value:.6g} ms, limit {limit:.6g} ms")
    assert reading.judged and reading.breached
    assert reading.value == pytest.approx(lower + (upper - lower) / 11, rel=1e-12)
    assert reading.value is not None and abs(reading.value - true_p99) / true_p99 < R - 1


def test_the_issues_healthy_v2_now_passes_and_the_legacy_rule_would_have_breached_it() -> None:
    # A healthy v2 whose true p99 is 310 ms, with a 400 ms limit: the legacy rule read the
    # bucket (300, 500] as 500 and rolled it back.
    samples = [40.0] * 985 + [310.0] * 10 + [320.0] * 5
    assert nearest_rank(samples, 0.99) == 310
    assert not p99_gate(samples, 400).breached
    legacy = SetCounters(requests=len(samples), layout=None)
    for value in samples:
        legacy.observe("latency_ms", value)
    [reading] = evaluate_gates([GateSpec(metric="latency_p99_ms", max=400)], "r", legacy, SetCounters(), 10)
    assert reading.value == 500 and reading.breached


# --- (b) histories recorded on the legacy bounds replay as they ran ------------------------------


def legacy_dump(requests: int, errors: int, latencies: dict[float, int]) -> dict[str, Any]:
    """Counters as the code before layouts pushed and recorded them: 22 counts, no `layout`."""
    counts = [0] * 22
    for value, n in latencies.items():
        counts[next((k for k, b in enumerate(LEGACY_BUCKETS_MS) if value <= b), 21)] += n
    return {"requests": requests, "errors": errors, "histograms": {"latency_ms": counts}}


def test_a_recorded_legacy_window_gives_the_legacy_answers() -> None:
    gates = [GateSpec(metric="latency_p99_ms", max=400), GateSpec(metric="error_rate", max=0.01)]
    before = {"us-east": {"sets": {}, "replicas": {"r1": {"new": legacy_dump(0, 0, {})}}}}
    after = {
        "us-east": {
            "sets": {},
            "replicas": {
                "r1": {"new": legacy_dump(100, 0, {40: 95, 310: 5}), "old": legacy_dump(50, 0, {9: 50})},
                "r2": {"new": legacy_dump(20, 2, {12_000: 18})},  # above the last legacy bound
            },
        }
    }
    readings, requests = judge_window(gates, 10, ["us-east"], before, after, {"new"}, {"old"})
    assert requests == 120
    latency, errors = readings
    # The legacy rule: rank 0.99 x 118 falls in the top bucket, read as infinity; the old set's
    # p99 is its bucket's upper bound, 10 ms.
    assert (latency.value, latency.old_value, latency.breached) == (float("inf"), 10, True)
    assert errors.value == pytest.approx(2 / 120) and errors.breached
    window = window_counters(before["us-east"], after["us-east"], {"new"})
    assert window.layout is None and len(window.histograms["latency_ms"]) == 22
    assert window.quantile_ms("latency_ms", 0.5) == 50  # 95 at 40 ms: the (30, 50] bucket
    assert window.quantile_ms("latency_ms", 0.83) == 500  # the 5 at 310 ms: the (300, 500] bucket


def test_a_recorded_sums_only_snapshot_still_reads_by_the_legacy_rule() -> None:
    before = {"sets": {"new": legacy_dump(10, 0, {5: 10})}}
    after = {"sets": {"new": legacy_dump(110, 0, {5: 98, 150: 2})}}
    window = window_counters(before, after, {"new"})
    assert window.histograms["latency_ms"][LEGACY_BUCKETS_MS.index(5)] == 88
    assert window.quantile_ms("latency_ms", 0.99) == 150


def test_a_replica_that_comes_back_on_the_new_layout_counts_from_zero() -> None:
    upgraded = SetCounters(requests=7)
    for _ in range(7):
        upgraded.observe("latency_ms", 20)
    # Its counters did not go down, but they were counted on another layout: a new process.
    before = {"sets": {}, "replicas": {"r1": {"new": legacy_dump(5, 0, {20: 5})}}}
    after = {"sets": {}, "replicas": {"r1": {"new": upgraded.model_dump()}}}
    window = window_counters(before, after, {"new"})
    assert (window.requests, window.errors, window.layout) == (7, 0, LATENCY_LAYOUT)
    assert sum(window.histograms["latency_ms"]) == 7
    # And back: a replica on the legacy bounds after one on the layout restarted too.
    back = window_counters(
        after, {"sets": {}, "replicas": {"r1": {"new": legacy_dump(9, 0, {20: 9})}}}, {"new"}
    )
    assert (back.requests, back.layout) == (9, None)


def test_a_sum_over_two_layouts_keeps_the_current_one_in_any_order() -> None:
    legacy = SetCounters.model_validate(legacy_dump(40, 2, {300: 38}))
    current = SetCounters(requests=10, errors=1)
    for _ in range(9):
        current.observe("latency_ms", 30)
    empty = SetCounters(requests=5, errors=5)
    sums = [
        legacy.plus(current).plus(empty),
        empty.plus(current).plus(legacy),
        current.plus(empty.plus(legacy)),
    ]
    assert all(s == sums[0] for s in sums)
    total = sums[0]
    assert (total.requests, total.errors, total.layout) == (55, 8, LATENCY_LAYOUT)
    assert sum(total.histograms["latency_ms"]) == 9  # the legacy side's latencies are left out
    assert legacy.minus(current) == legacy  # never zipped: counted from zero
    assert current.went_down_from(SetCounters.model_validate(legacy_dump(5, 0, {300: 5})))


# --- (c) a dashboard's p99, from the scraped histogram, is the gate's ----------------------------


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' `histogram_quantile`, as its documentation describes it, over cumulative
    (le, count) pairs: find the bucket where the rank q x count(+Inf) falls and interpolate
    linearly between its lower and upper bound; the lowest bucket's lower bound is 0 when its
    upper bound is positive; a rank in the +Inf bucket answers the highest finite bound."""
    buckets = sorted(buckets)
    rank = q * buckets[-1][1]
    for position, (le, cumulative) in enumerate(buckets):
        if cumulative < rank:
            continue
        if math.isinf(le):
            return buckets[position - 1][0]
        lower_le, lower_cumulative = buckets[position - 1] if position else (0.0, 0.0)
        if position == 0 and le <= 0:
            return le
        return lower_le + (le - lower_le) * (rank - lower_cumulative) / (cumulative - lower_cumulative)
    raise AssertionError("no bucket holds the rank")


def prometheus_backed(registry: prometheus_client.CollectorRegistry) -> SimpleNamespace:
    """Stand-ins for `ray.util.metrics` that keep the exporter's metrics in a prometheus_client
    registry, named as Ray's endpoint names them (`ray_` first); the bounds and every observation
    are the exporter's own."""

    class Counter:
        def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
            self._metric = prometheus_client.Counter(
                f"ray_{name}", description or name, labelnames=tag_keys, registry=registry
            )

        def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
            self._metric.labels(**(tags or {})).inc(value)

    class Histogram:
        def __init__(
            self, name: str, description: str, boundaries: list[float], tag_keys: tuple[str, ...] = ()
        ) -> None:
            self._metric = prometheus_client.Histogram(
                f"ray_{name}", description, labelnames=tag_keys, buckets=boundaries, registry=registry
            )

        def observe(self, value: float, tags: dict[str, str] | None = None) -> None:
            self._metric.labels(**(tags or {})).observe(value)

    return SimpleNamespace(Counter=Counter, Histogram=Histogram)


def scraped_buckets(exposition: str, family: str, labels: dict[str, str]) -> list[tuple[float, float]]:
    [parsed] = [f for f in text_string_to_metric_families(exposition) if f.name == family]
    assert parsed.type == "histogram"
    return [
        (float(s.labels["le"]), s.value)
        for s in parsed.samples
        if s.name == f"{family}_bucket" and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def sample_sets() -> list[tuple[str, list[float]]]:
    rng = random.Random(17)
    return [
        ("lognormal around 40 ms", [rng.lognormvariate(math.log(40), 0.6) for _ in range(2000)]),
        (
            "sub-ms and a slow tail",
            [rng.uniform(0.2, 0.9) for _ in range(970)] + [rng.uniform(300, 500) for _ in range(30)],
        ),
        ("a few past two minutes", [rng.uniform(5, 50) for _ in range(95)] + [200_000.0] * 5),
        ("one request", [412.5]),
    ]


@pytest.mark.parametrize(("name", "samples"), sample_sets(), ids=[n for n, _ in sample_sets()])
def test_a_dashboards_quantile_of_the_scraped_histogram_is_the_gates(
    name: str, samples: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ipnext.serving import export

    registry = prometheus_client.CollectorRegistry()
    monkeypatch.setattr(export, "metrics", prometheus_backed(registry))
    router = export.RouterPrometheus()
    part = export.PartPrometheus("m", "us-east", "m.us-east.s2.r0", "lm")
    counted = SetCounters()
    for value in samples:  # what a router's `_count` and a generative part's observer do
        counted.requests += 1
        counted.observe("latency_ms", value)
        router.record("m", "us-east", "m.us-east.s2.r0", value)
        counted.observe("ttft_ms", value)
        part.observe("ttft_ms", value)
    exposition = prometheus_client.generate_latest(registry).decode()

    labels = {"model": "m", "region": "us-east", "set_app": "m.us-east.s2.r0"}
    for family, gate in (("ray_ipnext_latency_ms", "latency_p99_ms"), ("ray_ipnext_ttft_ms", "ttft_p99_ms")):
        buckets = scraped_buckets(exposition, family, labels)
        assert len(buckets) == LATENCY_LAYOUT.count + 1  # the layout's bounds and +Inf
        assert [le for le, _ in buckets[:-1]] == list(BOUNDS)
        [reading] = evaluate_gates([GateSpec(metric=gate, max=1e9)], "us-east", counted, SetCounters(), 1)
        dashboard = histogram_quantile(0.99, buckets)
        print(f"{name}: {gate} gate {reading.value:.6g} ms, dashboard {dashboard:.6g} ms")
        assert reading.value == pytest.approx(dashboard, rel=1e-9)
        for q in (0.5, 0.9):
            metric = gate.removesuffix("_p99_ms") + "_ms"
            assert counted.quantile_ms(metric, q) == pytest.approx(histogram_quantile(q, buckets), rel=1e-9)
