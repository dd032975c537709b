"""What the LLM engine measures, per request and in aggregate.

Per request: time to first token (`ttft_ms`), inter-token latency (`itl_ms`, every gap between
two tokens of one answer), queue time (`queue_ms`, arrival to first step) and decode speed.
In aggregate: batch size per step, KV-cache use, prefix-cache hit rate (prompt tokens served
from the cache), preemptions, cancellations, failures. The latency histograms use the bucket layout of
`ipnext.contracts.counters`, so they push to a model's metrics actor beside the router's counters
and the rollout gates (`ttft_p99_ms`, `itl_p99_ms`) read them like `latency_p99_ms`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ipnext.contracts.counters import SetCounters
from ipnext.serving.llm.engine import LLMEngine, Sequence, StepResult
from ipnext.serving.llm.vllm_metrics import EngineStats

__all__ = ["LLMMetrics"]

logger = logging.getLogger(__name__)


@dataclass
class LLMMetrics:
    latency: SetCounters = field(default_factory=SetCounters)  # histograms only: the router counts requests
    # Also told of every latency observation (metric name, ms): the host's Prometheus export.
    observer: Callable[[str, float], None] | None = None
    steps: int = 0
    batch_size_sum: int = 0
    batched_tokens_sum: int = 0
    kv_usage: float = 0.0  # share of cache blocks in use after the last step
    kv_usage_peak: float = 0.0
    preemptions: int = 0
    cancelled: int = 0
    failed: int = 0  # requests that failed alone (GenerationError), the engine serving on
    finished: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    # A replica lives long: keep the running sum, not every answer's speed.
    decode_speed_sum: float = 0.0
    decode_speed_count: int = 0
    # The same requests under vLLM's names (`vllm_metrics`), for the `GET /metrics` door.
    engine_stats: EngineStats = field(default_factory=EngineStats)

    def observe_step(self, engine: LLMEngine, result: StepResult) -> None:
        if result.batch_size:
            self.steps += 1
            self.batch_size_sum += result.batch_size
            self.batched_tokens_sum += result.batched_tokens
        self.preemptions += result.preempted
        self.kv_usage = engine.cache_usage()
        self.kv_usage_peak = max(self.kv_usage_peak, self.kv_usage)
        self.prompt_tokens = engine.stats.prompt_tokens
        self.cached_prompt_tokens = engine.stats.cached_prompt_tokens
        self.engine_stats.observe_engine(
            len(engine.running),
            len(engine.waiting),
            self.kv_usage,
            self.prompt_tokens,
            self.cached_prompt_tokens,
        )

    def observe_finished(self, seq: Sequence) -> None:
        self.finished += 1
        self.completion_tokens += len(seq.output)
        self.engine_stats.observe_request(
            seq.arrival, seq.token_times, len(seq.prompt), len(seq.output), not seq.prefilled_elsewhere
        )
        times = seq.token_times
        if not times:
            return
        if not seq.prefilled_elsewhere:  # its first token came from the prefill part, timed there
            self._observe("ttft_ms", (times[0] - seq.arrival) * 1000)
        if seq.scheduled_at is not None:
            self._observe("queue_ms", (seq.scheduled_at - seq.arrival) * 1000)
        for before, after in itertools.pairwise(times):
            self._observe("itl_ms", (after - before) * 1000)
        if len(times) > 1 and times[-1] > times[0]:
            self.decode_speed_sum += (len(times) - 1) / (times[-1] - times[0])
            self.decode_speed_count += 1

    def _observe(self, metric: str, value_ms: float) -> None:
        self.latency.observe(metric, value_ms)
        if self.observer is not None:
            try:
                self.observer(metric, value_ms)
            except Exception:  # an exporter's failure must never stop serving
                logger.exception("metrics observer failed on %s; dropping it", metric)
                self.observer = None

    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def summary(self) -> dict[str, Any]:
        """The aggregate view (p50 and p99 in ms, as the gates and Prometheus read them)."""

        def quantiles(metric: str) -> dict[str, float | None]:
            return {
                "p50": self.latency.quantile_ms(metric, 0.5),
                "p99": self.latency.quantile_ms(metric, 0.99),
            }

        return {
            "finished": self.finished,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "ttft_ms": quantiles("ttft_ms"),
            "itl_ms": quantiles("itl_ms"),
            "queue_ms": quantiles("queue_ms"),
            "mean_batch_size": self.batch_size_sum / self.steps if self.steps else 0.0,
            "kv_cache_usage": self.kv_usage,
            "kv_cache_usage_peak": self.kv_usage_peak,
            "prefix_cache_hit_rate": self.prefix_hit_rate(),
            "preemptions": self.preemptions,
            "completion_tokens": self.completion_tokens,
            "decode_tokens_per_s_mean": (
                self.decode_speed_sum / self.decode_speed_count if self.decode_speed_count else 0.0
            ),
        }
