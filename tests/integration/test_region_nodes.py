"""Regions as real nodes: on `dev up --nodes per-region` a model served in two regions keeps
answering a lost region's callers from the surviving one, and what must outlive a region (the
Serve config writer, the metrics actors, the routing app) runs on the head node. Timings are
printed, never asserted."""

from __future__ import annotations

import time

import pytest

from ipnext.contracts import poll_until, wait_until
from ipnext.devstack import node_component
from ipnext.errors import PredictionError
from ipnext.routing import pick_region
from ipnext.sdk import AsyncPredictionClient, Client, Prediction
from ipnext.serving.layout import ROUTING_APP, WRITER_ACTOR, metrics_actor_name

from .conftest import one_region_spec, train_version
from .multinode import HEAD, REGIONS, PerRegionStack, per_region_stack, where_things_run

__all__ = ["per_region_stack"]  # the fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
INPUTS = {"user": 3, "items": [1, 2, 3]}


async def test_a_lost_regions_callers_are_answered_from_a_surviving_region(
    per_region_stack: PerRegionStack, model_name: str
) -> None:
    settings, dev = per_region_stack.settings, per_region_stack.dev
    spec = one_region_spec(
        model_name,
        traffic={"peak_qps": {"us-east": 50, "eu-west": 30}},
        availability={"headroom": 0.2, "min_regions": 2, "survive_region_loss": False},
    )
    async with await Client.connect(settings) as client:
        await client.publish_model(spec)
        folder, _ = train_version(settings, model_name, "v1")
        published = await client.publish_snapshot(model_name, folder)
        await client.wait_until_serving(model_name, published.set_id, timeout_s=240)

    async with AsyncPredictionClient(settings.serve_url, timeout_s=30, region_timeout_s=3) as serving:
        document = await serving.routing(model_name)
        serving_regions = sorted({r for row in document.routes.values() for r in row})
        assert len(serving_regions) >= 2, document.routes
        source = "us-east"
        lost = max(document.routes[source], key=lambda r: document.routes[source][r])
        # A key whose draw is the region to lose, so its requests try that region first.
        key = next(f"user-{i}" for i in range(1000) if pick_region(document, source, f"user-{i}") == lost)
        assert (await serving.predict(model_name, INPUTS, region=lost)).region == lost
        print(f"routes {document.routes}; losing {lost}")

        where = where_things_run(settings)
        print(f"nodes {where['nodes']}, proxies on {where['proxies']}, serving in {serving_regions}")
        assert sorted(where["nodes"]) == sorted([HEAD, *REGIONS])
        actors = where["actors"]
        pinned = [WRITER_ACTOR, *(metrics_actor_name(model_name, r) for r in serving_regions)]
        assert {name: actors.get(name) for name in pinned} == dict.fromkeys(pinned, HEAD)
        routing_replicas = [n for n in actors if n.startswith(f"SERVE_REPLICA::{ROUTING_APP}#")]
        assert routing_replicas and {actors[n] for n in routing_replicas} == {HEAD}
        for region in serving_regions:  # a region's router runs on that region's node
            routers = [n for n in actors if n.startswith(f"SERVE_REPLICA::{model_name}.{region}#router#")]
            assert routers and {actors[n] for n in routers} == {region}
        assert {HEAD, *serving_regions} <= set(where["proxies"])  # a proxy on every node serving

        killed = time.monotonic()
        dev.crash(node_component(lost))  # held: the supervisor leaves the region down
        reply = await poll_until(
            lambda: _answer(serving, model_name, source, key),
            lambda answer: answer is not None,
            timeout_s=60,
            interval_s=0.1,
            what=f"an answer for {source} after {lost} was lost",
        )
        answered_s = time.monotonic() - killed
        assert reply is not None and reply.region != lost and reply.region in serving_regions
        other = next(r for r in serving_regions if r != lost)
        assert (await serving.predict(model_name, INPUTS, region=other)).region == other
        print(f"{lost} killed: {source} answered from {reply.region} {answered_s:.2f}s later")

    after = wait_until(
        lambda: where_things_run(settings),
        lambda found: lost not in found["nodes"],  # Ray declared its node dead
        timeout_s=60,
        interval_s=0.5,
        what=f"Ray to declare {lost}'s node dead",
    )
    assert {name: after["actors"].get(name) for name in pinned} == dict.fromkeys(pinned, HEAD)
    print(f"{time.monotonic() - killed:.1f}s after the kill Ray lists the nodes {after['nodes']}")


async def _answer(serving: AsyncPredictionClient, model: str, source: str, key: str) -> Prediction | None:
    try:
        return await serving.predict(model, INPUTS, source=source, key=key)
    except PredictionError as err:
        print(f"  not yet: {type(err).__name__}: {str(err)[:160]}")
        return None
