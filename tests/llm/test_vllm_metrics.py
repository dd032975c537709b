"""The LLM engine's figures under vLLM's names (serving/llm/vllm_metrics.py): what a part
counts for N requests, rendered and parsed back with prometheus_client's own parser, equals
what their answers said; the metrics actor sums replicas and forgets a silent one."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ipnext.serving.llm.part import LLMPart
from ipnext.serving.llm.vllm_metrics import BUCKETS, COUNTERS, GAUGES, EngineStats, render
from ipnext.serving.metrics import MetricsStore

from .conftest import TrainedLM

PROMPTS = ["two plus three is", "ada is a red", "counting: one two", "bo lives by the river"]


def samples(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """Family -> {labels: value} of every sample, by the client library's parser."""
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


async def test_n_requests_are_counted_under_vllms_names_as_their_answers_say(lm: TrainedLM) -> None:
    part = LLMPart(lm.files, {"engine": {"kv_cache_bytes": 4 << 20}})
    answers = await asyncio.gather(
        *(part({"input": {"prompt": p, "max_tokens": 6 + i}}) for i, p in enumerate(PROMPTS))
    )
    text = render({"tiny-lm": EngineStats.model_validate(part.engine_stats())}).decode()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families == {
        **dict.fromkeys(BUCKETS, "histogram"),
        **dict.fromkeys(COUNTERS, "counter"),
        **dict.fromkeys(GAUGES, "gauge"),
    }
    got = samples(text)
    label = (("model_name", "tiny-lm"),)
    n = len(PROMPTS)
    assert got["vllm:prompt_tokens_total"][label] == sum(a["prompt_tokens"] for a in answers)
    assert got["vllm:generation_tokens_total"][label] == sum(a["completion_tokens"] for a in answers)
    assert got["vllm:time_to_first_token_seconds_count"][label] == n
    assert got["vllm:e2e_request_latency_seconds_count"][label] == n
    assert got["vllm:inter_token_latency_seconds_count"][label] == sum(
        a["completion_tokens"] - 1 for a in answers
    )
    assert got["vllm:prefix_cache_queries_total"][label] >= sum(a["prompt_tokens"] for a in answers)
    assert got["vllm:num_requests_running"][label] == 0 and got["vllm:num_requests_waiting"][label] == 0
    assert 0 <= got["vllm:kv_cache_usage_perc"][label] <= 1
    await part.service.close()


def test_the_metrics_actor_sums_replicas_and_forgets_a_silent_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import ipnext.serving.metrics as store_module

    store = MetricsStore()
    one, two = EngineStats(), EngineStats()
    one.observe_request(0.0, [0.1, 0.2], prompt_tokens=5, generated=2)
    two.observe_request(0.0, [0.3], prompt_tokens=7, generated=1)
    store.push_engine_stats("a", one.model_dump())
    store.push_engine_stats("b", two.model_dump())
    store.push_engine_stats("c", {"histograms": "garbage"})  # dropped, never fails a read
    total = EngineStats.model_validate(store.engine_stats())
    assert total.counters["vllm:prompt_tokens"] == 12 and total.counters["vllm:generation_tokens"] == 3
    assert sum(total.histograms["vllm:time_to_first_token_seconds"].buckets) == 2
    clock = store_module.time.monotonic() + store_module.ENGINE_STATS_STALE_S + 1
    monkeypatch.setattr(store_module.time, "monotonic", lambda: clock)
    assert store.engine_stats() is None
