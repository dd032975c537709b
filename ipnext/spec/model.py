"""What an ML engineer writes and publishes: the model spec (model.yaml) and its snapshot sets.

One file over 600 lines on purpose: the spec is one pydantic tree whose validators check one
section against another (parts against the DAG, gates against the rollout, choices against
variants), and `check_against_fleet` reads the same tree; the DAG algorithms are in ipnext.spec.dag."""

from __future__ import annotations

import hashlib
import importlib
import json
import math
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, StringConstraints, field_validator, model_validator

from ipnext.errors import SpecError
from ipnext.names import Frozen, SetStatus
from ipnext.spec.dag import DAG_INPUT, DAG_OUTPUT, RESERVED_NODES, check_graph, node_order
from ipnext.spec.dag import upstream as upstream_of
from ipnext.spec.fleet import Fleet, Name
from ipnext.spec.reading import load_yaml, parse_spec
from ipnext.spec.sharding import MAX_SHARDS, expand_shards

__all__ = [
    "CHECKPOINT_SUFFIXES",
    "DAG_INPUT",
    "DAG_OUTPUT",
    "DEFAULT_PART_MAX_QUEUED",
    "DEFAULT_ROUTER_MAX_ONGOING",
    "FACTORY_PREFIXES_SETTING",
    "MAX_DEADLINE_SECONDS",
    "MAX_IN_FLIGHT",
    "MAX_REPLICA_QPS",
    "MAX_SECONDS",
    "MAX_SPARE_REPLICAS",
    "VERSION_PATTERN",
    "AvailabilitySpec",
    "BatchingSpec",
    "BreakerSpec",
    "ChoiceSpec",
    "ContextPaths",
    "GateSpec",
    "HardwareOption",
    "ModelSpec",
    "PartSpec",
    "RolloutSpec",
    "RouterSpec",
    "RoutingRule",
    "SnapshotRef",
    "SnapshotSet",
    "SnapshotSetRequest",
    "TrafficSpec",
    "Version",
    "WatchSpec",
    "check_against_fleet",
    "check_factories",
    "check_factories_allowed",
    "checkpoint_digest",
    "checkpoint_tree",
    "fleet_capacity_qps",
    "import_factory",
    "load_model_spec",
    "module_allowed",
]

DEFAULT_ROUTER_MAX_ONGOING = 100
MAX_SPARE_REPLICAS = 4  # availability.spare_replicas: a spare costs a replica in every region
LLM_PART_MODULE = "ipnext.serving.llm.part"  # a model whose output part is from here is generative
DEFAULT_PART_MAX_QUEUED = 100  # a part's calls waiting at one caller, at most (PartSpec)
# The longest deadline a spec may give: Serve's proxy timeout sits above it as a backstop
# (`serving.layout.PROXY_TIMEOUT_S`), so the router, which counts, always answers first.
MAX_DEADLINE_SECONDS = 600.0

# Ceilings where a number can be absurd: a value above one is a typo or a probe, and accepted it
# would fail only later, after registration (a timer Temporal cannot set, a bound Serve cannot
# hold, a replica said to serve more than any could, which would make every traffic look servable).
MAX_SECONDS = 7 * 24 * 3600.0  # a week: bakes, check intervals, cool-downs, watch intervals
MAX_REPLICA_QPS = 1_000_000.0  # what one replica of a part may claim to serve
MAX_IN_FLIGHT = 100_000  # requests one router replica (or one variant of it) holds at once

# A snapshot set's version (from training's manifest): ASCII letters, digits, `.`, `_` and `-`,
# starting with a letter or digit, at most 128 characters. It names a snapshot (`<model>/<part>@<version>`)
# in logs, ids and the Temporal UI, so nothing that prints or sorts differently is let in.
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
Version = Annotated[str, StringConstraints(pattern=VERSION_PATTERN)]

Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
# A dotted path through JSON objects, e.g. "user.segment".
DottedPath = Annotated[str, StringConstraints(pattern=r"^[^.\s]+(\.[^.\s]+)*$")]


def _at_most(limit: float, unit: str, what: str) -> AfterValidator:
    def check(value: float) -> float:
        if value > limit:
            raise ValueError(
                f"{value:g} is above the ceiling of {limit:g}{unit} ({what}); use a smaller value"
            )
        return value

    return AfterValidator(check)


Seconds = Annotated[float, _at_most(MAX_SECONDS, " s", "a week")]
ReplicaQps = Annotated[float, _at_most(MAX_REPLICA_QPS, " qps", "more than any one replica serves")]
InFlight = Annotated[int, _at_most(MAX_IN_FLIGHT, "", "requests one router replica holds at once")]


def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first inf or nan inside a JSON-like value, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list | tuple)
        else ()
    )
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}")
        if found is not None:
            return found
    return None


class _Spec(Frozen):
    """What people write: immutable once read, unknown fields refused, every number finite (JSON,
    which carries a spec into every workflow, has no inf or nan: one would be read back as null)."""

    model_config = ConfigDict(allow_inf_nan=False)


class HardwareOption(_Spec):
    """Where one replica of a part may run: the pool units it takes and the QPS it serves."""

    units: int = Field(gt=0)
    qps: ReplicaQps = Field(gt=0)


class BatchingSpec(_Spec):
    """Serve batching of a part's calls: concurrent requests reach the part's `batch` method
    together, up to `max_batch_size` of them, waiting at most `wait_ms` for a batch to fill."""

    max_batch_size: int = Field(ge=1, le=1024)
    wait_ms: float = Field(default=2.0, ge=0, le=1000)


class PartSpec(_Spec):
    factory: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    hardware: dict[Name, HardwareOption] = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    batching: BatchingSpec | None = None
    # `shards: k` splits the part into k parts `<part>-shard<i>` when the spec is read (see
    # ipnext.spec.sharding); each of those names the part it came from in `shard_of`.
    shards: int = Field(default=1, ge=1, le=MAX_SHARDS, strict=True)
    shard_of: Name | None = None
    # Calls that may wait for this part's replicas at each caller (a router replica) beyond
    # their max_ongoing_requests; the next one is refused at once (the router answers 503 and
    # counts it against the set that served it: the part, behind the router, is overloaded).
    max_queued_requests: int = Field(default=DEFAULT_PART_MAX_QUEUED, ge=1, le=100_000)

    @field_validator("config")
    @classmethod
    def _config_finite(cls, config: dict[str, Any]) -> dict[str, Any]:
        where = _non_finite(config, "config")
        if where is not None:
            raise ValueError(
                f"{where} is not a finite number; JSON, which carries the spec to the worker and the "
                "replicas, has no inf or nan: give a finite number"
            )
        return config


class TrafficSpec(_Spec):
    # Bounded by the fleet, not here: `check_against_fleet` refuses traffic above what the whole
    # fleet could serve.
    peak_qps: dict[Name, Annotated[float, Field(gt=0)]] = Field(min_length=1)


class AvailabilitySpec(_Spec):
    headroom: float = Field(default=0.2, ge=0, lt=1)
    min_regions: int = Field(default=1, ge=1)
    survive_region_loss: bool = False
    # In every region where a part has replicas, losing any `spare_replicas` of them still
    # leaves capacity for the region's load under the headroom: a replica's death leaves no gap
    # while Serve starts its replacement (14 s measured). Each spare is a replica the pools hold
    # and the plan pays for, in every region; past a few, more headroom is the cheaper answer.
    spare_replicas: int = Field(default=0, ge=0, le=MAX_SPARE_REPLICAS)


class GateSpec(_Spec):
    metric: Literal["error_rate", "latency_p99_ms", "ttft_p99_ms", "itl_p99_ms"]
    max: float | None = Field(default=None, ge=0)
    max_ratio_to_old: float | None = Field(default=None, gt=0)
    floor: float = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _one_bound(self) -> GateSpec:
        if self.max is None and self.max_ratio_to_old is None:
            raise ValueError(f"gate on {self.metric}: give max or max_ratio_to_old")
        return self


class RolloutSpec(_Spec):
    steps: list[Annotated[int, Field(gt=0, le=100)]] = Field(default=[1, 5, 25, 50, 100], min_length=1)
    bake_seconds: Seconds = Field(default=60, ge=0)
    check_interval_seconds: Seconds = Field(default=2, gt=0)
    min_requests: int = Field(default=100, ge=0)
    gates: list[GateSpec] = Field(
        default_factory=lambda: [
            GateSpec(metric="error_rate", max=0.01),
            GateSpec(metric="latency_p99_ms", max_ratio_to_old=1.5, floor=20),
        ]
    )

    @model_validator(mode="after")
    def _steps_rise_to_100(self) -> RolloutSpec:
        if self.steps != sorted(set(self.steps)) or self.steps[-1] != 100:
            raise ValueError(
                f"rollout.steps: {self.steps} must rise strictly and end at 100, e.g. [1, 5, 25, 50, 100]"
            )
        return self


class WatchSpec(_Spec):
    """Opt-in: a Temporal Schedule that publishes new snapshots found in the training output."""

    enabled: bool = False
    interval_seconds: Seconds = Field(default=60, ge=1)


class RouterSpec(_Spec):
    """The model's router in each region: one Serve replica that parses a request, picks its set
    and variant, and awaits the parts. It only awaits, so it takes many requests at once; the
    parts hold their own bounds (`max_ongoing_requests` of 5, or twice a batching part's batch)."""

    # Requests one router replica holds at once; more wait in Serve's HTTP proxy. Serve's default
    # of 5 would cap the whole model in a region at 5 requests in flight, and so every batch of a
    # batching part at 5 (bench/ranking.py measures both). Not given, it is also kept above every
    # choice's max_in_flight (ModelSpec._router_above_choices).
    max_ongoing_requests: InFlight = Field(default=DEFAULT_ROUTER_MAX_ONGOING, ge=1)
    # Requests that may wait in Serve's proxy for a router replica beyond max_ongoing_requests;
    # the next one is refused at once (503 with Retry-After), never queued without bound. A
    # refusal is overload, not the model's failure: it is not counted against any set.
    max_queued_requests: int = Field(default=100, ge=1, le=100_000)
    # Router replicas per region at most: Serve scales them from 1 on the requests they hold.
    # Not given: the platform's `serve.autoscaling.router_max_replicas` (4 by default).
    max_replicas: int | None = Field(default=None, ge=1, le=64)
    retry_after_seconds: int = Field(default=1, ge=0, le=3600)
    # The longest a request may be expected to wait in the queue before the router sheds it at
    # once (503 with Retry-After, counted as shed, never as the set's error): ipnext/policy/
    # admission.py says how the wait is expected. Not given: only a request whose expected wait
    # would pass its deadline (its own `x-ipnext-deadline-ms`, else `deadline_seconds`) is shed.
    # Not the spec's `latency_budget_ms`, which is the planner's network budget.
    max_queue_wait_ms: float | None = Field(default=None, gt=0, le=3_600_000)
    # Every request's deadline, across all its hops (a stream: the whole stream). Past it the
    # router answers 504 and counts a failed request of the set that served it, so the gates see
    # a hung canary.
    deadline_seconds: float = Field(default=30.0, gt=0, le=MAX_DEADLINE_SECONDS)
    # Request limits, checked before the body is parsed: a bigger body answers 413, a deeper
    # JSON nesting 400 (Python's parser would otherwise recurse until RecursionError).
    max_body_bytes: int = Field(default=1 << 20, ge=1024, le=64 << 20)
    max_json_depth: int = Field(default=32, ge=2, le=1000)


class RoutingRule(_Spec):
    """One rule of a choice node: a request goes to `variant` when every condition given holds
    (bounds are inclusive; a condition on a value the request does not carry does not hold)."""

    variant: Name
    segment: list[str] | None = Field(default=None, min_length=1)
    min_candidates: int | None = Field(default=None, ge=0)
    max_candidates: int | None = Field(default=None, ge=0)
    min_latency_budget_ms: float | None = Field(default=None, ge=0)
    max_latency_budget_ms: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _conditions(self) -> RoutingRule:
        if not self.model_dump(exclude={"variant"}, exclude_none=True):
            raise ValueError(
                f"rule for variant {self.variant!r} has no condition; give segment, min/max_candidates "
                f"or min/max_latency_budget_ms, or make {self.variant!r} the choice's default"
            )
        for what in ("candidates", "latency_budget_ms"):
            low, high = getattr(self, f"min_{what}"), getattr(self, f"max_{what}")
            if low is not None and high is not None and low > high:
                raise ValueError(
                    f"rule for variant {self.variant!r}: min_{what} {low} is above max_{what} {high}, "
                    "so no request matches; swap them"
                )
        return self


class ContextPaths(_Spec):
    """Where the router finds a request's context in its inputs (dotted paths through objects)."""

    segment: DottedPath = "user.segment"  # a string
    candidates: DottedPath = "candidates"  # a list: its length is the number of candidates
    latency_budget_ms: DottedPath = "latency_budget_ms"  # a number


class BreakerSpec(_Spec):
    """After `failures` failed requests in a row, a variant gets no new traffic for
    `cooldown_seconds` (its choice's fallback takes it); then it is tried again."""

    failures: int = Field(default=5, ge=1)
    cooldown_seconds: Seconds = Field(default=10, gt=0)


class ChoiceSpec(_Spec):
    """A choice node of the DAG: alternative sub-DAGs (variants), one of which runs per request.

    Rules are tried in order and the first that matches picks the variant (`default`, else the
    fallback, when none does). The router moves a request to `fallback` when the variant it
    picked is saturated (`max_in_flight` requests of one router replica already on it), its
    breaker is open, or it failed the request (retried once on the fallback).

    A router replica holds at most the model's `router.max_ongoing_requests` requests at once,
    so `max_in_flight` must stay below it (validated): at or above it the variant never saturates."""

    variants: dict[Name, Annotated[list[Name], Field(min_length=1)]] = Field(min_length=2)
    fallback: Name
    default: Name | None = None  # None: the fallback
    rules: list[RoutingRule] = Field(default_factory=list)
    context: ContextPaths = Field(default_factory=ContextPaths)
    max_in_flight: InFlight = Field(default=4, ge=1)
    breaker: BreakerSpec = Field(default_factory=BreakerSpec)

    @model_validator(mode="after")
    def _variants_named(self) -> ChoiceSpec:
        declared = sorted(self.variants)
        named = [("fallback", self.fallback), ("default", self.default)]
        named += [(f"rules.{i}.variant", rule.variant) for i, rule in enumerate(self.rules)]
        for field, variant in named:
            if variant is not None and variant not in self.variants:
                raise ValueError(
                    f"{field} {variant!r} is not a variant of this choice; use one of {declared}"
                )
        owner: dict[str, str] = {}
        for variant, parts in self.variants.items():
            for part in parts:
                if owner.get(part) == variant:
                    raise ValueError(f"variants.{variant}: part {part!r} is listed twice; list it once")
                if part in owner:
                    raise ValueError(
                        f"variants.{variant}: part {part!r} is also in variant {owner[part]!r}; variants are "
                        "alternatives, so a part belongs to one of them (give each its own part)"
                    )
                owner[part] = variant
        return self

    @property
    def default_variant(self) -> str:
        """The variant a request goes to when no rule matches."""
        return self.default or self.fallback


class ModelSpec(_Spec):
    name: Name
    owner: str = Field(min_length=1)
    sync: Literal["synchronized", "independent"] = "synchronized"
    parts: dict[Name, PartSpec] = Field(min_length=1)
    dag: list[tuple[str, str]] = Field(min_length=1)
    choices: dict[Name, ChoiceSpec] = Field(default_factory=dict)  # choice nodes of the DAG
    traffic: TrafficSpec
    latency_budget_ms: float = Field(gt=0)
    availability: AvailabilitySpec = Field(default_factory=AvailabilitySpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    watch: WatchSpec = Field(default_factory=WatchSpec)
    router: RouterSpec = Field(default_factory=RouterSpec)
    # `pooled`: the parts are served from the shared pool of their hardware class in each region
    # (many models per replica, loaded on first use, the least recently used unloaded), with one
    # router per region for every pooled model; `dedicated`: replicas and a router of its own.
    # Changed by a spec update, rolled out as a new set like any other (docs: guides/pools.md).
    serving: Literal["dedicated", "pooled"] = "dedicated"

    @model_validator(mode="before")
    @classmethod
    def _split_shards(cls, data: Any) -> Any:
        return expand_shards(data)

    @model_validator(mode="before")
    @classmethod
    def _router_above_choices(cls, data: Any) -> Any:
        """A router bound not given is the default or, if a choice's max_in_flight is that high,
        one more than it (specs stored before the bound existed stay valid)."""
        if not isinstance(data, dict):
            return data
        router = data.get("router")
        if isinstance(router, RouterSpec) or (isinstance(router, dict) and "max_ongoing_requests" in router):
            return data
        choices = data.get("choices")
        bounds = [
            c.get("max_in_flight") if isinstance(c, dict) else getattr(c, "max_in_flight", None)
            for c in (choices.values() if isinstance(choices, dict) else [])
        ]
        highest = max((b for b in bounds if isinstance(b, int)), default=0)
        if highest < DEFAULT_ROUTER_MAX_ONGOING:
            return data
        return {**data, "router": {**(router or {}), "max_ongoing_requests": highest + 1}}

    @model_validator(mode="after")
    def _pooled_not_generative(self) -> ModelSpec:
        if self.serving == "pooled" and self.generative():
            raise ValueError(
                "serving: pooled: an LLM part holds a KV cache and an engine per replica, which a "
                "pool shared by many models cannot give it; serve it with `serving: dedicated`"
            )
        return self

    def pooled(self) -> bool:
        return self.serving == "pooled"

    @model_validator(mode="after")
    def _check_shards(self) -> ModelSpec:
        groups = self.shard_groups()
        for name, part in self.parts.items():
            if part.shard_of is None:
                continue
            group = groups[part.shard_of]
            if part.shard_of in self.parts or group != [
                f"{part.shard_of}-shard{i}" for i in range(len(group))
            ]:
                raise ValueError(
                    f"parts.{name}.shard_of: the shards of {part.shard_of!r} must be named "
                    f"{part.shard_of}-shard0 .. -shard<k-1>, with no part named {part.shard_of!r}; "
                    f"write `shards: k` on the part {part.shard_of!r} instead"
                )
            if part.config.get("shards") != len(group) or group.index(name) != part.config.get("shard"):
                raise ValueError(
                    f"parts.{name}.config: shard {group.index(name)} of {len(group)} must carry "
                    f"shard: {group.index(name)} and shards: {len(group)}; write `shards: k` on the "
                    f"part {part.shard_of!r} instead"
                )
        return self

    def shard_groups(self) -> dict[str, list[str]]:
        """Each part split into shards -> its shard parts, in shard order."""
        groups: dict[str, list[str]] = {}
        for name, part in self.parts.items():
            if part.shard_of is not None:
                groups.setdefault(part.shard_of, []).append(name)
        return {group: sorted(members, key=lambda m: (len(m), m)) for group, members in groups.items()}

    @model_validator(mode="after")
    def _check_dag(self) -> ModelSpec:
        for name in self.parts:
            if name in RESERVED_NODES:
                raise ValueError(f"parts.{name}: {name!r} is reserved for the DAG; rename the part")
        self._check_choice_names()
        variants = {name: choice.variants for name, choice in self.choices.items()}
        check_graph(list(self.parts), variants, self.dag)
        return self

    def _check_choice_names(self) -> None:
        """Choice nodes have names of their own, and their variants list parts, each in one variant."""
        owner: dict[str, str] = {}  # part -> "variant v of choice c"
        for name, choice in self.choices.items():
            if name in RESERVED_NODES:
                raise ValueError(f"choices.{name}: {name!r} is reserved for the DAG; rename the choice")
            if name in self.parts:
                raise ValueError(
                    f"choices.{name}: {name!r} is also a part; a choice node is not a part, "
                    "give it a name of its own"
                )
            if choice.max_in_flight >= self.router.max_ongoing_requests:
                raise ValueError(
                    f"choices.{name}.max_in_flight: {choice.max_in_flight} is not below "
                    f"router.max_ongoing_requests ({self.router.max_ongoing_requests}), so the variants "
                    "would never saturate; lower max_in_flight or raise router.max_ongoing_requests"
                )
            for variant, parts in choice.variants.items():
                for part in parts:
                    if part not in self.parts:
                        raise ValueError(
                            f"choices.{name}.variants.{variant}: {part!r} is not a part; list parts "
                            f"of {sorted(self.parts)}, or add {part!r} to parts"
                        )
                    if part in owner:
                        raise ValueError(
                            f"choices.{name}.variants.{variant}: part {part!r} is also in {owner[part]}; "
                            "a part belongs to at most one variant"
                        )
                    owner[part] = f"variant {variant} of choice {name}"

    def topological_order(self) -> list[str]:
        """The parts in an order where every part comes after its upstream parts, including the
        parts upstream of a choice node for the variants behind it."""
        order = node_order([*self.parts, *self.choices], self.dag)
        return [n for n in order if n in self.parts]

    def upstream(self, node: str) -> list[str]:
        return upstream_of(self.dag, node)

    def generative(self) -> bool:
        """True when what answers is one of ipnext's LLM parts (every node feeding the output is
        a part whose factory is in `LLM_PART_MODULE`): those parts define the contract the
        OpenAI door speaks (a prompt or messages in; text, finish reason, token counts out)."""
        finals = self.upstream(DAG_OUTPUT)
        return bool(finals) and all(
            f in self.parts and self.parts[f].factory.startswith(f"{LLM_PART_MODULE}:") for f in finals
        )


def load_model_spec(path: str | Path) -> ModelSpec:
    return parse_spec(ModelSpec, load_yaml(path), source=str(path))


def check_against_fleet(spec: ModelSpec, fleet: Fleet) -> None:
    """Hardware classes and traffic sources the spec names must exist in the fleet."""
    for part, part_spec in spec.parts.items():
        for hw in part_spec.hardware:
            if hw not in fleet.hardware:
                raise SpecError(
                    f"parts.{part}.hardware: hardware class {hw!r} is not in the fleet.",
                    field=f"parts.{part}.hardware",
                    value=hw,
                    fix=f"use one of {sorted(fleet.hardware)}",
                )
    for source in spec.traffic.peak_qps:
        if source not in fleet.regions:
            raise SpecError(
                f"traffic.peak_qps: traffic source {source!r} is not a region of the fleet.",
                field="traffic.peak_qps",
                value=source,
                fix=f"use one of {fleet.regions}",
            )
    if spec.availability.min_regions > len(fleet.regions):
        raise SpecError(
            f"availability.min_regions: {spec.availability.min_regions} is more than the "
            f"fleet's {len(fleet.regions)} regions.",
            field="availability.min_regions",
            value=spec.availability.min_regions,
            fix=f"use at most {len(fleet.regions)}",
        )
    for part, part_spec in spec.parts.items():
        _check_replica_fits(part, part_spec, fleet)
    _check_traffic_fits(spec, fleet)


def fleet_capacity_qps(
    part: PartSpec, fleet: Fleet, without_region: str | None = None, spare_replicas: int = 0
) -> float:
    """The most QPS one part could serve with the whole fleet to itself (leaving out
    `without_region`): every pool of a hardware class it runs on filled with its replicas,
    less in each region `spare_replicas` replicas of its largest-QPS option there.

    An upper bound of what any plan gives it: the planner routes to a region at most the
    replicas' QPS there less its spare, less headroom, and a pool holds at most
    `pool units // units` of them."""
    total = 0.0
    largest: dict[str, float] = {}  # region -> the largest QPS of a replica its pools hold
    held: dict[str, float] = {}  # region -> the QPS its pools hold
    for pool in fleet.pools:
        option = part.hardware.get(pool.hardware)
        if option is not None and pool.region != without_region:
            replicas = pool.units // option.units
            total += replicas * option.qps
            if replicas:
                largest[pool.region] = max(largest.get(pool.region, 0.0), option.qps)
                held[pool.region] = held.get(pool.region, 0.0) + replicas * option.qps
    if spare_replicas:
        total -= sum(min(held[r], spare_replicas * qps) for r, qps in largest.items())
    return total


def _check_replica_fits(part: str, part_spec: PartSpec, fleet: Fleet) -> None:
    """A part none of whose replicas fits in any pool can never be placed."""
    largest = {
        hw: max((p.units for p in fleet.pools if p.hardware == hw), default=0) for hw in part_spec.hardware
    }
    if any(option.units <= largest[hw] for hw, option in part_spec.hardware.items()):
        return
    hw, option = min(part_spec.hardware.items(), key=lambda item: item[1].units - largest[item[0]])
    raise SpecError(
        f"parts.{part}.hardware.{hw}.units: a replica of {option.units} units fits in no pool of "
        f"the fleet (the largest {hw} pool has {largest[hw]}).",
        field=f"parts.{part}.hardware.{hw}.units",
        value=option.units,
        fix=f"use at most {largest[hw]} units per replica, or allow another hardware class",
    )


def _check_traffic_fits(spec: ModelSpec, fleet: Fleet) -> None:
    """Refuse traffic no plan could serve, before any workflow starts. The planner gives every
    part the model's whole peak traffic (plan.demand_from_model), so the part that serves the
    least bounds the model; the error names it and that bound."""
    usable = 1 - spec.availability.headroom
    spare = spec.availability.spare_replicas  # held in every region (the loss rows count it)
    losses: list[str | None] = [None]
    if spec.availability.survive_region_loss:
        losses += list(fleet.regions)
    limit, lost, part = min(
        (usable * fleet_capacity_qps(part_spec, fleet, lost, 0 if lost else spare), lost or "", part)
        for part, part_spec in spec.parts.items()
        for lost in losses
    )
    demand = sum(spec.traffic.peak_qps.values())
    if demand <= limit * (1 + 1e-9):
        return
    source = max(sorted(spec.traffic.peak_qps), key=lambda s: spec.traffic.peak_qps[s])
    peak = spec.traffic.peak_qps[source]
    total = f"; {demand:g} qps in all regions" if len(spec.traffic.peak_qps) > 1 else ""
    when = f" once {lost} is lost" if lost else ""
    hardware = "/".join(sorted(spec.parts[part].hardware))
    spared = f" and availability.spare_replicas {spare} in each region" if spare and not lost else ""
    raise SpecError(
        f"traffic.peak_qps.{source}: {peak:g} qps{total} is more than the whole fleet can serve{when}: "
        f"part {part} serves at most {limit:g} qps with every {hardware} pool filled with its "
        f"replicas, less availability.headroom {spec.availability.headroom:g}{spared}.",
        field=f"traffic.peak_qps.{source}",
        value=peak,
        fix=f"lower traffic.peak_qps to at most {limit:g} qps in all, or give part {part} hardware that "
        "serves more qps per replica, or add pools to the fleet"
        + (", or lower availability.spare_replicas" if spared else ""),
    )


FACTORY_PREFIXES_SETTING = "model_code.factory_prefixes"


def module_allowed(module: str, prefixes: Sequence[str]) -> bool:
    """Whether `module` falls under one of `prefixes`: one ending in "." covers the modules of
    that package (`ipnext.` covers `ipnext.examples.parts`), one without covers that module and
    its submodules. Never a bare string prefix: `ipnext` does not cover `ipnext_evil`."""
    for prefix in prefixes:
        if prefix.endswith("."):
            if module.startswith(prefix) and len(module) > len(prefix):
                return True
        elif module == prefix or module.startswith(prefix + "."):
            return True
    return False


def check_factories_allowed(spec: ModelSpec, prefixes: Sequence[str]) -> None:
    """Refuse a spec naming a factory outside `prefixes`, before anything imports it: importing
    a module runs its code, so the module path is the boundary the operator sets."""
    for part, part_spec in spec.parts.items():
        module = part_spec.factory.partition(":")[0]
        if not module_allowed(module, prefixes):
            raise SpecError(
                f"parts.{part}.factory: {part_spec.factory!r} is outside the modules this worker may "
                f"import ({FACTORY_PREFIXES_SETTING}: {list(prefixes)}); nothing was imported.",
                field=f"parts.{part}.factory",
                value=part_spec.factory,
                fix=f"name a factory under one of those prefixes, or, if {module!r} is trusted to run "
                f"in the control plane's validation, have the worker's operator add its package to "
                f"{FACTORY_PREFIXES_SETTING}",
            )


def import_factory(factory: str, prefixes: Sequence[str] | None = None) -> Callable[..., Any]:
    """Resolve "module:callable"; errors say which part of the path failed. With `prefixes`, the
    module must fall under them before it is imported, and the callable must be defined under
    them too: an allowed module may import `os.system`, say,
    and a spec must not reach it through that module."""
    module_name, _, attr = factory.partition(":")
    if prefixes is not None and not module_allowed(module_name, prefixes):
        raise SpecError(  # before the import: importing a module runs its code
            f"factory {factory!r}: module {module_name!r} is outside the modules this worker may "
            f"import ({FACTORY_PREFIXES_SETTING}: {list(prefixes)}); nothing was imported.",
            field="factory",
            value=factory,
            fix=f"have the operator add its package to {FACTORY_PREFIXES_SETTING}",
        )
    try:
        module = importlib.import_module(module_name)
    except MemoryError:
        raise  # the caller's memory limit, not a module that does not import
    except Exception as err:  # an import can fail in any way; report it, whatever it is
        raise SpecError(
            f"factory {factory!r}: module {module_name!r} does not import ({type(err).__name__}: {err}).",
            field="factory",
            value=factory,
            fix="check the module path and that its package is installed on the worker",
        ) from None
    target = getattr(module, attr, None)
    if not callable(target):
        raise SpecError(
            f"factory {factory!r}: {module_name} has no callable {attr!r}.",
            field="factory",
            value=factory,
            fix="name a class or function of that module as module:callable",
        )
    if prefixes is not None:
        origin = getattr(target, "__module__", None) or type(target).__module__
        if not isinstance(origin, str) or not module_allowed(origin, prefixes):
            raise SpecError(
                f"factory {factory!r}: {attr} is defined in {origin!r}, outside the modules this "
                f"worker may run ({FACTORY_PREFIXES_SETTING}: {list(prefixes)}).",
                field="factory",
                value=factory,
                fix="name the factory where it is defined, under an allowed prefix",
            )
    return target


def check_factories(spec: ModelSpec, prefixes: Sequence[str] | None = None) -> None:
    for part, part_spec in spec.parts.items():
        try:
            import_factory(part_spec.factory, prefixes)
        except SpecError as err:
            raise SpecError(
                f"parts.{part}.factory: {err}",
                field=f"parts.{part}.factory",
                value=part_spec.factory,
            ) from None


# What a checkpoint snapshot may hold: configs, tokenizer, chat template and safetensors weights.
# Nothing that could be unpickled or run is ever copied in (a `.bin` beside them is left out).
CHECKPOINT_SUFFIXES = (".json", ".jinja", ".safetensors")
CheckpointFileName = Annotated[str, StringConstraints(pattern=r"^[^./\\][^/\\]*$", max_length=255)]


def checkpoint_digest(files: dict[str, str]) -> str:
    """The sha256 of a checkpoint snapshot: of the canonical JSON of its files (name -> sha256),
    which the pinned store keeps as the checkpoint's own file. One digest names every byte."""
    return hashlib.sha256(checkpoint_tree(files)).hexdigest()


def checkpoint_tree(files: dict[str, str]) -> bytes:
    """The canonical bytes `checkpoint_digest` hashes (sorted keys, no spaces)."""
    return json.dumps(
        {"files": files, "format": "ipnext.checkpoint/v1"}, sort_keys=True, separators=(",", ":")
    ).encode()


class SnapshotRef(_Spec):
    """One part's weights: where they are and what they must hash to. Either one safetensors
    file (`uri` names it), or a checkpoint folder (`uri` names the folder, `files` lists each of
    its files with its sha256, and `sha256` is `checkpoint_digest(files)`)."""

    uri: str = Field(min_length=1)
    sha256: Sha256
    snapshot_id: str = Field(min_length=1)
    files: dict[CheckpointFileName, Sha256] | None = None

    @model_validator(mode="after")
    def _checkpoint_digest(self) -> SnapshotRef:
        if self.files is None:
            return self
        if not self.files:
            raise ValueError("files: a checkpoint lists at least one file")
        odd = sorted(name for name in self.files if not name.endswith(CHECKPOINT_SUFFIXES))
        if odd:
            raise ValueError(f"files: {odd} are not {', '.join(CHECKPOINT_SUFFIXES)} files")
        digest = checkpoint_digest(self.files)
        if digest != self.sha256:
            raise ValueError(
                f"sha256: {self.sha256} is not the digest of the checkpoint's file list ({digest})"
            )
        return self


class SnapshotSetRequest(_Spec):
    """What a publish carries: a label from training and a snapshot per part.

    With `sync: independent` a request may name only the parts that changed; the
    others keep the snapshots of the serving set.
    """

    model: Name
    version: Version
    parts: dict[Name, SnapshotRef] = Field(min_length=1)


class SnapshotSet(_Spec):
    """A published, validated set: id `<model>@<n>`, a snapshot for every part."""

    id: str
    number: int
    version: str
    parts: dict[str, SnapshotRef]
    status: SetStatus
    published_at: datetime
    detail: str = ""
