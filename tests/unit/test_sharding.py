"""A part of `shards: k` becomes k shard parts wired like the part; their answers gather into one."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from ipnext.contracts.plan import PlanningProblem, demand_from_model
from ipnext.planner import solve
from ipnext.serving.layout import render_set_app, set_app_plan
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import (
    ModelSpec,
    SnapshotRef,
    SnapshotSet,
    check_against_fleet,
    check_factories,
    load_model_spec,
)
from ipnext.spec.sharding import expand_shards, gather_shards

REPO = Path(__file__).resolve().parents[2]
SHARDED = REPO / "examples" / "request_ranker" / "model-sharded.yaml"


def test_a_sharded_part_becomes_its_shards_each_wired_like_the_part() -> None:
    spec = load_model_spec(SHARDED)
    shards = ["embed-shard0", "embed-shard1", "embed-shard2"]
    assert sorted(spec.parts) == sorted(["dense", *shards])
    for i, name in enumerate(shards):
        part = spec.parts[name]
        assert part.shard_of == "embed"
        assert part.config["shard"] == i and part.config["shards"] == 3
        assert part.config["num_items"] == 2000  # the part's own config is kept
    assert sorted(spec.upstream("dense")) == sorted(["input", *shards])
    for name in shards:
        assert spec.upstream(name) == ["input"]
    assert spec.topological_order()[-1] == "dense"
    assert spec.shard_groups() == {"embed": shards}


def test_an_expanded_spec_validates_to_itself() -> None:
    spec = load_model_spec(SHARDED)
    again = ModelSpec.model_validate(spec.model_dump(mode="json"))
    assert again == spec


def test_a_part_of_one_shard_is_left_whole() -> None:
    data = load_model_spec(SHARDED).model_dump(mode="json")
    raw = {
        **data,
        "parts": {
            "embed": {**data["parts"]["embed-shard0"], "shard_of": None},
            "dense": data["parts"]["dense"],
        },
    }
    raw["parts"]["embed"]["shards"] = 1
    raw["dag"] = [["input", "embed"], ["input", "dense"], ["embed", "dense"], ["dense", "output"]]
    assert expand_shards(raw) is raw
    assert sorted(ModelSpec.model_validate(raw).parts) == ["dense", "embed"]


@pytest.mark.parametrize(
    ("shards", "message"),
    [(0, "shards"), (65, "shards"), ("3", "shards")],
)
def test_bad_shard_counts_name_the_field(shards: object, message: str) -> None:
    data = load_model_spec(REPO / "examples" / "request_ranker" / "model.yaml").model_dump(mode="json")
    data["parts"]["embed"]["shards"] = shards
    with pytest.raises(ValidationError, match=message):
        ModelSpec.model_validate(data)


def test_a_shard_name_that_exists_already_is_refused() -> None:
    data = load_model_spec(REPO / "examples" / "request_ranker" / "model.yaml").model_dump(mode="json")
    data["parts"]["embed"]["shards"] = 2
    data["parts"]["embed-shard1"] = dict(data["parts"]["dense"])
    data["dag"].append(["input", "embed-shard1"])
    with pytest.raises(ValidationError, match="embed-shard1"):
        ModelSpec.model_validate(data)


def test_gather_joins_dicts_of_tensors_and_lists_in_shard_order() -> None:
    answers = [
        {"ids": torch.tensor([4, 1]), "rows": torch.ones(2, 3), "names": ["a", "b"]},
        {"ids": torch.tensor([], dtype=torch.long), "rows": torch.zeros(0, 3), "names": []},
        {"ids": torch.tensor([7]), "rows": torch.full((1, 3), 2.0), "names": ["c"]},
    ]
    joined = gather_shards(answers)
    assert joined["ids"].tolist() == [4, 1, 7]
    assert joined["rows"].shape == (3, 3) and joined["rows"][2, 0] == 2.0
    assert joined["names"] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="shard 1"):
        gather_shards([{"ids": torch.tensor([1])}, {"other": torch.tensor([2])}])
    with pytest.raises(ValueError, match="join along their first dimension"):
        gather_shards([3, 4])


def test_each_shard_is_planned_and_deployed_and_the_router_learns_the_groups(dev_fleet: Fleet) -> None:
    spec = load_model_spec(SHARDED)
    plan = solve(PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(spec)))
    shards = [f"embed-shard{i}" for i in range(3)]
    assert sorted(plan.deployments) == sorted(f"{spec.name}/{p}" for p in [*shards, "dense"])
    snapshot_set = SnapshotSet(
        id=f"{spec.name}@1",
        number=1,
        version="v1",
        parts={
            part: SnapshotRef(
                uri=f"file:///srv/s/{part}.safetensors", sha256="a" * 64, snapshot_id=f"x/{part}@v1"
            )
            for part in spec.parts
        },
        status="validated",
        published_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    app = set_app_plan(spec, snapshot_set, plan, "us-east", "/srv/pinned")
    assert app.args.shard_groups == {"embed": shards}
    assert [app.args.parts[s].config["shard"] for s in shards] == [0, 1, 2]
    rendered = render_set_app(app, replica_num_cpus=0)
    assert rendered["args"]["shard_groups"] == {"embed": shards}
    by_name = {d["name"]: d for d in rendered["deployments"]}
    assert {f"{s}-cpu-highmem" for s in shards} <= set(by_name)
    # The batched dense part may hold two batches of 8; the others keep Serve's default.
    assert by_name["dense-cpu-std"]["max_ongoing_requests"] == 16
    assert "max_ongoing_requests" not in by_name["embed-shard0-cpu-highmem"]


def test_a_model_without_shards_renders_no_shard_groups(dev_fleet: Fleet) -> None:
    spec = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml")
    plan = solve(PlanningProblem(fleet=dev_fleet, deployments=demand_from_model(spec)))
    snapshot_set = SnapshotSet(
        id=f"{spec.name}@1",
        number=1,
        version="v1",
        parts={
            p: SnapshotRef(uri=f"file:///srv/s/{p}.safetensors", sha256="a" * 64, snapshot_id=f"x/{p}@v1")
            for p in spec.parts
        },
        status="validated",
        published_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    rendered = render_set_app(set_app_plan(spec, snapshot_set, plan, "us-east", "/srv/pinned"), 0)
    assert "shard_groups" not in rendered["args"] and "choices" not in rendered["args"]


def test_the_ranking_examples_fit_the_dev_fleet(dev_fleet: Fleet) -> None:
    for name in ("model.yaml", "model-sharded.yaml"):
        spec = load_model_spec(REPO / "examples" / "request_ranker" / name)
        check_against_fleet(spec, dev_fleet)
        check_factories(spec)
        assert spec.parts["dense"].batching is not None
