"""Model updates on the real stack: refused updates change nothing, a gate change applies in place
(the same replica processes) and to the next rollout, a traffic change moves capacity, and a
hardware change becomes a new set of the same snapshots, rolled out under load with no failed
request. One model goes through all of them, so the drill pays for one first rollout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from ipnext.config import Settings
from ipnext.contracts import poll_until
from ipnext.errors import IpnextError
from ipnext.model import ModelSpec
from ipnext.registry import ModelState
from ipnext.sdk import Client
from ipnext.serving.control import connect
from ipnext.spec_update import UpdateKind

from .conftest import keyed, one_region_spec, train_version
from .load import Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def changed(spec: ModelSpec, change: Any) -> ModelSpec:
    data = spec.model_dump(mode="json")
    change(data)
    return ModelSpec.model_validate(data)


def replica_pids(settings: Settings, app: str) -> set[int]:
    """The processes of every replica of a Serve app (its actors are `ServeReplica:<app>:<deployment>`)."""
    connect(settings.ray_address())
    # The GCS's actor table: Ray's state API would need the dashboard, which the stack does not start.
    actors = ray._private.state.actors().values()
    return {
        a["Pid"]
        for a in actors
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith(f"ServeReplica:{app}:")
    }


def replicas(state: ModelState) -> int:
    assert state.plan is not None
    return sum(
        n for p in state.plan.deployments.values() for by_hw in p.replicas.values() for n in by_hw.values()
    )


async def settled(client: Client, model: str, what: str, test: Any, timeout_s: float = 180) -> ModelState:
    return await poll_until(
        lambda: client.get_model(model),
        lambda s: s.active_rollout is None and s.pending_plan is None and not s.queued and test(s),
        timeout_s=timeout_s,
        interval_s=0.3,
        what=what,
    )


async def test_update_in_place_capacity_and_new_set(stack: Settings, client: Client, model_name: str) -> None:
    spec = one_region_spec(model_name)
    await client.publish_model(spec)
    folder, _ = train_version(stack, model_name, "v1")
    first = await client.publish_snapshot(model_name, folder)
    await client.wait_until_serving(model_name, first.set_id)
    before = await client.get_model(model_name)
    app = before.serving_apps["us-east"]
    pids = replica_pids(stack, app)
    assert pids

    # Refused by the worker (a factory it cannot import): nothing changes, nothing is recorded.
    broken = changed(
        spec, lambda d: d["parts"]["dense"].update(factory="ipnext.examples.click_ranker.parts:NoSuch")
    )
    with pytest.raises(IpnextError, match="NoSuch"):
        await client.update_model(broken, who="test")
    after_refusal = await client.get_model(model_name)
    assert (
        after_refusal.spec == spec and after_refusal.sets == before.sets and after_refusal.spec_changes == []
    )

    # The same spec: no change.
    same = await client.update_model(spec, who="test")
    assert same.kind == UpdateKind.NONE and same.outcome == "no change"

    # A gate: in place, the replicas keep running.
    gated = changed(spec, lambda d: d["rollout"]["gates"][0].update(max=0.02))
    result = await client.update_model(gated, who="test-gate")
    assert (result.kind, result.outcome) == (UpdateKind.IN_PLACE, "applied in place")
    assert result.changes == ["rollout.gates: " + result.changes[0].split(": ", 1)[1]]
    state = await client.get_model(model_name)
    assert state.spec == gated and state.serving_set == first.set_id
    change = state.spec_changes[-1]
    assert (change.number, change.who, change.kind) == (1, "test-gate", "in_place")
    await asyncio.sleep(3)  # the serving check it asked for has run: nothing in Serve changed
    assert replica_pids(stack, app) == pids

    # Traffic: a new placement for the same set, moved to by a capacity move.
    busier = changed(gated, lambda d: d["traffic"]["peak_qps"].update({"us-east": 600}))
    result = await client.update_model(busier, who="test-traffic")
    assert result.kind == UpdateKind.CAPACITY and result.plan_revision is not None
    assert result.outcome.startswith("capacity move to placement revision"), result.outcome
    grown = await settled(
        client,
        model_name,
        "the capacity move done",
        lambda s: s.plan is not None and s.plan.deployments != before.plan.deployments,  # type: ignore[union-attr]
    )
    assert grown.serving_set == first.set_id and grown.spec == busier
    assert replicas(grown) > replicas(before), (before.plan, grown.plan)

    # Hardware: a new set of the same snapshots under the new spec, rolled out under load.
    rehosted = changed(busier, lambda d: d["parts"]["dense"]["hardware"]["cpu-std"].update(qps=250))
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        result = await client.update_model(rehosted, who="test-hardware")
        assert result.kind == UpdateKind.NEW_SET and result.set_id is not None
        assert result.outcome == f"rolling out as {result.set_id}"
        assert result.changes == ["parts.dense.hardware.cpu-std.qps: 300.0 -> 250.0"]
        pending = await client.get_model(model_name)
        assert pending.spec == busier and pending.spec_pending is not None  # not before it serves
        with pytest.raises(IpnextError, match="is rolling out with set"):  # one update at a time
            await client.update_model(busier, who="test")
        done = await client.wait_until_serving(model_name, result.set_id, timeout_s=240)
    assert done.spec == rehosted and done.spec_pending is None
    new = next(s for s in done.sets if s.id == result.set_id)
    old = next(s for s in done.sets if s.id == first.set_id)
    assert {p: r.snapshot_id for p, r in new.parts.items()} == {
        p: r.snapshot_id for p, r in old.parts.items()
    }
    assert [c.outcome for c in done.spec_changes] == [
        "applied in place",
        grown.spec_changes[-1].outcome,
        f"applied: {result.set_id} serves",
    ]
    assert [c.who for c in done.spec_changes] == ["test-gate", "test-traffic", "test-hardware"]
    # The gate changed in place is the one this rollout judged.
    assert done.rollout is not None
    limits = {g.limit for g in done.rollout.gates if g.metric == "error_rate"}
    assert limits == {0.02}, done.rollout.gates
    assert load.failed() == [], load.failed()[:3]
    assert {a.set for a in load.answers} <= {first.set_id, result.set_id}
    served = await client.predict(model_name, {"user": 1, "items": [4]})
    assert served.set == result.set_id
