"""Model updates: which fields change, shown how, and the lightest kind that applies them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from ipnext.policy.spec_update import VALUE_WIDTH, UpdateKind, diff_specs
from ipnext.spec.model import ModelSpec
from ipnext.spec.reading import parse_spec
from tests.unit.helpers import spec_dict


def spec(change: Callable[[dict[str, Any]], None] | None = None) -> ModelSpec:
    data = spec_dict()
    if change is not None:
        change(data)
    return parse_spec(ModelSpec, data, source="model.yaml")


def test_the_same_spec_is_no_change() -> None:
    diff = diff_specs(spec(), spec())
    assert diff.kind == UpdateKind.NONE and diff.changes == []


# (what the update does, the kind it needs, the changed fields' paths)
CASES: dict[str, tuple[Callable[[dict[str, Any]], None], UpdateKind, list[str]]] = {
    "a gate": (
        lambda d: d["rollout"]["gates"][0].update(max=0.05),
        UpdateKind.IN_PLACE,
        ["rollout.gates"],
    ),
    "bake and steps": (
        lambda d: d["rollout"].update(bake_seconds=9, steps=[50, 100]),
        UpdateKind.IN_PLACE,
        ["rollout.steps", "rollout.bake_seconds"],
    ),
    "the owner": (lambda d: d.update(owner="other-team"), UpdateKind.IN_PLACE, ["owner"]),
    "the router section": (
        lambda d: d.update(router={"max_queued_requests": 7}),
        UpdateKind.IN_PLACE,
        ["router.max_queued_requests"],
    ),
    "a part's batching": (
        lambda d: d["parts"]["dense"].update(batching={"max_batch_size": 8}),
        UpdateKind.IN_PLACE,
        ["parts.dense.batching"],
    ),
    "the watch": (lambda d: d.update(watch={"enabled": True}), UpdateKind.IN_PLACE, ["watch.enabled"]),
    "traffic": (
        lambda d: d["traffic"]["peak_qps"].update({"us-east": 600}),
        UpdateKind.CAPACITY,
        ["traffic.peak_qps.us-east"],
    ),
    "a new source region": (
        lambda d: d["traffic"]["peak_qps"].update({"ap-south": 5}),
        UpdateKind.CAPACITY,
        ["traffic.peak_qps.ap-south"],
    ),
    "the latency budget": (
        lambda d: d.update(latency_budget_ms=80),
        UpdateKind.CAPACITY,
        ["latency_budget_ms"],
    ),
    "availability": (
        lambda d: d["availability"].update(min_regions=2),
        UpdateKind.CAPACITY,
        ["availability.min_regions"],
    ),
    "a part's config": (
        lambda d: d["parts"]["dense"]["config"].update(hidden=64),
        UpdateKind.NEW_SET,
        ["parts.dense.config.hidden"],
    ),
    "a part's hardware": (
        lambda d: d["parts"]["dense"]["hardware"]["cpu-std"].update(qps=100),
        UpdateKind.NEW_SET,
        ["parts.dense.hardware.cpu-std.qps"],
    ),
    "a factory": (
        lambda d: d["parts"]["dense"].update(factory="ipnext.examples.click_ranker.parts:EmbeddingPart"),
        UpdateKind.NEW_SET,
        ["parts.dense.factory"],
    ),
    "gate and traffic: the heavier": (
        lambda d: (d["rollout"].update(bake_seconds=9), d.update(latency_budget_ms=80)),
        UpdateKind.CAPACITY,
        ["latency_budget_ms", "rollout.bake_seconds"],
    ),
    "traffic and a part: the heavier": (
        lambda d: (d.update(latency_budget_ms=80), d["parts"]["dense"]["config"].update(hidden=64)),
        UpdateKind.NEW_SET,
        ["parts.dense.config.hidden", "latency_budget_ms"],
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_each_change_takes_the_lightest_kind_that_applies_it(case: str) -> None:
    change, kind, fields = CASES[case]
    diff = diff_specs(spec(), spec(change))
    assert diff.kind == kind
    assert sorted(diff.fields()) == sorted(fields)


def test_added_and_removed_parts_and_a_new_dag_need_a_new_set() -> None:
    def one_part(d: dict[str, Any]) -> None:
        del d["parts"]["embed"]
        d["dag"] = [["input", "dense"], ["dense", "output"]]

    diff = diff_specs(spec(), spec(one_part))
    assert diff.kind == UpdateKind.NEW_SET
    assert "parts.embed: removed" in diff.changes
    assert (
        'dag: [["input","embed"],["embed","dense"],["dense","output"]] -> '
        '[["input","dense"],["dense","output"]]' in diff.changes
    )
    back = diff_specs(spec(one_part), spec())
    assert back.kind == UpdateKind.NEW_SET
    assert any(line.startswith("parts.embed: added (") for line in back.changes)


def test_a_line_shows_the_old_and_the_new_value() -> None:
    diff = diff_specs(spec(), spec(lambda d: d["rollout"].update(bake_seconds=9)))
    assert diff.changes == ["rollout.bake_seconds: 3.0 -> 9.0"]


def test_long_values_are_cut() -> None:
    diff = diff_specs(spec(), spec(lambda d: d["parts"]["dense"]["config"].update(note="x" * 500)))
    (line,) = diff.changes
    _, new = line.split(": ", 1)[1].split(" -> ")
    assert len(new) == VALUE_WIDTH and new.endswith("...")


def test_the_name_cannot_change() -> None:
    with pytest.raises(ValueError, match=r"^name: an update keeps the model's name 'feed-ranker'"):
        diff_specs(spec(), spec(lambda d: d.update(name="other")))
