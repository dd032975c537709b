"""The example ranker's parts built from a trained snapshot: answers, tensor contracts, bad inputs."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from ipnext.errors import PartInputError, SnapshotError
from ipnext.examples.click_ranker.parts import DensePart, EmbeddingPart
from ipnext.spec.model import ModelSpec
from ipnext.store.snapshots import inspect_safetensors, load_weights
from tests.unit.helpers import Trained


@pytest.fixture(scope="module")
def weights(trained: Trained) -> dict[str, dict[str, torch.Tensor]]:
    return {part: load_weights(trained.folder / f"{part}.safetensors") for part in ("embed", "dense")}


def config(spec: ModelSpec, part: str) -> dict[str, Any]:
    return dict(spec.parts[part].config)


@pytest.fixture(scope="module")
def parts(
    example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]]
) -> tuple[EmbeddingPart, DensePart]:
    return (
        EmbeddingPart(weights["embed"], config(example_spec, "embed")),
        DensePart(weights["dense"], config(example_spec, "dense")),
    )


async def rank(parts: tuple[EmbeddingPart, DensePart], user: int, items: list[int]) -> list[float]:
    embed, dense = parts
    vectors = await embed({"input": {"user": user, "items": items}})
    return await dense({"input": {"user": user, "items": items}, "embed": vectors})


async def test_parts_answer_one_probability_per_item(parts: tuple[EmbeddingPart, DensePart]) -> None:
    items = [0, 7, 42, 499, 7]
    scores = await rank(parts, 3, items)
    assert isinstance(scores, list)
    assert len(scores) == len(items)
    assert all(isinstance(p, float) and 0.0 <= p <= 1.0 for p in scores)
    assert scores[1] == scores[4]  # the same item scores the same
    assert len(set(scores)) > 1  # trained weights, not a constant


async def test_embedding_part_returns_the_tables_rows(
    parts: tuple[EmbeddingPart, DensePart], weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    out = await parts[0]({"input": {"user": 5, "items": [1, 2]}})
    assert out["user"].shape == (1, 16)
    assert out["items"].shape == (2, 16)
    assert torch.equal(out["user"][0], weights["embed"]["user.weight"][5])
    assert torch.equal(out["items"][1], weights["embed"]["item.weight"][2])


async def test_scores_match_the_trained_modules(
    parts: tuple[EmbeddingPart, DensePart],
    weights: dict[str, dict[str, torch.Tensor]],
    example_spec: ModelSpec,
) -> None:
    from ipnext.examples.click_ranker.parts import build_modules

    modules = build_modules(config(example_spec, "dense"))
    modules.load_state_dict({**weights["embed"], **weights["dense"]})
    with torch.no_grad():
        u, i = modules.embed(torch.tensor([9]), torch.tensor([10, 20, 30]))
        expected = torch.sigmoid(modules.score(u, i)).tolist()
    assert await rank(parts, 9, [10, 20, 30]) == pytest.approx(expected, abs=1e-6)


async def test_empty_item_list(parts: tuple[EmbeddingPart, DensePart]) -> None:
    assert await rank(parts, 0, []) == []


@pytest.mark.parametrize("part", ["embed", "dense"])
def test_expected_tensors_match_the_safetensors_header(
    trained: Trained, example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]], part: str
) -> None:
    cls = EmbeddingPart if part == "embed" else DensePart
    built = cls(weights[part], config(example_spec, part))
    header = inspect_safetensors(trained.folder / f"{part}.safetensors")
    assert built.expected_tensors() == header
    assert header  # not vacuous


def test_expected_tensor_names(parts: tuple[EmbeddingPart, DensePart]) -> None:
    assert parts[0].expected_tensors() == {
        "user.weight": ((200, 16), "float32"),
        "item.weight": ((500, 16), "float32"),
    }
    assert parts[1].expected_tensors() == {
        "mlp.0.weight": ((32, 48), "float32"),
        "mlp.0.bias": ((32,), "float32"),
        "mlp.2.weight": ((1, 32), "float32"),
        "mlp.2.bias": ((1,), "float32"),
    }


def test_wrong_shape_embedding_is_rejected(
    example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    bad = {**weights["embed"], "item.weight": torch.zeros(500, 8)}
    with pytest.raises(SnapshotError) as info:
        EmbeddingPart(bad, config(example_spec, "embed"))
    message = str(info.value)
    assert "'item.weight'" in message
    assert "[500, 8]" in message
    assert "[500, 16]" in message


def test_wrong_shape_dense_tensor_is_rejected(
    example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    bad = {**weights["dense"], "mlp.2.weight": torch.zeros(2, 32)}
    with pytest.raises(SnapshotError) as info:
        DensePart(bad, config(example_spec, "dense"))
    assert "'mlp.2.weight'" in str(info.value)
    assert "[2, 32]" in str(info.value)


def test_wrong_dtype_is_rejected(
    example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    bad = {**weights["dense"], "mlp.0.bias": weights["dense"]["mlp.0.bias"].to(torch.float16)}
    with pytest.raises(SnapshotError) as info:
        DensePart(bad, config(example_spec, "dense"))
    assert "'mlp.0.bias'" in str(info.value)
    assert "float16" in str(info.value)


def test_missing_and_extra_tensors_are_rejected(
    example_spec: ModelSpec, weights: dict[str, dict[str, torch.Tensor]]
) -> None:
    missing = {k: v for k, v in weights["embed"].items() if k != "user.weight"}
    with pytest.raises(SnapshotError, match=r"'user\.weight' is missing"):
        EmbeddingPart(missing, config(example_spec, "embed"))
    extra = {**weights["dense"], "mlp.9.weight": torch.zeros(1)}
    with pytest.raises(SnapshotError, match=r"unexpected tensors \['mlp\.9\.weight'\]"):
        DensePart(extra, config(example_spec, "dense"))


@pytest.mark.parametrize(
    ("user", "items"),
    [(200, [1]), (-1, [1]), (0, [500]), (0, [3, -1]), (10_000, [])],
)
async def test_out_of_range_ids_are_rejected(
    parts: tuple[EmbeddingPart, DensePart], user: int, items: list[int]
) -> None:
    with pytest.raises(PartInputError) as info:  # the caller's mistake: HTTP 400
        await parts[0]({"input": {"user": user, "items": items}})
    if not 0 <= user < 200:
        assert f"inputs.user: {user} is out of range: users are 0..199" in str(info.value)
    else:
        bad = [i for i in items if not 0 <= i < 500]
        assert f"inputs.items: {bad} are out of range: items are 0..499" in str(info.value)


@pytest.mark.parametrize("request_", [None, {"user": 1}, {"user": "x", "items": [1]}, {"items": [1]}, [1, 2]])
async def test_malformed_requests_name_the_expected_shape(
    parts: tuple[EmbeddingPart, DensePart], request_: object
) -> None:
    with pytest.raises(PartInputError, match=r'inputs: expected \{"user": int, "items": \[int, \.\.\.\]\}'):
        await parts[0]({"input": request_})


# --- variants: MLP parts of several sizes, and the drill knobs -----------------------------------


@pytest.fixture(scope="module")
def variant_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ipnext.examples.click_ranker.train import train

    report = train(
        tmp_path_factory.mktemp("variants"), "m", "v1", steps=5, dense_parts={"small": 8, "large": 24}
    )
    assert sorted(report.manifest.parts) == ["embed", "large", "small"]
    assert sorted(report.loglosses) == ["large", "small"]
    return report.folder


async def test_trainer_writes_one_mlp_part_per_size_on_shared_embeddings(
    variant_snapshot: Path, example_spec: ModelSpec
) -> None:
    base = config(example_spec, "dense")
    embed = EmbeddingPart(load_weights(variant_snapshot / "embed.safetensors"), config(example_spec, "embed"))
    vectors = await embed({"input": {"user": 4, "items": [1, 2, 3]}})
    scores = {}
    for part, hidden in (("small", 8), ("large", 24)):
        dense = DensePart(load_weights(variant_snapshot / f"{part}.safetensors"), {**base, "hidden": hidden})
        assert dense.expected_tensors()["mlp.0.weight"] == ((hidden, 48), "float32")
        scores[part] = await dense({"embed": vectors})
    assert len(scores["small"]) == len(scores["large"]) == 3
    assert scores["small"] != scores["large"]
    with pytest.raises(SnapshotError, match=r"'mlp\.0\.weight' is float32\[8, 48\]"):
        DensePart(load_weights(variant_snapshot / "small.safetensors"), {**base, "hidden": 24})


async def test_dense_part_drill_knobs(
    parts: tuple[EmbeddingPart, DensePart],
    weights: dict[str, dict[str, torch.Tensor]],
    example_spec: ModelSpec,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The patch replaces asyncio.sleep for the whole process, so only this test's own task is
    # recorded; anything else sleeping (a thread left by an earlier test in this worker) still
    # sleeps for real instead of spinning.
    slept: list[float] = []
    real_sleep, this_task = asyncio.sleep, asyncio.current_task()

    async def sleep(seconds: float, *args: Any) -> Any:
        if asyncio.current_task() is not this_task:
            return await real_sleep(seconds, *args)
        slept.append(seconds)
        return None

    monkeypatch.setattr("ipnext.examples.click_ranker.parts.asyncio.sleep", sleep)
    drilled = DensePart(weights["dense"], {**config(example_spec, "dense"), "delay_ms": 150, "max_items": 2})
    vectors = await parts[0]({"input": {"user": 1, "items": [5, 6]}})
    assert await drilled({"embed": vectors}) == await parts[1]({"embed": vectors})
    assert slept == [0.15]
    too_many = await parts[0]({"input": {"user": 1, "items": [5, 6, 7]}})
    with pytest.raises(RuntimeError, match="3 items are over this part's max_items 2") as info:
        await drilled({"embed": too_many})
    assert not isinstance(info.value, PartInputError)  # the server's fault: a fallback may retry it
    assert slept == [0.15, 0.15] and await parts[1]({"embed": too_many})  # no knobs: no limit, no sleep


@pytest.mark.parametrize(
    ("request_inputs", "words"),
    [
        ({"user": 3.7, "items": [1]}, "expected"),  # int() would have taken 3
        ({"user": "5", "items": [1]}, "expected"),
        ({"user": True, "items": [1]}, "expected"),
        ({"user": float("inf"), "items": [1]}, "expected"),  # int() raised OverflowError: a 500
        ({"user": 1, "items": [1.0]}, "expected"),
        ({"user": 1, "items": "12"}, "expected"),
        ({"user": 1, "items": list(range(1001))}, "inputs.items: 1001 items; send at most 1000"),
    ],
)
async def test_inputs_are_checked_before_they_reach_a_tensor(
    parts: tuple[EmbeddingPart, DensePart], request_inputs: dict[str, object], words: str
) -> None:
    with pytest.raises(PartInputError, match=words):
        await parts[0]({"input": request_inputs})
