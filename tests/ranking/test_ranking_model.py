"""The request-oriented ranker scores exactly like the naive per-pair model, and its parts
(tables whole or sharded, batched ranker) answer exactly what the model computes."""

from __future__ import annotations

import asyncio
import random
import re
from typing import Any

import pytest
import torch

from ipnext.errors import PartInputError, SnapshotError, SpecError
from ipnext.examples.request_ranker.model import RankingConfig, RankingModel
from ipnext.examples.request_ranker.parts import PairRankerPart, RankerPart, TablePart, shard_of
from ipnext.examples.request_ranker.train import SMALL_CONFIG, TrainReport, World
from ipnext.store.snapshots import load_weights


def random_model(seed: int = 0, **sizes: Any) -> RankingModel:
    """The issue's sizes (256 events, dim 64) with random weights and a random catalogue."""
    torch.manual_seed(seed)
    model = RankingModel(RankingConfig(**sizes)).eval()
    with torch.no_grad():
        model.item_features.normal_()
        model.item_category.random_(0, model.config.num_categories)
        for p in model.parameters():  # biases start at zero; make every term count
            p.add_(torch.randn_like(p) * 0.05)
    return model


def request_tensors(model: RankingModel, rng: random.Random, n: int) -> tuple[torch.Tensor, ...]:
    c = model.config
    return (
        torch.tensor([rng.randrange(c.num_users)]),
        torch.tensor([rng.randrange(c.num_items) for _ in range(c.seq_len)]),
        torch.randn(c.user_features, generator=torch.Generator().manual_seed(rng.randrange(2**31))),
        torch.tensor([rng.randrange(c.num_items) for _ in range(n)]),
    )


def test_request_path_equals_the_per_pair_path_for_1_to_1000_candidates() -> None:
    model = random_model()
    rng = random.Random(7)
    counts = [1, 2, 63, 64, 65, 1000] + [rng.randint(1, 1000) for _ in range(3)]
    with torch.inference_mode():
        for n in counts:
            tensors = request_tensors(model, rng, n)
            fast, naive = model.score_request(*tensors), model.score_pairs(*tensors)
            assert fast.shape == (n,)
            torch.testing.assert_close(fast, naive, rtol=1e-5, atol=1e-6, msg=f"{n} candidates")
            assert float(fast.std()) > 0 if n > 1 else True


def test_the_user_tower_runs_once_per_request() -> None:
    """Count the transformer block's calls: once for a request of 500 candidates, once per pair
    (in chunks) for the naive path."""
    model = random_model()
    calls: list[int] = []
    model.block.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    tensors = request_tensors(model, random.Random(1), 500)
    with torch.inference_mode():
        model.score_request(*tensors)
        assert calls == [1]
        calls.clear()
        model.score_pairs(*tensors)
    assert sum(calls) == 500


def test_a_candidate_score_does_not_depend_on_the_others() -> None:
    model = random_model()
    user, history, features, candidates = request_tensors(model, random.Random(3), 40)
    with torch.inference_mode():
        whole = model.score_request(user, history, features, candidates)
        alone = torch.stack(
            [model.score_request(user, history, features, c.view(1))[0] for c in candidates[:5]]
        )
    torch.testing.assert_close(whole[:5], alone, rtol=1e-5, atol=1e-6)


def config() -> dict[str, Any]:
    return dict(SMALL_CONFIG)


def build_parts(report: TrainReport, shards: int) -> tuple[list[TablePart], RankerPart]:
    folder = report.folder
    if shards == 1:
        tables = [TablePart(load_weights(folder / "embed.safetensors"), config())]
    else:
        tables = [
            TablePart(
                load_weights(folder / f"embed-shard{i}.safetensors"),
                {**config(), "shard": i, "shards": shards},
            )
            for i in range(shards)
        ]
    return tables, RankerPart(load_weights(folder / "dense.safetensors"), config())


async def lookups(tables: list[TablePart], request: dict[str, Any]) -> dict[str, torch.Tensor]:
    """What the router does for a sharded table: every shard looks up its ids, answers concatenate."""
    answers = [await t({"input": request}) for t in tables]
    return {key: torch.cat([a[key] for a in answers]) for key in answers[0]}


def model_scores(report: TrainReport, request: dict[str, Any]) -> list[float]:
    user = request["user"]
    with torch.inference_mode():
        return report.model.score_request(
            torch.tensor(user["id"]),
            torch.tensor(user["history"]),
            torch.tensor(user["features"]),
            torch.tensor(request["candidates"]),
        ).tolist()


@pytest.mark.parametrize("which", ["whole", "sharded"])
def test_parts_answer_what_the_model_computes(
    which: str, trained_whole: TrainReport, trained_sharded: TrainReport
) -> None:
    report, shards = (trained_whole, 1) if which == "whole" else (trained_sharded, 3)
    tables, ranker = build_parts(report, shards)
    world = World(RankingConfig.from_config(config()))
    rng = random.Random(11)
    naive = PairRankerPart(load_weights(report.folder / "dense.safetensors"), config())
    for n in (1, 17, 300):
        request = world.request(rng, n)
        inputs = {"input": request, "embed": asyncio.run(lookups(tables, request))}
        scores = asyncio.run(ranker(inputs))
        assert len(scores) == n
        assert scores == pytest.approx(model_scores(report, request), abs=2e-6)
        assert asyncio.run(naive(inputs)) == pytest.approx(scores, abs=2e-6)


def test_sharded_and_whole_tables_give_the_same_scores(
    trained_whole: TrainReport, trained_sharded: TrainReport
) -> None:
    """Same seed, same training: the two snapshots differ only in how the tables are split."""
    whole, sharded = build_parts(trained_whole, 1), build_parts(trained_sharded, 3)
    world = World(RankingConfig.from_config(config()))
    rng = random.Random(5)
    for n in (1, 50, 1000):
        request = world.request(rng, n)
        a = asyncio.run(whole[1]({"input": request, "embed": asyncio.run(lookups(whole[0], request))}))
        b = asyncio.run(sharded[1]({"input": request, "embed": asyncio.run(lookups(sharded[0], request))}))
        assert a == pytest.approx(b, abs=2e-6)


def test_each_shard_holds_and_answers_only_its_own_ids(trained_sharded: TrainReport) -> None:
    tables, _ = build_parts(trained_sharded, 3)
    world = World(RankingConfig.from_config(config()))
    request = world.request(random.Random(2), 200)
    wanted = set(request["user"]["history"]) | set(request["candidates"])
    seen: set[int] = set()
    for shard, table in enumerate(tables):
        answer = asyncio.run(table({"input": request}))
        ids = answer["item_ids"]
        assert bool((shard_of(ids, 3) == shard).all())
        assert not seen & set(ids.tolist())
        seen |= set(ids.tolist())
    assert seen == wanted
    sizes = [
        load_weights(trained_sharded.folder / f"embed-shard{i}.safetensors")["item_ids"].numel()
        for i in range(3)
    ]
    assert sum(sizes) == SMALL_CONFIG["num_items"] and min(sizes) > 0.25 * SMALL_CONFIG["num_items"]


def test_a_batch_scores_each_request_against_its_own_user(trained_whole: TrainReport) -> None:
    tables, ranker = build_parts(trained_whole, 1)
    world = World(RankingConfig.from_config(config()))
    rng = random.Random(9)
    requests = [world.request(rng, n) for n in (3, 40, 1, 250)]
    bad = {**requests[1], "candidates": [10**9]}
    batch = [{"input": r, "embed": asyncio.run(lookups(tables, r))} for r in requests]
    batch.insert(2, {"input": bad, "embed": batch[1]["embed"]})
    results = asyncio.run(ranker.batch(batch))
    assert isinstance(results[2], PartInputError) and "inputs.candidates" in str(results[2])
    good = [r for i, r in enumerate(results) if i != 2]
    for request, scores in zip(requests, good, strict=True):
        assert scores == pytest.approx(model_scores(trained_whole, request), abs=2e-6)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda r: r.pop("candidates"), "inputs.candidates"),
        (lambda r: r.update(candidates=[]), "inputs.candidates"),
        (lambda r: r["candidates"].append(-1), "inputs.candidates"),
        (lambda r: r["user"].update(id=10**6), "inputs.user.id"),
        (lambda r: r["user"].update(history=r["user"]["history"][:10]), "inputs.user.history"),
        (lambda r: r["user"].update(features=[1.0]), "inputs.user.features"),
        (lambda r: r["user"]["features"].__setitem__(2, float("nan")), r"inputs.user.features[2]"),
        (lambda r: r["user"]["features"].__setitem__(0, float("inf")), r"inputs.user.features[0]"),
        (lambda r: r["user"].update(id=1e999), "inputs.user.id"),
        (lambda r: r.update(candidates=r["candidates"] * 2000), "inputs.candidates"),  # over 5000
        (lambda r: r["user"].update(segment=3), "inputs.user.segment"),
        (lambda r: r.update(latency_budget_ms=-5), "inputs.latency_budget_ms"),
        (lambda r: r.pop("user"), "inputs.user"),
    ],
)
def test_bad_requests_name_the_field(change: Any, field: str, trained_whole: TrainReport) -> None:
    tables, _ = build_parts(trained_whole, 1)
    request = World(RankingConfig.from_config(config())).request(random.Random(1), 5)
    change(request)
    with pytest.raises(PartInputError, match=re.escape(field)):
        asyncio.run(tables[0]({"input": request}))


def test_the_candidate_bound_is_the_parts_config(trained_whole: TrainReport) -> None:
    tables, _ = build_parts(trained_whole, 1)
    request = World(RankingConfig.from_config(config())).request(random.Random(1), 5)
    small = TablePart(
        load_weights(trained_whole.folder / "embed.safetensors"), {**config(), "max_candidates": 4}
    )
    with pytest.raises(
        PartInputError, match=re.escape("inputs.candidates: 5 candidates; send 1 to 4 per request")
    ):
        asyncio.run(small({"input": request}))
    assert asyncio.run(tables[0]({"input": request}))  # the default bound takes 5


def test_parts_refuse_weights_that_do_not_fit(trained_sharded: TrainReport) -> None:
    shard0 = load_weights(trained_sharded.folder / "embed-shard0.safetensors")
    with pytest.raises(SnapshotError, match="user_ids"):  # shard 0's rows loaded as shard 1
        TablePart(shard0, {**config(), "shard": 1, "shards": 3})
    for broken in ("duplicate", "foreign"):
        weights = dict(shard0)
        ids = weights["item_ids"].clone()
        if broken == "duplicate":
            ids[1] = ids[0]
        else:  # an id another shard owns, kept in rising order
            ids[-1] = next(
                i for i in range(int(ids[-1]) + 1, 10**6) if int(shard_of(torch.tensor([i]), 3)) != 0
            )
        weights["item_ids"] = ids
        with pytest.raises(SnapshotError, match="item_ids must rise strictly"):
            TablePart(weights, {**config(), "shard": 0, "shards": 3})
    dense = load_weights(trained_sharded.folder / "dense.safetensors")
    dense.pop("head.weight")
    with pytest.raises(SnapshotError, match=r"head\.weight"):
        RankerPart(dense, config())
    with pytest.raises(SpecError, match=r"config\.heads"):
        RankerPart(load_weights(trained_sharded.folder / "dense.safetensors"), {**config(), "heads": 3})


def test_training_learns_the_world(trained_whole: TrainReport) -> None:
    assert trained_whole.logloss < trained_whole.base_logloss - 0.02


def test_a_batch_runs_one_user_tower_over_its_requests(trained_whole: TrainReport) -> None:
    """Serve batching keeps the user side once per request: one tower call with a row per request."""
    tables, ranker = build_parts(trained_whole, 1)
    calls: list[int] = []
    ranker._model.block.register_forward_hook(lambda _m, args, _out: calls.append(args[0].shape[0]))
    world = World(RankingConfig.from_config(config()))
    rng = random.Random(12)
    requests = [world.request(rng, n) for n in (5, 300, 40, 1)]
    batch = [{"input": r, "embed": asyncio.run(lookups(tables, r))} for r in requests]
    results = asyncio.run(ranker.batch(batch))
    assert calls == [len(requests)]
    assert [len(r) for r in results if isinstance(r, list)] == [5, 300, 40, 1]
