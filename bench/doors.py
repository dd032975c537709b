"""Overload at the model's door, on a dev stack of its own: a closed loop well above what the
router admits, for the full length, against the same model at its capacity measured in the same
run.

    .venv/bin/python bench/doors.py [--seconds 60] [--clients 48] [--max-ongoing 8] [--max-queued 8]

Baseline: `--max-ongoing` closed-loop clients (what the router holds at once) for `--seconds`:
nothing waits in Serve's proxy, nothing is shed. Overload: `--clients` closed-loop clients for
`--seconds`; a client refused with 503 pauses 50 ms before its next request. Measured: admitted
requests' p50/p99/max latency (and the p99's ratio to the baseline's), requests shed with 503 and
how fast they were refused, any other answer, and the RSS of Serve's proxy and of the router
replica before and after each phase (from /proc).

Prints one line per phase and writes bench/results/doors.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.serving.layout import router_app_name
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-doors"
REFUSED_PAUSE_S = 0.05


def spec(max_ongoing: int, max_queued: int) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=MODEL, traffic={"peak_qps": {"us-east": 50}})
    data["router"] = {"max_ongoing_requests": max_ongoing, "max_queued_requests": max_queued}
    return ModelSpec.model_validate(data)


def serve_pids(router_app: str) -> dict[str, int]:
    """Serve's proxy and the model's router replica, by their process titles."""
    titles = {"proxy": "ray::ProxyActor", "router": f"ray::ServeReplica:{router_app}:router"}
    pids = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except OSError:
                continue
            pids.update({name: int(proc.name) for name, want in titles.items() if title.startswith(want)})
    return pids


def rss_mib(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                out[name] = round(int(line.split()[1]) / 1024, 1)
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else math.nan


async def closed_loop(
    url: str, clients: int, seconds: float, headers: dict[str, str]
) -> list[tuple[int, float]]:
    """(status, latency s) of every answer of `clients` closed-loop callers over `seconds`."""
    answers: list[tuple[int, float]] = []
    stop = time.perf_counter() + seconds

    async def call(user: int) -> None:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            while time.perf_counter() < stop:
                sent = time.perf_counter()
                try:
                    status = (
                        await http.post(url, json={"inputs": {"user": user, "items": [1, 2, 3]}})
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                answers.append((status, time.perf_counter() - sent))
                if status != 200:
                    await asyncio.sleep(REFUSED_PAUSE_S)
                user = (user + 1) % 200

    await asyncio.gather(*(call(i) for i in range(clients)))
    return answers


def summary(answers: list[tuple[int, float]], seconds: float) -> dict[str, Any]:
    admitted = [s for code, s in answers if code == 200]
    shed = [s for code, s in answers if code == 503]
    return {
        "admitted": len(admitted),
        "admitted_per_s": round(len(admitted) / seconds, 1),
        "admitted_p50_ms": round(statistics.median(admitted) * 1000, 1) if admitted else None,
        "admitted_p99_ms": round(quantile(admitted, 0.99) * 1000, 1),
        "admitted_max_ms": round(max(admitted, default=math.nan) * 1000, 1),
        "shed_503": len(shed),
        "shed_p99_ms": round(quantile(shed, 0.99) * 1000, 1) if shed else None,
        "other": sorted({code for code, _ in answers} - {200, 503}),
    }


async def measure(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    async with await Client.connect(settings) as client:
        await client.publish_model(spec(args.max_ongoing, args.max_queued))
        report = train(settings.snapshot_roots[0], MODEL, "v1", steps=60)
        published = await client.publish_snapshot(MODEL, report.folder)
        await client.wait_until_serving(MODEL, published.set_id)
        url = f"{settings.serve_url}/us-east/models/{MODEL}/predict"
        await closed_loop(url, 2, 3.0, key_header(settings))  # warm up: replicas loaded, connections open
        pids = serve_pids(router_app_name(MODEL, "us-east"))
        result: dict[str, Any] = {"pids_found": sorted(pids)}
        for phase, clients in (("baseline", args.max_ongoing), ("overload", args.clients)):
            before = rss_mib(pids)
            answers = await closed_loop(url, clients, args.seconds, key_header(settings))
            result[phase] = {
                "clients": clients,
                **summary(answers, args.seconds),
                "rss_mib_before": before,
                "rss_mib_after": rss_mib(pids),
            }
            print(f"{phase}: {json.dumps(result[phase])}", flush=True)
        await client.delete_model(MODEL)
    base, over = result["baseline"]["admitted_p99_ms"], result["overload"]["admitted_p99_ms"]
    result["overload_p99_over_baseline_p99"] = round(over / base, 2) if base else None
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each phase")
    parser.add_argument("--clients", type=int, default=48, help="closed-loop clients in the overload phase")
    parser.add_argument("--max-ongoing", type=int, default=8, help="router.max_ongoing_requests")
    parser.add_argument("--max-queued", type=int, default=8, help="router.max_queued_requests")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "doors.json")
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config, log=lambda line: None)
    dev.up()
    try:
        result = asyncio.run(measure(load_settings(config), args))
    finally:
        dev.down()
    result["settings"] = vars(args) | {"out": str(args.out.relative_to(REPO))}
    print(json.dumps({k: result[k] for k in ("overload_p99_over_baseline_p99",)}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
