"""Elastic capacity, the region loss at full length: on `dev up --nodes per-region` (a 3-region
fleet of its own) a model served in two regions takes open-loop Poisson load from two sources
through the SDK while one region's node is killed and, later, started again. Two modes, each on
a stack of its own, in the same run under the same arrivals: elastic (the SDK fails over across
regions, `fleet` finds the region down and replans without it, and replans again on its return)
against a static baseline (each source's SDK pinned to its own region, `regions.detect: false`:
nothing notices the loss, nothing replans; the region serves again when its node is back).

    .venv/bin/python bench/elastic.py --scenario region [--phases 60 120 60] [--qps 4]

Measured per mode: failed requests (in all and per phase: before the kill, after it, after the
node's return), every phase's p50/p99 (over every request sent in it, failures at the time they
failed), per source the time from the kill until a request sent after it is answered (None if
never) and until the last failure, and the `fleet` workflow's replans (kind, seconds from the
kill or return to applied, the constraints relaxed). Reported: elastic over static for the
failures and the after-kill p99, and both modes' time until every source is answered again.

Prints one line per mode and writes bench/results/elastic-region.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import yaml

from ipnext.client.devstack.stack import WORKER_GCS_PATIENCE_S, DevStack, node_component, scratch_config
from ipnext.client.sdk import AsyncPredictionClient, Client
from ipnext.contracts.fleet import FleetStatus
from ipnext.errors import PredictionError
from ipnext.examples.click_ranker.train import train
from ipnext.names import ModelStatus, PollTimeoutError, poll_until
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-region"
THREE_REGIONS = REPO / "examples" / "planning" / "fleet-3-regions.yaml"  # us-east, eu-west, ap-south
SOURCES = ("us-east", "eu-west")  # the two regions the model can live in (ap-south has no highmem)
LOST, SURVIVOR = "eu-west", "us-east"
INPUTS = {"user": 3, "items": [1, 2, 3]}
PHASES = ("before", "after kill", "after return")


def spec() -> ModelSpec:
    """The demo ranker served from both source regions, each source at home (the regions are
    40 ms apart, the budget 20 ms); the latency gate floored at 5 s, as in the drills (a loaded
    2-core machine must not roll a healthy set back)."""
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(
        name=MODEL,
        traffic={"peak_qps": {"us-east": 30, "eu-west": 20}},
        latency_budget_ms=20,
        availability={"headroom": 0.2, "min_regions": 2, "survive_region_loss": False},
    )
    rollout = data["rollout"]
    rollout.update(steps=[100], min_requests=10)
    rollout["gates"] = [
        {**g, "floor": max(g.get("floor", 0), 5000)} if g["metric"] == "latency_p99_ms" else g
        for g in rollout["gates"]
    ]
    return ModelSpec.model_validate(data)


@dataclass
class Call:
    source: str
    at: float  # seconds from the load's start it was sent
    latency: float = math.nan
    region: str | None = None  # the region that answered
    error: str = ""


def arrivals(phases: list[float], qps: float, seed: int) -> dict[str, list[float]]:
    """Per source, the Poisson send times (s from the load's start): the same in both modes."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {}
    for source in SOURCES:
        at, end, sent = rng.expovariate(qps), sum(phases), []
        while at < end:
            sent.append(at)
            at += rng.expovariate(qps)
        times[source] = sent
    return times


async def open_loop(
    clients: dict[str, AsyncPredictionClient], times: dict[str, list[float]], pinned: bool, started: float
) -> list[Call]:
    """Every arrival on its own task (a slow answer never delays the next), each with its own key."""
    calls: list[Call] = []

    async def one(client: AsyncPredictionClient, call: Call, key: str) -> None:
        begun = time.perf_counter()
        try:
            answer = await client.predict(
                MODEL, INPUTS, source=call.source, region=call.source if pinned else None, key=key
            )
            call.region = answer.region
        except PredictionError as err:
            call.error = f"{type(err).__name__}: {str(err)[:160]}"
        call.latency = time.perf_counter() - begun

    async def source(name: str) -> None:
        tasks = []
        for i, at in enumerate(times[name]):
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            call = Call(source=name, at=at)
            calls.append(call)
            tasks.append(asyncio.create_task(one(clients[name], call, f"{name}-{i}")))
        await asyncio.gather(*tasks)

    await asyncio.gather(*(source(s) for s in SOURCES))
    return calls


def quantile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def summarize(calls: list[Call], kill_at: float, return_at: float, end: float) -> dict[str, Any]:
    bounds = [0.0, kill_at, return_at, end]
    result: dict[str, Any] = {
        "requests": len(calls),
        "failed": sum(1 for c in calls if c.error),
        "errors": sorted({c.error.split(":")[0] for c in calls if c.error}),
    }
    for name, lo, hi in zip(PHASES, bounds, bounds[1:], strict=False):
        inside = [c for c in calls if lo <= c.at < hi]
        latencies = [c.latency for c in inside]
        result[name] = {
            "requests": len(inside),
            "failed": sum(1 for c in inside if c.error),
            "by_region": {
                r: sum(1 for c in inside if c.region == r)
                for r in sorted({c.region or "" for c in inside} - {""})
            },
            "p50_ms": ms(statistics.median(latencies)) if latencies else None,
            "p99_ms": ms(quantile(latencies, 0.99)),
        }
    answered: dict[str, float | None] = {}
    failing_until: dict[str, float | None] = {}
    for source in SOURCES:
        after = [c for c in calls if c.source == source and c.at >= kill_at]
        ok = [c.at + c.latency - kill_at for c in after if not c.error]
        answered[source] = round(min(ok), 2) if ok else None
        bad = [c.at - kill_at for c in after if c.error]
        failing_until[source] = round(max(bad), 2) if bad else None
    result["answered_after_kill_s"] = answered  # a request sent after the kill answered
    result["last_failure_after_kill_s"] = failing_until  # sent this long after the kill
    times = [t for t in answered.values() if t is not None]
    result["every_source_answered_s"] = max(times) if len(times) == len(SOURCES) else None
    return result


async def replans_seen(client: Client, stop: asyncio.Event, seen: dict[str, dict[str, Any]]) -> None:
    """The `fleet` workflow's replans as they start and end, stamped with when they were first
    seen started and ended, and each change of the regions the model serves from and its plan
    (polling every 0.5 s; a read that fails is tried again)."""
    while not stop.is_set():
        status: FleetStatus | None = None
        try:
            status = await client.fleet_regions()
        except Exception:  # a slow query on a loaded machine: read again
            pass
        if status is not None:
            now = time.perf_counter()
            for replan in status.replans:
                entry = seen.setdefault(replan.workflow_id, {"kind": replan.kind, "seen_started": now})
                entry.update(down_regions=replan.down_regions, outcome=replan.outcome, relaxed=replan.relaxed)
                if replan.outcome != "running" and "seen_done" not in entry:
                    entry["seen_done"] = now
            for state in status.regions:
                if state.region == LOST:
                    seen.setdefault("_lost_region", {})["health"] = str(state.health)
        try:
            model = await client.get_model(MODEL)
        except Exception:  # as above
            pass
        else:
            where = (sorted(model.serving_apps), model.plan.revision if model.plan else 0)
            changes = seen.setdefault("_serving", {}).setdefault("changes", [])
            if not changes or changes[-1][1:] != [*where]:
                changes.append([time.perf_counter(), *where])
        with_timeout = asyncio.create_task(stop.wait())
        await asyncio.wait({with_timeout}, timeout=0.5)
        with_timeout.cancel()


async def answered_at_home(client: AsyncPredictionClient, source: str, timeout_s: float = 60) -> None:
    deadline = time.perf_counter() + timeout_s
    while True:
        try:
            if (await client.predict(MODEL, INPUTS, source=source, region=source)).region == source:
                return
        except PredictionError:
            if time.perf_counter() > deadline:
                raise
        await asyncio.sleep(0.5)


def return_done(seen: dict[str, dict[str, Any]]) -> bool:
    return any(
        e.get("kind") == "return" and "seen_done" in e for k, e in seen.items() if not k.startswith("_")
    )


async def measure(
    dev: DevStack, settings: Settings, args: argparse.Namespace, elastic: bool
) -> dict[str, Any]:
    began = time.perf_counter()
    async with await Client.connect(settings) as client:
        await client.publish_model(spec())
        report = train(settings.snapshot_roots[0], MODEL, "v1", steps=60)
        published = await client.publish_snapshot(MODEL, report.folder)
        first = await client.wait_until_serving(MODEL, published.set_id, timeout_s=300)
        serving_s = time.perf_counter() - began
        revision = first.plan.revision if first.plan else 1
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        clients = {
            s: AsyncPredictionClient.from_settings(
                settings,
                timeout_s=args.timeout,
                region_timeout_s=args.region_timeout,
                transport=httpx.AsyncHTTPTransport(limits=limits),
            )
            for s in SOURCES
        }
        try:
            for s in SOURCES:  # both sources answered at home before the load
                await answered_at_home(clients[s], s)
            times = arrivals(args.phases, args.qps, args.seed)
            stop, seen = asyncio.Event(), cast(dict[str, dict[str, Any]], {})
            watcher = asyncio.create_task(replans_seen(client, stop, seen))
            started = time.perf_counter()
            load = asyncio.create_task(open_loop(clients, times, pinned=not elastic, started=started))
            await asyncio.sleep(max(0.0, started + args.phases[0] - time.perf_counter()))
            killed = time.perf_counter()
            await asyncio.to_thread(dev.crash, node_component(LOST))
            await asyncio.sleep(max(0.0, killed + args.phases[1] - time.perf_counter()))
            back = time.perf_counter()
            await asyncio.to_thread(dev.start, node_component(LOST))
            node_started_s = time.perf_counter() - back
            calls = await load
            ended = time.perf_counter()
            returned_s = None
            if elastic:  # the return replan and both regions serving again, after the load if need be
                try:
                    await poll_until(
                        lambda: client.get_model(MODEL),
                        lambda s: (
                            return_done(seen)
                            and s.state == ModelStatus.SERVING
                            and set(s.serving_apps) == set(SOURCES)
                            and s.plan is not None
                            and s.plan.revision > revision
                        ),
                        timeout_s=args.settle,
                        interval_s=0.5,
                        what="serving from both regions on the return plan",
                    )
                    returned_s = round(time.perf_counter() - back, 1)
                except PollTimeoutError:
                    pass
            stop.set()
            await watcher
        finally:
            for c in clients.values():
                await c.aclose()
    kill_at, return_at = killed - started, back - started
    result = summarize(calls, kill_at, return_at, sum(args.phases))
    replans = []
    for workflow_id, entry in seen.items():
        if workflow_id.startswith("_"):
            continue
        since = killed if entry["kind"] == "emergency" else back
        replans.append(
            {
                "workflow_id": workflow_id,
                "kind": entry["kind"],
                "outcome": entry.get("outcome"),
                "started_after_s": round(entry["seen_started"] - since, 1),
                "ended_after_s": round(entry["seen_done"] - since, 1) if "seen_done" in entry else None,
                "relaxed": entry.get("relaxed", []),
            }
        )
    result.update(
        serving_after_s=round(serving_s, 1),
        kill_at_s=round(kill_at, 1),
        return_at_s=round(return_at, 1),
        node_start_s=round(node_started_s, 1),
        load_overran_s=round(ended - started - sum(args.phases), 1),
        replans=replans,
        # [s from the kill, the regions the model serves from, its plan revision] at each change
        serving_changes=[
            [round(at - killed, 1), apps, plan]
            for at, apps, plan in seen.get("_serving", {}).get("changes", [])
        ],
        both_regions_again_after_return_s=returned_s,
    )
    return result


def run_mode(elastic: bool, args: argparse.Namespace) -> dict[str, Any]:
    for var in ("TEMPORAL_ADDRESS", "RAY_ADDRESS", "IPNEXT_CONFIG"):
        os.environ.pop(var, None)
    os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"] = str(WORKER_GCS_PATIENCE_S)
    # Short path: Ray's unix sockets live under the state folder and must stay under 107 bytes.
    base = Path(tempfile.mkdtemp(prefix="ipn-bregion-", dir="/tmp"))
    config = scratch_config(base, REPO / "config")
    shutil.copyfile(THREE_REGIONS, base / "fleet.yaml")
    data = yaml.safe_load(config.read_text())
    data["serve"]["reconcile_seconds"] = 5.0
    data["ray"] = {"nodes": "per-region"}
    if not elastic:  # nothing finds the region down, so nothing replans
        data["regions"] = {"detect": False}
    config.write_text(yaml.safe_dump(data))
    mode = "elastic" if elastic else "static"

    def log(line: str) -> None:
        if args.verbose:
            print(f"  [{mode}] {line}", file=sys.stderr, flush=True)

    dev = DevStack(config_path=config, log=log)
    up = time.perf_counter()
    dev.up()
    stack_s = time.perf_counter() - up
    try:
        result = asyncio.run(measure(dev, load_settings(config), args, elastic))
        return {"stack_up_s": round(stack_s, 1), **result}
    finally:
        dev.down(quiet=True)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Elastic capacity, the region loss: elastic against a static plan"
    )
    parser.add_argument(
        "--phases",
        type=float,
        nargs=3,
        default=[60.0, 120.0, 60.0],
        help="seconds before the kill, after it (until the node starts again), after the return",
    )
    parser.add_argument("--qps", type=float, default=4.0, help="Poisson requests/s per source")
    parser.add_argument("--timeout", type=float, default=30.0, help="a request's deadline (SDK timeout_s)")
    parser.add_argument("--region-timeout", type=float, default=5.0, help="SDK region_timeout_s")
    parser.add_argument("--settle", type=float, default=120.0, help="elastic: wait for the return plan")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--verbose", action="store_true", help="the dev stack's log on stderr")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "elastic-region.json")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    load = os.getloadavg()
    for mode in ("static", "elastic"):
        result[mode] = run_mode(mode == "elastic", args)
        print(f"{mode}: {json.dumps(result[mode])}", flush=True)
    static, elastic = result["static"], result["elastic"]
    result["region_loss"] = {
        "failed_elastic_over_static": ratio(elastic["failed"], static["failed"]),
        "failed_after_kill_elastic_over_static": ratio(
            elastic["after kill"]["failed"], static["after kill"]["failed"]
        ),
        "p99_after_kill_elastic_over_static": ratio(
            elastic["after kill"]["p99_ms"], static["after kill"]["p99_ms"]
        ),
        "every_source_answered_s": {
            "static": static["every_source_answered_s"],
            "elastic": elastic["every_source_answered_s"],
        },
        "failed": {"static": static["failed"], "elastic": elastic["failed"]},
    }
    out = args.out.resolve()
    result["settings"] = {k: v for k, v in vars(args).items() if k not in ("out", "verbose")} | {
        "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else out.name
    }
    result["machine"] = {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in load]}
    print(json.dumps(result["region_loss"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
