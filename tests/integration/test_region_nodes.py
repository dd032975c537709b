"""Regions as real nodes, the region-loss drill: on `dev up --nodes per-region` a model served in
two regions, called from two sources through the SDK, loses one region's node. Its callers are
answered from the surviving region within seconds, only requests in flight there may fail,
the `fleet` workflow finds the region down and its emergency replan (in `ipnext plan show`)
moves the capacity; the node comes back, the region comes up and the return replan moves
capacity back, with no failed request and the region's router healthy, without a command. Then
on-call takes the region down and up again (its node alive all along), and it serves from its
own region again, router healthy. What must outlive a region (the Serve config writer, the
metrics actors, the routing app) runs on the head node. Timings are printed, never asserted."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import pytest

from ipnext.activities.serving import APPS_RUNNING_TIMEOUT_S
from ipnext.client.devstack.stack import node_component
from ipnext.client.sdk import AsyncPredictionClient, Client
from ipnext.contracts.fleet import FleetStatus
from ipnext.contracts.model import ModelState
from ipnext.contracts.routing import RoutingDocument, pick_region
from ipnext.errors import PredictionError
from ipnext.names import ModelStatus, poll_until
from ipnext.serving.layout import ROUTING_APP, WRITER_ACTOR, metrics_actor_name, router_app_name
from ipnext.spec.settings import Settings

from .conftest import one_region_spec, train_version
from .multinode import HEAD, REGIONS, PerRegionStack, per_region_stack, where_things_run
from .test_cli import ipnext

__all__ = ["per_region_stack"]  # the fixture, imported for pytest

# Four phases, each up to its deadlines below: 3-4 minutes idle, about 10 beside a loaded suite.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]
INPUTS = {"user": 3, "items": [1, 2, 3]}


SOURCES = ("us-east", "eu-west")  # the two regions the model can live in (ap-south has no highmem)
QPS_PER_SOURCE = 4.0  # light on 2 cores: 8 requests/s in all
# Deadlines of the drill's waits (each a wait for a condition, never a sleep): every source
# answered (before the kill, from a survivor after it, from both regions after the return); a
# replan found and applied; the model serving from the regions a replan gave it. The last is the
# product's own patience: a capacity move waits up to APPS_RUNNING_TIMEOUT_S for Serve to start
# its apps, and one that fails is tried again (rollout_steps.capacity_retry), so a move on a
# loaded machine may take two such waits (a CI run's return took over 240 s: the drill failed
# while the move was still on its way).
ANSWERED_S = 60.0
REPLAN_S = 180.0
SERVING_S = 2 * APPS_RUNNING_TIMEOUT_S


@dataclass
class Call:
    source: str
    first: str  # the region the routing document drew for it (the SDK tries it first)
    started: float
    ended: float = 0.0
    region: str | None = None  # the region that answered
    error: str = ""


class SourceLoad:
    """An open loop per source through the SDK (`source=`, failover across regions): a request
    every 1/qps s on its own task, each with its own key, so a slow answer never delays the next;
    ticks missed while the event loop was held are skipped (a burst would be a load of its own)."""

    def __init__(self, serving: AsyncPredictionClient, model: str, document: RoutingDocument) -> None:
        self.serving, self.model, self.document = serving, model, document
        self.calls: list[Call] = []
        self._stop = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._inflight: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> SourceLoad:
        self._loops = [asyncio.create_task(self._source(s)) for s in SOURCES]
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._loops)
        await asyncio.gather(*self._inflight)

    async def _source(self, source: str) -> None:
        loop = asyncio.get_running_loop()
        start, i = loop.time(), 0
        while not self._stop.is_set():
            key = f"{source}-{i}"
            call = Call(
                source=source, first=pick_region(self.document, source, key) or "", started=time.monotonic()
            )
            self.calls.append(call)
            task = asyncio.create_task(self._one(call, key))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            # The next tick; ticks missed while the loop was held are skipped, never sent at once.
            i = max(i + 1, int((loop.time() - start) * QPS_PER_SOURCE))
            await asyncio.sleep(max(0.0, start + i / QPS_PER_SOURCE - loop.time()))

    async def _one(self, call: Call, key: str) -> None:
        try:
            answer = await self.serving.predict(self.model, INPUTS, source=call.source, key=key)
            call.region = answer.region
        except PredictionError as err:
            call.error = f"{type(err).__name__}: {str(err)[:160]}"
        call.ended = time.monotonic()

    def failed(self, since: float = 0.0) -> list[Call]:
        return [c for c in self.calls if c.error and c.started >= since]


async def test_a_lost_region_is_routed_around_replanned_without_and_returns(
    per_region_stack: PerRegionStack, model_name: str
) -> None:
    settings, dev, config = per_region_stack.settings, per_region_stack.dev, per_region_stack.config
    spec = one_region_spec(
        model_name,
        traffic={"peak_qps": {"us-east": 30, "eu-west": 20}},
        latency_budget_ms=20,  # each source served at home (the regions are 40 ms apart)
        availability={"headroom": 0.2, "min_regions": 2, "survive_region_loss": False},
    )
    spec = spec.model_copy(
        update={"rollout": spec.rollout.model_copy(update={"steps": [100], "min_requests": 10})}
    )
    async with await Client.connect(settings) as client:
        began = time.monotonic()
        await client.publish_model(spec)
        folder, _ = train_version(settings, model_name, "v1")
        published = await client.publish_snapshot(model_name, folder)
        first = await client.wait_until_serving(model_name, published.set_id, timeout_s=240)
        assert sorted(first.serving_apps) == sorted(SOURCES), first.serving_apps
        revision = first.plan.revision if first.plan else 1

        # 10 s a region (the SDK's default): on a loaded 2-core machine a live region took over 5 s,
        # and the SDK then failed over to the dead one, which held the request to its end (the SDK
        # now gives a region the rest of the deadline when every other one is known down).
        async with AsyncPredictionClient.from_settings(
            settings, timeout_s=30, region_timeout_s=10
        ) as serving:
            document = await serving.routing(model_name)
            serving_regions = sorted({r for row in document.routes.values() for r in row})
            assert serving_regions == sorted(SOURCES), document.routes
            lost = "eu-west"
            survivor = "us-east"
            assert (await serving.predict(model_name, INPUTS, region=lost)).region == lost
            print(f"serving in {time.monotonic() - began:.1f}s; routes {document.routes}; losing {lost}")

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

            async with SourceLoad(serving, model_name, document) as load:
                await poll_until(  # both sources answered from home before the kill
                    lambda: _now(_answered_from(load, 0.0)),
                    lambda answered: all(answered.get(s, {}).get(s, 0) > 0 for s in SOURCES),
                    timeout_s=ANSWERED_S,
                    interval_s=0.1,
                    what="every source answered from its own region before the kill",
                )
                killed = time.monotonic()
                # Held: the supervisor leaves the region down. Off the event loop, as every blocking
                # call below: a 13 s `dev.start` on the loop once stopped the load, which then sent
                # the missed requests at once into the return replan (a CI run's 16 failures).
                await asyncio.to_thread(dev.crash, node_component(lost))
                dead = time.monotonic()  # the kill takes time: 8 processes found and killed
                # Every source answered again from a surviving region.
                await poll_until(
                    lambda: _now(_answered_after(load, killed, lost)),
                    lambda answered: set(answered) == set(SOURCES),
                    timeout_s=ANSWERED_S,
                    interval_s=0.1,
                    what=f"every source answered from a surviving region after {lost} was lost",
                )
                answered = _answered_after(load, killed, lost)
                print(
                    f"{lost} killed: every source answered again from a surviving region "
                    f"{max(answered.values()):.2f}s later "
                    f"({', '.join(f'{s} {t:.2f}s' for s, t in answered.items())})"
                )
                # The fleet workflow finds the region down (its node is dead) and replans without it.
                status = await poll_until(
                    client.fleet_regions,
                    lambda s: _replan_done(s, "emergency"),
                    timeout_s=REPLAN_S,
                    interval_s=0.5,
                    what=f"the emergency replan for {lost}",
                )
                detected_s = time.monotonic() - killed
                assert (
                    lost in status.down
                    and status.regions[[r.region for r in status.regions].index(lost)].detected
                )
                replan = status.replans[-1]
                assert replan.outcome == "applied" and replan.down_regions == [lost], replan
                assert f"{model_name}: min_regions 2 -> 1" in "\n".join(replan.relaxed), replan.relaxed
                shown = await asyncio.to_thread(ipnext, config, "plan", "show")
                assert shown.returncode == 0, shown.stderr
                assert f"planned without the down regions: {lost}" in shown.stdout, shown.stdout
                assert f"relaxed {model_name}: min_regions 2 -> 1" in shown.stdout, shown.stdout
                emergency = await _serving_on(client, model_name, {survivor}, revision, killed)
                moved_s = time.monotonic() - killed
                after_kill = load.failed()
                # Only requests in flight at the kill may fail: those held by the lost region, and
                # those whose connection the lost node's proxy held (on one machine every node's
                # proxy listens on the serving port, and the kernel spreads connections over them).
                # The kill is not an instant: a request sent while the node's processes were being
                # found and killed (a second or more on a loaded machine) was in flight at it.
                in_flight = [c for c in load.calls if c.started < dead and (c.ended or 1e12) > killed]
                assert all(c in in_flight for c in after_kill), [
                    f"sent {c.started - killed:+.2f}s after the kill began "
                    f"(it took {dead - killed:.2f}s): {c.error}"
                    for c in after_kill
                    if c not in in_flight
                ][:5]
                print(
                    f"found down and replanned {detected_s:.1f}s after the kill "
                    f"(plan revision {replan.revision}, "
                    f"relaxed {replan.relaxed}); serving only from {survivor} {moved_s:.1f}s after it; "
                    f"{len(after_kill)} failed of {len(in_flight)} in flight at the kill "
                    f"(it took {dead - killed:.2f}s)"
                )

                # The node comes back: the region comes up, the return replan moves capacity back.
                back = time.monotonic()
                await asyncio.to_thread(dev.start, node_component(lost))
                status = await poll_until(
                    client.fleet_regions,
                    lambda s: lost not in s.down and _replan_done(s, "return"),
                    timeout_s=REPLAN_S,
                    interval_s=0.5,
                    what=f"{lost} up and the return replan",
                )
                assert status.replans[-1].outcome == "applied", status.replans[-1]
                returned = await _serving_on(client, model_name, set(SOURCES), emergency.plan_revision, back)
                returned_s = time.monotonic() - back
                served = time.monotonic()
                await poll_until(  # requests go on to both regions, each source's at home again
                    lambda: _now(_answered_from(load, served)),
                    lambda answered: all(answered.get(s, {}).get(s, 0) > 0 for s in SOURCES),
                    timeout_s=ANSWERED_S,
                    interval_s=0.1,
                    what="every source answered from its own region after the return",
                )
                failed_back = load.failed(since=back)
                assert failed_back == [], [c.error for c in failed_back[:5]]
                await _routers_healthy(settings, model_name)
                print(
                    f"{lost} back: serving from {sorted(returned.state.serving_apps)} "
                    f"{returned_s:.1f}s after "
                    "the node started, both routers healthy; "
                    f"{len([c for c in load.calls if c.started >= back])} "
                    f"requests, none failed; {len(load.calls)} requests in all"
                )

                # On-call takes the region down (its node alive) and up again, under the same load (a
                # capacity rollout waits for requests on its new set): it serves from its own region
                # again, its router healthy, with no other command.
                oncall = time.monotonic()
                down = await asyncio.to_thread(
                    ipnext, config, "fleet", "region", "down", lost, "--reason", "drill", "--who", "test"
                )
                assert down.returncode == 0, down.stderr
                assert f"{lost} is down" in down.stdout and "replan fleet-replan/emergency-" in down.stdout, (
                    down.stdout
                )
                await poll_until(
                    client.fleet_regions,
                    lambda s: lost in s.down and _replan_done(s, "emergency") and len(s.replans) >= 3,
                    timeout_s=REPLAN_S,
                    interval_s=0.5,
                    what=f"on-call's down of {lost} and its emergency replan",
                )
                held_down = await _serving_on(client, model_name, {survivor}, returned.plan_revision, oncall)
                down_s = time.monotonic() - oncall
                up_at = time.monotonic()
                up = await asyncio.to_thread(ipnext, config, "fleet", "region", "up", lost, "--who", "test")
                assert up.returncode == 0, up.stderr
                assert "replan fleet-replan/return-" in up.stdout, up.stdout
                await poll_until(
                    client.fleet_regions,
                    lambda s: lost not in s.down and _replan_done(s, "return") and len(s.replans) >= 4,
                    timeout_s=REPLAN_S,
                    interval_s=0.5,
                    what=f"on-call's up of {lost} and the return replan",
                )
                again = await _serving_on(client, model_name, set(SOURCES), held_down.plan_revision, up_at)
                await _routers_healthy(settings, model_name)
                print(
                    f"on-call: {lost} down, serving only from {survivor} {down_s:.1f}s later; "
                    "up, serving from "
                    f"{sorted(again.state.serving_apps)} {time.monotonic() - up_at:.1f}s later, "
                    "both routers healthy; "
                    f"{len(load.failed(since=oncall))} of "
                    f"{len([c for c in load.calls if c.started >= oncall])} "
                    "requests failed meanwhile"
                )
        await client.delete_model(model_name)


async def _routers_healthy(settings: Settings, model: str) -> None:
    """Each source region's router app RUNNING and its deployment HEALTHY, as Serve says."""
    apps = (await asyncio.to_thread(where_things_run, settings))["apps"]
    routers = {r: apps.get(router_app_name(model, r)) for r in SOURCES}
    assert all(
        a is not None and a["status"] == "RUNNING" and a["router"] == "HEALTHY" for a in routers.values()
    ), routers


def _answered_from(load: SourceLoad, since: float) -> dict[str, dict[str, int]]:
    """Per source, the answers per answering region among calls started at `since` or later."""
    answered: dict[str, dict[str, int]] = {}
    for call in load.calls:
        if call.region and call.started >= since:
            row = answered.setdefault(call.source, {})
            row[call.region] = row.get(call.region, 0) + 1
    return answered


def _answered_after(load: SourceLoad, killed: float, lost: str) -> dict[str, float]:
    """Per source, seconds from the kill to its first answer from another region."""
    answered: dict[str, float] = {}
    for call in load.calls:
        if call.region and call.region != lost and call.ended > killed:
            answered[call.source] = min(answered.get(call.source, 1e9), call.ended - killed)
    return answered


async def _now(value: dict[str, float]) -> dict[str, float]:
    return value


def _replan_done(status: FleetStatus, kind: str) -> bool:
    return (
        bool(status.replans) and status.replans[-1].kind == kind and status.replans[-1].outcome != "running"
    )


@dataclass
class _Serving:
    state: ModelState
    plan_revision: int


async def _serving_on(client: Client, model: str, regions: set[str], after: int, since: float) -> _Serving:
    """The model once it serves from `regions` on a plan revision newer than `after`."""
    state = await poll_until(
        lambda: client.get_model(model),
        lambda s: (
            s.state == ModelStatus.SERVING
            and set(s.serving_apps) == regions
            and s.plan is not None
            and s.plan.revision > after
        ),
        timeout_s=max(1.0, SERVING_S - (time.monotonic() - since)),
        interval_s=0.5,
        what=f"{model} serving from {sorted(regions)} on a new plan",
    )
    return _Serving(state=state, plan_revision=state.plan.revision if state.plan else after)
