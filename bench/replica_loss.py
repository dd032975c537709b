"""A part's replica killed under load, with and without a spare, on a dev stack of its own, in one run.

    .venv/bin/python bench/replica_loss.py [--seconds 20] [--clients 20]

Two copies of the click ranker serve side by side in us-east, the same but for
`availability.spare_replicas`: `bench-alone` has 0 (the plan gives each part one replica at this
demand, so its replacement is the only way back), `bench-spare` has 1 (the planner counts a second
replica of each part). For each in turn, `--clients` closed-loop clients run for `--seconds`;
after a quarter of it one replica of the dense part is killed (as a crashed process dies).
Measured: the longest time with no answer from the kill on, and the requests that failed (those
in flight at the kill and those sent after it); then that Serve runs the plan's replicas again.

Prints one line per copy and writes bench/results/replica_loss.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import httpx
import ray

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.names import poll_until
from ipnext.serving.control import connect_for
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]


def spec(name: str, spare: int) -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=name, traffic={"peak_qps": {"us-east": 50}})
    data["availability"] = {**data.get("availability", {}), "spare_replicas": spare}
    return ModelSpec.model_validate(data)


def dense_replicas(model: str) -> list[str]:
    """The Serve actors of the dense part of the model's set app."""
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{model}.us-east.") and "#dense-" in a["name"]
    )


async def under_load(
    url: str, headers: dict[str, str], clients: int, seconds: float, model: str
) -> dict[str, Any]:
    answers: list[tuple[float, float, int]] = []  # (sent, answered, status), seconds since start
    started = time.perf_counter()
    stop = started + seconds

    async def call(user: int) -> None:
        async with httpx.AsyncClient(timeout=30, headers=headers) as http:
            while time.perf_counter() < stop:
                sent = time.perf_counter() - started
                try:
                    status = (
                        await http.post(url, json={"inputs": {"user": user, "items": [1, 2, 3]}})
                    ).status_code
                except httpx.HTTPError:
                    status = 0
                answers.append((sent, time.perf_counter() - started, status))
                if status != 200:
                    await asyncio.sleep(0.05)
                user = (user + 1) % 200

    async def kill() -> tuple[float, str, int]:
        await asyncio.sleep(seconds / 4)
        replicas = dense_replicas(model)
        at = time.perf_counter() - started
        ray.kill(ray.get_actor(replicas[0], namespace="serve"), no_restart=True)
        return at, replicas[0], len(replicas)

    *_, (killed_at, killed, planned) = await asyncio.gather(*(call(i) for i in range(clients)), kill())
    answered = sorted(done for _, done, status in answers if status == 200 and done >= killed_at - 1)
    gap = max((b - a for a, b in itertools.pairwise(answered)), default=math.inf)
    in_flight = [a for a in answers if a[0] < killed_at < a[1]]
    after = [a for a in answers if a[0] >= killed_at and a[2] != 200]
    back = await poll_until(
        lambda: asyncio.to_thread(dense_replicas, model),
        lambda names: len(names) >= planned and killed not in names,
        timeout_s=120,
        interval_s=0.2,
        what="the plan's replicas again",
    )
    return {
        "dense_replicas": planned,
        "longest_gap_s": round(gap, 2),
        "in_flight_at_kill": len(in_flight),
        "in_flight_failed": sum(1 for a in in_flight if a[2] != 200),
        "sent_after_kill_failed": len(after),
        "replicas_after": len(back),
        "answered": sum(1 for a in answers if a[2] == 200),
    }


async def measure(settings: Settings, args: argparse.Namespace) -> dict[str, Any]:
    headers = key_header(settings)
    result: dict[str, Any] = {}
    connect_for(settings)
    async with await Client.connect(settings) as client:
        for name, spare in (("bench-alone", 0), ("bench-spare", 1)):
            await client.publish_model(spec(name, spare))
            report = train(settings.snapshot_roots[0], name, "v1", steps=60)
            published = await client.publish_snapshot(name, report.folder)
            await client.wait_until_serving(name, published.set_id)
            url = f"{settings.serve_url}/us-east/models/{name}/predict"
            result[name] = {
                "spare_replicas": spare,
                **await under_load(url, headers, args.clients, args.seconds, name),
            }
            print(f"{name}: {json.dumps(result[name])}", flush=True)
            await client.delete_model(name)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each load")
    parser.add_argument("--clients", type=int, default=20, help="closed-loop clients")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "replica_loss.json")
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config, log=lambda line: None)
    dev.up()
    try:
        result = asyncio.run(measure(load_settings(config), args))
    except BaseException:
        traceback.print_exc()  # before Ray's own exit handlers, which may outlive the stack
        sys.stderr.flush()
        raise
    finally:
        dev.down()
    result["settings"] = vars(args) | {"out": str(args.out.relative_to(REPO))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
