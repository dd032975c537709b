"""Recovery times on a dev stack of its own, beside the time the stack itself takes to start,
measured in the same run.

    .venv/bin/python bench/recovery.py [--repeats 3] [--reconcile-seconds 30]

Baseline: `ipnext dev up` from nothing to ready (Temporal dev server, Ray head with Serve, the
worker), each time the bench starts the stack.

1. Full restart: a model serves under a closed-loop load; `dev down`, then `dev up` on the same
   state. Measured: from the start of `dev up` to the model's first answer again (its serving
   check pushes the record to Serve, with no command; Serve itself starts on the first use of
   the new cluster), against `dev up`'s own time, and from `dev down` to that answer.
   The worker asks every model to check when it starts, so this does not wait for
   `serve.reconcile_seconds`.
2. Replica killed: every part replica of the serving set app is killed (as a crashed process
   dies) under load. Measured: from the kill to the plan's replicas alive again (none of them
   a killed one) and Serve reporting them all running, and the requests that failed meanwhile.

3. Ray lost mid-rollout: a new snapshot rolls out under load; in its first bake the Ray
   cluster is killed (head, GCS, Serve, every replica) and started again after
   `--outage-seconds` (60 by default), at a new address. Measured: from Ray started again to
   the rollout resumed (its own serving check pushed both sets and the split back; the bake
   starts again), to the first answer, and to the rollout completed; the generations it
   applied (one per step, none twice).

Prints one line per measurement and writes bench/results/recovery.json.
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
import ray
import yaml
from ray import serve

from ipnext.client.devstack.stack import DevStack, scratch_config
from ipnext.client.sdk import Client
from ipnext.examples.click_ranker.train import train
from ipnext.serving.control import connect_for
from ipnext.serving.layout import SET_DEPLOYMENT
from ipnext.spec.model import ModelSpec, load_model_spec
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import key_header

REPO = Path(__file__).resolve().parents[1]
MODEL = "bench-recovery"


class Load:
    """Closed-loop callers on the us-east router; records (time, status) per answer."""

    def __init__(self, settings: Settings, workers: int = 3) -> None:
        self.url = f"{settings.serve_url}/us-east/models/{MODEL}/predict"
        self.headers = key_header(settings)
        self.answers: list[tuple[float, int]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._call(i)) for i in range(workers)]

    async def _call(self, user: int) -> None:
        async with httpx.AsyncClient(timeout=30, headers=self.headers) as http:
            while not self._stop.is_set():
                try:
                    reply = await http.post(self.url, json={"inputs": {"user": user, "items": [1, 2, 3]}})
                    self.answers.append((time.perf_counter(), reply.status_code))
                except httpx.HTTPError:
                    self.answers.append((time.perf_counter(), 0))
                    await asyncio.sleep(0.05)  # nothing listens: do not spin
                user = (user + 1) % 200

    def first_ok_after(self, t: float) -> float | None:
        return min((at for at, code in self.answers if at >= t and code == 200), default=None)

    def failed_between(self, t0: float, t1: float) -> int:
        return sum(1 for at, code in self.answers if t0 <= at <= t1 and code != 200)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def spec() -> ModelSpec:
    data = load_model_spec(REPO / "examples" / "click_ranker" / "model.yaml").model_dump(mode="json")
    data.update(name=MODEL, traffic={"peak_qps": {"us-east": 50}})
    return ModelSpec.model_validate(data)


def part_replicas(app: str) -> tuple[int, int]:
    """(running, target) part replicas of a set app, from Serve's status."""
    status = serve.status().applications.get(app)
    if status is None:
        return 0, 0
    running = target = 0
    for name, deployment in status.deployments.items():
        if name == SET_DEPLOYMENT:
            continue
        running += sum(n for s, n in deployment.replica_states.items() if str(s).endswith("RUNNING"))
        target += sum(deployment.replica_states.values())
    return running, target


def replica_names(app: str) -> set[str]:
    """The live part replica actors of a set app (not its `set` ingress)."""
    return {
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#") and f"#{SET_DEPLOYMENT}#" not in a["name"]
    }


def full(app: str, target: int, killed: set[str]) -> bool:
    """`target` part replicas alive, none of them one of `killed`, and Serve says all run."""
    alive = replica_names(app)
    running, _ = part_replicas(app)
    return len(alive) == target and not alive & killed and running == target


async def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        await asyncio.sleep(0.05)


async def measure(
    config: Path, dev: DevStack, repeats: int, up_s: list[float], outage_s: float
) -> dict[str, Any]:
    settings = load_settings(config)
    out: dict[str, Any] = {"restart": [], "replica_kill": [], "ray_lost_mid_rollout": []}
    async with await Client.connect(settings) as ipn:
        await ipn.publish_model(spec())
        v1 = train(settings.snapshot_roots[0], MODEL, "v1", seed=1, steps=60).folder
        first = await ipn.publish_snapshot(MODEL, v1, who="bench")
        state = await ipn.wait_until_serving(MODEL, first.set_id)
        app = state.serving_apps["us-east"]
        load = Load(settings)
        try:
            await wait_for(lambda: load.first_ok_after(0) is not None, 60, "first answer")
            # 1. full restart
            for i in range(repeats):
                if ray.is_initialized():
                    ray.shutdown()
                down_at = time.perf_counter()
                await asyncio.to_thread(dev.down)  # the load goes on meanwhile
                started = time.perf_counter()
                await asyncio.to_thread(dev.up)
                up_s.append(time.perf_counter() - started)
                # Every call fails from dev down on: the first answer after dev up started is
                # the model serving again (it may come before dev up returns).
                await wait_for(
                    lambda t=started: load.first_ok_after(t) is not None, 600, "answer after restart"
                )
                back = load.first_ok_after(started) or started
                out["restart"].append(
                    {
                        "stack_up_s": up_s[-1],
                        "up_start_to_answer_s": back - started,
                        "down_to_answer_s": back - down_at,
                    }
                )
                print(
                    f"restart {i}: dev up took {up_s[-1]:.1f} s; the model answered {back - started:.1f} s "
                    f"after dev up started ({back - down_at:.1f} s after dev down started)"
                )
            # 2. replica killed
            connect_for(settings)
            plan = state.plan.deployments.values() if state.plan else []
            target = sum(n for placement in plan for n in placement.replicas.get("us-east", {}).values())
            for i in range(repeats):
                await wait_for(lambda: full(app, target, set()), 120, "full replicas")
                killed = replica_names(app)
                killed_at = time.perf_counter()
                for name in killed:
                    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
                await wait_for(lambda k=killed: full(app, target, k), 300, "replicas back")
                full_at = time.perf_counter()
                failed = load.failed_between(killed_at, full_at)
                out["replica_kill"].append(
                    {"to_full_s": full_at - killed_at, "failed": failed, "killed": len(killed)}
                )
                print(
                    f"replica kill {i}: {len(killed)} killed, {target} running again after "
                    f"{full_at - killed_at:.1f} s, {failed} requests failed meanwhile"
                )
            # 3. Ray lost mid-rollout
            for i in range(repeats):
                out["ray_lost_mid_rollout"].append(
                    await ray_lost_mid_rollout(ipn, settings, dev, load, i, outage_s)
                )
        finally:
            await load.stop()
        out["requests"] = len(load.answers)
        await ipn.delete_model(MODEL, who="bench")
    return out


async def ray_lost_mid_rollout(
    ipn: Client, settings: Settings, dev: DevStack, load: Load, i: int, outage_s: float
) -> dict[str, Any]:
    version = f"v{i + 2}"
    folder = train(settings.snapshot_roots[0], MODEL, version, seed=i + 2, steps=60).folder
    before = await ipn.get_model(MODEL)
    applied = max(before.rollout.generations) if before.rollout else 0
    published = await ipn.publish_snapshot(MODEL, folder, who="bench")
    while True:
        live = await ipn.rollout_status(MODEL)
        if live is not None and live.set_id == published.set_id and "baking" in live.step:
            break
        await asyncio.sleep(0.1)
    step = live.step
    if ray.is_initialized():
        ray.shutdown()
    await asyncio.to_thread(dev.crash, "ray")
    await asyncio.sleep(outage_s)
    back = time.perf_counter()
    await asyncio.to_thread(dev.start, "ray")
    ray_up_s = time.perf_counter() - back
    resumed = done = None
    while done is None:
        rollout = await ipn.rollout_status(MODEL)  # live from the rollout while it runs
        if resumed is None and rollout and rollout.set_id == published.set_id and rollout.repairs:
            resumed = time.perf_counter()
        state = await ipn.get_model(MODEL)
        if state.serving_set == published.set_id and state.state == "serving":
            done = time.perf_counter()
        elif time.perf_counter() - back > 900:
            raise RuntimeError(f"{published.set_id} not serving 900 s after Ray was back: {rollout}")
        await asyncio.sleep(0.2)
    answer = load.first_ok_after(back) or done
    generations = state.rollout.generations if state.rollout else []
    row = {
        "outage_s": outage_s,
        "lost_in": step,
        "ray_start_s": ray_up_s,
        "ray_back_to_resumed_s": (resumed or done) - back,
        "ray_back_to_answer_s": answer - back,
        "ray_back_to_completed_s": done - back,
        "generations": generations,
        "each_step_once": generations == list(range(applied + 1, applied + 1 + len(generations))),
        "state": str(state.rollout.state.value) if state.rollout else "",
    }
    print(
        f"ray lost {i}: {outage_s:.0f} s in {step}; Ray started again in {ray_up_s:.1f} s; the rollout "
        f"resumed {row['ray_back_to_resumed_s']:.1f} s after, answered {row['ray_back_to_answer_s']:.1f} s, "
        f"ended {row['state']} {row['ray_back_to_completed_s']:.1f} s after; generations {generations}"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reconcile-seconds", type=float, default=30.0)
    parser.add_argument("--outage-seconds", type=float, default=60.0, help="how long Ray stays lost")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recovery.json")
    args = parser.parse_args()
    config = scratch_config(Path(tempfile.mkdtemp(prefix="ipn-bench-", dir="/tmp")), REPO / "config")
    data = yaml.safe_load(config.read_text())
    data["serve"]["reconcile_seconds"] = args.reconcile_seconds
    config.write_text(yaml.safe_dump(data))
    dev = DevStack(config_path=config, log=lambda line: None)
    started = time.perf_counter()
    dev.up()
    up_s = [time.perf_counter() - started]
    print(f"stack up from nothing: {up_s[0]:.1f} s")
    try:
        result = asyncio.run(measure(config, dev, args.repeats, up_s, args.outage_seconds))
    finally:
        dev.down()
    restart = statistics.median(r["up_start_to_answer_s"] for r in result["restart"])
    up = statistics.median(up_s)
    result["summary"] = {
        "reconcile_seconds": args.reconcile_seconds,
        "stack_up_median_s": round(up, 2),
        "restart_up_start_to_answer_median_s": round(restart, 2),
        "restart_down_to_answer_median_s": round(
            statistics.median(r["down_to_answer_s"] for r in result["restart"]), 2
        ),
        "answer_after_restart_over_stack_up": round(restart / up, 2),
        "replica_kill_to_full_median_s": round(
            statistics.median(r["to_full_s"] for r in result["replica_kill"]), 2
        ),
        "replica_kill_failed_requests": [r["failed"] for r in result["replica_kill"]],
        "ray_outage_s": args.outage_seconds,
        "ray_back_to_rollout_resumed_median_s": round(
            statistics.median(r["ray_back_to_resumed_s"] for r in result["ray_lost_mid_rollout"]), 2
        ),
        "ray_back_to_rollout_completed_median_s": round(
            statistics.median(r["ray_back_to_completed_s"] for r in result["ray_lost_mid_rollout"]), 2
        ),
        "ray_back_to_resumed_over_stack_up": round(
            statistics.median(r["ray_back_to_resumed_s"] for r in result["ray_lost_mid_rollout"]) / up, 2
        ),
        "rollouts_each_step_once": [r["each_step_once"] for r in result["ray_lost_mid_rollout"]],
    }
    result["stack_up_s"] = [round(x, 2) for x in up_s]
    print(json.dumps(result["summary"], indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
