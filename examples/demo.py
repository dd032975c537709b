"""The demo scenario: train v1, publish the model, serve it, predict; train v2, publish, and
watch its gradual rollout move traffic to v2 step by step under a small closed-loop load;
predict again; print where to watch it all in the Temporal UI."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from ipnext import Client, ModelNotFoundError, ModelState, Prediction, Settings, key_header, load_model_spec
from ipnext.examples.click_ranker.train import train

__all__ = ["DEMO_MODEL_YAML", "DemoReport", "run_scenario"]

DEMO_MODEL_YAML = Path(__file__).parent / "click_ranker" / "model.yaml"
REQUESTS = [{"user": 7, "items": [1, 2, 3, 4, 5]}, {"user": 42, "items": [10, 20, 30]}]


class DemoReport:
    def __init__(self) -> None:
        self.predictions: dict[str, list[Prediction]] = {}
        self.timings: dict[str, float] = {}
        self.rollout_requests: dict[int, int] = {}  # HTTP status -> count during v2's rollout


# Closed-loop callers during a rollout. The example's gates need 20 requests on the new set in a
# bake; at the first step's 10% that is 200 in all, and two callers on a loaded 2-core machine
# sent too few (the rollout paused for traffic: 8 requests on the new set in 12 s).
DEMO_CALLERS = 4


async def run_scenario(
    settings: Settings, log: Callable[[str], None] = print, model_name: str | None = None
) -> DemoReport:
    """Run the whole scenario against a running stack; raise with the reason if any step fails."""
    report = DemoReport()
    spec = load_model_spec(DEMO_MODEL_YAML)
    if model_name:
        spec = spec.model_copy(update={"name": model_name})
    root = settings.snapshot_roots[0]
    async with await Client.connect(settings) as ipn:
        try:
            await ipn.delete_model(spec.name, who="demo")  # a model left by an earlier demo
            log(f"deleted the {spec.name} left by an earlier run")
        except ModelNotFoundError:
            pass  # the usual case: no earlier demo left it
        for version, seed, steps in (("v1", 1, 300), ("v2", 2, 600)):
            tag = f"{version}-{int(time.time())}"
            trained = train(root, spec.name, tag, seed=seed, steps=steps)
            log(
                f"trained {spec.name} {tag} in {trained.seconds:.1f}s: held-out logloss "
                f"{trained.logloss:.3f} (click-rate baseline {trained.base_logloss:.3f})"
            )
            if version == "v1":
                await ipn.publish_model(spec)
                log(f"published model {spec.name} (workflow model/{spec.name})")
            started = time.perf_counter()
            published = await ipn.publish_snapshot(spec.name, trained.folder, who="demo")
            log(f"published snapshot set {published.set_id} ({tag}); rolling out...")
            if version == "v1":
                state = await ipn.wait_until_serving(spec.name, published.set_id)
            else:  # the gates need traffic to judge v2: send some while it rolls out
                state, report.rollout_requests = await _roll_out_under_load(
                    ipn, settings, spec.name, published.set_id, log
                )
            report.timings[f"publish_to_serving_{version}"] = time.perf_counter() - started
            log(
                f"{published.set_id} serves in {sorted(state.serving_apps)} "
                f"({report.timings[f'publish_to_serving_{version}']:.1f}s from publish)"
            )
            replies = []
            for request in REQUESTS:
                reply = await ipn.predict(spec.name, request, source="us-east")
                if reply.set != published.set_id:
                    raise RuntimeError(f"expected an answer from {published.set_id}, got {reply.set}")
                replies.append(reply)
                log(f"  predict {request} -> {reply.outputs}  (set {reply.set}, parts {reply.parts})")
            report.predictions[version] = replies
        log(f"Temporal UI: {settings.ui_url}/workflows/model%2F{spec.name}")
        log(f"             {settings.ui_url}/workflows?query=IpnextModel%3D%22{spec.name}%22")
    return report


async def _roll_out_under_load(
    ipn: Client, settings: Settings, model: str, set_id: str, log: Callable[[str], None]
) -> tuple[ModelState, dict[int, int]]:
    """Wait until `set_id` serves while `DEMO_CALLERS` callers keep asking the us-east router; log
    each step of the rollout as it happens. Returns the model's state and the answers by status."""
    statuses: dict[int, int] = {}
    stop = asyncio.Event()

    async def caller(user: int) -> None:
        async with httpx.AsyncClient(
            base_url=settings.serve_url, timeout=30, headers=key_header(settings)
        ) as http:
            while not stop.is_set():
                reply = await http.post(
                    f"/us-east/models/{model}/predict", json={"inputs": {"user": user, "items": [1, 2, 3]}}
                )
                statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
                user = (user + DEMO_CALLERS) % 200

    callers = [asyncio.create_task(caller(u)) for u in range(DEMO_CALLERS)]
    try:
        # These callers are the traffic a pause for too little of it waits for: waited through
        # (a loaded machine's first bake can fall short: 18 of 20 requests), any other pause not.
        wait = asyncio.create_task(ipn.wait_until_serving(model, set_id, through_traffic_pause=True))
        shown = ""
        while not wait.done():
            status = await ipn.rollout_status(model)
            if status is not None and status.set_id == set_id:
                split = ", ".join(f"{k} {v:g}%" for k, v in sorted(status.traffic_percent.items()))
                line = f"  rollout: {status.state.value}, {status.step}; traffic {split}"
                if line != shown:
                    log(line)
                    shown = line
            await asyncio.wait([wait], timeout=0.5)
        state = wait.result()
    finally:
        stop.set()
        await asyncio.gather(*callers, return_exceptions=True)
    log(f"  {sum(statuses.values())} requests during the rollout, by HTTP status: {statuses}")
    return state, statuses
