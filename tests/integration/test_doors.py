"""Guarded doors on the real stack, one model through four drills with load running: poison
inputs answer 400 and count against nothing; overload is shed at once by Serve's proxy (503,
Retry-After) while admitted requests keep a bounded latency; a canary that hangs on some inputs
answers 504 within the deadline, counted, and its gate rolls it back; a killed router replica
is replaced by Serve, and what its proxy answers meanwhile is recorded."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from ipnext.client.sdk import Client
from ipnext.contracts.counters import MetricsSnapshot, SetCounters
from ipnext.examples.click_ranker.train import poisoned_copy
from ipnext.names import RolloutState, poll_until
from ipnext.serving.control import connect
from ipnext.serving.layout import RAY_NAMESPACE, metrics_actor_name, router_app_name, set_app_name
from ipnext.spec.model import ModelSpec
from ipnext.spec.settings import Settings
from ipnext.store.keys import add_key, bearer

from .conftest import keyed, one_region_spec, train_version, until_rolled_back
from .load import Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

# The model's router.deadline_seconds in this drill (30 s by default): above what an admitted
# request takes under the overload phase on a loaded 2-core CI machine (up to 2.3 s seen), so
# only the hung canary reaches it.
DEADLINE_S = 5.0
OVERLOAD_S = 8.0  # the overload phase (bench/doors.py runs it for 60 s)
MAX_ONGOING, MAX_QUEUED = 8, 8
OVERLOAD_CLIENTS = 48  # closed loop, six times what the router admits
# How long a wait for the stack to show something may take (the doors reading a changed keys
# file, the load answering, a push of the routers' counters): far above what each takes.
SHOWN_WITHIN_S = 30.0
# Answers the load must get after the rollback: the period over which nothing may fail is this
# many answers, not a stretch of wall clock.
ANSWERS_AFTER_ROLLBACK = 20


async def _refused_without_the_right_key(stack: Settings, model: str) -> int:
    """Predict, stream, the model's description and demand, and its routing document: 401
    without a key or with one not known, 403 with a key of another model; answered with the
    stack's own. Returns how many were refused (none may count against the set)."""
    keys_file = stack.keys_file()
    assert keys_file is not None, "the test stack runs with auth on (the default)"
    other = add_key(keys_file, f"other-{model}", [f"{model}-not-this-one"])
    region = f"/us-east/models/{model}"
    doors = [
        ("POST", f"{region}/predict", {"inputs": {"user": 1, "items": [1]}}),
        ("POST", f"{region}/predict", {"inputs": {"user": 1, "items": [1]}, "stream": True}),
        ("GET", region, None),
        ("GET", f"{region}/demand", None),
        ("GET", f"/models/{model}/routing", None),
    ]
    refused = 0
    async with httpx.AsyncClient(base_url=stack.serve_url, timeout=30) as http:
        # The doors read a changed keys file within a second: the new key is known once every
        # door refuses it as another model's (403), none as unknown (401).
        async def with_other_key() -> list[int]:
            return [
                (await http.request(method, url, json=body, headers=bearer(other))).status_code
                for method, url, body in doors
            ]

        await poll_until(
            with_other_key,
            lambda statuses: 401 not in statuses,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.2,
            what="the doors to read the changed keys file",
        )
        for headers, status in (({}, 401), (bearer("ipn_guessed"), 401), (bearer(other), 403)):
            for method, url, body in doors:
                reply = await http.request(method, url, json=body, headers=headers)
                assert reply.status_code == status, (method, url, headers.keys(), reply.text)
                assert "message" in reply.json() and "set" not in reply.json(), reply.text
                refused += 1
        for method, url, body in doors:
            reply = await http.request(method, url, json=body, headers=keyed(stack))
            assert reply.status_code == 200, (method, url, reply.text)
    return refused


async def _ok(load: Load) -> int:
    return sum(1 for a in load.answers if a.status == 200)


def counters(model: str, app: str) -> SetCounters:
    """What the model's metrics actor holds for one set app (every router replica's sum)."""
    store = ray.get_actor(metrics_actor_name(model, "us-east"), namespace=RAY_NAMESPACE)
    snapshot = MetricsSnapshot.model_validate(ray.get(store.snapshot.remote(), timeout=30))
    return snapshot.sets.get(app, SetCounters())


async def counted(model: str, app: str, at_least: int, what: str) -> SetCounters:
    """The set app's counters once they count at least `at_least` requests (routers push every
    second)."""
    return await poll_until(
        lambda: asyncio.to_thread(counters, model, app),
        lambda now: now.requests >= at_least,
        timeout_s=30,
        interval_s=0.5,
        what=what,
    )


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def serve_pids(router_app: str) -> dict[str, int]:
    """The pids of Serve's proxy and of the model's router replica, by their process titles
    (`ray::ProxyActor`, `ray::ServeReplica:<app>:router`): the state API needs the dashboard,
    which the dev stack does not start."""
    titles = {"proxy": "ray::ProxyActor", "router": f"ray::ServeReplica:{router_app}:router"}
    pids = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue
        for name, wanted in titles.items():
            if title.startswith(wanted):
                pids[name] = int(proc.name)
    return pids


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else math.nan


async def test_doors_poison_inputs_overload_a_hung_canary_and_a_killed_router(
    stack: Settings, client: Client, model_name: str
) -> None:
    data = one_region_spec(model_name).model_dump(mode="json")
    data["router"] = {
        "deadline_seconds": DEADLINE_S,
        "max_ongoing_requests": MAX_ONGOING,
        "max_queued_requests": MAX_QUEUED,
        "max_body_bytes": 4096,
        "max_json_depth": 8,
    }
    data["parts"]["dense"]["config"]["hang_on_non_finite"] = True  # only a poisoned set hangs
    # A spare replica per part in us-east, counted by the planner: the part replica killed at the
    # end leaves no gap in the answers.
    data["availability"] = {**data.get("availability", {}), "spare_replicas": 1}
    # The example's steps and a floor of 10: the hung canary's calls count as errors only at their
    # deadline, so a gate judged on its first 5 answers (two steps, the drills' floor) passed it
    # (a fresh run: error_rate 0 on 44 requests, rolled out).
    data["rollout"]["steps"] = [10, 50, 100]
    data["rollout"]["min_requests"] = 10
    spec = ModelSpec.model_validate(data)
    await client.publish_model(spec)
    good, _ = train_version(stack, model_name, "v1")
    first = await client.publish_snapshot(model_name, good)
    await client.wait_until_serving(model_name, first.set_id)
    connect(stack.ray_address())
    path = f"/us-east/models/{model_name}/predict"
    app = set_app_name(model_name, "us-east", 1, 1)
    router_app = router_app_name(model_name, "us-east")

    # ---- poison inputs: 400 naming the field, nothing counted against the set ----------------
    before = counters(model_name, app)
    poison = {
        "user 1e999": (b'{"inputs": {"user": 1e999, "items": [1]}}', 400, "inputs.user"),
        "NaN item": (b'{"inputs": {"user": 1, "items": [1, NaN]}}', 400, "inputs.items[1]"),
        "user 3.5": (b'{"inputs": {"user": 3.5, "items": [1]}}', 400, "inputs: expected"),
        "user 10**6": (b'{"inputs": {"user": 1000000, "items": [1]}}', 400, "inputs.user: 1000000"),
        "too deep": (b'{"inputs": ' + b"[" * 9 + b"]" * 9 + b"}", 400, "body: JSON nested 10 levels"),
        "too big": (
            b'{"inputs": {"user": 1, "items": [' + b"1, " * 2000 + b"1]}}",
            413,
            "body: larger than 4096",
        ),
        "not JSON": (b"{", 400, "body is not JSON"),
    }
    # With two callers of good requests running throughout: the replica answers them on.
    async with Load(stack.serve_url, path, headers=keyed(stack), workers=2) as load:
        await poll_until(lambda: _ok(load), lambda n: n >= 5, timeout_s=30, interval_s=0.1, what="load")
        async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
            for label, (body, status, field) in poison.items():
                reply = await http.post(path, content=body, headers={"content-type": "application/json"})
                answer = reply.json()
                assert reply.status_code == status and answer["message"].startswith(field), (
                    label,
                    reply.text,
                )
                assert set(answer) == {"error_id", "message"} | ({"set"} if "set" in answer else set()), (
                    answer
                )
                assert "Traceback" not in reply.text and "File " not in reply.text
            goods = [await http.post(path, json={"inputs": {"user": u, "items": [1, 2]}}) for u in range(5)]
            assert [g.status_code for g in goods] == [200] * 5
        refused = await _refused_without_the_right_key(stack, model_name)
    # The load's callers finish their last request before stopping: every answer is in `answers`.
    assert load.failed() == [], load.failed()[:3]
    expected = before.requests + 5 + 2 + len(load.answers)
    await counted(model_name, app, expected, "the good requests and the load counted")
    # One more good request, counted after every refusal: once its push is in, a counted 400
    # (or 401/403) would show in the same cumulative counters.
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        last = await http.post(path, json={"inputs": {"user": 1, "items": [1, 2]}})
    assert last.status_code == 200, last.text
    expected += 1
    after = await counted(model_name, app, expected, "the request after the refusals counted")
    print(
        f"keys: {refused} requests without a key or with another model's refused (401/403); "
        f"poison inputs: {len(poison)} refused at the door under {len(load.answers)} good requests "
        f"(none failed); set counters {before.requests}/{before.errors} -> {after.requests}/{after.errors} "
        "(requests/errors)"
    )
    # The right key's two predicts (one streamed) counted; the refusals did not.
    assert (after.requests, after.errors) == (expected, before.errors)

    # ---- gate truth: a dashboard's p99 (Ray's Prometheus endpoint) is the gate's p99 ----------
    node = next(n for n in ray.nodes() if n["Alive"])
    metrics_url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        for u in range(60):
            assert (
                await http.post(path, json={"inputs": {"user": u, "items": [1, 2, 3]}})
            ).status_code == 200
    gate = await counted(model_name, app, after.requests + 60, "the 60 requests counted")
    observed = sum(gate.histograms["latency_ms"])
    scraped = await poll_until(
        lambda: asyncio.to_thread(scrape_latency, metrics_url, model_name, app),
        lambda buckets: bool(buckets) and buckets[-1][1] >= observed,
        timeout_s=90,
        interval_s=1.0,
        what=f"Ray's metrics endpoint to export the {observed} latencies",
    )
    dashboard, gate_p99 = histogram_quantile(0.99, scraped), gate.quantile_ms("latency_ms", 0.99)
    print(
        f"gate truth: p99 {gate_p99:.3f} ms at the gate, {dashboard:.3f} ms from the scraped histogram "
        f"({len(scraped)} buckets, {observed} latencies)"
    )
    assert scraped[-1][1] == observed and gate_p99 is not None
    assert dashboard == pytest.approx(gate_p99, rel=1e-9)

    # ---- overload: shed at once, admitted latency bounded, memory flat ------------------------
    pids = serve_pids(router_app)
    assert set(pids) == {"proxy", "router"}, pids
    rss_before = {name: rss_kib(pid) for name, pid in pids.items()}
    async with Load(
        stack.serve_url, path, headers=keyed(stack), workers=OVERLOAD_CLIENTS, backoff_s=0.05, rate=None
    ) as load:
        await asyncio.sleep(OVERLOAD_S)
    rss_after = {name: rss_kib(pid) for name, pid in pids.items()}
    admitted = [a.latency_s for a in load.answers if a.status == 200]
    shed = [a for a in load.answers if a.status == 503]
    others = [a for a in load.answers if a.status not in (200, 503)]
    print(
        f"overload ({OVERLOAD_CLIENTS} clients, {OVERLOAD_S:g} s, router {MAX_ONGOING}+{MAX_QUEUED}): "
        f"{len(admitted)} admitted p50 {statistics.median(admitted) * 1000:.0f} ms "
        f"p99 {p99(admitted) * 1000:.0f} ms max {max(admitted) * 1000:.0f} ms; {len(shed)} shed with 503, "
        f"p99 {p99([a.latency_s for a in shed]) * 1000:.0f} ms; RSS KiB before {rss_before} after {rss_after}"
    )
    assert admitted and shed, "the drill never overloaded the router"
    assert others == [], others[:3]
    assert all("backpressure" in a.error.lower() or "retry" in a.error.lower() for a in shed[:5]), shed[:3]
    # Shed requests never reached the router: the set's errors did not move.
    assert counters(model_name, app).errors == before.errors

    # ---- a canary that hangs on some inputs: 504 within the deadline, counted, rolled back -----
    bad = poisoned_copy(stack.snapshot_roots[0], model_name, "v2-hangs", good)
    async with Load(
        stack.serve_url, path, headers=keyed(stack), workers=8
    ) as load:  # hung calls hold a caller each
        published = await client.publish_snapshot(model_name, bad)
        state = await until_rolled_back(client, model_name)
        rolled_back_at = load.elapsed()
        await poll_until(
            lambda: asyncio.sleep(0, sum(1 for a in load.answers if a.at > rolled_back_at + 0.5)),
            lambda answered: answered >= ANSWERS_AFTER_ROLLBACK,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.2,
            what=f"{ANSWERS_AFTER_ROLLBACK} answers after the rollback",
        )
    status = state.rollout
    assert status is not None and status.state == RolloutState.ROLLED_BACK
    assert "error_rate" in status.detail, status.detail
    timeouts = [a for a in load.answers if a.status == 504]
    # Every 504 is the canary's, and the hung (poisoned, even) users are among them; an odd user
    # of the canary may time out too, queued behind hung calls on a loaded machine.
    assert timeouts and all(a.set == published.set_id for a in timeouts), load.failed()[:3]
    assert any(a.user % 2 == 0 for a in timeouts) and all("deadline" in a.error for a in timeouts)
    # Other requests keep flowing: nothing on the old set failed.
    assert [a for a in load.failed() if a.set != published.set_id] == []
    slowest = max(a.latency_s for a in timeouts)
    flowing = [a for a in load.answers if a.status == 200]
    assert load.failed(since=rolled_back_at + 0.5) == []
    print(
        f"hung canary: {len(timeouts)} answered 504 ({sum(a.user % 2 for a in timeouts)} of them odd users "
        f"queued behind hung calls; slowest {slowest:.2f} s, deadline {DEADLINE_S:g} s), "
        f"{len(flowing)} answered 200 meanwhile; rolled back at {rolled_back_at:.1f} s: {status.detail}"
    )

    # ---- a killed router replica: Serve replaces it; record what the proxy answers meanwhile --
    async with Load(stack.serve_url, path, headers=keyed(stack)) as load:
        await poll_until(
            lambda: _ok(load), lambda n: n >= 5, timeout_s=SHOWN_WITHIN_S, interval_s=0.1, what="load"
        )
        killed_at = load.elapsed()
        replica = next(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{router_app}#router#")
        )
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        await poll_until(
            lambda: asyncio.sleep(0, [a for a in load.answers if a.at > killed_at + 0.5 and a.status == 200]),
            lambda answered: len(answered) >= 20,
            timeout_s=120,
            interval_s=0.2,
            what="answers again after the router replica was killed",
        )
    during = [a for a in load.answers if a.at >= killed_at and a.status != 200]
    back = min(a.at for a in load.answers if a.at > killed_at + 0.5 and a.status == 200)
    kinds: dict[str, int] = {}
    for a in during:
        key = f"{a.status} {a.error[:60]}"
        kinds[key] = kinds.get(key, 0) + 1
    print(
        f"router replica killed: answers again {back - killed_at:.1f} s later; meanwhile "
        f"{len(during)} failed: {json.dumps(kinds)}"
    )

    # ---- a killed part replica, with the spare the spec asks for: answers go on -------------
    replicas = sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#dense-")
    )
    assert len(replicas) >= 2, f"availability.spare_replicas 1 planned {replicas}"
    async with Load(stack.serve_url, path, headers=keyed(stack), workers=4) as load:
        await poll_until(
            lambda: _ok(load), lambda n: n >= 5, timeout_s=SHOWN_WITHIN_S, interval_s=0.1, what="load"
        )
        killed_at = load.elapsed()
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
        await poll_until(
            lambda: asyncio.sleep(0, [a for a in load.answers if a.at > killed_at + 3 and a.status == 200]),
            lambda answered: len(answered) >= 10,
            timeout_s=120,
            interval_s=0.2,
            what="answers 3 s after a part replica was killed",
        )
    answered = sorted(a.at + a.latency_s for a in load.answers if a.status == 200)
    around = [t for t in answered if t >= killed_at - 1]
    gap = max((b - a for a, b in itertools.pairwise(around)), default=math.inf)
    in_flight = [a for a in load.answers if a.at < killed_at < a.at + a.latency_s]
    after = [a for a in load.failed(since=killed_at) if a.at >= killed_at]
    print(
        f"part replica killed (spare_replicas 1, {len(replicas)} dense replicas): longest gap with no "
        f"answer {gap:.2f} s; {len(in_flight)} in flight at the kill, "
        f"{len([a for a in in_flight if a.status != 200])} of them failed; {len(after)} sent after it failed"
    )
    assert after == [], after[:3]  # only a request in flight on the dead replica may fail
    await client.delete_model(model_name)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile, from its documentation: `buckets` are (upper bound `le`,
    cumulative count), +Inf last. The rank's bucket is interpolated linearly from its lower
    bound (0 for the first bucket) to its upper bound; a rank in the +Inf bucket gives the
    highest finite bound."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / (count - below) if count > below else le
        lower, below = le, count
    return lower


def scrape_latency(metrics_url: str, model: str, app: str) -> list[tuple[float, float]]:
    text = httpx.get(metrics_url, timeout=10).text
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels: dict[str, Any] = sample.labels
            if sample.name.endswith("ipnext_latency_ms_bucket") and labels.get("set_app") == app:
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
    return sorted(buckets.items())
