"""ipnext's own Prometheus series as data, so the routing app's keyed `GET /metrics` serves them
beside vLLM's names with no scrape of Ray's metrics port: what a replica records (`SeriesTally`,
one per metrics actor in `ProcessSeries`), what it pushes to that actor and what the actor sums
over replicas (`SeriesState`, `replicas_total`), how a scrape gathers every actor within one
bounded wait (`gather_figures`), and the text exposition (`render_series`). Pure: no Ray.

What a scrape says about the actors it asked: `ipnext_metrics_actor_up{model, region}` is 1 for
an actor that answered and 0 for one that is missing, failed or did not answer within the wait,
and a comment line (`# ipnext: ...`) says which and why; the series of an actor that did not
answer are left out of that scrape (a gap, never a made-up value).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import os
import re
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ipnext.names import Frozen

__all__ = [
    "ACTOR_UP",
    "REPLICA_LABEL",
    "ActorFigures",
    "Family",
    "FamilySpec",
    "ProcessSeries",
    "Sample",
    "SeriesState",
    "SeriesTally",
    "gather_figures",
    "render_series",
    "replicas_total",
    "valid_name",
]

ACTOR_UP = "ipnext_metrics_actor_up"
# Gauges are a replica's moment (a p99, a hit rate) and do not add up: each live replica's value
# is its own sample, told apart by this label (Ray's export tells them apart by its `WorkerId`
# label, where its metric cardinality setting keeps that label).
REPLICA_LABEL = "replica"
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

Kind = Literal["counter", "gauge", "histogram"]


def valid_name(name: str) -> bool:
    """Whether `name` may name a Prometheus family (a part's status key may not)."""
    return _NAME.match(name) is not None


class FamilySpec(Frozen):
    """One family's declaration: its name, kind, help, label names and (histograms) finite bounds.
    The same spec declares the series to Ray and to the tally, so both export one name and label set."""

    name: str = Field(pattern=_NAME.pattern)
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    bounds: tuple[float, ...] = ()  # a histogram's finite upper bounds, ascending; +Inf is implied

    @model_validator(mode="after")
    def _consistent(self) -> FamilySpec:
        bad = [label for label in self.labels if not _LABEL.match(label) or label == "le"]
        if bad or len(set(self.labels)) != len(self.labels):
            raise ValueError(
                f"family {self.name}: label names {list(self.labels)} are not distinct valid names"
            )
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name}: a counter's name ends in _total")
        if (self.kind == "histogram") != bool(self.bounds):
            raise ValueError(f"family {self.name}: bounds are for histograms, and every histogram has some")
        if any(b >= c for b, c in itertools.pairwise(self.bounds)):
            raise ValueError(f"histogram {self.name}: bounds must ascend")
        return self

    def spec(self) -> FamilySpec:
        return FamilySpec(
            name=self.name, kind=self.kind, help=self.help, labels=self.labels, bounds=self.bounds
        )


class Sample(BaseModel):
    """One label set's figures: a counter's or gauge's `value`, or a histogram's counts per bucket
    (sparse: bucket index -> count, not cumulative; index len(bounds) is above every bound) and sum."""

    model_config = ConfigDict(extra="forbid")

    labels: tuple[str, ...]
    value: float = 0.0
    buckets: dict[int, int] = Field(default_factory=dict)
    sum: float = 0.0


class Family(FamilySpec):
    samples: list[Sample] = Field(default_factory=list)

    @model_validator(mode="after")
    def _samples_fit(self) -> Family:
        for sample in self.samples:
            if len(sample.labels) != len(self.labels):
                raise ValueError(f"family {self.name}: a sample has labels {sample.labels} for {self.labels}")
            if any(not 0 <= i <= len(self.bounds) or n < 0 for i, n in sample.buckets.items()):
                raise ValueError(
                    f"histogram {self.name}: bucket counts {sample.buckets} do not fit its bounds"
                )
        return self


class SeriesState(BaseModel):
    """Families by name: one replica's cumulative series, or a sum of several."""

    model_config = ConfigDict(extra="forbid")

    families: dict[str, Family] = Field(default_factory=dict)

    def plus(self, other: SeriesState) -> SeriesState:
        """The sum: counters, histograms and gauges of one label set add up. A family the two
        declare differently (replicas of two versions) keeps this side's declaration and samples."""
        families = dict(self.families)
        for name, theirs in other.families.items():
            mine = families.get(name)
            if mine is None:
                families[name] = theirs
            elif mine.spec() == theirs.spec():
                families[name] = mine.model_copy(update={"samples": _added(mine.samples, theirs.samples)})
        return SeriesState(families=families)


def _added(mine: Iterable[Sample], theirs: Iterable[Sample]) -> list[Sample]:
    by_labels: dict[tuple[str, ...], Sample] = {}
    for sample in itertools.chain(mine, theirs):
        seen = by_labels.get(sample.labels)
        if seen is None:
            by_labels[sample.labels] = sample
            continue
        buckets = dict(seen.buckets)
        for i, n in sample.buckets.items():
            buckets[i] = buckets.get(i, 0) + n
        by_labels[sample.labels] = Sample(
            labels=sample.labels, value=seen.value + sample.value, buckets=buckets, sum=seen.sum + sample.sum
        )
    return list(by_labels.values())


def replicas_total(by_replica: Mapping[str, SeriesState], live: Iterable[str]) -> SeriesState:
    """What a metrics actor serves: counters and histograms summed over every replica that ever
    pushed (cumulative, so the sum never goes down while the actor lives, as the gates' counters),
    and each `live` replica's gauges with its `replica` label (a gone replica's moment is no
    longer true). In key order, so the answer does not depend on the order of the pushes."""
    live_keys = set(live)
    total = SeriesState()
    for key in sorted(by_replica):
        kept: dict[str, Family] = {}
        for name, family in by_replica[key].families.items():
            if family.kind != "gauge":
                kept[name] = family
            elif key in live_keys and REPLICA_LABEL not in family.labels:
                kept[name] = family.model_copy(
                    update={
                        "labels": (*family.labels, REPLICA_LABEL),
                        "samples": [
                            s.model_copy(update={"labels": (*s.labels, key)}) for s in family.samples
                        ],
                    }
                )
        total = total.plus(SeriesState(families=kept))
    return total


@dataclass
class _Observed:
    counts: dict[int, int] = field(default_factory=dict)  # bucket index -> observations
    sum: float = 0.0


class SeriesTally:
    """One process's cumulative series for one metrics actor: what its recorders (`export.py`)
    counted, observed and set, kept to be pushed. Thread-safe: a part may record from its
    engine's thread while the push reads on the event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._specs: dict[str, FamilySpec] = {}
        self._values: dict[str, dict[tuple[str, ...], float]] = {}
        self._histograms: dict[str, dict[tuple[str, ...], _Observed]] = {}

    def _declare(self, spec: FamilySpec) -> None:
        known = self._specs.setdefault(spec.name, spec)
        if known is not spec and known != spec:
            raise ValueError(f"family {spec.name} is declared twice, differently: {known} and {spec}")

    def inc(self, spec: FamilySpec, labels: tuple[str, ...], amount: float = 1.0) -> None:
        with self._lock:
            self._declare(spec)
            values = self._values.setdefault(spec.name, {})
            values[labels] = values.get(labels, 0.0) + amount

    def set(self, spec: FamilySpec, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            self._declare(spec)
            self._values.setdefault(spec.name, {})[labels] = value

    def observe(self, spec: FamilySpec, labels: tuple[str, ...], value: float) -> None:
        """One observation, into the bucket of the first bound at or above it (Prometheus' `le`)."""
        index = bisect.bisect_left(spec.bounds, value)
        with self._lock:
            self._declare(spec)
            observed = self._histograms.setdefault(spec.name, {}).setdefault(labels, _Observed())
            observed.counts[index] = observed.counts.get(index, 0) + 1
            observed.sum += value

    def state(self) -> SeriesState:
        with self._lock:
            families = {}
            for name, spec in self._specs.items():
                if spec.kind == "histogram":
                    samples = [
                        Sample(labels=labels, buckets=dict(o.counts), sum=o.sum)
                        for labels, o in self._histograms.get(name, {}).items()
                    ]
                else:
                    samples = [Sample(labels=k, value=v) for k, v in self._values.get(name, {}).items()]
                families[name] = Family(**spec.model_dump(), samples=samples)
        return SeriesState(families=families)


class ProcessSeries:
    """Every `SeriesTally` of this process, by the metrics actor it goes to, and the key the
    process pushes them under. One per process (as Ray's metrics and prometheus_client's registry
    are): a router and a part sharing a process (local testing mode) push one tally, not two."""

    def __init__(self) -> None:
        # Host and pid say which process it is; the random tail keeps a reused pid from taking
        # over a dead process's counters (they would go down: a false reset).
        self.key = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._lock = threading.Lock()
        self._tallies: dict[str, SeriesTally] = {}

    def tally(self, actor_name: str) -> SeriesTally:
        with self._lock:
            return self._tallies.setdefault(actor_name, SeriesTally())

    def get(self, actor_name: str) -> SeriesTally | None:
        with self._lock:
            return self._tallies.get(actor_name)


# ---- the scrape: every actor at once, within one wait ------------------------------------------


@dataclass(frozen=True)
class ActorFigures:
    """What one (model, region) metrics actor answered: its series and, for a generative model,
    its engine figures under vLLM's names (None: no fresh LLM replica)."""

    series: SeriesState | None  # None: an actor of an older version, which keeps none
    engine_stats: dict[str, Any] | None = None


Asker = Callable[[str, str, bool], Awaitable[ActorFigures | None]]


async def gather_figures(
    targets: Sequence[tuple[str, str, bool]], ask: Asker, wait_s: float
) -> tuple[dict[tuple[str, str], ActorFigures], dict[tuple[str, str], str]]:
    """Ask every (model, region, generative) target's actor at once (`ask` answers None when there
    is no actor), waiting `wait_s` in all, so one slow actor never holds the scrape past its
    timeout. Returns the figures of those that answered and, for the others, why not."""
    tasks = {
        (model, region): asyncio.ensure_future(ask(model, region, gen)) for model, region, gen in targets
    }
    if tasks:
        await asyncio.wait(tasks.values(), timeout=wait_s)
    answered: dict[tuple[str, str], ActorFigures] = {}
    missing: dict[tuple[str, str], str] = {}
    for target, task in tasks.items():
        if not task.done():
            task.cancel()
            missing[target] = f"did not answer within {wait_s:g} s"
        elif task.cancelled():
            missing[target] = "cancelled"
        elif (err := task.exception()) is not None:
            first_line = str(err).splitlines()[0] if str(err) else ""
            missing[target] = f"failed: {type(err).__name__}" + (f": {first_line}" if first_line else "")
        elif (figures := task.result()) is None:
            missing[target] = "no metrics actor (no replica of the region has pushed to one)"
        else:
            answered[target] = figures
    return answered, missing


# ---- the text exposition ----------------------------------------------------------------------


class _Collector:
    def __init__(self, state: SeriesState, up: Mapping[tuple[str, str], bool]) -> None:
        self._state = state
        self._up = up

    def collect(self) -> Iterable[Metric]:
        for name in sorted(self._state.families):
            yield _metric(self._state.families[name])
        up = GaugeMetricFamily(
            ACTOR_UP,
            "1: the (model, region) metrics actor answered this scrape; 0: its series are left out",
            labels=["model", "region"],
        )
        for (model, region), answered in sorted(self._up.items()):
            up.add_metric([model, region], 1.0 if answered else 0.0)
        yield up


def _metric(family: Family) -> Metric:
    labels = list(family.labels)
    samples = sorted(family.samples, key=lambda s: s.labels)
    if family.kind == "histogram":
        histogram = HistogramMetricFamily(family.name, family.help, labels=labels)
        bounds = [*(floatToGoString(b) for b in family.bounds), "+Inf"]
        for s in samples:
            counts = itertools.accumulate(s.buckets.get(i, 0) for i in range(len(bounds)))
            histogram.add_metric(list(s.labels), list(zip(bounds, counts, strict=True)), s.sum)
        return histogram
    metric: CounterMetricFamily | GaugeMetricFamily
    if family.kind == "counter":
        metric = CounterMetricFamily(family.name, family.help, labels=labels)
    else:
        metric = GaugeMetricFamily(family.name, family.help, labels=labels)
    for s in samples:
        metric.add_metric(list(s.labels), s.value)
    return metric


def render_series(
    state: SeriesState, up: Mapping[tuple[str, str], bool], notes: Mapping[tuple[str, str], str]
) -> bytes:
    """The Prometheus text exposition of `state`, then `ipnext_metrics_actor_up` for every
    (model, region) actor asked (`up`: whether it answered), then one comment line per note on an
    actor (why it was left out), which parsers skip."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(state, up))
    text: bytes = generate_latest(registry)
    lines = "".join(
        f"# ipnext: metrics actor of model {model} in region {region}: {' '.join(note.split())}\n"
        for (model, region), note in sorted(notes.items())
    )
    return text + lines.encode()
