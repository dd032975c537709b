"""Shadow traffic's cost to callers, on a dev stack of its own: callers' latency with and without
a share of their requests copied to a candidate, measured in the same run.

    .venv/bin/python bench/shadow.py [--phase-seconds 30] [--rounds 3] [--percent 50] [--rate 15]

The model is the click ranker with its dense part sleeping `--delay-ms` per call (20): latency
that is not CPU, so the copies compete for the router and the proxy, not for the parts' cores.
Open-loop callers send `--rate` requests/s in all. Phases alternate: no shadow (the baseline),
then a shadow copying `--percent` of the requests to an equal candidate (v1's weights under
another version), `--rounds` times, so drift over the run (a warming cache, a busier box) falls
on both sides. Reported: callers' p50 and p99 per side over every phase, the ratio of the p50s
(issue 21's goal: within 5%), and the shadow's own figures (mirrored, dropped, compared).

Prints one line per phase and writes bench/results/shadow.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load_file

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header
from ipnext.store.snapshots import write_snapshot

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-shadow"
INPUTS = {"user": 3, "items": [5, 17, 42, 99, 123, 256, 300, 411]}


async def phase(settings: Settings, seconds: float, rate: float) -> list[float]:
    """Open-loop requests at `rate`/s for `seconds`: each answer's latency in ms (200s only)."""
    url = f"{settings.serve_url}/us-east/models/{MODEL}/predict"
    latencies: list[float] = []
    failed = 0

    async def one(http: httpx.AsyncClient) -> None:
        nonlocal failed
        started = time.perf_counter()
        try:
            reply = await http.post(url, json={"inputs": INPUTS})
        except httpx.HTTPError:
            failed += 1
            return
        if reply.status_code == 200:
            latencies.append((time.perf_counter() - started) * 1000)
        else:
            failed += 1

    async with httpx.AsyncClient(timeout=30, headers=key_header(settings)) as http:
        tasks, start, n = [], time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            tasks.append(asyncio.create_task(one(http)))
            n += 1
            await asyncio.sleep(max(0.0, start + n / rate - time.perf_counter()))
        await asyncio.gather(*tasks)
    if failed:
        raise RuntimeError(f"{failed} requests failed in a phase")
    return latencies


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    spec = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    spec.update(name=MODEL, traffic={"peak_qps": {"us-east": 50}})
    spec["parts"]["dense"]["config"]["delay_ms"] = args.delay_ms
    root = settings.snapshot_roots[0]
    async with await Client.connect(settings) as client:
        await client.publish_model(ModelSpec.model_validate(spec))
        v1 = train(root, MODEL, "v1", seed=1, steps=60).folder
        serving = (await client.publish_snapshot(MODEL, v1)).set_id
        await client.wait_until_serving(MODEL, serving, timeout_s=300)
        weights = {part: load_file(str(v1 / f"{part}.safetensors")) for part in ("embed", "dense")}
        write_snapshot(root / MODEL / "v1-copy", MODEL, "v1-copy", weights)
        candidate = await client.publish_snapshot(MODEL, root / MODEL / "v1-copy", hold=True)
        sides: dict[str, list[float]] = {"without": [], "with": []}
        shadows: list[dict[str, Any]] = []
        await phase(settings, 5, args.rate)  # warm-up, not counted
        for round_ in range(args.rounds):
            alone = await phase(settings, args.phase_seconds, args.rate)
            sides["without"] += alone
            print(f"round {round_ + 1}: without a shadow p50 {p(alone, 0.5):.1f} ms ({len(alone)} requests)")
            name = f"bench-{round_ + 1}"
            await client.start_shadow(
                MODEL, candidate.set_id, args.percent, shadow=name, duration_seconds=3600, check_seconds=5
            )
            # Copies flow once the routers have the route and the candidate described itself.
            while True:
                status = await client.experiment_status(MODEL)
                if status.shadow is not None and status.shadow.compared > 0:
                    break
                await phase(settings, 1, args.rate)
            copied = await phase(settings, args.phase_seconds, args.rate)
            sides["with"] += copied
            ended = await client.stop_experiment(MODEL, "measured", who="bench")
            if ended.shadow is not None:
                shadows.append(ended.shadow.model_dump(mode="json"))
            print(
                f"round {round_ + 1}: with {args.percent:g}% copied p50 {p(copied, 0.5):.1f} ms "
                f"({len(copied)} requests); shadow: {ended.shadow}"
            )
            while (await client.get_model(MODEL)).experiment is not None:
                await asyncio.sleep(1)
        await client.delete_model(MODEL, who="bench")
    result = {
        "percent": args.percent,
        "rate": args.rate,
        "phase_seconds": args.phase_seconds,
        "rounds": args.rounds,
        "delay_ms": args.delay_ms,
        "p50_ms": {side: statistics.median(v) for side, v in sides.items()},
        "p99_ms": {side: p(v, 0.99) for side, v in sides.items()},
        "requests": {side: len(v) for side, v in sides.items()},
        "shadows": shadows,
    }
    result["p50_ratio"] = result["p50_ms"]["with"] / result["p50_ms"]["without"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--percent", type=float, default=50.0)
    parser.add_argument("--rate", type=float, default=15.0, help="requests/s in all")
    parser.add_argument("--delay-ms", type=float, default=20.0)
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bsh-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config)
    dev.up()
    try:
        result = asyncio.run(run(load_settings(config), args))
    finally:
        dev.down()
    print(
        f"callers' p50 without a shadow {result['p50_ms']['without']:.1f} ms, with {args.percent:g}% "
        f"copied {result['p50_ms']['with']:.1f} ms: ratio {result['p50_ratio']:.3f} (goal: within 5%); "
        f"p99 {result['p99_ms']['without']:.1f} against {result['p99_ms']['with']:.1f} ms"
    )
    out = REPO / "bench" / "results" / "shadow.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
