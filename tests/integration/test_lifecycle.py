"""The lifecycle on the real dev stack: publish, serve, predict over HTTP, a second set, and the
snapshot watcher (a delete's teardown is the CLI drill's, tests/integration/test_cli.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import ray

from ipnext.client.sdk import AsyncPredictionClient, Client, PredictionClient
from ipnext.errors import PredictionBadRequestError, PredictionNotFoundError
from ipnext.examples.click_ranker.train import train
from ipnext.names import model_workflow_id, poll_until, watch_schedule_id
from ipnext.serving.control import connect, get_writer
from ipnext.serving.layout import metrics_actor_name
from ipnext.spec.settings import Settings

from .conftest import keyed, one_region_spec, train_version
from .load import Load

# Events per run before the model and its rollouts continue as new, in the history drill, and
# what a run may add past it before it does (what is in flight when the limit is seen).
HISTORY_LIMIT = 300
HISTORY_SLACK = 40
# Ticks of the watch Schedule (every 2 s in the watcher drill) that must run, after the corrupt
# snapshot's refusal, with the rollout still paused and the snapshot not offered again; and how
# long they may take on a loaded machine.
WATCH_TICKS_PAUSED = 3
WATCH_TICKS_WITHIN_S = 60.0

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def serve_apps(settings: Settings) -> list[str]:
    """App names in the Serve config the writer owns (what `ipnext serve export` prints)."""
    connect(settings.ray_address())
    config = ray.get(get_writer(settings.serve.host, settings.serve.port).export.remote())
    return [app["name"] for app in config["applications"]]


async def test_publish_serve_predict_then_second_set(
    stack: Settings, client: Client, model_name: str
) -> None:
    spec = one_region_spec(model_name)
    # The example's three steps: this drill shows a rollout step by step.
    spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(update={"steps": [10, 50, 100]})})
    state = await client.publish_model(spec)
    assert state.state == "empty" and state.sets == []

    folder1, _ = train_version(stack, model_name, "v1", seed=1)
    started = time.perf_counter()
    published = await client.publish_snapshot(model_name, folder1)
    assert published.set_id == f"{model_name}@1"
    state = await client.wait_until_serving(model_name, published.set_id)
    print(f"publish-to-serving of {published.set_id}: {time.perf_counter() - started:.1f}s")
    assert state.serving_apps == {"us-east": f"{model_name}.us-east.s1.r1"}

    connect(stack.ray_address())
    # Raw HTTP, as a product engineer calls it: the envelope, stamped by each part's host.
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        reply = await http.post(
            f"/us-east/models/{model_name}/predict", json={"inputs": {"user": 3, "items": [1, 2, 3]}}
        )
        assert reply.status_code == 200, reply.text
        envelope = reply.json()
        assert set(envelope) == {"outputs", "set", "parts", "variant", "arm"} and envelope["arm"] is None
        assert envelope["set"] == f"{model_name}@1"
        assert envelope["variant"] is None
        assert envelope["parts"] == {
            "embed": f"{model_name}/embed@v1",
            "dense": f"{model_name}/dense@v1",
        }
        assert len(envelope["outputs"]) == 3 and all(0 <= p <= 1 for p in envelope["outputs"])
        bad = await http.post(f"/us-east/models/{model_name}/predict", json={"nope": 1})
        assert bad.status_code == 400 and "inputs" in bad.json()["message"]
        # The part refuses an unknown user: the caller's mistake, a 400 not counted as an error.
        unknown = await http.post(
            f"/us-east/models/{model_name}/predict", json={"inputs": {"user": 9999, "items": [1]}}
        )
        assert unknown.status_code == 400 and unknown.json()["message"].startswith("inputs.user: 9999"), (
            unknown.text
        )
        # The router pushes its counters to the model's metrics actor every second.
        metrics = ray.get_actor(metrics_actor_name(model_name, "us-east"), namespace="ipnext")
        app = f"{model_name}.us-east.s1.r1"

        async def counted_now() -> dict[str, Any]:
            sets: dict[str, dict[str, Any]] = ray.get(metrics.snapshot.remote())["sets"]
            return sets.get(app, {})

        counted = await poll_until(
            counted_now,
            lambda c: c.get("requests", 0) >= 1,
            timeout_s=30,
            interval_s=0.5,
            what="metrics pushed",
        )
        assert counted["errors"] == 0 and sum(counted["histograms"]["latency_ms"]) >= 1
        router = (await http.get(f"/us-east/models/{model_name}")).json()
        assert router["weights"] == {f"{model_name}.us-east.s1.r1": 100.0}
        first_generation = router["generation"]
        # The routing document, on its one global route: the plan's fractions per traffic source.
        routing = await http.get(f"/models/{model_name}/routing")
        assert routing.status_code == 200, routing.text
        document = routing.json()
        assert state.plan is not None
        planned = {
            source: {region: share for region, share in row.items() if share > 0}
            for source, row in state.plan.deployments[f"{model_name}/dense"].fractions.items()
        }
        assert document["model"] == model_name and document["routes"] == planned == {
            "us-east": {"us-east": 1.0}
        }
        assert document["ttl_seconds"] == stack.serve.routing_ttl_seconds and document["generation"] >= 1
        unknown_model = await http.get(f"/models/{model_name}-absent/routing")
        assert unknown_model.status_code == 404 and f"{model_name}-absent" in unknown_model.json()["message"]

    # The data plane alone: no Temporal client, only the serving URL.
    with PredictionClient.from_settings(stack) as serving:
        reply = serving.predict(model_name, {"user": 3, "items": [1, 2, 3]}, source="us-east")
        assert (reply.set, reply.region, reply.outputs) == (f"{model_name}@1", "us-east", envelope["outputs"])
        assert serving.routing(model_name).generation == document["generation"]
        with pytest.raises(PredictionBadRequestError) as bad_request:
            serving.predict(model_name, {"user": 9999, "items": [1]}, source="us-east")
        assert bad_request.value.status_code == 400 and "inputs.user: 9999" in str(bad_request.value)
        with pytest.raises(PredictionNotFoundError, match=f"{model_name}-absent"):
            serving.predict(f"{model_name}-absent", {"user": 3, "items": [1]})
    async with AsyncPredictionClient.from_settings(stack) as aserving:
        areply = await aserving.predict(model_name, {"user": 3, "items": [1, 2, 3]}, source="us-east")
        assert areply == reply
        with pytest.raises(PredictionBadRequestError):
            await aserving.predict(model_name, {"nope": 1}, region="us-east")
    # Observed demand: the router counted every request it admitted by its caller's source.
    demand = await poll_until(
        lambda: client.model_demand(model_name, window_seconds=5),
        lambda d: "us-east" in d.sources and d.sources["us-east"].requests >= 4,
        timeout_s=30,
        interval_s=0.5,
        what="the requests so far in the model's observed demand",
    )
    east = demand.sources["us-east"]
    print(f"observed demand: {east.requests} requests from us-east, declared {east.declared_qps} qps")
    assert demand.regions == ["us-east"] and east.declared_qps == spec.traffic.peak_qps["us-east"]

    folder2, _ = train_version(stack, model_name, "v2", seed=2)
    # The second set rolls out step by step (the example's 10/50/100) under a closed-loop load.
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        published2 = await client.publish_snapshot(model_name, folder2)
        state = await client.wait_until_serving(model_name, published2.set_id, timeout_s=240)
    print(f"rollout of {published2.set_id} under load: {len(load.answers)} requests in {load.elapsed():.1f}s")
    assert load.failed() == [] and len(load.answers) > 100
    # Synchronized: every answer came end to end from one set.
    for answer in load.answers:
        assert answer.set is not None and all(
            s.endswith(answer.set.split("@")[1]) for s in answer.parts.values()
        )
    served = [a.set for a in load.answers]
    assert served[-1] == published2.set_id and f"{model_name}@1" in served
    assert [(s.id, s.status) for s in state.sets] == [
        (f"{model_name}@1", "retired"),
        (f"{model_name}@2", "serving"),
    ]
    for _ in range(5):
        reply2 = await client.predict(model_name, {"user": 3, "items": [1, 2, 3]}, source="us-east")
        assert reply2.set == f"{model_name}@2"
        assert reply2.parts == {"embed": f"{model_name}/embed@v2", "dense": f"{model_name}/dense@v2"}
    assert reply2.outputs != envelope["outputs"]  # other weights, other scores
    # The router moved in place to a new generation; the old set's app is gone.
    # One router generation per step, in order.
    assert state.rollout is not None
    assert state.rollout.generations == [first_generation + 1, first_generation + 2, first_generation + 3]
    apps = serve_apps(stack)
    assert f"{model_name}.us-east.s2.r1" in apps and f"{model_name}.us-east.s1.r1" not in apps
    # A new set on the same plan changes no routing: the document keeps its generation.
    async with AsyncPredictionClient.from_settings(stack) as aserving:
        assert (await aserving.routing(model_name)).generation == document["generation"]


async def test_watcher_publishes_new_snapshots(stack: Settings, client: Client, model_name: str) -> None:
    """The watcher publishes what training writes. Then, with the history limit set low, a
    rollout paused by on-call while the watcher meets a corrupt snapshot: the rollout keeps
    judging its gates (events every check) and continues as new, every run of the model and of
    the rollout stays under the limit, the corrupt snapshot is refused once, and nothing is
    lost: resumed, the rollout completes with its pause on the record."""
    base = one_region_spec(model_name, watch={"enabled": True, "interval_seconds": 2})
    # Gates judged 4 times a second: a paused rollout's history grows fast enough to pass the
    # limit within seconds.
    spec = base.model_copy(
        update={"rollout": base.rollout.model_copy(update={"check_interval_seconds": 0.25})}
    )
    await client.publish_model(spec, history_limit=HISTORY_LIMIT)
    _, manifest = train_version(stack, model_name, "nightly-1")
    state = await poll_until(
        lambda: client.get_model(model_name),
        lambda s: s.serving_set is not None,
        timeout_s=180,
        interval_s=1,
        what="the watcher's first publish",
    )
    served = next(s for s in state.sets if s.id == state.serving_set)
    assert served.version == manifest.version == "nightly-1"
    assert served.detail == "published by snapshot-watcher"
    assert (await client.predict(model_name, {"user": 2, "items": [7, 8]})).parts["dense"] == (
        f"{model_name}/dense@nightly-1"
    )
    # A good snapshot: the watcher publishes it, and on-call pauses its rollout at once.
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        train_version(stack, model_name, "nightly-2", seed=2)
        live = await poll_until(
            lambda: client.rollout_status(model_name),
            lambda r: r is not None and r.set_id.endswith("@2") and r.state.value == "running",
            timeout_s=120,
            interval_s=0.1,
            what="nightly-2's rollout",
        )
        await client.pause_rollout(model_name, reason="history drill", who="oncall")
        assert live is not None
        rollout_id = live.workflow_id
        # Training then writes a folder whose manifest does not read, and a snapshot whose file is
        # corrupt after its manifest was written: the first is skipped (it hides nothing), the
        # second refused once and not offered again on the following ticks.
        broken = stack.snapshot_roots[0] / model_name / "nightly-2b"
        broken.mkdir()
        (broken / "manifest.json").write_text("{torn")
        staging = stack.snapshot_roots[0].parent / "staging"  # the trainer's own folder: unwatched
        corrupt = train(staging, model_name, "nightly-3", steps=5).folder
        with (corrupt / "dense.safetensors").open("ab") as f:
            f.write(b"\0")
        corrupt.rename(stack.snapshot_roots[0] / model_name / "nightly-3")  # appears whole, corrupt
        refusals = stack.state_dir / "watch" / f"{model_name}.json"
        await poll_until(
            lambda: asyncio.to_thread(refusals.exists),
            bool,
            timeout_s=60,
            interval_s=0.5,
            what="the watcher's refusal of nightly-3",
        )
        runs = await poll_until(
            lambda: _runs(client, rollout_id),
            lambda found: len(found) >= 2,
            timeout_s=120,
            interval_s=1,
            what="the paused rollout continued as new",
        )
        schedule = client.temporal.get_schedule_handle(watch_schedule_id(model_name))

        async def watch_ticks_ended() -> int:
            info = (await schedule.describe()).info
            return info.num_actions - len(info.running_actions)

        ticks = await watch_ticks_ended()
        await poll_until(
            watch_ticks_ended,
            lambda ended: ended >= ticks + WATCH_TICKS_PAUSED,
            timeout_s=WATCH_TICKS_WITHIN_S,
            interval_s=0.5,
            what=f"{WATCH_TICKS_PAUSED} more ticks of the watch Schedule, the rollout paused",
        )
        paused = await client.rollout_status(model_name)
        assert paused is not None and paused.state.value == "paused", paused
        await client.resume_rollout(model_name, who="oncall")
        state = await client.wait_until_serving(model_name, live.set_id, timeout_s=180)
        assert [s.version for s in state.sets] == [
            "nightly-1",
            "nightly-2",
        ]  # a refused publish changes nothing
        assert state.rollout is not None and [(p.who, p.resumed_by) for p in state.rollout.pauses] == [
            ("oncall", "oncall")
        ]
    validations = 0  # across every run of model/<name>
    model_runs = await _runs(client, model_workflow_id(model_name))
    for run_id in model_runs:
        history = await client.temporal.get_workflow_handle(
            model_workflow_id(model_name), run_id=run_id
        ).fetch_history()
        validations += sum(
            1
            for e in history.events
            if e.activity_task_scheduled_event_attributes.activity_type.name == "validate_snapshot_set"
        )
    assert validations == 3, validations  # nightly-1, nightly-2, and nightly-3 once
    assert load.failed() == [], load.failed()[:3]
    assert "nightly-3" in refusals.read_text() and "checksum" in refusals.read_text()
    rollout_runs = await _runs(client, rollout_id)
    lengths = {**model_runs, **rollout_runs}
    assert max(lengths.values()) <= HISTORY_LIMIT + HISTORY_SLACK, lengths
    print(
        f"history bound (limit {HISTORY_LIMIT}): the paused rollout ran in {len(rollout_runs)} runs "
        f"({sorted(rollout_runs.values())} events), the model in {len(model_runs)} "
        f"({sorted(model_runs.values())}); {len(runs)} rollout runs when first seen continuing"
    )
    await client.delete_model(model_name, who="test")
    schedules = [s.id async for s in await client.temporal.list_schedules()]
    assert f"watch/{model_name}" not in schedules


async def _runs(client: Client, workflow_id: str) -> dict[str, int]:
    """Every run of `workflow_id`: run id -> its history length (read from the history itself:
    visibility reports none for a run still open)."""
    found = {}
    async for run in client.temporal.list_workflows(f'WorkflowId = "{workflow_id}"'):
        history = await client.temporal.get_workflow_handle(workflow_id, run_id=run.run_id).fetch_history()
        found[run.run_id] = len(history.events)
    return found
