"""Rollout control timings on a dev stack of its own (Temporal dev server, local Ray + Serve, the
worker), with the signal round trip measured in the same run as the baseline.

    .venv/bin/python bench/rollout.py [--repeats 5]

1. Pause: a good set rolls out under a closed-loop load and sits in its first bake; on-call's
   `pause` signal is sent and the rollout's `status` polled until it reads `paused` (from then
   on the workflow changes no weight: the split is frozen; the router's generation is checked
   to stay put). Baseline: the same signal call plus one `status` query (a `resume` of a
   rollout that is not paused, which changes nothing).
2. Breach: a bad set (every even user's embedding is NaN: those requests fail) rolls out with
   the default check interval (2 s); from the first failed answer the load sees to the router
   serving the old set alone again (its config polled every 50 ms).

Prints one line per measurement and writes bench/results/rollout.json.
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

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.contracts.rollout import PauseInput, ResumeInput, RolloutStatus
from ipnext.examples.click_ranker.train import poisoned_copy, train
from ipnext.names import RolloutState, rollout_workflow_id
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-ranker"


class Load:
    """Closed-loop callers on the us-east router; records (time, status, set) per answer."""

    def __init__(self, settings: Settings, workers: int = 3) -> None:
        self.url = f"{settings.serve_url}/us-east/models/{MODEL}/predict"
        self.headers = key_header(settings)
        self.answers: list[tuple[float, int, str | None]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._call(i)) for i in range(workers)]

    async def _call(self, user: int) -> None:
        async with httpx.AsyncClient(timeout=30, headers=self.headers) as http:
            while not self._stop.is_set():
                reply = await http.post(self.url, json={"inputs": {"user": user, "items": [1, 2, 3]}})
                self.answers.append((time.perf_counter(), reply.status_code, reply.json().get("set")))
                user = (user + 1) % 200

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def spec() -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=MODEL, traffic={"peak_qps": {"us-east": 50}})
    # Long bakes (the pauses happen inside the first one) and the default check interval.
    data["rollout"].update(steps=[10, 50, 100], bake_seconds=600, check_interval_seconds=2)
    return ModelSpec.model_validate(data)


async def until_status(ipn: Client, check: Any, timeout: float = 180) -> RolloutStatus:
    deadline = time.monotonic() + timeout
    while True:
        status = await ipn.rollout_status(MODEL)
        if status is not None and check(status):
            return status
        if time.monotonic() > deadline:
            raise RuntimeError(f"condition never held: {status}")
        await asyncio.sleep(0.05)


async def until_state(ipn: Client, set_id: str, state: RolloutState) -> RolloutStatus:
    return await until_status(ipn, lambda s: s.set_id == set_id and s.state == state)


async def router_config(http: httpx.AsyncClient) -> dict[str, Any]:
    reply: dict[str, Any] = (await http.get(f"/us-east/models/{MODEL}")).json()
    return reply


async def measure(settings: Settings, repeats: int) -> dict[str, Any]:
    root = settings.snapshot_roots[0]
    out: dict[str, Any] = {}
    async with (
        await Client.connect(settings) as ipn,
        httpx.AsyncClient(base_url=settings.serve_url, headers=key_header(settings)) as http,
    ):
        await ipn.publish_model(spec())
        v1 = train(root, MODEL, "v1", seed=1, steps=60).folder
        await ipn.wait_until_serving(MODEL, (await ipn.publish_snapshot(MODEL, v1, who="bench")).set_id)
        load = Load(settings)
        try:
            # 1. pause
            v2 = train(root, MODEL, "v2", seed=2, steps=60).folder
            published = await ipn.publish_snapshot(MODEL, v2, who="bench")
            await until_status(ipn, lambda s: s.set_id == published.set_id and "baking" in s.step)
            handle = ipn.temporal.get_workflow_handle(rollout_workflow_id(MODEL, published.set_id))
            pause_s, baseline_s, frozen = [], [], []
            for i in range(repeats):
                started = time.perf_counter()
                await handle.signal("resume", ResumeInput(who="bench"))  # not paused: a no-op
                await handle.query("status", result_type=RolloutStatus)
                baseline_s.append(time.perf_counter() - started)
                generation = (await router_config(http))["generation"]
                started = time.perf_counter()
                await handle.signal("pause", PauseInput(reason=f"bench {i}", who="bench"))
                while (await handle.query("status", result_type=RolloutStatus)).state != RolloutState.PAUSED:
                    await asyncio.sleep(0.005)
                pause_s.append(time.perf_counter() - started)
                await asyncio.sleep(3.0)
                frozen.append((await router_config(http))["generation"] == generation)
                await handle.signal("resume", ResumeInput(who="bench"))
                await until_status(ipn, lambda s: s.state == RolloutState.RUNNING)
                print(
                    f"pause {i}: {pause_s[-1] * 1000:.1f} ms (signal + query {baseline_s[-1] * 1000:.1f} ms)"
                )
            await ipn.abort_rollout(MODEL, "bench: pause measured", who="bench")
            await until_status(
                ipn, lambda s: s.set_id == published.set_id and s.state == RolloutState.ABORTED
            )
            out["pause_to_frozen_ms"] = [round(x * 1000, 1) for x in pause_s]
            out["signal_round_trip_ms"] = [round(x * 1000, 1) for x in baseline_s]
            out["split_stayed_frozen"] = frozen
            # 2. breach
            old_app = f"{MODEL}.us-east.s1.r1"
            breach_s = []
            for i in range(max(1, repeats // 2)):
                bad = poisoned_copy(root, MODEL, f"bad-{i}", v1)
                since = len(load.answers)
                published = await ipn.publish_snapshot(MODEL, bad, who="bench")
                seen_new = False
                while True:
                    weights = (await router_config(http))["weights"]
                    seen_new = seen_new or len(weights) > 1
                    if seen_new and weights == {old_app: 100.0}:
                        back_at = time.perf_counter()
                        break
                    await asyncio.sleep(0.05)
                first_bad = min(t for t, code, _ in load.answers[since:] if code != 200)
                breach_s.append(back_at - first_bad)
                await until_state(ipn, published.set_id, RolloutState.ROLLED_BACK)
                print(f"breach {i}: first failed answer -> old set alone again {breach_s[-1]:.2f} s")
            out["first_failure_to_traffic_back_s"] = [round(x, 2) for x in breach_s]
        finally:
            await load.stop()
        out["requests"] = len(load.answers)
        await ipn.delete_model(MODEL, who="bench")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "rollout.json")
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    dev = DevStack(config_path=config)
    dev.up()
    try:
        result = asyncio.run(measure(load_settings(config), args.repeats))
    finally:
        dev.down()
    pause = statistics.median(result["pause_to_frozen_ms"])
    base = statistics.median(result["signal_round_trip_ms"])
    result["summary"] = {
        "pause_to_frozen_median_ms": pause,
        "signal_round_trip_median_ms": base,
        "pause_over_round_trip": round(pause / base, 2),
        "breach_to_traffic_back_median_s": statistics.median(result["first_failure_to_traffic_back_s"]),
    }
    print(json.dumps(result["summary"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
