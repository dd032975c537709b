"""The router's pure decisions and data shaping: which set app each request (and each part
that rolls on its own) goes to, and how part answers join into the next part's inputs and
the final answer. No Ray: unit tests import it alone."""

from __future__ import annotations

import math
import random
from typing import Any, NamedTuple

from ipnext.contracts.router import RouterConfig
from ipnext.contracts.routing import weighted_draw
from ipnext.policy.experiments import assign_arm
from ipnext.serving.choices import RequestPlan
from ipnext.spec.model import DAG_INPUT
from ipnext.spec.sharding import gather_shards

__all__ = ["PickedApps", "all_finite", "join_shards", "jsonable", "pick_apps", "pick_set", "upstream_values"]


class PickedApps(NamedTuple):
    """The set apps one request runs on."""

    counted: str  # the app the request is counted against and stamped with
    base: str  # the app whose DAG runs
    part_apps: dict[str, str]  # part that rolls on its own -> the app it runs on
    arm: str | None = None  # the experiment arm of the request's unit


def pick_set(weights: dict[str, float], key: str | None, rng: random.Random) -> str | None:
    """Choose a set app in proportion to its weight; with a key, the same key always picks the
    same app while the weights stay put (sticky sessions, A/B-stable users)."""
    return weighted_draw(weights, key, rng)


def pick_apps(
    config: RouterConfig, reachable: set[str], key: str | None, rng: random.Random, unit: str | None = None
) -> PickedApps | None:
    """The apps of one request, or None when no app is reachable.

    In an experiment, a request with a `unit` runs whole on its arm's set app, or nowhere while
    that app is unreachable: another arm would break the unit's stickiness. Otherwise `base` is
    drawn from `config.weights` and runs the DAG; each part that rolls on its own
    (`config.parts`) runs on the app drawn from its weights; the request is counted against
    (and stamped with) the gated part's app, else the base app."""
    experiment = config.experiment
    if experiment is not None and unit is not None:
        arm = assign_arm(experiment.split, experiment.salt, unit)
        app = experiment.arms[arm]
        return PickedApps(app, app, {}, arm) if app in reachable else None

    def pick(weights: dict[str, float]) -> str | None:
        return pick_set({a: w for a, w in weights.items() if a in reachable}, key, rng)

    base = pick(config.weights)
    part_apps: dict[str, str] = {}
    for part, weights in config.parts.items():
        chosen = pick(weights)
        if chosen is not None:
            part_apps[part] = chosen
    if base is None:
        return None
    counted = part_apps.get(config.gated_part, base) if config.gated_part else base
    return PickedApps(counted, base, part_apps)


def join_shards(values: dict[str, Any], shard_groups: dict[str, list[str]]) -> dict[str, Any]:
    """`values` with the answers of each sharded part's shards gathered under the part's name."""
    for group, members in shard_groups.items():
        present = [m for m in members if m in values]
        if present and len(present) != len(members):
            raise RuntimeError(f"{group}: only the shards {present} of {members} answered")
        if present:
            values[group] = gather_shards([values.pop(m) for m in members])
    return values


def upstream_values(
    plan: RequestPlan, part: str, results: dict[str, Any], inputs: Any, shard_groups: dict[str, list[str]]
) -> dict[str, Any]:
    """A part's `inputs`: each upstream node's output, the request under "input", and the
    answers of a sharded part's shards gathered under the part's own name."""
    ups = plan.upstream.get(part, [])
    values = join_shards({u: results[u] for u in ups if u != DAG_INPUT}, shard_groups)
    if DAG_INPUT in ups:
        values[DAG_INPUT] = inputs
    return values


def all_finite(value: Any) -> bool:
    """No NaN or infinity anywhere in a JSON-like answer."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(all_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(all_finite(v) for v in value)
    return True


def jsonable(value: Any) -> Any:
    """A part's answer as JSON-ready values (tensors and arrays as nested lists)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
