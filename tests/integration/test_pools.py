"""Shared pools on the real stack.

1. A pool app deployed through the one config writer: six models' parts with real pinned
   safetensors served from one replica within a byte budget that holds four, each answering with
   its own weights; a part whose factory raises is quarantined while the rest serve; the catalogue
   changes in place (same process) and a retired part is unloaded; a part whose first call kills
   its replica is quarantined across the pool by its ledger after two deaths.
2. The lifecycle drill: six models published with `serving: pooled` serve from one pool per
   hardware class and one pool router; under load, one model's poisoned snapshot is rolled back
   by its gates and another's new snapshot, whose pinned file changed after validation, fails to
   load in the pool, is quarantined and rolled back, while a third moves to replicas of its own by
   a spec update, with no failed request for it nor the other three."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
import torch
from ray import serve
from safetensors.torch import save_file

from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.parts import build_modules
from ipnext.examples.click_ranker.train import poisoned_copy
from ipnext.names import RolloutState, poll_until, wait_until
from ipnext.serving.control import (
    connect_for,
    serve_applications,
    wait_apps_gone,
    wait_apps_running,
    writer_for,
)
from ipnext.serving.layout import PartHostArgs
from ipnext.serving.pool_layout import (
    POOL_DEPLOYMENT,
    PoolAppArgs,
    PoolCatalogue,
    PoolEntry,
    is_pool_app,
    pool_app_name,
    pool_router_app_name,
    render_pool_app,
)
from ipnext.spec.settings import DEFAULT_FACTORY_PREFIXES, PoolSettings, Settings
from ipnext.store.pinned import pin, pinned_path

from .conftest import keyed, one_region_spec, train_version, until_rolled_back
from .load import Load

pytestmark = pytest.mark.timeout(300)

CONFIG = {"num_users": 2000, "num_items": 2000, "dim": 64}  # about 1 MiB of tables per model
EMBED = "ipnext.examples.click_ranker.parts:EmbeddingPart"
MODELS = [f"pooled-{i}" for i in range(6)]
LEAK_BYTES = 20 * 1024**2  # a pool replica's parts may grow it by this much before they leak


def snapshot(folder: Path, store: Path, seed: int) -> tuple[str, int, dict[str, torch.Tensor]]:
    """An embedding part's weights, written and pinned as validation pins them."""
    torch.manual_seed(seed)
    modules = build_modules(CONFIG)
    tensors = {
        "user.weight": modules.user.weight.detach().clone(),
        "item.weight": modules.item.weight.detach().clone(),
    }
    path = folder / f"embed-{seed}.safetensors"
    save_file(tensors, str(path))
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    pin(path, sha, store)
    return sha, path.stat().st_size, tensors


def entry(model: str, sha: str, size: int, store: Path, factory: str = EMBED) -> PoolEntry:
    app = f"{model}.us-east.s1.r1"
    host = PartHostArgs(
        model=model,
        part="embed",
        factory=factory,
        config=CONFIG,
        uri=f"file:///snapshots/{model}",
        sha256=sha,
        snapshot_id=f"{model}-v1",
        pinned_store=str(store),
        region="us-east",
        app=app,
        factory_prefixes=[*DEFAULT_FACTORY_PREFIXES, "tests.bad_parts"],
    )
    return PoolEntry(host=host, estimate_bytes=size)


def ask(app: str, entry_id: str, user: int) -> Any:
    handle = serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=app)
    inputs = {"input": {"user": user, "items": [1, 2]}}
    return handle.options(multiplexed_model_id=entry_id).remote(inputs).result(timeout_s=60)


def _answers(app: str, entry_id: str) -> bool:
    try:
        return bool(ask(app, entry_id, user=1)["snapshot_id"])
    except Exception:  # the replica is being replaced
        return False


async def _repairs(client: Client, models: list[str]) -> int:
    """The serving repairs the models' records hold, summed."""
    states = [await client.get_model(n) for n in models]
    return sum(s.reconcile.repairs for s in states if s.reconcile is not None)


def _answers_http(stack: Settings, model: str) -> bool:
    try:
        answer = httpx.post(
            f"{stack.serve_url}/us-east/models/{model}/predict",
            json={"inputs": {"user": 1, "items": [1]}},
            headers=keyed(stack),
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


def serve_beside(writer: Any, args: PoolAppArgs, kept: dict[str, PoolEntry], bad: PoolEntry) -> None:
    """The pool's catalogue: the `kept` entries and `bad` (a misbehaving part), applied and
    running."""
    entries = {**kept, f"{bad.host.app}/{bad.host.part}": bad}
    ray.get(writer.apply.remote([render_pool_app(args, PoolCatalogue(entries=entries), 1, 1, 0)], []))
    wait_apps_running([pool_app_name(args.region, args.hardware)], timeout_s=120)


def describe(app: str) -> dict[str, Any]:
    described: dict[str, Any] = (
        serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=app).describe.remote().result(timeout_s=60)
    )
    return described


def test_a_pool_serves_many_models_within_its_bytes(stack: Settings, tmp_path: Path) -> None:
    connect_for(stack)
    store = tmp_path / "pinned"
    made = {model: snapshot(tmp_path, store, seed) for seed, model in enumerate(MODELS)}
    size = next(iter(made.values()))[1]
    entries = {f"{m}.us-east.s1.r1/embed": entry(m, sha, n, store) for m, (sha, n, _) in made.items()}
    bad = entry("pooled-bad", made[MODELS[0]][0], size, store, factory="tests.bad_parts:raises")
    entries["pooled-bad.us-east.s1.r1/embed"] = bad
    # Room for four parts: each counts at least its pinned file's size.
    args = PoolAppArgs(
        region="us-east",
        hardware="cpu-std",
        pools=PoolSettings(budget_bytes=4 * size + size // 2, leak_bytes=LEAK_BYTES),
    )
    name = pool_app_name("us-east", "cpu-std")
    writer = writer_for(stack)
    ray.get(writer.apply.remote([render_pool_app(args, PoolCatalogue(entries=entries), 1, 1, 0)], []))
    try:
        wait_apps_running([name], timeout_s=120)
        for round_ in range(2):  # six models through a budget of four: the second round evicts again
            for model, (_, _, tensors) in made.items():
                answer = ask(name, f"{model}.us-east.s1.r1/embed", user=3)
                assert answer["snapshot_id"] == f"{model}-v1"
                assert torch.equal(answer["output"]["user"], tensors["user.weight"][3:4]), (
                    f"{model} round {round_}"
                )
        for _ in range(3):  # the bad part fails, then is refused; its pool-mates serve between
            with pytest.raises(Exception, match=r"missing from the snapshot|quarantined"):
                ask(name, "pooled-bad.us-east.s1.r1/embed", user=1)
            assert ask(name, f"{MODELS[5]}.us-east.s1.r1/embed", user=1)["snapshot_id"] == f"{MODELS[5]}-v1"
        before = describe(name)
        stats = before["stats"]
        print(f"pool after 2 rounds of 6 models, budget 4: {stats}")
        assert stats["evictions"] >= 6 and stats["committed_bytes"] <= stats["budget_bytes"]
        assert [q["part"] for q in stats["quarantined"]] == ["pooled-bad/embed@pooled-bad-v1"]
        assert len(before["held"]) <= 4

        kept = {k: v for k, v in entries.items() if k.startswith(MODELS[5])}
        ray.get(writer.apply.remote([render_pool_app(args, PoolCatalogue(entries=kept), 1, 1, 0)], []))
        wait_apps_running([name], timeout_s=120)
        after = describe(name)
        assert after["replica"] == before["replica"], "a catalogue change restarted the pool replica"
        assert (after["entries"], after["held"]) == (1, [f"{MODELS[5]}/embed@{MODELS[5]}-v1"])
        with pytest.raises(Exception, match="no entry"):
            ask(name, f"{MODELS[0]}.us-east.s1.r1/embed", user=1)

        # A part whose first call kills its replica (it loads fine): the pool's ledger counts each
        # death of a replica running it on probation, and after two every replica refuses it;
        # Serve replaces the replica, and its pool-mate serves again.
        sha = made[MODELS[0]][0]
        serve_beside(
            writer, args, kept, entry("pooled-killer", sha, size, store, "tests.bad_parts:killed_on_call")
        )
        outcomes = []
        for _ in range(3):
            try:
                ask(name, "pooled-killer.us-east.s1.r1/embed", user=1)
                outcomes.append("answered")
            except Exception as err:
                outcomes.append("refused" if "quarantined by the pool" in str(err) else "died")
            wait_until(  # the pool-mate, answered again (by the replaced replica after a death)
                lambda: _answers(name, f"{MODELS[5]}.us-east.s1.r1/embed"),
                lambda answered: answered,
                timeout_s=120,
                interval_s=0.5,
            )
        print(f"the part that kills its replica when called, three requests: {outcomes}")
        assert outcomes == ["died", "died", "refused"]
        quarantined = describe(name)["stats"]["quarantined"]
        assert [q["part"] for q in quarantined] == ["pooled-killer/embed@pooled-killer-v1"], quarantined
        assert "died while running it" in quarantined[0]["reason"], quarantined

        # A part whose calls keep 8 MiB each: after its three warm calls, its third charged one
        # passes the 20 MiB the test sets; refused from then on, its pool-mate serving between.
        serve_beside(
            writer, args, kept, entry("pooled-leaker", sha, size, store, "tests.bad_parts:leaks_on_call")
        )
        leaked = []
        for _ in range(10):
            try:
                ask(name, "pooled-leaker.us-east.s1.r1/embed", user=1)
                leaked.append("answered")
            except Exception as err:
                leaked.append("refused" if "leaks memory" in str(err) else repr(err))
            assert ask(name, f"{MODELS[5]}.us-east.s1.r1/embed", user=1)["snapshot_id"] == f"{MODELS[5]}-v1"
        print(f"the part that leaks 8 MiB a call, ten requests: {leaked}")
        # Quarantined at its sixth call (8 MiB a call past 20 MiB on its third charged one), give
        # or take one: a call's reading of the whole process's memory carries a few MiB of noise.
        answered = leaked.count("answered")
        assert 5 <= answered <= 7, leaked
        assert leaked == ["answered"] * answered + ["refused"] * (10 - answered), leaked
        grown = describe(name)["grown_bytes"]
        assert all(n < LEAK_BYTES for n in grown.values()), grown  # its pool-mate charged nothing
    finally:
        ray.get(writer.apply.remote([], [name]))
        wait_apps_gone([name], timeout_s=120)


# Each pooled model's load: light, so six of them and two rollouts fit a loaded 2-core box.
DRILL_RATE = 4.0
# After both rollbacks, the load runs on for this long and this many answers of each model.
AFTER_ROLLBACK_S, AFTER_ROLLBACK_ANSWERS = 2.0, 5


@pytest.mark.timeout(420)  # seven models published, a move each way and two rollbacks, on 2 cores
async def test_pooled_models_roll_back_alone_while_their_pool_mates_serve(
    stack: Settings, client: Client, model_name: str
) -> None:
    pooled = [f"{model_name}-p{i}" for i in range(6)]
    poisoned, corrupted, mover, others = pooled[0], pooled[1], pooled[2], pooled[3:]
    joiner = f"{model_name}-d6"  # starts dedicated, moves into the pool
    names = [*pooled, joiner]
    started = time.perf_counter()
    await asyncio.gather(
        *(client.publish_model(one_region_spec(n, serving="pooled")) for n in pooled),
        client.publish_model(one_region_spec(joiner, serving="dedicated")),
    )
    folders = {name: train_version(stack, name, "v1")[0] for name in names}
    published = await asyncio.gather(*(client.publish_snapshot(n, folders[n]) for n in names))
    firsts = dict(zip(names, published, strict=True))
    await asyncio.gather(*(client.wait_until_serving(n, firsts[n].set_id) for n in names))
    served_at = time.perf_counter() - started
    connect_for(stack)
    apps = serve_applications()
    pools = sorted(a for a in apps if is_pool_app(a))
    assert pools and pool_router_app_name("us-east") in apps, sorted(apps)
    assert not any(a.startswith(tuple(pooled)) for a in apps), "a pooled model got apps of its own"
    assert f"{joiner}.us-east" in apps, sorted(apps)
    async with httpx.AsyncClient(base_url=stack.serve_url, timeout=30) as http:
        unkeyed = await http.post(
            f"/us-east/models/{names[2]}/predict", json={"inputs": {"user": 1, "items": [1]}}
        )
    assert unkeyed.status_code == 401, unkeyed.text  # the pool router checks keys as every door does

    def load(name: str) -> Load:
        return Load(
            stack.serve_url,
            f"/us-east/models/{name}/predict",
            workers=2,
            headers=keyed(stack),
            rate=DRILL_RATE,
        )

    loads = {name: load(name) for name in names if name != corrupted}
    async with contextlib.AsyncExitStack() as running:
        for each in loads.values():
            await running.enter_async_context(each)
        bad_folder = poisoned_copy(
            stack.snapshot_roots[0], poisoned, "v2-bad", stack.snapshot_roots[0] / poisoned / "v1"
        )
        # A seed of its own: the pinned store is shared by content, and another test's v2 of a
        # common seed would be these very bytes, changed under it.
        good_folder, manifest = train_version(stack, corrupted, "v2", seed=int(model_name[1:], 16))
        bad_set, new_set = await asyncio.gather(
            client.publish_snapshot(poisoned, bad_folder), client.publish_snapshot(corrupted, good_folder)
        )
        # Meanwhile a pool-mate moves to replicas of its own by a spec update, rolled out under
        # its load like any new set (its router leaves the pool router at the last step).
        moved = await client.update_model(one_region_spec(mover, serving="dedicated"), who="test-move")
        assert moved.kind == "new_set" and moved.set_id is not None, moved
        # And a dedicated model moves into the pool the same way (its router joins the pool
        # router once its old, dedicated set is gone).
        joined = await client.update_model(one_region_spec(joiner, serving="pooled"), who="test-join")
        assert joined.kind == "new_set" and joined.set_id is not None, joined
        # The corrupted model has no traffic yet, so the pool has not loaded its new set: once its
        # rollout deployed the set, the pinned file changes under the pool (as a disk fault would).
        await poll_until(
            lambda: client.rollout_status(corrupted),
            lambda s: (
                s is not None and s.set_id == new_set.set_id and s.traffic_percent.get(new_set.set_id, 0) > 0
            ),
            timeout_s=180,
            interval_s=0.2,
            what=f"{new_set.set_id} deployed and routed to",
        )
        pinned = pinned_path(stack.pinned_store(), manifest.parts["embed"].sha256)
        pinned.chmod(0o644)
        original = pinned.read_bytes()
        data = bytearray(original)
        data[-1] ^= 0xFF  # one byte of a tensor: still safetensors, no longer the bytes validated
        pinned.write_bytes(bytes(data))
        corrupted_load = await running.enter_async_context(load(corrupted))
        *states, mover_state, joiner_state = await asyncio.gather(
            until_rolled_back(client, poisoned),
            until_rolled_back(client, corrupted),
            client.wait_until_serving(mover, moved.set_id, timeout_s=240),
            client.wait_until_serving(joiner, joined.set_id, timeout_s=240),
        )
        rolled_back_at = {name: each.elapsed() for name, each in {**loads, corrupted: corrupted_load}.items()}
        every = {**loads, corrupted: corrupted_load}
        await poll_until(
            lambda: asyncio.sleep(
                0, [len([a for a in every[n].answers if a.at >= rolled_back_at[n]]) for n in every]
            ),
            lambda counts: min(counts) >= AFTER_ROLLBACK_ANSWERS,
            timeout_s=60,
            interval_s=0.2,
            what=f"{AFTER_ROLLBACK_ANSWERS} answers of each model after the rollbacks",
        )
        await asyncio.sleep(AFTER_ROLLBACK_S)
    for state, first in zip(states, (firsts[poisoned], firsts[corrupted]), strict=True):
        assert state.serving_set == first.set_id and state.rollout is not None
        assert state.rollout.state == RolloutState.ROLLED_BACK, state.rollout
    for name in others:
        assert loads[name].failed() == [], f"{name}, a pool-mate, failed: {loads[name].failed()[:3]}"
        assert {a.set for a in loads[name].answers} == {firsts[name].set_id}
    # The mover: no failed request through the move, its router and set now apps of their own.
    assert loads[mover].failed() == [], f"{mover} failed in its move: {loads[mover].failed()[:3]}"
    assert {a.set for a in loads[mover].answers} <= {firsts[mover].set_id, moved.set_id}
    assert loads[mover].answers[-1].set == moved.set_id
    assert mover_state.spec is not None and not mover_state.spec.pooled()
    listed = await asyncio.to_thread(serve_applications)
    assert f"{mover}.us-east" in listed and mover_state.serving_apps["us-east"] in listed, sorted(listed)
    # The joiner: no failed request through the move, and no app of its own left.
    assert loads[joiner].failed() == [], f"{joiner} failed in its move: {loads[joiner].failed()[:3]}"
    assert loads[joiner].answers[-1].set == joined.set_id
    assert joiner_state.spec is not None and joiner_state.spec.pooled()
    assert not any(a.startswith(f"{joiner}.") for a in listed), sorted(listed)
    assert all(a.set == bad_set.set_id for a in loads[poisoned].failed()), "only the poisoned set failed"
    refused = [a for a in corrupted_load.failed() if "quarantined by its pool" in a.error]
    assert refused, f"no request of {corrupted} was refused by a quarantine: {corrupted_load.failed()[:3]}"
    assert all(a.set == new_set.set_id for a in corrupted_load.failed())
    for name, each in every.items():
        assert each.failed(since=rolled_back_at[name]) == [], name
    counts = ", ".join(
        f"{n[-2:]} {len(each.answers)} ({len(each.failed())} failed)" for n, each in every.items()
    )
    print(
        f"{len(pooled)} pooled models and a dedicated one serving {served_at:.1f} s after their "
        f"publish, from {pools}; "
        f"answers: {counts}; {len(refused)} of {corrupted}'s refused by the quarantine"
    )
    # One serving check for the pools: Serve loses the pool router every pooled model of the
    # region shares. The models' own idle checks wait `serve.pools.model_check_seconds` (600 s),
    # so it is the fleet's pool check that asks them, and the first to check puts it back.
    pooled_now = [poisoned, corrupted, *others, joiner]
    before = await _repairs(client, pooled_now)
    lost_at = time.perf_counter()
    await asyncio.to_thread(serve.delete, pool_router_app_name("us-east"))
    await poll_until(
        lambda: _repairs(client, pooled_now),
        lambda after: after > before,
        timeout_s=120,
        interval_s=0.5,
        what="a pooled model's repair, asked for by the fleet's pool check",
    )
    await poll_until(
        lambda: asyncio.to_thread(_answers_http, stack, others[0]),
        bool,
        timeout_s=60,
        interval_s=0.5,
        what="the pool router back",
    )
    print(f"the pool router lost and served again {time.perf_counter() - lost_at:.1f} s later")
    pinned.write_bytes(original)  # the store as it was: the same bytes under the same name
    pinned.chmod(0o444)
    await asyncio.gather(*(client.delete_model(n) for n in names))
    await poll_until(
        lambda: asyncio.to_thread(serve_applications),
        lambda listed: (
            pool_router_app_name("us-east") not in listed and not any(is_pool_app(a) for a in listed)
        ),
        timeout_s=120,
        interval_s=0.5,
        what="the pools gone with their last model",
    )
