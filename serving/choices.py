"""Adaptive routing at a model's choice nodes: which variant (alternative sub-DAG) a request runs,
from the request's context and from what one router replica sees of each variant (requests in
flight, failures in a row), and the plain DAG of parts the request then runs.

Pure code (no Ray): the router keeps one `VariantRouter` per set app; the unit tests drive it alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from ipnext.spec.model import BreakerSpec, ChoiceSpec, ContextPaths, RoutingRule

__all__ = [
    "FALLBACK_REASONS",
    "RequestContext",
    "RequestPlan",
    "VariantHealth",
    "VariantRouter",
    "fallback_reason",
    "lookup",
    "matched_variant",
    "request_context",
    "resolve_dag",
    "rule_matches",
    "variant_label",
]

FallbackReason = Literal["saturated", "breaker_open", "failed"]
FALLBACK_REASONS: tuple[FallbackReason, ...] = ("saturated", "breaker_open", "failed")

# Called once per variant a request is sent to: (choice, variant, fallback reason or None).
RouteObserver = Callable[[str, str, FallbackReason | None], None]


@dataclass(frozen=True)
class RequestContext:
    """What routing rules look at; None where the request does not carry the value."""

    segment: str | None = None
    candidates: int | None = None
    latency_budget_ms: float | None = None


def lookup(inputs: Any, path: str) -> Any:
    """The value at a dotted path through JSON objects, or None where the path does not lead."""
    value = inputs
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def request_context(inputs: Any, paths: ContextPaths) -> RequestContext:
    """The request's context. A value of the wrong type counts as absent: routing never fails a
    request (the parts judge their inputs)."""
    segment = lookup(inputs, paths.segment)
    candidates = lookup(inputs, paths.candidates)
    budget = lookup(inputs, paths.latency_budget_ms)
    number = isinstance(budget, int | float) and not isinstance(budget, bool) and math.isfinite(budget)
    return RequestContext(
        segment=segment if isinstance(segment, str) else None,
        candidates=len(candidates) if isinstance(candidates, list) else None,
        latency_budget_ms=float(budget) if number else None,
    )


def _within(value: float | None, low: float | None, high: float | None) -> bool:
    if low is None and high is None:
        return True
    if value is None:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def rule_matches(rule: RoutingRule, context: RequestContext) -> bool:
    """Every condition the rule gives holds (bounds inclusive); one on an absent value does not."""
    if rule.segment is not None and context.segment not in rule.segment:
        return False
    return _within(context.candidates, rule.min_candidates, rule.max_candidates) and _within(
        context.latency_budget_ms, rule.min_latency_budget_ms, rule.max_latency_budget_ms
    )


def matched_variant(choice: ChoiceSpec, context: RequestContext) -> str:
    """The variant of the first rule that matches, else the choice's default."""
    for rule in choice.rules:
        if rule_matches(rule, context):
            return rule.variant
    return choice.default_variant


@dataclass
class VariantHealth:
    """What one router replica knows of one variant of one set app."""

    in_flight: int = 0
    failures_in_a_row: int = 0
    open_until: float = -math.inf  # the breaker is open before this time (monotonic seconds)

    def failed(self, breaker: BreakerSpec, now: float) -> None:
        self.failures_in_a_row += 1
        # Past the cooldown the count stays at or above the bound, so one more failure reopens
        # the breaker at once, and one success closes it for good.
        if self.failures_in_a_row >= breaker.failures:
            self.open_until = now + breaker.cooldown_seconds

    def succeeded(self) -> None:
        self.failures_in_a_row = 0


def fallback_reason(
    choice: ChoiceSpec, variant: str, health: VariantHealth, now: float
) -> FallbackReason | None:
    """Why a request meant for `variant` goes to the choice's fallback instead, or None. The
    fallback itself is never refused: it is where traffic goes when nothing else can take it."""
    if variant == choice.fallback:
        return None
    if now < health.open_until:
        return "breaker_open"
    if health.in_flight >= choice.max_in_flight:
        return "saturated"
    return None


def resolve_dag(
    dag: list[tuple[str, str]], choices: dict[str, ChoiceSpec], chosen: dict[str, str]
) -> list[tuple[str, str]]:
    """The plain DAG of parts one request runs, given the variant `chosen` at every choice node:
    the parts of the variants not chosen are left out, and each choice node is replaced by edges
    from its upstream nodes to the chosen variant's entry parts (a choice node is transparent)."""
    skipped = {
        part
        for name, choice in choices.items()
        for variant, parts in choice.variants.items()
        if variant != chosen[name]
        for part in parts
    }
    feeding = {name: [src for src, dst in dag if dst == name and src not in skipped] for name in choices}
    edges: list[tuple[str, str]] = []
    for src, dst in dag:
        if src in skipped or dst in skipped or dst in choices:
            continue
        for up in feeding[src] if src in choices else [src]:
            if (up, dst) not in edges:
                edges.append((up, dst))
    return edges


def variant_label(chosen: dict[str, str]) -> str | None:
    """The envelope's `variant`: None without choice nodes, the variant's name with one, and
    `choice=variant` pairs joined by commas (in the spec's order of choices) with several."""
    if not chosen:
        return None
    if len(chosen) == 1:
        return next(iter(chosen.values()))
    return ",".join(f"{name}={variant}" for name, variant in chosen.items())


@dataclass(frozen=True)
class RequestPlan:
    """The parts one request runs: each part's upstream nodes, and the parts in DAG order."""

    upstream: dict[str, list[str]]
    order: list[str]


class VariantRouter:
    """One set app's choice nodes as one router replica sees them: picks each request's
    variants, counts requests in flight and failures per variant, and counts fallbacks by
    reason. Without choice nodes it only hands out the set's DAG."""

    def __init__(
        self,
        dag: list[tuple[str, str]],
        order: list[str],
        choices: dict[str, ChoiceSpec],
        observe: RouteObserver | None = None,
    ) -> None:
        self.choices = choices
        self._dag = dag
        self._order = order
        self._observe = observe
        self._owner = {
            p: (c, v) for c, spec in choices.items() for v, parts in spec.variants.items() for p in parts
        }
        self._health = {c: {v: VariantHealth() for v in spec.variants} for c, spec in choices.items()}
        self._requests = {c: dict.fromkeys(spec.variants, 0) for c, spec in choices.items()}
        self._fallbacks = {c: dict.fromkeys(FALLBACK_REASONS, 0) for c in choices}
        self._plans: dict[tuple[tuple[str, str], ...], RequestPlan] = {}

    def carry_over(self, previous: VariantRouter) -> None:
        """Keep what `previous` saw (the same set app, before a router reconfigure), so that
        requests still in flight are counted and an open breaker stays open."""
        if previous.choices == self.choices:
            self._health, self._requests, self._fallbacks = (
                previous._health,
                previous._requests,
                previous._fallbacks,
            )

    def choose(self, inputs: Any, now: float) -> dict[str, str]:
        """The variant of every choice node for one request, each counted in flight until `finish`."""
        chosen: dict[str, str] = {}
        for name, choice in self.choices.items():
            wanted = matched_variant(choice, request_context(inputs, choice.context))
            reason = fallback_reason(choice, wanted, self._health[name][wanted], now)
            chosen[name] = choice.fallback if reason else wanted
            self._enter(name, chosen[name], reason)
        return chosen

    def finish(
        self, chosen: dict[str, str], answered: Collection[str], failed_part: str | None, now: float
    ) -> None:
        """A request is done: `answered` are the parts that answered, `failed_part` the part that
        failed (not by the caller's mistake), if one did. A variant is failed when one of its parts
        failed, and healthy again when all its parts answered."""
        for name, variant in chosen.items():
            health = self._health[name][variant]
            health.in_flight -= 1
            parts = self.choices[name].variants[variant]
            if failed_part in parts:
                health.failed(self.choices[name].breaker, now)
            elif all(p in answered for p in parts):
                health.succeeded()

    def retry_on_fallback(self, chosen: dict[str, str], failed_part: str | None) -> dict[str, str] | None:
        """The variants to run a request again with when `failed_part` failed it: its choice moved
        to the fallback (counted in flight again, and as a fallback for reason "failed"). None
        when the part is in no chosen variant, or in a fallback already."""
        owner = self._owner.get(failed_part or "")
        if owner is None:
            return None
        name, variant = owner
        fallback = self.choices[name].fallback
        if chosen.get(name) != variant or variant == fallback:
            return None
        retry = {**chosen, name: fallback}
        for choice, picked in retry.items():
            self._enter(choice, picked, "failed" if choice == name else None)
        return retry

    def plan(self, chosen: dict[str, str]) -> RequestPlan:
        """The parts a request with these variants runs (cached: a set app has few combinations)."""
        key = tuple(chosen.items())
        if key not in self._plans:
            edges = resolve_dag(self._dag, self.choices, chosen)
            upstream: dict[str, list[str]] = {}
            for src, dst in edges:
                upstream.setdefault(dst, []).append(src)
            runs = {node for edge in edges for node in edge}
            self._plans[key] = RequestPlan(upstream=upstream, order=[p for p in self._order if p in runs])
        return self._plans[key]

    def report(self, now: float) -> dict[str, Any]:
        """Per choice node: requests sent to each variant (a retry counts again), fallbacks by
        reason, requests in flight, and the variants whose breaker is open."""
        return {
            name: {
                "requests": dict(self._requests[name]),
                "fallbacks": dict(self._fallbacks[name]),
                "in_flight": {v: h.in_flight for v, h in self._health[name].items()},
                "breaker_open": sorted(v for v, h in self._health[name].items() if now < h.open_until),
            }
            for name in self.choices
        }

    def _enter(self, choice: str, variant: str, reason: FallbackReason | None) -> None:
        self._health[choice][variant].in_flight += 1
        self._requests[choice][variant] += 1
        if reason is not None:
            self._fallbacks[choice][reason] += 1
        if self._observe is not None:
            self._observe(choice, variant, reason)
