"""The LLM engine's figures under vLLM's metric names, so the dashboards and autoscalers people
already run against vLLM work unchanged on ipnext.

Each LLM part keeps an `EngineStats` (cumulative counters and histograms, and gauges of the
moment); its host pushes it to the model's metrics actor every second beside the set counters
(`MetricsStore.push_engine_stats`); the routing app's `GET /metrics` sums every replica's of
every generative model and renders (`render`) the Prometheus text exposition, labelled
`model_name`, as vLLM labels them:

    vllm:time_to_first_token_seconds   histogram  arrival to first token (not for a sequence
                                                  whose first token a prefill part made)
    vllm:inter_token_latency_seconds   histogram  every gap between two tokens of one answer
    vllm:e2e_request_latency_seconds   histogram  arrival to last token
    vllm:num_requests_running          gauge      sequences in the running batch
    vllm:num_requests_waiting          gauge      sequences queued
    vllm:kv_cache_usage_perc           gauge      share of KV-cache blocks in use, 0 to 1
    vllm:prefix_cache_queries          counter    prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits             counter    prompt tokens the prefix cache supplied
    vllm:prompt_tokens                 counter    prompt tokens of finished requests
    vllm:generation_tokens             counter    tokens generated for finished requests

Counters are exposed with `_total`, as prometheus_client names a counter family (vLLM's own
exposition does the same). These are not Ray's metrics: Ray's exporter prefixes every name with
`ray_`. The same scrape serves ipnext's own series under their `ipnext_*` names
(`serving/prometheus_text.py`), so one scrape config finds both.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from pydantic import BaseModel, Field

__all__ = ["BUCKETS", "COUNTERS", "GAUGES", "EngineStats", "render"]

# Upper bounds in seconds (vLLM-like ranges: TTFT from 1 ms, ITL from 10 ms, whole requests to hours).
BUCKETS: dict[str, tuple[float, ...]] = {
    "vllm:time_to_first_token_seconds": (
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0, 160.0, 640.0, 2560.0,
    ),
    "vllm:inter_token_latency_seconds": (
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
        40.0, 80.0,
    ),
    "vllm:e2e_request_latency_seconds": (
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
        960.0, 1920.0, 7680.0,
    ),
}  # fmt: skip
COUNTERS = {
    "vllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache",
    "vllm:prefix_cache_hits": "Prompt tokens the prefix cache supplied",
    "vllm:prompt_tokens": "Prompt tokens of finished requests",
    "vllm:generation_tokens": "Tokens generated for finished requests",
}
GAUGES = {
    "vllm:num_requests_running": "Requests in the running batch",
    "vllm:num_requests_waiting": "Requests waiting to be scheduled",
    "vllm:kv_cache_usage_perc": "Share of KV-cache blocks in use (0 to 1)",
}
_HELP = {
    "vllm:time_to_first_token_seconds": "Time from arrival to the first token",
    "vllm:inter_token_latency_seconds": "Time between two tokens of one answer",
    "vllm:e2e_request_latency_seconds": "Time from arrival to the last token",
}


class Histogram(BaseModel):
    buckets: list[int]  # per bucket (not cumulative), the last one past every bound
    sum: float = 0.0

    def observe(self, bounds: tuple[float, ...], seconds: float) -> None:
        self.buckets[bisect.bisect_left(bounds, seconds)] += 1
        self.sum += seconds


def _empty(name: str) -> Histogram:
    return Histogram(buckets=[0] * (len(BUCKETS[name]) + 1))


class EngineStats(BaseModel):
    """One replica's figures (or the sum of several): histograms and counters cumulative since
    it started, gauges as of its last step."""

    histograms: dict[str, Histogram] = Field(default_factory=lambda: {name: _empty(name) for name in BUCKETS})
    counters: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    gauges: dict[str, float] = Field(default_factory=lambda: dict.fromkeys(GAUGES, 0.0))

    def observe_request(
        self,
        arrival: float,
        token_times: list[float],
        prompt_tokens: int,
        generated: int,
        first_token_here: bool = True,
    ) -> None:
        """A finished request: its latencies (seconds, from its token times) and token counts."""
        self.counters["vllm:prompt_tokens"] += prompt_tokens
        self.counters["vllm:generation_tokens"] += generated
        if not token_times:
            return
        if first_token_here:
            self._observe("vllm:time_to_first_token_seconds", token_times[0] - arrival)
        for before, after in itertools.pairwise(token_times):
            self._observe("vllm:inter_token_latency_seconds", after - before)
        self._observe("vllm:e2e_request_latency_seconds", token_times[-1] - arrival)

    def _observe(self, name: str, seconds: float) -> None:
        self.histograms[name].observe(BUCKETS[name], max(0.0, seconds))

    def observe_engine(self, running: int, waiting: int, kv_usage: float, queried: int, hit: int) -> None:
        """The engine after a step: its queues, its cache, its prefix-cache totals so far."""
        self.gauges |= {
            "vllm:num_requests_running": float(running),
            "vllm:num_requests_waiting": float(waiting),
            "vllm:kv_cache_usage_perc": float(kv_usage),
        }
        self.counters["vllm:prefix_cache_queries"] = float(queried)
        self.counters["vllm:prefix_cache_hits"] = float(hit)

    def plus(self, other: EngineStats) -> EngineStats:
        """The sum of two replicas' figures (gauges add up too: requests running anywhere)."""
        return EngineStats(
            histograms={
                name: Histogram(
                    buckets=[a + b for a, b in zip(h.buckets, other.histograms[name].buckets, strict=True)],
                    sum=h.sum + other.histograms[name].sum,
                )
                for name, h in self.histograms.items()
            },
            counters={k: v + other.counters.get(k, 0.0) for k, v in self.counters.items()},
            gauges={k: v + other.gauges.get(k, 0.0) for k, v in self.gauges.items()},
        )


class _Collector:
    def __init__(self, by_model: Mapping[str, EngineStats]) -> None:
        self._by_model = by_model

    def collect(self) -> Iterable[Any]:
        models = sorted(self._by_model)
        for name, help_text in _HELP.items():
            family = HistogramMetricFamily(name, help_text, labels=["model_name"])
            for model in models:
                h = self._by_model[model].histograms[name]
                cumulative = list(itertools.accumulate(h.buckets))
                bounds = [*(f"{b:g}" for b in BUCKETS[name]), "+Inf"]
                family.add_metric([model], list(zip(bounds, cumulative, strict=True)), h.sum)
            yield family
        for name, help_text in COUNTERS.items():
            counter = CounterMetricFamily(name, help_text, labels=["model_name"])
            for model in models:
                counter.add_metric([model], self._by_model[model].counters[name])
            yield counter
        for name, help_text in GAUGES.items():
            gauge = GaugeMetricFamily(name, help_text, labels=["model_name"])
            for model in models:
                gauge.add_metric([model], self._by_model[model].gauges[name])
            yield gauge


def render(by_model: Mapping[str, EngineStats]) -> bytes:
    """The Prometheus text exposition of every model's figures (`model_name` label)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(by_model))
    data: bytes = generate_latest(registry)
    return data
