"""Experiments on the real stack, with a fast clock (seconds, not days): two arms trained to differ
(the click ranker trained 60 steps, serving, against 1,000 steps, held), simulated users who
click when an answer ranks their favourite item (the trainer's hidden world) in the top 3 and
say so through the feedback route; the report finds the better arm on its own merits, every
user saw one arm throughout; then a treatment that fails every even user's request breaches the
guardrail, and the experiment ends with all traffic on control and no failed request after."""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from ipnext.config import Settings
from ipnext.contracts import poll_until
from ipnext.examples.click_ranker.train import favourite, poisoned_copy, train
from ipnext.registry import ExperimentStatus, StartExperimentInput
from ipnext.sdk import Client

from .conftest import keyed, one_region_spec, train_version

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

CANDIDATES, TOP = 10, 3
# Requests/s of all the users together: enough for a clear verdict in a 10 s experiment (about
# 100 answers an arm), and far below what the box can serve, so the load does not hold the
# control plane back (four unpaced users kept both cores busy on their own).
RATE = 20.0


@dataclass
class Users:
    """Simulated users: each asks for 10 random items ranked, clicks when its favourite is in
    the top 3, and sends that back as feedback on the answer's request id."""

    http: httpx.AsyncClient
    model: str
    answers: list[dict[str, Any]] = field(default_factory=list)  # user, arm, set, status, at
    feedback: list[int] = field(default_factory=list)  # feedback statuses
    started: float = field(default_factory=time.monotonic)

    async def run(self, stop: asyncio.Event, seed: int, every_s: float) -> None:
        """One user loop: a request every `every_s` seconds at most, until stopped."""
        rng = random.Random(seed)
        due = time.monotonic()
        while not stop.is_set():
            due = max(due + every_s, time.monotonic())
            await asyncio.sleep(due - time.monotonic())
            user, items = rng.randrange(200), rng.sample(range(500), CANDIDATES)
            body = {"inputs": {"user": user, "items": items}, "unit": user}
            answer = await self.http.post(f"/us-east/models/{self.model}/predict", json=body)
            got = answer.json()
            self.answers.append(
                {
                    "user": user,
                    "arm": got.get("arm"),
                    "set": got.get("set"),
                    "status": answer.status_code,
                    "at": time.monotonic() - self.started,
                }
            )
            if answer.status_code != 200 or not got.get("request_id"):
                continue
            ranked = [item for _, item in sorted(zip(got["outputs"], items, strict=True), reverse=True)]
            click = 1 if favourite(user, items) in ranked[:TOP] else 0
            said = await self.http.post(
                f"/us-east/models/{self.model}/feedback",
                json={"request_id": got["request_id"], "outcome": {"click": click}},
            )
            self.feedback.append(said.status_code)


async def under_load(stack: Settings, model: str, until: Any, workers: int = 4) -> Users:
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=30) as http:
        users, stop = Users(http, model), asyncio.Event()
        tasks = [asyncio.create_task(users.run(stop, seed, workers / RATE)) for seed in range(workers)]
        try:
            await until(users)
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return users


async def ended(client: Client, model: str, name: str, timeout_s: float = 180) -> ExperimentStatus:
    state = await poll_until(
        lambda: client.get_model(model),
        lambda s: any(e.name == name for e in s.experiments) and s.experiment is None,
        timeout_s=timeout_s,
        interval_s=0.5,
        what=f"experiment {name} ended",
    )
    return next(e for e in state.experiments if e.name == name)


async def test_the_better_arm_wins_and_a_failing_arm_ends_on_its_guardrail(
    stack: Settings, client: Client, model_name: str
) -> None:
    await client.publish_model(one_region_spec(model_name))
    weak, _ = train_version(stack, model_name, "v1")  # 60 steps: ranks hardly better than chance
    first = await client.publish_snapshot(model_name, weak)
    await client.wait_until_serving(model_name, first.set_id)
    strong = train(stack.snapshot_roots[0], model_name, "v2", seed=2, steps=1000).folder
    held = await client.publish_snapshot(model_name, strong, hold=True)
    assert held.status == "held"

    start = StartExperimentInput(
        name="ranker", treatment=held.set_id, duration_seconds=10, check_seconds=2, who="test"
    )
    await client.start_experiment(model_name, start)

    async def through_the_experiment(users: Users) -> None:
        await ended(client, model_name, "ranker")

    users = await under_load(stack, model_name, through_the_experiment)
    result = await ended(client, model_name, "ranker")
    assert result.outcome == "completed", result.end
    report = result.report
    assert report is not None
    (clicks,) = [c for c in report.comparisons if c.outcome == "click"]
    print(f"clicks: control {clicks.control:.3f}, treatment {clicks.value:.3f}, p {clicks.p_value:.2g}")
    assert clicks.difference > 0 and clicks.p_value < 0.01 and report.winner == "treatment"
    arms_of: dict[int, set[str]] = defaultdict(set)
    for answer in users.answers:
        if answer["arm"] is not None:
            arms_of[answer["user"]].add(answer["arm"])
    assert arms_of and all(len(arms) == 1 for arms in arms_of.values())  # one arm per user, always
    assert {arm for arms in arms_of.values() for arm in arms} == {"control", "treatment"}
    assert set(users.feedback) <= {200, 410}  # 410: feedback that came after the end
    assert (await client.get_model(model_name)).serving_set == first.set_id  # the control serves on

    # A treatment that fails every even user: its guardrail ends it, all traffic back to control.
    poisoned = poisoned_copy(stack.snapshot_roots[0], model_name, "v3-bad", strong)
    bad = await client.publish_snapshot(model_name, poisoned, hold=True)
    start = start.model_copy(update={"name": "poisoned", "treatment": bad.set_id, "duration_seconds": 300})
    await client.start_experiment(model_name, start)
    ended_at: list[float] = []

    async def through_the_breach(users: Users) -> None:
        await ended(client, model_name, "poisoned")
        ended_at.append(time.monotonic() - users.started)
        await asyncio.sleep(4)  # and on, with every request on control

    users = await under_load(stack, model_name, through_the_breach)
    result = await ended(client, model_name, "poisoned")
    assert result.outcome == "guardrail" and result.end.startswith("guardrail error_rate breached"), (
        result.end
    )
    assert any(a["status"] != 200 for a in users.answers)  # the treatment did fail
    after = [a for a in users.answers if a["at"] > ended_at[0] + 1]
    assert after and all(a["status"] == 200 and a["set"] == first.set_id and a["arm"] is None for a in after)
