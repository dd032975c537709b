"""The fleet's pool check (activities/pool_check.py): which pooled models it doubts from the
writer's placeholders and Serve's status, and whom it signals: each model in doubt once per
`serve.reconcile_seconds`, a model whose workflow is gone forgotten, one the writer lost
remembered for `serve.pools.model_check_seconds`. The writer is the real one over a faked Serve;
the Temporal client is faked at its seam."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from ipnext.activities import pool_check
from ipnext.activities.pool_check import PoolCheckActivities, PoolCheckInput, pools_in_doubt
from ipnext.names import ModelWorkflowNames
from ipnext.spec.settings import PoolSettings, ServeSettings, Settings

from .test_group_commit import FakeServe, Writer
from .test_pool_layout import pooled_apps

STD, HIGHMEM = "ipnext-pool.us-east.cpu-std", "ipnext-pool.us-east.cpu-highmem"
ROUTER = "ipnext-pooled.us-east.router"
CHECK = ModelWorkflowNames.RECONCILE
RUNNING = SimpleNamespace(deployments={})


def test_the_writer_names_each_pooled_model_and_the_serve_apps_it_is_folded_into() -> None:
    writer = Writer(FakeServe())
    dedicated = {"name": "gamma.us-east", "route_prefix": "/g", "import_path": "m:app", "deployments": []}
    writer.apply([*pooled_apps().values(), dedicated], [])
    assert writer.pool_members() == {"alpha": [STD, ROUTER], "beta": [HIGHMEM, STD, ROUTER]}
    # alpha leaves (its pools stay, beta is in both: a pool that went would have the writer
    # call Ray to forget its ledger)
    writer.apply([], [n for n in writer.app_names() if n.startswith("alpha.")])
    assert writer.pool_members() == {"beta": [HIGHMEM, STD, ROUTER]}


def test_a_pooled_model_is_in_doubt_when_an_app_it_is_folded_into_is_missing_or_given_up() -> None:
    held = {"alpha": [STD, ROUTER], "beta": [HIGHMEM, STD, ROUTER]}
    every = {STD: RUNNING, HIGHMEM: RUNNING, ROUTER: RUNNING}
    live = {"us-east"}
    assert pools_in_doubt(held, {}, every, live) == {}
    assert pools_in_doubt(held, {}, {STD: RUNNING, ROUTER: RUNNING}, live) == {
        "beta": f"{HIGHMEM} missing in Serve"
    }
    no_router = pools_in_doubt(held, {}, {STD: RUNNING, HIGHMEM: RUNNING}, live)
    assert sorted(no_router) == ["alpha", "beta"] and ROUTER in no_router["alpha"]
    assert pools_in_doubt(held, {}, {}, set()) == {}  # no live node in us-east: left alone
    failed = SimpleNamespace(
        deployments={
            "pool": SimpleNamespace(
                replica_states={},
                status_trigger="REPLICA_STARTUP_FAILED",
                status="DEPLOY_FAILED",
                message="node gone",
            )
        }
    )
    gave_up = pools_in_doubt(held, {}, {**every, STD: failed}, live)
    assert sorted(gave_up) == ["alpha", "beta"] and "Serve gave up" in gave_up["alpha"]
    lost = pools_in_doubt({"alpha": [STD, ROUTER]}, {"alpha": 1.0, "beta": 1.0}, every, live)
    assert list(lost) == ["beta"] and "holds it no more" in lost["beta"]


class FakeClient:
    """Temporal's client at its seam: signals recorded; models in `gone` answer NOT_FOUND."""

    def __init__(self, gone: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.signals: list[tuple[str, str]] = []
        self.gone = gone

    def get_workflow_handle(self, workflow_id: str) -> Any:
        client = self

        class Handle:
            async def signal(self, name: str) -> None:
                if workflow_id.removeprefix("model/") in client.gone:
                    raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
                client.signals.append((workflow_id, name))

        return Handle()


@pytest.fixture
def judged(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """What `_read_and_judge` answers (the writer's members and the doubts), set by each test."""
    answer: dict[str, Any] = {"held": {}, "doubts": {}}
    pools = PoolSettings(model_check_seconds=600)
    settings = Settings(serve=ServeSettings(reconcile_seconds=30, pools=pools))
    monkeypatch.setattr(pool_check._context, "settings", lambda: settings)
    monkeypatch.setattr(pool_check, "_read_and_judge", lambda remembered: (answer["held"], answer["doubts"]))
    monkeypatch.setattr(pool_check.time, "time", lambda: answer.get("now", 10_000.0))
    return answer


async def test_each_model_in_doubt_is_signalled_once_per_reconcile_interval(judged: dict[str, Any]) -> None:
    client = FakeClient()
    check = PoolCheckActivities(client).check_pools  # type: ignore[arg-type]
    env = ActivityEnvironment()
    judged["held"] = {"alpha": [STD, ROUTER], "beta": [STD, ROUTER]}
    judged["doubts"] = {"alpha": f"{ROUTER} missing in Serve", "beta": f"{ROUTER} missing in Serve"}
    first = await env.run(check, PoolCheckInput())
    assert first.signalled == ["alpha", "beta"]
    assert client.signals == [("model/alpha", CHECK), ("model/beta", CHECK)]
    judged["now"] = 10_005.0  # a tick later, still missing: nobody asked again
    second = await env.run(check, PoolCheckInput(members=first.members, asked=first.asked))
    assert second.signalled == [] and len(client.signals) == 2
    judged["now"] = 10_031.0  # past serve.reconcile_seconds: asked again
    third = await env.run(check, PoolCheckInput(members=second.members, asked=second.asked))
    assert third.signalled == ["alpha", "beta"]
    judged["doubts"] = {}  # back: the memory of asking goes, so a new loss is signalled at once
    fourth = await env.run(check, PoolCheckInput(members=third.members, asked=third.asked))
    assert fourth.asked == {} and sorted(fourth.members) == ["alpha", "beta"]


async def test_a_model_the_writer_lost_is_remembered_for_a_while_and_a_gone_workflow_is_forgotten(
    judged: dict[str, Any],
) -> None:
    client = FakeClient(gone={"beta"})
    check = PoolCheckActivities(client).check_pools  # type: ignore[arg-type]
    env = ActivityEnvironment()
    remembered = {"alpha": 9_900.0, "beta": 9_900.0}
    judged["doubts"] = {m: "the writer holds it no more" for m in remembered}
    seen = await env.run(check, PoolCheckInput(members=remembered))
    assert seen.signalled == ["alpha"] and client.signals == [("model/alpha", CHECK)]
    assert seen.members == {"alpha": 9_900.0}  # not held now: kept with when it was last held
    judged["now"] = 9_900.0 + 600 + 1  # past serve.pools.model_check_seconds: its own check ran
    later = await env.run(check, PoolCheckInput(members=seen.members, asked=seen.asked))
    assert later.members == {}


async def test_ray_unreachable_is_reported_and_the_memory_kept(
    judged: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreachable(remembered: dict[str, float]) -> Any:
        raise ConnectionError("GCS at 127.0.0.1:6379 not answering")

    monkeypatch.setattr(pool_check, "_read_and_judge", unreachable)
    client = FakeClient()
    before = PoolCheckInput(members={"alpha": 9_000.0}, asked={"alpha": 9_990.0})
    seen = await ActivityEnvironment().run(PoolCheckActivities(client).check_pools, before)  # type: ignore[arg-type]
    assert "GCS" in seen.error and seen.signalled == [] and client.signals == []
    assert (seen.members, seen.asked) == (before.members, before.asked)
