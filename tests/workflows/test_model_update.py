"""ModelWorkflow's `update_model` on a real Temporal dev server with the activities faked at their
seam: each kind applies as it should, a new set's rollout runs its old set under the old spec, a
rolled-back update keeps the old spec, and every refused update changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from temporalio.client import Client, WorkflowHandle, WorkflowUpdateFailedError

from ipnext.contracts.model import ModelState, PublishResult, UpdateModelInput, UpdateModelResult
from ipnext.spec.model import ModelSpec

from .fakes import SPEC, FakeServing, request, start, until

pytestmark = pytest.mark.timeout(120)


def changed(change: Any, spec: ModelSpec = SPEC) -> ModelSpec:
    data = spec.model_dump(mode="json")
    change(data)
    return ModelSpec.model_validate(data)


async def update(handle: WorkflowHandle[Any, Any], spec: ModelSpec, who: str = "ann") -> UpdateModelResult:
    result: UpdateModelResult = await handle.execute_update(
        "update_model", UpdateModelInput(spec=spec, who=who), result_type=UpdateModelResult
    )
    return result


async def refused(handle: WorkflowHandle[Any, Any], spec: ModelSpec) -> str:
    with pytest.raises(WorkflowUpdateFailedError) as caught:
        await update(handle, spec)
    return str(caught.value.cause)


async def serving_v1(handle: WorkflowHandle[Any, Any]) -> ModelState:
    await handle.execute_update("publish", request("v1"), result_type=PublishResult)
    return await until(handle, lambda s: s.serving_set == "wf-model@1" and s.state == "serving")


GATED = changed(lambda d: d["rollout"].update(gates=[{"metric": "error_rate", "max": 0.2}]))
REHOSTED = changed(lambda d: d["parts"]["embed"]["hardware"]["cpu-std"].update(qps=50))


async def test_in_place_and_capacity_updates_apply_and_are_recorded(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        before = await serving_v1(handle)
        deploys = len(fake.deployed)
        result = await update(handle, GATED, who="ann")
        assert (result.kind, result.outcome) == ("in_place", "applied in place")
        state = await until(handle, lambda s: s.spec == GATED)
        assert len(fake.deployed) == deploys and state.serving_set == "wf-model@1"  # nothing redeployed
        checks = len(fake.reconciled)
        await until(handle, lambda s: len(fake.reconciled) > checks)  # the serving check it asked for
        assert fake.reconciled[-1].spec == GATED

        fake.replicas = 3  # the placement the new traffic needs
        busier = changed(lambda d: d["traffic"]["peak_qps"].update({"us-east": 30}), GATED)
        result = await update(handle, busier, who="bob")
        assert result.kind == "capacity" and result.outcome == "capacity move to placement revision 1"
        state = await until(
            handle, lambda s: s.active_rollout is None and s.spec == busier and s.pending_plan is None
        )
        assert state.plan is not None and state.plan.deployments != before.plan.deployments  # type: ignore[union-attr]
        assert fake.scales[-1] == ("wf-model@1", 1, 1.0) and state.serving_set == "wf-model@1"

        same = await update(handle, busier)
        assert (same.kind, same.outcome, same.changes) == ("none", "no change", [])
    assert [(c.number, c.who, c.kind) for c in state.spec_changes] == [
        (1, "ann", "in_place"),
        (2, "bob", "capacity"),
    ]
    (gates,) = state.spec_changes[0].changes  # the old value is cut at VALUE_WIDTH
    assert gates.startswith('rollout.gates: [{"floor":0.0,"max":0.01,')
    assert gates.endswith(' -> [{"floor":0.0,"max":0.2,"max_ratio_to_old":null,"metric":"error_rate"}]')
    assert state.spec_changes[1].changes == ["traffic.peak_qps.us-east: 10.0 -> 30.0"]


async def test_a_parts_update_rolls_out_a_new_set_and_its_spec_serves_with_it(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await serving_v1(handle)
        result = await update(handle, REHOSTED)
        assert result.kind == "new_set" and result.set_id == "wf-model@2"
        assert result.changes == ["parts.embed.hardware.cpu-std.qps: 100.0 -> 50.0"]
        # Until it serves, the model's spec is the old one, and publishes and updates wait.
        pending = await handle.query("get", result_type=ModelState)
        assert pending.spec == SPEC and pending.spec_pending is not None
        assert "is rolling out with set wf-model@2" in await refused(handle, GATED)
        with pytest.raises(WorkflowUpdateFailedError) as caught:
            await handle.execute_update("publish", request("v2"), result_type=PublishResult)
        assert "update 1 of its spec is rolling out with set wf-model@2" in str(caught.value.cause)
        state = await until(handle, lambda s: s.serving_set == "wf-model@2" and s.state == "serving")
    assert state.spec == REHOSTED and state.spec_pending is None
    new, old = state.sets[1], state.sets[0]
    assert (
        new.parts == old.parts
        and new.version == "v1-spec2"
        and new.detail.startswith("model update 1 by ann")
    )
    assert state.spec_changes[-1].outcome == "applied: wf-model@2 serves"
    # Each set was deployed under its own spec: the old one scaled down under the old spec.
    assert {(s, spec.parts["embed"].hardware["cpu-std"].qps) for s, spec in fake.deploy_specs} == {
        ("wf-model@1", 100.0),
        ("wf-model@2", 50.0),
    }


async def test_a_rolled_back_parts_update_keeps_the_old_spec(temporal: Client) -> None:
    fake = FakeServing()
    fake.bad_apps.add("app-2")  # the new set's app answers with errors: the gate rolls it back
    spec = changed(lambda d: d["rollout"].update(gates=[{"metric": "error_rate", "max": 0.01}]))
    worker, handle = await start(temporal, fake, spec)
    async with worker:
        await serving_v1(handle)
        rehosted = changed(lambda d: d["parts"]["embed"]["hardware"]["cpu-std"].update(qps=50), spec)
        result = await update(handle, rehosted)
        state = await until(
            handle, lambda s: s.spec_pending is None and s.state == "serving" and len(s.sets) == 2
        )
    assert state.serving_set == "wf-model@1" and state.spec == spec
    assert state.sets[1].id == result.set_id and state.sets[1].status == "rolled_back"
    assert state.spec_changes[-1].outcome == (
        "not applied: the rollout of wf-model@2 rolled_back; the old spec stays"
    )


async def test_refused_updates_change_nothing(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        before = await serving_v1(handle)
        renamed = changed(lambda d: d.update(name="other"))
        assert "spec.name: an update keeps the model's name 'wf-model'" in await refused(handle, renamed)
        bad = changed(lambda d: d["parts"]["embed"].update(factory="bad:factory"))
        assert "parts.embed.factory: cannot import it" in await refused(handle, bad)
        added = changed(
            lambda d: (
                d["parts"].update(
                    extra={"factory": "m:g", "hardware": {"cpu-std": {"units": 1, "qps": 100}}}
                ),
                d.update(dag=[["input", "embed"], ["embed", "extra"], ["extra", "output"]]),
            )
        )
        assert "snapshots: the new spec's parts ['extra'] have no snapshot" in await refused(handle, added)
        after: ModelState = await handle.query("get", result_type=ModelState)
    unchecked = {"reconcile": None, "updated_at": None}  # the serving checks go on meanwhile
    assert after.model_copy(update=unchecked) == before.model_copy(update=unchecked)
    assert after.spec_changes == [] and after.sets == before.sets


async def test_a_held_set_is_validated_and_kept_without_a_rollout(temporal: Client) -> None:
    fake = FakeServing()
    worker, handle = await start(temporal, fake)
    async with worker:
        await serving_v1(handle)
        deploys = len(fake.deployed)
        held = request("v2").model_copy(update={"hold": True, "who": "ann"})
        result: PublishResult = await handle.execute_update("publish", held, result_type=PublishResult)
        assert (result.set_id, result.status) == ("wf-model@2", "held")
        await handle.execute_update("publish", request("v3"), result_type=PublishResult)
        state = await until(handle, lambda s: s.serving_set == "wf-model@3" and s.state == "serving")
    assert [(s.id, s.status) for s in state.sets] == [
        ("wf-model@1", "retired"),
        ("wf-model@2", "held"),  # neither rolled out nor superseded by the set after it
        ("wf-model@3", "serving"),
    ]
    assert "wf-model@2" not in fake.deployed[deploys:] and state.sets[1].detail.startswith(
        "published by ann and held"
    )
