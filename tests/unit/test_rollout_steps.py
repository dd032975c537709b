"""The step arithmetic of a rollout (ipnext.policy.rollout_steps): which steps it walks, what each
deploys and routes, and how much traffic a rollback moves back at once."""

from __future__ import annotations

from datetime import UTC, datetime
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.contracts.rollout import RolloutInput
from ipnext.policy.rollout_steps import (
    IDLE_SHARE,
    RolloutStep,
    carried_share,
    cutover_weights,
    deploy_scale,
    initial_traffic,
    is_gradual,
    new_set_scales,
    old_set_scales,
    rollback_percent,
    rolling_parts,
    rollout_steps,
    start_weights,
    step_routes,
    traffic_split,
)
from ipnext.spec.model import ModelSpec, SnapshotRef, SnapshotSet


def spec(
    parts: tuple[str, ...] = ("embed",), sync: str = "synchronized", steps: tuple[int, ...] = (10, 50, 100)
) -> ModelSpec:
    chain = ["input", *parts, "output"]
    return ModelSpec.model_validate(
        {
            "name": "m",
            "owner": "tests",
            "parts": {
                p: {"factory": "m:f", "hardware": {"cpu-std": {"units": 1, "qps": 100}}} for p in parts
            },
            "dag": [[a, b] for a, b in pairwise(chain)],
            "traffic": {"peak_qps": {"us-east": 10}},
            "latency_budget_ms": 50,
            "sync": sync,
            "rollout": {"steps": list(steps)},
        }
    )


def snapshot_set(number: int, versions: dict[str, str]) -> SnapshotSet:
    return SnapshotSet(
        id=f"m@{number}",
        number=number,
        version=f"v{number}",
        parts={
            part: SnapshotRef(uri=f"file:///snap/{part}/{v}", sha256="a" * 64, snapshot_id=f"m/{part}@{v}")
            for part, v in versions.items()
        },
        status="validated",
        published_at=datetime(2026, 11, 1, tzinfo=UTC),
    )


def plan(replicas: int = 4, parts: tuple[str, ...] = ("embed",), revision: int = 1) -> Plan:
    placement = DeploymentPlacement(
        replicas={"us-east": {"cpu-std": replicas}}, fractions={"us-east": {"us-east": 1.0}}
    )
    return Plan(deployments={f"m/{p}": placement for p in parts}, cost=1.0, solver="test", revision=revision)


TWO = ("embed", "dense")


def rollout(
    model: ModelSpec, new: dict[str, str], old: dict[str, str] | None, **fields: object
) -> RolloutInput:
    parts = tuple(model.parts)
    return RolloutInput.model_validate(
        {
            "spec": model,
            "plan": plan(parts=parts),
            "new_set": snapshot_set(2, new),
            "old_set": snapshot_set(1, old) if old is not None else None,
            "old_apps": {"us-east": "app-1"} if old is not None else {},
            **fields,
        }
    )


def walk(input: RolloutInput) -> list[tuple[int, int, str | None, list[str], str]]:
    return [(s.index, s.percent, s.part, s.done, s.label) for s in rollout_steps(input)]


# ---- which steps ------------------------------------------------------------------------------


def test_a_synchronized_rollout_walks_the_models_steps_for_the_whole_set() -> None:
    input = rollout(spec(), {"embed": "v2"}, {"embed": "v1"})
    assert walk(input) == [
        (0, 10, None, [], "step 1/3 (10%)"),
        (1, 50, None, [], "step 2/3 (50%)"),
        (2, 100, None, [], "step 3/3 (100%)"),
    ]
    assert start_weights(input) == {"us-east": {"app-1": 100.0}}


def test_independent_parts_each_walk_every_step_in_dag_order() -> None:
    model = spec(TWO, "independent", (50, 100))
    both = rollout(model, {"embed": "v2", "dense": "v2"}, {"embed": "v1", "dense": "v1"})
    assert walk(both) == [
        (0, 50, "embed", [], "embed step 1/2 (50%)"),
        (1, 100, "embed", [], "embed step 2/2 (100%)"),
        (2, 50, "dense", ["embed"], "dense step 1/2 (50%)"),
        (3, 100, "dense", ["embed"], "dense step 2/2 (100%)"),
    ]
    only_dense = rollout(model, {"embed": "v1", "dense": "v2"}, {"embed": "v1", "dense": "v1"})
    assert rolling_parts(only_dense) == ["dense"]
    assert [(s.part, s.done) for s in rollout_steps(only_dense)] == [("dense", []), ("dense", [])]
    # Nothing changed part by part (a capacity move of the same set): the set moves as one.
    same = rollout(model, {"embed": "v1", "dense": "v1"}, {"embed": "v1", "dense": "v1"})
    same = same.model_copy(
        update={"old_set": same.new_set, "old_plan": same.plan, "plan": plan(parts=TWO, revision=2)}
    )
    assert rolling_parts(same) == [] and [s.part for s in rollout_steps(same)] == [None, None]


def test_a_first_rollout_or_an_in_place_resize_is_one_step_to_100() -> None:
    first = rollout(spec(), {"embed": "v1"}, None)
    assert not is_gradual(first) and walk(first) == [(0, 100, None, [], "step 1/1 (100%)")]
    assert start_weights(first) == {}
    resize = rollout(spec(), {"embed": "v1"}, {"embed": "v1"})
    resize = resize.model_copy(update={"old_set": resize.new_set})  # same set, same plan revision
    assert not is_gradual(resize) and [s.percent for s in rollout_steps(resize)] == [100]
    moved = resize.model_copy(update={"old_plan": resize.plan, "plan": plan(revision=2)})  # a new placement
    assert is_gradual(moved) and [s.percent for s in rollout_steps(moved)] == [10, 50, 100]


# ---- what each step deploys ------------------------------------------------------------------


def test_the_new_set_scales_to_the_step_and_waiting_parts_keep_one_replica() -> None:
    whole = RolloutStep(index=0, percent=25, number=1, of=3)
    assert new_set_scales(whole, list(TWO)) == {"embed": 0.25, "dense": 0.25}
    embed = RolloutStep(index=0, percent=50, number=1, of=2, part="embed")
    assert new_set_scales(embed, list(TWO)) == {"embed": 0.5, "dense": IDLE_SHARE}
    dense = RolloutStep(index=2, percent=50, number=1, of=2, part="dense", done=["embed"])
    assert new_set_scales(dense, list(TWO)) == {"embed": 1.0, "dense": 0.5}


def test_the_old_set_scales_down_to_what_its_remaining_share_needs() -> None:
    full = {"embed": 1.0, "dense": 1.0}
    assert old_set_scales(RolloutStep(index=0, percent=30, number=1, of=2), full) == {
        "embed": 0.7,
        "dense": 0.7,
    }
    assert old_set_scales(RolloutStep(index=1, percent=100, number=2, of=2), full) is None
    half = RolloutStep(index=0, percent=50, number=1, of=2, part="embed")
    assert old_set_scales(half, full) == {"embed": 0.5, "dense": 1.0}
    moved = RolloutStep(index=1, percent=100, number=2, of=2, part="embed")
    assert old_set_scales(moved, {"embed": 0.5, "dense": 1.0}) == {"embed": IDLE_SHARE, "dense": 1.0}


def test_one_share_for_every_part_is_sent_as_one_scale() -> None:
    parts = list(TWO)
    assert deploy_scale({"embed": 0.5, "dense": 0.5}, parts) == (0.5, {})
    assert deploy_scale({"embed": 1.0, "dense": IDLE_SHARE}, parts) == (
        1.0,
        {"embed": 1.0, "dense": IDLE_SHARE},
    )
    assert deploy_scale({"embed": 0.5}, parts) == (1.0, {"embed": 0.5})  # not every part named


# ---- what each step routes -------------------------------------------------------------------


def test_step_routes_for_the_set_and_for_one_part() -> None:
    start = {"us-east": {"old": 100.0}}
    end = {"us-east": {"new": 100.0}}
    assert step_routes(start, end, 25) == ({"us-east": {"new": 25.0, "old": 75.0}}, {}, None)
    assert step_routes({}, end, 100) == (end, {}, None)  # a first rollout: straight to the end
    assert step_routes(start, end, 0) == (start, {}, None)  # a rollback all the way
    weights, parts, gated = step_routes(start, end, 50, "dense", ["embed"])
    assert weights == start and gated == "dense"
    assert parts == {"us-east": {"embed": {"new": 100.0}, "dense": {"new": 50.0, "old": 50.0}}}


def test_cutover_sends_a_region_without_apps_to_the_region_that_serves_it() -> None:
    placement = DeploymentPlacement(
        replicas={"us-east": {"cpu-std": 2}},
        fractions={"us-east": {"us-east": 1.0}, "eu-west": {"us-east": 1.0}},
    )
    input = rollout(spec(), {"embed": "v2"}, {"embed": "v1"}).model_copy(
        update={
            "plan": Plan(deployments={"m/embed": placement}, cost=1.0, solver="test"),
            "old_apps": {"us-east": "app-1", "ap-south": "app-1-ap"},
        }
    )
    # eu-west sends traffic to us-east; ap-south served before but the plan no longer routes it.
    assert cutover_weights(input, {"us-east": "app-2"}) == {
        "us-east": {"app-2": 100.0},
        "eu-west": {"app-2": 100.0},
    }


def test_traffic_percent_per_set() -> None:
    input = rollout(spec(), {"embed": "v2"}, {"embed": "v1"})
    assert initial_traffic(input) == {"m@2": 0.0, "m@1": 100.0}
    assert traffic_split(input, 25.0) == {"m@2": 25.0, "m@1": 75.0}
    capacity = input.model_copy(update={"old_set": input.new_set})
    assert initial_traffic(capacity) == {"m@2": 0.0}
    assert traffic_split(capacity, 25.0) == {"m@2": 100.0}  # one set serves throughout
    first = rollout(spec(), {"embed": "v1"}, None)
    assert traffic_split(first, 100.0) == {"m@2": 100.0}


# ---- rollback ----------------------------------------------------------------------------------


def test_a_rollback_moves_back_what_the_old_replicas_carry_at_full_load() -> None:
    ten = plan(replicas=10)
    # 5 of 10 replicas, planned at 0.8 load, carry 62.5% at full load: 37.5% stays on the new set.
    assert carried_share(ten, 0.2, {"embed": 0.5}) == pytest.approx(0.625)
    assert rollback_percent(ten, 0.2, {"embed": 0.5}) == pytest.approx(37.5)
    assert rollback_percent(ten, 0.2, {"embed": 1.0}) == 0.0  # all of it goes back at once
    two = plan(replicas=10, parts=TWO)
    scales = {"embed": 0.1, "dense": 1.0}
    assert rollback_percent(two, 0.2, scales) == pytest.approx(87.5)  # the smallest part decides
    assert rollback_percent(two, 0.2, scales, {"m/dense"}) == 0.0  # only the moving part counts


# ---- invariants ------------------------------------------------------------------------------


@settings(deadline=None, derandomize=True, max_examples=60)
@given(
    steps=st.lists(st.integers(1, 99), max_size=4, unique=True).map(lambda s: (*sorted(s), 100)),
    changed=st.sampled_from([("embed",), ("dense",), TWO]),
)
def test_every_part_ends_at_100_and_steps_are_numbered_in_order(
    steps: tuple[int, ...], changed: tuple[str, ...]
) -> None:
    model = spec(TWO, "independent", steps)
    new = {p: "v2" if p in changed else "v1" for p in TWO}
    walked = rollout_steps(rollout(model, new, {"embed": "v1", "dense": "v1"}))
    moving = [p for p in TWO if p in changed]  # in DAG order: embed feeds dense
    assert [s.index for s in walked] == list(range(len(steps) * len(moving)))
    assert [s.part for s in walked if s.percent == 100] == moving
    assert all(s.part is not None and s.done == moving[: moving.index(s.part)] for s in walked)


@settings(deadline=None, derandomize=True, max_examples=100)
@given(percent=st.floats(0, 100), part=st.sampled_from([None, "embed", "dense"]))
def test_every_router_sends_all_its_traffic_somewhere(percent: float, part: str | None) -> None:
    start = {"us-east": {"old-e": 100.0}, "eu-west": {"old-w": 100.0}}
    end = {"us-east": {"new-e": 100.0}, "eu-west": {"new-e": 100.0}, "ap-south": {"new-a": 100.0}}
    weights, parts, _ = step_routes(start, end, percent, part, ["embed"] if part == "dense" else [])
    for by_app in [*weights.values(), *(w for by_part in parts.values() for w in by_part.values())]:
        assert sum(by_app.values()) == pytest.approx(100.0, abs=1e-4)


# ---- which router a model moving between pooled and dedicated is routed by --------------------


def test_a_model_leaving_its_pool_is_routed_by_the_pool_router_while_its_pooled_set_takes_traffic() -> None:
    """A pool router reaches both kinds of set, a router of the model's own no pooled one: while
    the old, pooled set takes traffic the rollout routes through the pool router; its last step
    (all on the new, dedicated set) gives the model its own router. Into the pool: always pooled."""
    from ipnext.workflows._rollout_actions import RolloutActions

    dedicated = spec()
    pooled = dedicated.model_copy(update={"serving": "pooled"})

    def routes_pooled(new: ModelSpec, old: ModelSpec | None, weights: dict[str, dict[str, float]]) -> bool:
        actions = RolloutActions.__new__(RolloutActions)
        actions._input = rollout(new, {"embed": "v2"}, {"embed": "v1"}, old_spec=old)
        return actions._pool_routes(weights)

    step = {"us-east": {"m.us-east.s1.r1": 50.0, "m.us-east.s2.r1": 50.0}}
    last = {"us-east": {"m.us-east.s1.r1": 0.0, "m.us-east.s2.r1": 100.0}}
    back = {"us-east": {"m.us-east.s1.r1": 100.0}}  # a rollback
    assert routes_pooled(dedicated, pooled, step) and routes_pooled(dedicated, pooled, back)
    assert not routes_pooled(dedicated, pooled, last)
    assert all(routes_pooled(pooled, dedicated, w) for w in (step, last, back))
    assert not any(routes_pooled(dedicated, None, w) for w in (step, last, back))
    assert all(routes_pooled(pooled, None, w) for w in (step, last, back))
