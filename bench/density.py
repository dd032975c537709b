"""Density: hundreds of small models on one machine through shared pools, against dedicated
replicas, measured in one run on one dev stack.

    .venv/bin/python bench/density.py [--pooled 200] [--dedicated 8] [--peak-qps 1] [--phase-s 60]

1. Memory. The PSS of every process of the stack (`/proc/<pid>/smaps_rollup`, so pages shared
   between processes count once) with no model; then with `--pooled` click-ranker models served
   from the shared pools (`serving: pooled`), published in two halves, every one answered once so
   all are resident (the pool's byte budget holds them all: evictions reported); then with
   `--dedicated` more of the same size with replicas of their own (`serving: dedicated`).
   Memory per model: the PSS each step adds, divided by its models; and the second half's slope,
   what one more pooled model costs beside the pools' fixed processes.
2. Cold loads: the latency of each pooled model's first request (its parts loaded in the pool on
   that request), p50 and p99, against the same model's next request.
3. Load. The saturation of the pooled path (a closed loop of `--callers` as fast as they are
   answered, over every pooled model; after `--settle-s` idle, the median of three runs), then
   open-loop Poisson arrivals at `--load` (0.7) of it, spread over the pooled models by a Zipf
   law (exponent `--zipf`, 1.1), in alternating phases:
   `pooled` (every request to the pools) and `dedicated` (the same arrivals, but the 8 hottest
   models' requests go to the dedicated models instead). Reported: the hot models' p99 pooled
   over dedicated, and every phase's p50, p99 and failures.
4. The worker's CPU (user + system seconds, from /proc) over `--idle-s` three times: with no
   model, with every pooled model idle and serving, and with the dedicated ones beside them
   (their difference over the models' count: what one pooled and one dedicated model cost the
   worker; `--idle-s` is at least `--model-check-s`, so every pooled model's own safety-net check
   falls in each window once); and per second of each load phase. Serve's controller's CPU over
   the pooled idle window and over the saturation measurement; the config writer's group
   commits (`commit_stats`): how many applies carried the publishes.

Every model declares `--peak-qps` (1: a tail model), which sizes its pool's floor or its own
replicas; the load phases run at a share of the measured saturation, whatever that size is.

Prints its figures and writes bench/results/density.json.
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
import torch
import yaml

from ipnext.client.devstack.stack import DevStack, scratch_config, stack_processes
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.parts import build_modules
from ipnext.serving.control import connect_for, serve_applications, writer_for
from ipnext.serving.pool_layout import POOL_DEPLOYMENT, is_pool_app
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header
from ipnext.store.snapshots import write_snapshot

REPO = Path(__file__).resolve().parents[1]
REGION = "us-east"
HOT = 8  # the hottest models, served both ways
FLEET = {
    "regions": [REGION],
    "hardware": {"cpu-std": {"kind": "cpu"}, "cpu-highmem": {"kind": "cpu"}},
    "pools": [
        {"region": REGION, "hardware": "cpu-std", "units": 64, "unit_cost": 1.0},
        {"region": REGION, "hardware": "cpu-highmem", "units": 64, "unit_cost": 1.6},
    ],
    "latency_ms": {REGION: {REGION: 1}},
}
CLK_TCK = 100  # /proc/<pid>/stat's ticks per second on Linux


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


def pss_mb(stack_id: str) -> tuple[float, int]:
    """The stack's processes' PSS summed (MB), and how many processes."""
    total_kb, count = 0, 0
    for pid in stack_processes(stack_id):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total_kb += int(line.split()[1])
                    count += 1
                    break
        except OSError:  # the process ended meanwhile
            continue
    return total_kb / 1024, count


def controller_pid(stack_id: str) -> int | None:
    """Serve's controller among the stack's processes (its title: ray::ServeController...)."""
    for pid in stack_processes(stack_id):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ServeController"):
                return int(pid)
        except OSError:
            continue
    return None


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


def spec(name: str, serving: str, peak_qps: float) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=name, traffic={"peak_qps": {REGION: peak_qps}}, serving=serving)
    data["rollout"].update(steps=[100], min_requests=1, bake_seconds=1)
    data["rollout"]["gates"] = [{"metric": "error_rate", "max": 0.5}]
    return ModelSpec.model_validate(data)


def snapshot(root: Path, model: str, seed: int) -> Path:
    """Random click-ranker weights of the example's size (a trained model's size, not its skill)."""
    config = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").parts["embed"].config
    torch.manual_seed(seed)
    state = build_modules(config).state_dict()
    folder = root / model / "v1"
    write_snapshot(
        folder,
        model,
        "v1",
        {
            "embed": {k: v for k, v in state.items() if k.startswith(("user.", "item."))},
            "dense": {k: v for k, v in state.items() if k.startswith("mlp.")},
        },
    )
    return folder


async def publish_all(
    client: Client, settings: Settings, names: list[str], serving: str, width: int, peak_qps: float
) -> float:
    """Publish and serve every model, `width` at a time; the seconds it took."""
    started = time.perf_counter()
    gate = asyncio.Semaphore(width)
    done = 0

    async def one(i: int, name: str) -> None:
        nonlocal done
        async with gate:
            await client.publish_model(spec(name, serving, peak_qps))
            folder = await asyncio.to_thread(snapshot, settings.snapshot_roots[0], name, i)
            published = await client.publish_snapshot(name, folder)
            await client.wait_until_serving(name, published.set_id, timeout_s=600)
        done += 1
        if done % 10 == 0 or done == len(names):
            print(
                f"  {serving}: {done}/{len(names)} serving, {time.perf_counter() - started:.0f} s", flush=True
            )

    await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))
    return time.perf_counter() - started


def request(model: str, user: int) -> tuple[str, dict[str, Any]]:
    return f"/{REGION}/models/{model}/predict", {"inputs": {"user": user % 200, "items": [1, 2, 3]}}


async def first_requests(http: httpx.AsyncClient, names: list[str]) -> dict[str, list[float]]:
    """Each model's first request (its cold load) and its second, one model at a time (ms)."""
    cold, warm = [], []
    for i, name in enumerate(names):
        for into in (cold, warm):
            path, body = request(name, i)
            began = time.perf_counter()
            reply = await http.post(path, json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"{name} did not answer: {reply.status_code} {reply.text[:200]}")
            into.append((time.perf_counter() - began) * 1000)
    return {"cold_ms": cold, "warm_ms": warm}


async def saturation(http: httpx.AsyncClient, names: list[str], callers: int, seconds: float) -> float:
    """Requests/s the pooled path answers with `callers` closed-loop callers over every model."""
    stop = time.perf_counter() + seconds
    answered = 0

    async def caller(k: int) -> None:
        nonlocal answered
        n = k
        while time.perf_counter() < stop:
            path, body = request(names[n % len(names)], n)
            n += callers
            if (await http.post(path, json=body)).status_code == 200:
                answered += 1

    began = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    return answered / (time.perf_counter() - began)


def zipf_weights(n: int, exponent: float) -> list[float]:
    raw = [1 / (rank + 1) ** exponent for rank in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


async def open_phase(
    http: httpx.AsyncClient,
    targets: list[str],
    weights: list[float],
    rate: float,
    seconds: float,
    rng: random.Random,
) -> list[tuple[int, int, float]]:
    """(model rank, status, latency ms) of Poisson arrivals at `rate`, each to a model drawn by
    `weights` (rank i is sent to `targets[i]`)."""
    sent: list[tuple[int, int, float]] = []
    tasks = []
    began = time.perf_counter()
    at = 0.0

    async def send(rank: int, n: int) -> None:
        path, body = request(targets[rank], n)
        start = time.perf_counter()
        try:
            status = (await http.post(path, json=body)).status_code
        except httpx.HTTPError:
            status = 0
        sent.append((rank, status, (time.perf_counter() - start) * 1000))

    n = 0
    while at < seconds:
        at += rng.expovariate(rate)
        delay = began + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        rank = rng.choices(range(len(weights)), weights)[0]
        tasks.append(asyncio.ensure_future(send(rank, n)))
        n += 1
    await asyncio.gather(*tasks)
    return sent


def summarize(sent: list[tuple[int, int, float]], hot: int) -> dict[str, Any]:
    ok = [ms for _, status, ms in sent if status == 200]
    hot_ok = [ms for rank, status, ms in sent if status == 200 and rank < hot]
    return {
        "requests": len(sent),
        "failed": sum(1 for _, status, _ in sent if status != 200),
        "p50_ms": round(quantile(ok, 0.5), 1),
        "p99_ms": round(quantile(ok, 0.99), 1),
        "hot_requests": len(hot_ok),
        "hot_p99_ms": round(quantile(hot_ok, 0.99), 1),
    }


async def worker_cpu(pid: int, seconds: float) -> float:
    """The worker's CPU over the next `seconds`, in percent of one core."""
    before = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return round(100 * (cpu_seconds(pid) - before) / seconds, 1)


def writer_commits(settings: Settings) -> dict[str, int]:
    """The config writer's group commits so far: how many applies carried how many changes."""
    connect_for(settings)
    stats: dict[str, int] = ray.get(writer_for(settings).commit_stats.remote(), timeout=60)
    return stats


async def pool_holds(settings: Settings) -> list[dict[str, Any]]:
    """What each pool app's replica answering says it holds (one replica per pool here)."""
    from ray import serve

    connect_for(settings)
    held = []
    for app in sorted(a for a in await asyncio.to_thread(serve_applications) if is_pool_app(a)):
        handle = serve.get_deployment_handle(POOL_DEPLOYMENT, app_name=app)
        described = await handle.describe.remote()
        held.append({"app": app, **described["stats"], "held": len(described["held"])})
        # Its router would push metrics to the controller for as long as this process lives,
        # and log a failure each time once the stack is down.
        await handle.shutdown_async()
    return held


async def measure(
    settings: Settings, stack_id: str, worker_pid: int, args: argparse.Namespace
) -> dict[str, Any]:
    result: dict[str, Any] = {"pooled_models": args.pooled, "dedicated_models": args.dedicated}
    client = await Client.connect(settings)
    dedicated = [f"dense-{i}" for i in range(args.dedicated)]
    pooled = [f"pool-{i:03d}" for i in range(args.pooled)]
    base, processes = pss_mb(stack_id)
    print(f"no model: {base:.0f} MB PSS over {processes} processes", flush=True)
    result["worker_cpu_no_model_percent"] = await worker_cpu(worker_pid, args.idle_s)
    print(f"worker CPU, no model: {result['worker_cpu_no_model_percent']}%", flush=True)
    async with httpx.AsyncClient(
        base_url=settings.serve_url, timeout=120, headers=key_header(settings)
    ) as http:
        # The pooled models first, in two halves, the PSS read after each: the second half's
        # slope is what one more model costs, apart from the pools' fixed processes (which the
        # first half brought). Then the dedicated ones: published after, so the 2-core machine
        # is not publishing 200 models beside their replicas (8 dedicated models starting took
        # it to where the Temporal dev server's SQLite missed its deadlines).
        half = pooled[: len(pooled) // 2]
        took = await publish_all(client, settings, half, "pooled", args.width, args.peak_qps)
        firsts = await first_requests(http, half)
        await asyncio.sleep(5)
        with_half, _ = pss_mb(stack_id)
        print(f"+{len(half)} pooled: {with_half:.0f} MB PSS", flush=True)
        took += await publish_all(client, settings, pooled[len(half) :], "pooled", args.width, args.peak_qps)
        result["publish_pooled_s"] = round(took, 1)
        result["writer_commits_pooled"] = await asyncio.to_thread(writer_commits, settings)
        print(f"the writer, after {args.pooled} pooled: {result['writer_commits_pooled']}", flush=True)
        rest = await first_requests(http, pooled[len(half) :])
        firsts = {k: firsts[k] + rest[k] for k in firsts}
        holds = await pool_holds(settings)
        await asyncio.sleep(5)
        with_pooled, processes = pss_mb(stack_id)
        print(f"+{args.pooled} pooled: {with_pooled:.0f} MB PSS over {processes} processes", flush=True)
        controller = controller_pid(stack_id)
        idle_from = cpu_seconds(worker_pid)
        controller_from = cpu_seconds(controller) if controller else 0.0
        await asyncio.sleep(args.idle_s)
        result["worker_cpu_idle_percent"] = round(
            100 * (cpu_seconds(worker_pid) - idle_from) / args.idle_s, 1
        )
        if controller:
            result["controller_cpu_idle_percent"] = round(
                100 * (cpu_seconds(controller) - controller_from) / args.idle_s, 1
            )
        print(
            f"worker CPU, {args.pooled} pooled models idle: {result['worker_cpu_idle_percent']}%; "
            f"Serve's controller: {result.get('controller_cpu_idle_percent')}%",
            flush=True,
        )
        result["publish_dedicated_s"] = round(
            await publish_all(client, settings, dedicated, "dedicated", 4, args.peak_qps), 1
        )
        result["writer_commits"] = await asyncio.to_thread(writer_commits, settings)
        await first_requests(http, dedicated)
        await asyncio.sleep(5)
        with_both, _ = pss_mb(stack_id)
        print(f"+{args.dedicated} dedicated: {with_both:.0f} MB PSS", flush=True)
        # The same window again with the dedicated models beside: what they add to the worker.
        result["worker_cpu_idle_with_dedicated_percent"] = await worker_cpu(worker_pid, args.idle_s)
        result["worker_cpu_per_dedicated_model_percent"] = round(
            (result["worker_cpu_idle_with_dedicated_percent"] - result["worker_cpu_idle_percent"])
            / max(1, args.dedicated),
            2,
        )
        result["worker_cpu_per_pooled_model_percent"] = round(
            (result["worker_cpu_idle_percent"] - result["worker_cpu_no_model_percent"]) / max(1, args.pooled),
            3,
        )
        print(
            f"worker CPU, {args.pooled} pooled and {args.dedicated} dedicated idle: "
            f"{result['worker_cpu_idle_with_dedicated_percent']}% (a pooled model "
            f"{result['worker_cpu_per_pooled_model_percent']}%, a dedicated one "
            f"{result['worker_cpu_per_dedicated_model_percent']}%)",
            flush=True,
        )
        result["memory"] = {
            "pss_no_model_mb": round(base, 1),
            "pss_with_half_pooled_mb": round(with_half, 1),
            "pss_with_pooled_mb": round(with_pooled, 1),
            "pss_with_dedicated_too_mb": round(with_both, 1),
            "per_pooled_model_mb": round((with_pooled - base) / max(1, args.pooled), 2),
            "per_pooled_model_slope_mb": round(
                (with_pooled - with_half) / max(1, len(pooled) - len(half)), 2
            ),
            "per_dedicated_model_mb": round((with_both - with_pooled) / max(1, args.dedicated), 1),
            "pools": holds,
            "evictions": sum(h["evictions"] for h in holds),
        }
        result["cold_load"] = {
            "first_p50_ms": round(quantile(firsts["cold_ms"], 0.5), 1),
            "first_p99_ms": round(quantile(firsts["cold_ms"], 0.99), 1),
            "second_p50_ms": round(quantile(firsts["warm_ms"], 0.5), 1),
            "second_p99_ms": round(quantile(firsts["warm_ms"], 0.99), 1),
        }
        # The stack settles first (Serve's controller and the dedicated models' replicas were
        # busy starting); then the median of three closed-loop runs: one run right after the
        # publishes measured anywhere from 5.8 to 48.9 requests/s on this machine.
        await asyncio.sleep(args.settle_s)
        controller_from = cpu_seconds(controller) if controller else 0.0
        runs = [await saturation(http, pooled, args.callers, args.saturation_s / 3) for _ in range(3)]
        sat = statistics.median(runs)
        result["saturation_runs_rps"] = [round(r, 1) for r in runs]
        if controller:
            result["controller_cpu_saturation_percent"] = round(
                100 * (cpu_seconds(controller) - controller_from) / args.saturation_s, 1
            )
        rate = args.load * sat
        result["saturation_rps"], result["rate_rps"] = round(sat, 1), round(rate, 1)
        print(
            f"saturation {sat:.1f} requests/s (Serve's controller at "
            f"{result.get('controller_cpu_saturation_percent')}% meanwhile); load {rate:.1f}/s",
            flush=True,
        )
        rng = random.Random(args.seed)
        order = pooled[:]
        rng.shuffle(order)  # which models are hot: drawn, printed
        weights = zipf_weights(len(order), args.zipf)
        hot = min(HOT, len(dedicated))
        hot_dedicated = [*dedicated[:hot], *order[hot:]]
        result["hot_models"] = order[:hot]
        phases: list[dict[str, Any]] = []
        for k in range(args.phases):
            mode = "pooled" if k % 2 == 0 else "dedicated"
            targets = order if mode == "pooled" else hot_dedicated
            cpu_from = cpu_seconds(worker_pid)
            sent = await open_phase(http, targets, weights, rate, args.phase_s, rng)
            summary = {"mode": mode, **summarize(sent, hot)}
            summary["worker_cpu_percent"] = round(
                100 * (cpu_seconds(worker_pid) - cpu_from) / args.phase_s, 1
            )
            phases.append(summary)
            print(f"phase {k + 1} {json.dumps(summary)}", flush=True)
        result["phases"] = phases
    by_mode = {m: [p for p in phases if p["mode"] == m] for m in ("pooled", "dedicated")}
    hot = {m: statistics.median(p["hot_p99_ms"] for p in ps) for m, ps in by_mode.items() if ps}
    if len(hot) == 2:
        result["hot_p99_pooled_over_dedicated"] = round(hot["pooled"] / hot["dedicated"], 3)
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    data = yaml.safe_load(config.read_text())
    data["serve"]["reconcile_seconds"] = args.reconcile_s
    data["serve"].setdefault("pools", {})["model_check_seconds"] = args.model_check_s
    config.write_text(yaml.safe_dump(data))
    # One region with room for every dedicated model's replicas: the bench is about memory per
    # model, not placement (the dev fleet's 8 high-memory units hold 4 click rankers).
    (config.parent / "fleet.yaml").write_text(yaml.safe_dump(FLEET))
    dev = DevStack(config_path=config, log=lambda line: None)
    record = dev.up()
    try:
        worker_pid = int(record["processes"]["worker"]["pid"])
        return asyncio.run(measure(load_settings(config), record["stack_id"], worker_pid, args))
    finally:
        if ray.is_initialized():
            from ray.serve.context import _set_global_client

            ray.shutdown()
            _set_global_client(None)
        dev.down()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pooled", type=int, default=200, help="models served from the shared pools")
    parser.add_argument("--dedicated", type=int, default=HOT, help="models with replicas of their own")
    parser.add_argument("--width", type=int, default=8, help="pooled models published at once")
    parser.add_argument(
        "--peak-qps",
        type=float,
        default=1.0,
        help="each model's declared peak (traffic.peak_qps): what sizes the pools and replicas",
    )
    parser.add_argument("--callers", type=int, default=32, help="closed-loop callers measuring saturation")
    parser.add_argument("--saturation-s", type=float, default=30.0, help="three closed-loop runs in all")
    parser.add_argument("--settle-s", type=float, default=60.0, help="idle before the saturation runs")
    parser.add_argument("--load", type=float, default=0.7, help="share of the saturation the load runs at")
    parser.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent over the pooled models")
    parser.add_argument("--phases", type=int, default=4, help="alternating pooled / dedicated phases")
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument(
        "--idle-s",
        type=float,
        default=120.0,
        help="the worker's CPU measured idle this long (no model, pooled, pooled and dedicated); "
        "at least --model-check-s, so each pooled model's own check falls in it once",
    )
    parser.add_argument(
        "--model-check-s", type=float, default=120.0, help="serve.pools.model_check_seconds (600 by default)"
    )
    parser.add_argument("--reconcile-s", type=float, default=30.0, help="serve.reconcile_seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "density.json")
    args = parser.parse_args()
    print(f"seed {args.seed}", flush=True)
    result = run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
