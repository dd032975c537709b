"""The routing document: which serving region answers a caller of each traffic source, per model.

The serving layer publishes one per model at `GET /models/<name>/routing`, built from the
fractions of the model's plan; prediction clients cache it for `ttl_seconds` and pick a region
from it, so predicting needs the serving URL only. Pure code: built, compared and read here.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Mapping
from typing import Annotated

from pydantic import Field

from ipnext.contracts.plan import Plan
from ipnext.names import Frozen
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet

__all__ = [
    "ROUTING_PREFIX",
    "Routes",
    "RoutingDocument",
    "RoutingTable",
    "demand_path",
    "failover_routes",
    "fallback_order",
    "pick_region",
    "predict_path",
    "routes_from_plan",
    "routing_document",
    "routing_model_of",
    "routing_path",
    "succeed",
    "weighted_draw",
]

# The one global route of the routing documents: GET /models/<name>/routing.
ROUTING_PREFIX = "/models"
_ROUTING_LEAF = "routing"

Fraction = Annotated[float, Field(gt=0)]
Routes = dict[str, dict[str, float]]  # traffic source -> serving region -> fraction (a row sums to 1)


class RoutingDocument(Frozen):
    """Where a model's callers go. `generation` counts up on every change of the document;
    a client may use it for `ttl_seconds` before fetching it again."""

    model: str
    generation: int = Field(ge=1)
    ttl_seconds: float = Field(gt=0)
    routes: dict[str, dict[str, Fraction]]
    plan_revision: int = Field(default=1, ge=1)  # the placement revision the fractions come from
    generative: bool = False  # an LLM: the OpenAI door serves it (`ModelSpec.generative`)

    def same_routing(self, other: RoutingDocument) -> bool:
        """True when the two say the same thing (whatever their generations)."""
        return self.model_copy(update={"generation": other.generation}) == other


class RoutingTable(Frozen):
    """Every model's document: the routing app's `user_config`."""

    documents: dict[str, RoutingDocument] = Field(default_factory=dict)

    def with_document(self, document: RoutingDocument) -> RoutingTable:
        return RoutingTable(documents={**self.documents, document.model: document})

    def without(self, model: str) -> RoutingTable:
        return RoutingTable(documents={m: d for m, d in self.documents.items() if m != model})


def routing_path(model: str) -> str:
    return f"{ROUTING_PREFIX}/{model}/{_ROUTING_LEAF}"


def routing_model_of(path: str, root_path: str = "") -> str | None:
    """The model a `/models/<name>/routing` request names (`path` may still carry the app's
    route prefix as `root_path`); None for any other path."""
    if root_path and path.startswith(root_path):
        path = ROUTING_PREFIX + path[len(root_path) :]
    parts = path.strip("/").split("/")
    if len(parts) == 3 and f"/{parts[0]}" == ROUTING_PREFIX and parts[2] == _ROUTING_LEAF and parts[1]:
        return parts[1]
    return None


def predict_path(model: str, region: str) -> str:
    """The model's predict route in a serving region (its router app there)."""
    return f"/{region}/models/{model}/predict"


def feedback_path(model: str, region: str) -> str:
    """The model's feedback route in a serving region: outcomes of answers given in an experiment."""
    return f"/{region}/models/{model}/feedback"


def demand_path(model: str, region: str) -> str:
    """The model's observed demand in a serving region, by source (its router app there)."""
    return f"/{region}/models/{model}/demand"


def routes_from_plan(model: str, plan: Plan) -> Routes:
    """Each traffic source's serving regions and fractions, from the plan's routing.

    A model's parts are placed as a group, with the same fractions, and a request runs its whole
    DAG in one region; so a region counts only where every part of the model has replicas.
    Each row is normalized to sum to 1; a source routed nowhere has no row."""
    placements = [p for name, p in sorted(plan.deployments.items()) if name.startswith(f"{model}/")]
    if not placements:
        return {}
    serving = set.intersection(*(set(p.regions()) for p in placements))
    routes: Routes = {}
    for source, row in sorted(placements[0].fractions.items()):
        kept = {region: share for region, share in sorted(row.items()) if share > 0 and region in serving}
        total = sum(kept.values())
        if total > 0:
            routes[source] = {region: share / total for region, share in kept.items()}
    return routes


def succeed(previous: RoutingDocument | None, draft: RoutingDocument) -> RoutingDocument:
    """The document to publish after `previous`: `previous` itself when `draft` says the same,
    else `draft` at the next generation (1 with no previous)."""
    if previous is None:
        return draft.model_copy(update={"generation": 1})
    if previous.same_routing(draft):
        return previous
    return draft.model_copy(update={"generation": previous.generation + 1})


def routing_document(
    model: str,
    plan: Plan,
    ttl_seconds: float,
    previous: RoutingDocument | None = None,
    generative: bool = False,
) -> RoutingDocument:
    """The model's document for `plan`, succeeding `previous` (see `succeed`)."""
    draft = RoutingDocument(
        model=model,
        generation=1,
        ttl_seconds=ttl_seconds,
        routes=routes_from_plan(model, plan),
        plan_revision=plan.revision,
        generative=generative,
    )
    return succeed(previous, draft)


def pick_region(
    document: RoutingDocument,
    source: str | None,
    key: str | None = None,
    rng: random.Random | None = None,
) -> str | None:
    """A serving region for a caller from `source`, in proportion to the source's fractions.

    With a `key`, the same key always gets the same region while the fractions stay put (the
    draw is salted, so it does not line up with the router's sticky choice of set). A source
    the document has no row for (or None) draws from every source's rows pooled. None when
    the document routes nowhere."""
    row = document.routes.get(source) if source is not None else None
    if not row:
        row = _pooled(document.routes)
    salted = None if key is None else f"region\x00{document.model}\x00{key}"
    return weighted_draw(row, salted, rng)


def fallback_order(
    document: RoutingDocument,
    source: str | None,
    key: str | None = None,
    rng: random.Random | None = None,
) -> list[str]:
    """Every serving region of the document, in the order a caller from `source` tries them when
    one does not answer: the region `pick_region` draws, then the rest of the source's row by
    fraction (largest first), then the regions that serve only other sources, by their pooled
    fraction. The last are the plan's answer for other callers, not for this source's latency
    budget: a way out while a region is lost, until a replan routes the source again. Empty
    when the document routes nowhere."""
    first = pick_region(document, source, key, rng)
    if first is None:
        return []
    order = [first]
    row = document.routes.get(source, {}) if source is not None else {}
    for weights in (row, _pooled(document.routes)):
        for region in sorted(weights, key=lambda r: (-weights[r], r)):
            if region not in order:
                order.append(region)
    return order


def weighted_draw(
    weights: Mapping[str, float], key: str | None, rng: random.Random | None = None
) -> str | None:
    """One of the names with a positive weight, in proportion to it (None when there is none).
    With a `key` the draw is a hash of the key, so the same key gets the same name while the
    weights stay put; the router's sticky set choice and the client's region choice share it
    (each salting its keys its own way)."""
    names = sorted(n for n, w in weights.items() if w > 0)
    if not names:
        return None
    total = sum(weights[n] for n in names)
    if key is None:
        point = (rng.random() if rng is not None else random.random()) * total
    else:
        digest = hashlib.sha256(key.encode()).digest()
        point = int.from_bytes(digest[:8], "big") / 2**64 * total
    for name in names:
        point -= weights[name]
        if point < 0:
            return name
    return names[-1]


def _pooled(routes: Routes) -> dict[str, float]:
    pooled: dict[str, float] = {}
    for row in routes.values():
        for region, share in row.items():
            pooled[region] = pooled.get(region, 0.0) + share / len(routes)
    return pooled


def failover_routes(
    routes: Routes, plan: Plan, deployments: list[DeploymentDemand], fleet: Fleet, down: Collection[str]
) -> Routes:
    """`routes` (a model's, from `plan`) with the `down` regions taken out, at once, before any
    replan moved capacity.

    A source that the plan also sends to surviving regions keeps those, in their proportions. A
    source the plan served only from down regions goes to the surviving regions where every part
    has replicas, those within the model's latency budget of it (else the nearest ones), in
    proportion to the capacity each has to spare under the plan (what `survive_region_loss`
    reserved), or to its whole capacity where none has any to spare. A source with nowhere to
    go keeps no row (the client then draws from every row pooled)."""
    down = set(down)
    if not down:
        return routes
    capacity: dict[str, float] = {}  # region -> the QPS the model carries there (its weakest part's)
    for i, dep in enumerate(deployments):
        placement = plan.deployments.get(dep.name)
        replicas = placement.replicas if placement is not None else {}
        mine = {
            region: (1 - dep.headroom)
            * sum(n * dep.hardware[hw].qps for hw, n in by_hw.items() if hw in dep.hardware)
            for region, by_hw in replicas.items()
        }
        capacity = mine if i == 0 else {r: min(c, mine[r]) for r, c in capacity.items() if r in mine}
    serving = {r: c for r, c in capacity.items() if c > 0 and r not in down}
    demand = dict(deployments[0].demand_qps) if deployments else {}  # the parts share it
    load = dict.fromkeys(serving, 0.0)
    for source, row in routes.items():
        for region, share in row.items():
            if region in load:
                load[region] += demand.get(source, 0.0) * share
    budget = min((d.latency_budget_ms for d in deployments), default=float("inf"))
    out: Routes = {}
    for source, row in sorted(routes.items()):
        kept = {r: f for r, f in row.items() if r not in down}
        total = sum(kept.values())
        if total > 0:
            out[source] = {r: f / total for r, f in sorted(kept.items())}
            continue
        if not serving:
            continue
        near = [r for r in serving if fleet.latency(source, r) <= budget]
        if not near:
            closest = min(fleet.latency(source, r) for r in serving)
            near = [r for r in serving if fleet.latency(source, r) == closest]
        spare = {r: serving[r] - load[r] for r in near if serving[r] - load[r] > 0}
        weights = spare or {r: serving[r] for r in near}
        total = sum(weights.values())
        out[source] = {r: w / total for r, w in sorted(weights.items())}
    return out
