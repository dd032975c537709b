"""Elastic capacity, the load step at full length: a part of fixed capacity per replica under
open-loop Poisson load at 1x its declared peak, then 4x, then 1x, on a dev stack that
autoscales inside the plan's envelope, against a static plan (the same stack with `burst: 0`,
so every deployment keeps the plan's replicas) in the same run.

    .venv/bin/python bench/elastic.py [--phases 60 120 120] [--peak 5] [--service-ms 400]

The part awaits `--service-ms` per request, at most 5 at once per replica (no CPU), and its
spec's `qps` is that capacity (5 / service time); the model declares `--peak` requests/s (4x
it at most 40 through the router on one machine). Measured per mode: every phase's p50/p99
and failed requests, the part's running replicas each second (from `serve.status()`) and
their peak, any pool oversubscribed by running replicas x units, and the p99 recovery time
(from the end of the 4x phase until every later second's p99 is within twice the first
phase's). Reported: elastic over static for the 4x phase's p99 and for failures.

Prints one line per mode and writes bench/results/elastic.json. `--scenario region` runs the
region loss instead (bench/elastic_region.py, its options after it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.serving.control import connect_for, get_writer, serve_applications
from ipnext.serving.layout import SET_IMPORT_PATH, part_deployment_name, pool_usage, set_app_name
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-elastic"
PART_MAX_ONGOING = 5  # Serve's default per replica
DENSE = part_deployment_name("dense", "cpu-std")


def spec(peak: float, service_s: float) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=MODEL, traffic={"peak_qps": {"us-east": peak}})
    data["parts"]["dense"]["config"]["delay_ms"] = service_s * 1000
    data["parts"]["dense"]["hardware"] = {"cpu-std": {"units": 1, "qps": PART_MAX_ONGOING / service_s}}
    data["router"] = {"max_ongoing_requests": 5000, "max_queued_requests": 5000}
    for part in data["parts"].values():  # open loop: nothing refused, the queues show the capacity
        part["max_queued_requests"] = 5000
    return ModelSpec.model_validate(data)


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


async def open_loop(
    url: str, phases: list[tuple[float, float]], seed: int, headers: dict[str, str]
) -> list[tuple[float, int, float]]:
    """(sent at, status, latency s) of every request of Poisson arrivals at each phase's rate."""
    rng = random.Random(seed)
    sent: list[tuple[float, int, float]] = []
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as http:

        async def send(at: float, n: int) -> None:
            begun = time.perf_counter()
            try:
                status = (
                    await http.post(url, json={"inputs": {"user": n % 200, "items": [1, 2, 3]}})
                ).status_code
            except httpx.HTTPError:
                status = 0
            sent.append((at, status, time.perf_counter() - begun))

        started, start, tasks, n = time.perf_counter(), 0.0, [], 0
        for seconds, rate in phases:
            at = start + rng.expovariate(rate)
            while at < start + seconds:
                delay = started + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(send(at, n)))
                n += 1
                at += rng.expovariate(rate)
            start += seconds
        await asyncio.gather(*tasks)
    return sent


def running(apps: list[str]) -> dict[str, dict[str, int]]:
    status = serve_applications()  # serve.status(), one thread at a time
    return {
        app: {name: int(d.replica_states.get("RUNNING", 0)) for name, d in status[app].deployments.items()}
        for app in apps
        if app in status
    }


def recovery_s(sent: list[tuple[float, int, float]], step_end: float, baseline: float) -> float | None:
    windows: dict[int, list[float]] = {}
    for at, _, latency in sent:
        if at >= step_end:
            windows.setdefault(int(at - step_end), []).append(latency)
    if not windows:
        return None
    slow = [w for w, lat in windows.items() if quantile(lat, 0.99) > 2 * baseline]
    return float(max(slow) + 1) if slow else 0.0


async def measure(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    async with await Client.connect(settings) as client:
        await client.publish_model(spec(args.peak, args.service_ms / 1000))
        report = train(settings.snapshot_roots[0], MODEL, "v1", steps=60)
        published = await client.publish_snapshot(MODEL, report.folder)
        await client.wait_until_serving(MODEL, published.set_id)
        connect_for(settings)
        app = set_app_name(MODEL, "us-east", 1, 1)
        exported = ray.get(get_writer(settings.serve.host, settings.serve.port).export.remote(), timeout=60)
        set_apps = {a["name"]: a for a in exported["applications"] if a["import_path"] == SET_IMPORT_PATH}
        scaling = next(d for d in set_apps[app]["deployments"] if d["name"] == DENSE)["autoscaling_config"]
        pools = {(p.region, p.hardware): p.units for p in settings.fleet().pools}
        url = f"{settings.serve_url}/us-east/models/{MODEL}/predict"
        await open_loop(
            url, [(3.0, args.peak)], seed=0, headers=key_header(settings)
        )  # warm up: connections open, replicas loaded
        replicas: list[int] = []
        oversubscribed: list[str] = []
        stop = asyncio.Event()

        async def sample() -> None:
            while not stop.is_set():
                counts = await asyncio.to_thread(running, sorted(set_apps))
                replicas.append(counts.get(app, {}).get(DENSE, 0))
                usage = pool_usage(set_apps, running=counts)
                oversubscribed.extend(
                    f"{k}: {u} > {pools.get(k, 0)}" for k, u in usage.items() if u > pools.get(k, 0)
                )
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        phases = [(args.phases[0], args.peak), (args.phases[1], 4 * args.peak), (args.phases[2], args.peak)]
        sent = await open_loop(url, phases, seed=args.seed, headers=key_header(settings))
        stop.set()
        await sampler
        await client.delete_model(MODEL)
    bounds = [0.0, args.phases[0], args.phases[0] + args.phases[1], sum(args.phases)]
    result: dict[str, Any] = {
        "envelope": [scaling["min_replicas"], scaling["max_replicas"]],
        "replicas_each_second": replicas,
        "peak_replicas": max(replicas, default=0),
        "pools_oversubscribed": oversubscribed,
        "failed": sum(1 for _, status, _ in sent if status != 200),
        "requests": len(sent),
    }
    for name, lo, hi in zip(("1x", "4x", "1x after"), bounds, bounds[1:], strict=False):
        latencies = [lat for at, _, lat in sent if lo <= at < hi]
        result[name] = {
            "requests": len(latencies),
            "failed": sum(1 for at, status, _ in sent if lo <= at < hi and status != 200),
            "p50_ms": round(statistics.median(latencies) * 1000, 1) if latencies else None,
            "p99_ms": round(quantile(latencies, 0.99) * 1000, 1),
        }
    baseline = result["1x"]["p99_ms"] / 1000
    result["p99_recovery_s"] = recovery_s(sent, bounds[2], baseline)
    return result


def run_mode(burst: float, args: argparse.Namespace) -> dict[str, Any]:
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    data = yaml.safe_load(config.read_text())
    data["serve"]["autoscaling"] = {
        "burst": burst,
        "upscale_delay_s": args.upscale_delay,
        "downscale_delay_s": args.downscale_delay,
        "look_back_period_s": args.look_back,
        "metrics_interval_s": args.metrics_interval,
    }
    config.write_text(yaml.safe_dump(data))
    dev = DevStack(config_path=config, log=lambda line: None)
    dev.up()
    try:
        return asyncio.run(measure(load_settings(config), args))
    finally:
        if ray.is_initialized():  # detach before the cluster goes, and forget its Serve controller
            from ray.serve.context import _set_global_client

            ray.shutdown()
            _set_global_client(None)
        dev.down()


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> None:
    scenario = argparse.ArgumentParser(add_help=False)
    scenario.add_argument("--scenario", choices=("step", "region"), default="step")
    chosen, rest = scenario.parse_known_args()
    if chosen.scenario == "region":
        import elastic_region  # bench/ is this script's folder, on sys.path

        elastic_region.main(rest)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario", choices=("step", "region"), default="step", help="region: the region loss"
    )
    parser.add_argument(
        "--phases", type=float, nargs=3, default=[60.0, 120.0, 120.0], help="1x, 4x, 1x seconds"
    )
    parser.add_argument("--peak", type=float, default=5.0, help="declared peak_qps (4x: at most 40)")
    parser.add_argument("--service-ms", type=float, default=400.0, help="the part's fixed service time")
    parser.add_argument("--upscale-delay", type=float, default=5.0)
    parser.add_argument("--downscale-delay", type=float, default=30.0)
    parser.add_argument("--look-back", type=float, default=10.0)
    parser.add_argument("--metrics-interval", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "elastic.json")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    for mode, burst in (("static", 0.0), ("elastic", 1.0)):
        result[mode] = run_mode(burst, args)
        shown = {k: v for k, v in result[mode].items() if k != "replicas_each_second"}
        print(f"{mode}: {json.dumps(shown)}", flush=True)
    static, elastic = result["static"], result["elastic"]
    result["load_step"] = {
        "p99_4x_elastic_over_static": ratio(elastic["4x"]["p99_ms"], static["4x"]["p99_ms"]),
        "failed_elastic_over_static": ratio(elastic["failed"], static["failed"]),
        "failed": {"static": static["failed"], "elastic": elastic["failed"]},
    }
    out = args.out.resolve()
    result["settings"] = {k: v for k, v in vars(args).items() if k != "out"} | {
        "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else out.name
    }
    print(json.dumps(result["load_step"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
