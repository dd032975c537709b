"""Overload shed by time against the count-only bounds, on a dev stack of its own, in one run.

    .venv/bin/python bench/overload.py [--seconds 30] [--clients 50] [--queue-wait-ms 100]

Two copies of the click ranker serve side by side, the same but for `router.max_queue_wait_ms`,
each with its dense part taking `--part-delay-ms` per call (awaited, as an accelerator's time is:
5 calls at once per replica, so one replica serves about 25 requests/s at 200 ms). That makes the
model the bottleneck, as a served model is. With the part's own time near zero on this 2-core
box, the machine is: 50 clients, Serve's proxy, the router and the parts share two cores, every
process waits in the kernel's run queue, and no rule at the router can see or shorten that
queue (measured: admitted p99 3.3 s against 3.8 s without shedding, goodput unchanged).
`bench-count` has none (the count-only bounds: 100 running and 100 queued per router, and only a
request that would miss its deadline is shed), `bench-time` has `--queue-wait-ms`. Phases, one
after another so each has the machine:

0. calibration: the model served once more as `bench-probe` with 20 closed-loop clients for 10 s:
   its throughput is the dense part's qps per replica, which both copies then declare (the
   owner's job; the router's plan-based bound holds only if the declaration does).
1. service: one closed-loop client on bench-count for 10 s: nothing waits, so its median latency
   is the model's service time.
2. count-only: `--clients` closed-loop clients on bench-count for `--seconds`.
3. by time: `--clients` closed-loop clients on bench-time for `--seconds`.

Every client honours Retry-After: a 503 that carries one waits that long (else 50 ms) before its
next request. Measured per phase: admitted requests per second (goodput), their p50/p99/max
latency, requests shed and how fast they were refused. The issue's marks, printed with their
figures: by time, admitted p99 within 2 x (queue wait + service time), and goodput at least 90%
of the count-only phase's (what the same model serves without shedding).

Prints one line per phase and writes bench/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from doors import summary  # bench/ is the script's directory: the same figures as the doors bench

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]
REFUSED_PAUSE_S = 0.05
SERVICE_PHASE_S = 10.0
CALIBRATION_CLIENTS = 20


def spec(name: str, queue_wait_ms: float | None, part_delay_ms: float, dense_qps: float) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    # One replica per part: the declared qps is the calibrated one, the traffic within it.
    data.update(name=name, traffic={"peak_qps": {"us-east": max(1.0, dense_qps / 2)}})
    data["parts"]["dense"]["config"]["delay_ms"] = part_delay_ms
    for option in data["parts"]["dense"]["hardware"].values():
        option["qps"] = dense_qps
    if queue_wait_ms is not None:
        data["router"] = {**data.get("router", {}), "max_queue_wait_ms": queue_wait_ms}
    return ModelSpec.model_validate(data)


async def closed_loop(
    url: str, clients: int, seconds: float, headers: dict[str, str]
) -> list[tuple[int, float]]:
    """(status, latency s) of every answer of `clients` closed-loop callers over `seconds`, each
    honouring Retry-After."""
    answers: list[tuple[int, float]] = []
    stop = time.perf_counter() + seconds

    async def call(user: int) -> None:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                retry_after = None
                try:
                    answer = await http.post(url, json={"inputs": {"user": user, "items": [1, 2, 3]}})
                    status, retry_after = answer.status_code, answer.headers.get("retry-after")
                except httpx.HTTPError:
                    status = 0
                answers.append((status, time.perf_counter() - sent))
                if status != 200:
                    pause = float(retry_after) if retry_after and retry_after.isdigit() else REFUSED_PAUSE_S
                    await asyncio.sleep(min(pause, max(0.0, stop - time.perf_counter())))
                user = (user + 1) % 200

    await asyncio.gather(*(call(i) for i in range(clients)))
    return answers


async def serving(client: Client, settings: Settings, model: ModelSpec) -> str:
    """Publish `model`, serve a trained snapshot, warm it; its predict URL."""
    await client.publish_model(model)
    report = train(settings.snapshot_roots[0], model.name, "v1", steps=60)
    published = await client.publish_snapshot(model.name, report.folder)
    await client.wait_until_serving(model.name, published.set_id)
    url = f"{settings.serve_url}/us-east/models/{model.name}/predict"
    await closed_loop(url, 2, 3.0, key_header(settings))  # warm up: replicas loaded, connections open
    return url


async def measure(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    headers = key_header(settings)
    result: dict[str, Any] = {}
    async with await Client.connect(settings) as client:
        # Calibration: what one replica of the slow part serves, measured as an owner would
        # before declaring its qps (a closed loop well above its concurrency, nothing shed).
        probe = await serving(client, settings, spec("bench-probe", None, args.part_delay_ms, 1000.0))
        answers = await closed_loop(probe, CALIBRATION_CLIENTS, SERVICE_PHASE_S, headers)
        result["calibration"] = {"clients": CALIBRATION_CLIENTS, **summary(answers, SERVICE_PHASE_S)}
        print(f"calibration: {json.dumps(result['calibration'])}", flush=True)
        await client.delete_model("bench-probe")
        qps = float(result["calibration"]["admitted_per_s"])
        urls = {
            name: await serving(client, settings, spec(name, wait, args.part_delay_ms, qps))
            for name, wait in (("bench-count", None), ("bench-time", args.queue_wait_ms))
        }
        phases = (
            ("service", "bench-count", 1, SERVICE_PHASE_S),
            ("count_only", "bench-count", args.clients, args.seconds),
            ("by_time", "bench-time", args.clients, args.seconds),
        )
        for phase, model, clients, seconds in phases:
            answers = await closed_loop(urls[model], clients, seconds, headers)
            result[phase] = {"model": model, "clients": clients, **summary(answers, seconds)}
            print(f"{phase}: {json.dumps(result[phase])}", flush=True)
        for name in urls:
            await client.delete_model(name)
    service_ms = result["service"]["admitted_p50_ms"]
    bound_ms = 2 * (args.queue_wait_ms + service_ms)
    p99 = result["by_time"]["admitted_p99_ms"]
    goodput = result["by_time"]["admitted_per_s"] / result["count_only"]["admitted_per_s"]
    result["marks"] = {
        "declared_qps": qps,
        "service_ms": service_ms,
        "by_time_p99_ms": p99,
        "p99_bound_ms": bound_ms,
        "p99_within_bound": p99 <= bound_ms,
        "goodput_by_time_over_count_only": round(goodput, 3),
        "goodput_at_least_90_percent": goodput >= 0.9,
        "count_only_p99_ms": result["count_only"]["admitted_p99_ms"],
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each overload phase")
    parser.add_argument("--clients", type=int, default=50, help="closed-loop clients in the overload phases")
    parser.add_argument(
        "--queue-wait-ms", type=float, default=100.0, help="bench-time's router.max_queue_wait_ms"
    )
    parser.add_argument(
        "--part-delay-ms",
        type=float,
        default=200.0,
        help="the dense part's time per call, awaited as an accelerator's time is (the model, "
        "not the host, is the bottleneck)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "overload.json")
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config, log=lambda line: None)
    dev.up()
    try:
        result = asyncio.run(measure(load_settings(config), args))
    finally:
        dev.down()
    result["settings"] = vars(args) | {"out": str(args.out.relative_to(REPO))}
    print(json.dumps(result["marks"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
