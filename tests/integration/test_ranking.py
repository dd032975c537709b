"""The request-oriented ranker on the real stack: published, served, its dense part batched by
Serve across concurrent requests, and every answer equal to the model's own scores, with its
tables whole or split into hashed shards that the router gathers."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ray import serve

from ipnext.client.sdk import Client
from ipnext.examples.request_ranker.model import RankingConfig
from ipnext.examples.request_ranker.train import SMALL_CONFIG, World, train
from ipnext.serving.control import connect
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings

from .conftest import keyed, tolerant_latency_gate

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]


def ranking_spec(name: str, file: str) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "request_ranker" / file).model_dump(mode="json")
    data.update(name=name, traffic={"peak_qps": {"us-east": 40}})
    return ModelSpec.model_validate(tolerant_latency_gate(data))


# The whole-table model serves the same way without the gather; its spec and parts are tested in
# tests/ranking and tests/unit, and bench/ranking.py serves it. One stack test keeps make test short.
@pytest.mark.parametrize("shards", [3])
async def test_ranking_serves_batched_request_oriented_scores(
    stack: Settings, client: Client, model_name: str, shards: int
) -> None:
    spec = ranking_spec(model_name, "model.yaml" if shards == 1 else "model-sharded.yaml")
    assert spec.parts["dense"].batching is not None
    tables = ["embed"] if shards == 1 else [f"embed-shard{i}" for i in range(shards)]
    assert sorted(p for p in spec.parts if p != "dense") == tables
    await client.publish_model(spec)
    report = train(stack.snapshot_roots[0], model_name, "v1", steps=20, shards=shards)
    published = await client.publish_snapshot(model_name, report.folder)
    state = await client.wait_until_serving(model_name, published.set_id, timeout_s=240)
    assert state.plan is not None  # each shard is a planner deployment of its own
    mine = sorted(d for d in state.plan.deployments if d.startswith(f"{model_name}/"))
    assert mine == sorted(f"{model_name}/{p}" for p in [*tables, "dense"])
    world = World(RankingConfig.from_config(dict(SMALL_CONFIG)))
    rng = random.Random(4)
    requests = [world.request(rng, n) for n in [1, 2, 300, *(rng.randint(1, 200) for _ in range(21))]]
    path = f"/us-east/models/{model_name}/predict"

    def expected(request: dict[str, Any]) -> list[float]:
        user = request["user"]
        with torch.inference_mode():
            scores = report.model.score_request(
                torch.tensor(user["id"]),
                torch.tensor(user["history"]),
                torch.tensor(user["features"]),
                torch.tensor(request["candidates"]),
            )
        return [float(s) for s in scores]

    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=60) as http:
        replies = await asyncio.gather(*(http.post(path, json={"inputs": r}) for r in requests))
        for request, reply in zip(requests, replies, strict=True):
            assert reply.status_code == 200, reply.text
            envelope = reply.json()
            assert envelope["set"] == published.set_id
            assert envelope["parts"] == {p: f"{model_name}/{p}@v1" for p in [*tables, "dense"]}
            assert envelope["outputs"] == pytest.approx(expected(request), abs=2e-6)
        bad = dict(requests[0], candidates=[10**9])
        refused = await http.post(path, json={"inputs": bad})
        assert refused.status_code == 400 and refused.json()["message"].startswith("inputs.candidates"), (
            refused.text
        )

    connect(stack.ray_address())
    host = serve.get_deployment_handle("dense-cpu-std", app_name=f"{model_name}.us-east.s1.r1")
    described = await asyncio.to_thread(lambda: host.describe.remote().result())
    batching = described["batching"]
    print(f"dense part: {batching['calls']} calls in {batching['batches']} batches")
    assert batching["calls"] >= len(requests)
    assert batching["batches"] < batching["calls"], "concurrent requests never shared a batch"
    await client.delete_model(model_name)
