"""Experiments on the real stack, with a fast clock (seconds, not days): two arms trained to differ
(the click ranker trained 60 steps, serving, against 1,000 steps, held), simulated users who
click when an answer ranks their favourite item (the trainer's hidden world) in the top 3 and
say so through the feedback route; the report finds the better arm on its own merits, every
user saw one arm throughout; then a treatment that fails every even user's request breaches the
guardrail, and the experiment ends with all traffic on control and no failed request after.

Then shadows on the same model (drills share rollouts): callers' latency with and without 50% of
their requests copied to a candidate (the dense part sleeps rather than computes, so the copies
compete for the router, not for the cores: printed, never asserted); a candidate equal to the
serving set compares as equal; the better-trained treatment reports the true difference,
computed here from the two snapshots' weight files; no caller ever gets a candidate's answer.

Last, model updates on the same model (its first rollout paid once for all three drills):
refused updates change nothing, a gate change applies in place (the same replica processes) and
to the next rollout, a traffic change moves capacity, and a hardware change becomes a new set of
the same snapshots, rolled out under load with no failed request."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import ray
from safetensors.torch import load_file

from ipnext.client.sdk import Client
from ipnext.contracts.experiment import ExperimentStatus, StartExperimentInput
from ipnext.contracts.model import ModelState
from ipnext.errors import IpnextError
from ipnext.examples.click_ranker.parts import DensePart, EmbeddingPart
from ipnext.examples.click_ranker.train import favourite, poisoned_copy, train
from ipnext.names import poll_until
from ipnext.policy.shadow import compare_answers
from ipnext.policy.spec_update import UpdateKind
from ipnext.serving.control import connect
from ipnext.spec.model import ModelSpec
from ipnext.spec.settings import Settings
from ipnext.store.snapshots import write_snapshot

from .conftest import keyed, one_region_spec, train_version
from .load import Load

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

CANDIDATES, TOP = 10, 3
# The shadows' latency phases (a setting: bench/shadow.py runs them at full length), and the
# dense part's sleep: latency without CPU.
PHASE_S = 3.0
DELAY_MS = 20
USER, ITEMS = 3, [5, 17, 42, 99, 123, 256, 300, 411]  # the shadows' request: one true difference
# Requests/s of all the users together, far below what the box can serve, so the load does not
# hold the control plane back (four unpaced users kept both cores busy on their own).
RATE = 20.0
# Clicks the experiment counted on each arm (its report so far) before on-call stops it: enough
# for a clear verdict (the arms click about 0.3 and 0.95 of the time; 30 a side puts p near 1e-6).
# It runs until then, never for a set time: a 6 s experiment on a loaded box once ended with too
# few clicks counted on one arm to compare, and one stopped once the routers had taken 36 clicks
# an arm had counted 8 (counts reach the experiment at its checks, behind the routers). Ending by
# duration is the workflow tests' to prove (tests/workflows/test_experiment_workflow.py).
CLICKS_PER_ARM = 30
# Answers the users must get from a second after the poisoned experiment ended, every one on
# control (about 2 s of the users' RATE); how long a wait for the stack to show something may
# take (those answers, a serving check of the model's): far above what each takes.
ANSWERS_AFTER_THE_END = 40
SHOWN_WITHIN_S = 60.0


@dataclass
class Users:
    """Simulated users: each asks for 10 random items ranked, clicks when its favourite is in
    the top 3, and sends that back as feedback on the answer's request id."""

    http: httpx.AsyncClient
    model: str
    answers: list[dict[str, Any]] = field(default_factory=list)  # user, arm, set, status, at
    feedback: list[int] = field(default_factory=list)  # feedback statuses
    clicks_taken: Counter[str] = field(default_factory=Counter)  # feedback the router took (200), by arm
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
                    "request_id": got.get("request_id"),
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
            if said.status_code == 200 and got.get("arm"):
                self.clicks_taken[got["arm"]] += 1


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


def checks_run(state: ModelState) -> int:
    """The model's serving checks that ran to their end (-1: none on its record yet)."""
    done = state.reconcile
    return -1 if done is None else done.checks - done.failures


REPLAYS = 200  # posts of one request id in the replay drill (issue 41's probe)


def lap(began: float, what: str) -> None:
    print(f"[{time.monotonic() - began:6.1f}s] {what}")


async def test_the_better_arm_wins_a_failing_arm_ends_shadows_compare_and_updates_apply(
    stack: Settings, client: Client, model_name: str
) -> None:
    began = time.monotonic()
    data = one_region_spec(model_name).model_dump(mode="json")
    data["parts"]["dense"]["config"]["delay_ms"] = DELAY_MS
    spec = ModelSpec.model_validate(data)
    await client.publish_model(spec)
    weak, _ = train_version(stack, model_name, "v1")  # 60 steps: ranks hardly better than chance
    first = await client.publish_snapshot(model_name, weak)
    await client.wait_until_serving(model_name, first.set_id)
    lap(began, "the weak arm serves")
    strong = train(stack.snapshot_roots[0], model_name, "v2", seed=2, steps=1000).folder
    held = await client.publish_snapshot(model_name, strong, hold=True)
    assert held.status == "held"
    lap(began, "the strong arm trained and held")

    start = StartExperimentInput(
        name="ranker",
        treatment=held.set_id,
        duration_seconds=300,
        check_seconds=2,
        who="test",
        metrics=["click:higher"],
    )
    await client.start_experiment(model_name, start)

    async def fewest_clicks_counted() -> int:
        """The click outcomes the experiment counted on its arm with fewer (its report so far)."""
        report = (await client.experiment_status(model_name, "ranker")).report
        counts = [arm.outcomes.get("click", (0, None))[0] for arm in report.arms] if report else []
        return min(counts) if len(counts) == 2 else 0

    counted: list[int] = []

    replayed: list[dict[str, Any]] = []

    async def through_the_experiment(users: Users) -> None:
        # The forgery the issue found: one legitimate id of the losing arm (control) posted 200
        # times with a click. Its user's own click counted once; none of the 200 counts, in
        # whichever router it reaches; a purchase on the same answer later is another outcome
        # and counts.
        control_id = await poll_until(
            lambda: asyncio.sleep(
                0,
                next(
                    (a["request_id"] for a in users.answers if a["arm"] == "control" and a["request_id"]),
                    None,
                ),
            ),
            lambda found: found is not None,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.2,
            what="an answer of the control arm",
        )
        for _ in range(REPLAYS):
            said = await users.http.post(
                f"/us-east/models/{model_name}/feedback",
                json={"request_id": control_id, "outcome": {"click": 1}},
            )
            replayed.append(said.json())
        bought = await users.http.post(
            f"/us-east/models/{model_name}/feedback",
            json={"request_id": control_id, "outcome": {"purchase": 12.5}},
        )
        replayed.append(bought.json())
        counted.append(
            await poll_until(
                fewest_clicks_counted,
                lambda fewest: fewest >= CLICKS_PER_ARM,
                timeout_s=SHOWN_WITHIN_S * 3,
                interval_s=0.5,
                what=f"{CLICKS_PER_ARM} clicks counted by the experiment on each arm",
            )
        )

        # The purchase is in a router's counters at once, in the experiment's totals after its
        # next push and read: wait for it there, or the stop's last window may come first.
        async def purchases() -> int:
            report = (await client.experiment_status(model_name, "ranker")).report
            arms = {a.arm: a for a in report.arms} if report else {}
            return arms["control"].outcomes.get("purchase", (0, None))[0] if "control" in arms else 0

        await poll_until(
            purchases, lambda n: n >= 1, timeout_s=SHOWN_WITHIN_S, interval_s=0.5, what="the purchase"
        )
        await client.stop_experiment(model_name, reason="enough clicks on each arm", who="test")
        await ended(client, model_name, "ranker")

    users = await under_load(stack, model_name, through_the_experiment)
    lap(
        began,
        f"the experiment stopped: {counted[0]} clicks counted on its arm with fewer; the routers had "
        f"taken {dict(users.clicks_taken)}",
    )
    result = await ended(client, model_name, "ranker")
    assert result.outcome == "stopped", result.end
    report = result.report
    assert report is not None
    (clicks,) = [c for c in report.comparisons if c.outcome == "click"]
    print(f"clicks: control {clicks.control:.3f}, treatment {clicks.value:.3f}, p {clicks.p_value:.2g}")
    assert clicks.difference > 0 and clicks.p_value < 0.01 and report.winner == "treatment"
    assert clicks.better and clicks.test.startswith("mSPRT") and "always-valid" in report.method
    # The simulated user already fed back its click on that answer: every replay is a repeat.
    recorded = [answer.get("recorded") for answer in replayed]
    extra = sum(map(len, recorded[:-1]))
    print(f"replay: {REPLAYS} posts of one control id after its user's own feedback, counted {extra}")
    assert recorded[:REPLAYS] == [[]] * REPLAYS, replayed[:3]
    assert all(answer.get("already_recorded") == ["click"] for answer in replayed[:REPLAYS])
    assert recorded[-1] == ["purchase"]  # a conversion on the same answer: another outcome
    (control_arm,) = [a for a in report.arms if a.arm == "control"]
    assert control_arm.outcomes["purchase"][0] == 1
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
        await poll_until(  # and on, with every request on control
            lambda: asyncio.sleep(0, sum(1 for a in users.answers if a["at"] > ended_at[0] + 1)),
            lambda answered: answered >= ANSWERS_AFTER_THE_END,
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.2,
            what=f"{ANSWERS_AFTER_THE_END} answers after the poisoned experiment ended",
        )

    users = await under_load(stack, model_name, through_the_breach)
    lap(began, f"the poisoned experiment ended, and {ANSWERS_AFTER_THE_END} answers on control")
    result = await ended(client, model_name, "poisoned")
    assert result.outcome == "guardrail" and result.end.startswith("guardrail error_rate breached"), (
        result.end
    )
    assert any(a["status"] != 200 for a in users.answers)  # the treatment did fail
    after = [a for a in users.answers if a["at"] > ended_at[0] + 1]
    assert after and all(a["status"] == 200 and a["set"] == first.set_id and a["arm"] is None for a in after)

    await shadows(
        stack, client, model_name, first.set_id, weak, held.set_id, strong, data["parts"]["dense"]["config"]
    )
    lap(began, "the shadows done")
    await updates(stack, client, model_name, spec, first.set_id)
    lap(began, "the updates done")
    await client.delete_model(model_name, who="test")
    lap(began, "deleted")


def the_request(user: int) -> dict[str, Any]:
    return {"user": USER, "items": ITEMS}


async def expected_outputs(folder: Path, config: dict[str, Any]) -> list[float]:
    """What a set's parts answer the shadows' request, computed here from its weight files."""
    embed = EmbeddingPart(load_file(str(folder / "embed.safetensors")), config)
    dense = DensePart(load_file(str(folder / "dense.safetensors")), config)
    vectors = await embed({"input": {"user": USER, "items": ITEMS}})
    return await dense({"embed": vectors})


async def shadow_until(client: Client, model: str, compared: int) -> ExperimentStatus:
    return await poll_until(
        lambda: client.experiment_status(model),
        lambda s: s.phase == "running" and s.shadow is not None and s.shadow.compared >= compared,
        timeout_s=120,
        interval_s=0.5,
        what=f"{model}'s shadow with {compared} comparisons",
    )


async def no_experiment(client: Client, model: str) -> None:
    await poll_until(
        lambda: client.get_model(model),
        lambda s: s.experiment is None,
        timeout_s=120,
        interval_s=0.5,
        what=f"{model}'s shadow ended",
    )


async def shadows(
    stack: Settings,
    client: Client,
    model_name: str,
    serving: str,
    serving_folder: Path,
    different: str,
    different_folder: Path,
    config: dict[str, Any],
) -> None:
    """The shadow drill (module docstring) on the experiments' model: `serving` answers, the
    equal candidate is its weights under another version, `different` is a held set."""
    weights = {part: load_file(str(serving_folder / f"{part}.safetensors")) for part in ("embed", "dense")}
    copy = stack.snapshot_roots[0] / model_name / "v1-copy"
    write_snapshot(copy, model_name, "v1-copy", weights)
    began = time.monotonic()
    equal = await client.publish_snapshot(model_name, copy, hold=True)
    path = f"/us-east/models/{model_name}/predict"
    lap(began, "shadows: the equal candidate held")

    # 1. Callers' latency without a shadow, then with 50% copied to the equal candidate.
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as alone:
        await asyncio.sleep(PHASE_S)
    await client.start_shadow(
        model_name, equal.set_id, 50, duration_seconds=600, check_seconds=1, shadow="equal"
    )
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as shadowed:
        await shadow_until(client, model_name, 1)  # the routers copy: the measured phase starts
        copying_from = shadowed.elapsed()
        await asyncio.sleep(PHASE_S)
        status = await shadow_until(client, model_name, 20)
    await client.stop_experiment(model_name, "measured", who="test")
    lap(began, "shadows: the equal candidate measured")
    same = status.shadow
    assert same is not None
    print(f"equal candidate: {same}")
    assert same.max_abs_diff_mean == 0.0 and same.differing == 0.0 and same.mismatched == 0
    assert same.rank_correlation_mean == 1.0 and same.top_k_overlap_mean == 1.0
    assert same.candidate_errors == 0 and status.shadow_windows

    # 2. The different candidate: every comparison finds the difference the weight files give.
    truth = compare_answers(
        await expected_outputs(serving_folder, config),
        await expected_outputs(different_folder, config),
        top_k=3,
    )
    assert truth["shadow.max_abs_diff"] > 1e-3  # it does answer otherwise
    await no_experiment(client, model_name)
    lap(began, "shadows: the equal candidate's shadow ended")
    await client.start_shadow(
        model_name, different, 50, duration_seconds=600, check_seconds=1, shadow="different"
    )
    async with Load(stack.serve_url, path, headers=keyed(stack), inputs=the_request) as third:
        status = await shadow_until(client, model_name, 20)
    await client.stop_experiment(model_name, "measured", who="test")
    lap(began, "shadows: the different candidate measured")
    found = status.shadow
    assert found is not None
    print(f"different candidate: {found}; the weight files give {truth}")
    # The parts round scores to 6 decimals: equal up to that.
    assert found.max_abs_diff_mean == pytest.approx(truth["shadow.max_abs_diff"], abs=2e-6)
    assert found.differing == 1.0 and found.mismatched == 0
    assert found.rank_correlation_mean == pytest.approx(truth["shadow.rank_correlation"])
    assert found.top_k_overlap_mean == pytest.approx(truth["shadow.top_k_overlap"])

    # No caller ever got a candidate's answer; none failed.
    answers = [*alone.answers, *shadowed.answers, *third.answers]
    assert answers and all(a.status == 200 and a.set == serving for a in answers), [
        a for a in answers if a.status != 200 or a.set != serving
    ][:3]
    assert all(a.parts == {p: f"{model_name}/{p}@v1" for p in ("embed", "dense")} for a in answers)
    measured = [a for a in shadowed.answers if a.at >= copying_from]
    p50_alone = statistics.median(a.latency_s for a in alone.answers) * 1000
    p50_shadowed = statistics.median(a.latency_s for a in measured) * 1000
    print(
        f"callers' p50 without a shadow {p50_alone:.1f} ms ({len(alone.answers)} requests), with 50% "
        f"copied {p50_shadowed:.1f} ms ({len(measured)}): ratio {p50_shadowed / p50_alone:.3f} "
        f"(goal: within 5%); {same.compared} comparisons, {same.dropped} dropped"
    )
    await no_experiment(client, model_name)
    kept = {s.id: s for s in (await client.get_model(model_name)).sets}
    assert kept[different].status == "held" and "shadow different:" in kept[different].detail


def changed(spec: ModelSpec, change: Any) -> ModelSpec:
    data = spec.model_dump(mode="json")
    change(data)
    return ModelSpec.model_validate(data)


def replica_pids(settings: Settings, app: str) -> set[int]:
    """The processes of every replica of a Serve app (its actors are `ServeReplica:<app>:<deployment>`)."""
    connect(settings.ray_address())
    # The GCS's actor table: Ray's state API would need the dashboard, which the stack does not start.
    actors = ray._private.state.actors().values()
    return {
        a["Pid"]
        for a in actors
        if a["State"] == "ALIVE" and a["ActorClassName"].startswith(f"ServeReplica:{app}:")
    }


def replicas(state: ModelState) -> int:
    assert state.plan is not None
    return sum(
        n for p in state.plan.deployments.values() for by_hw in p.replicas.values() for n in by_hw.values()
    )


async def settled(client: Client, model: str, what: str, test: Any, timeout_s: float = 180) -> ModelState:
    return await poll_until(
        lambda: client.get_model(model),
        lambda s: s.active_rollout is None and s.pending_plan is None and not s.queued and test(s),
        timeout_s=timeout_s,
        interval_s=0.3,
        what=what,
    )


async def updates(stack: Settings, client: Client, model_name: str, spec: ModelSpec, serving: str) -> None:
    """The update drill (module docstring) on the experiments' model: `spec` is what it was
    published with, `serving` the set that serves."""
    before = await client.get_model(model_name)
    assert before.serving_set == serving and before.spec == spec
    app = before.serving_apps["us-east"]
    pids = replica_pids(stack, app)
    assert pids

    # Refused by the worker (a factory it cannot import): nothing changes, nothing is recorded.
    broken = changed(
        spec, lambda d: d["parts"]["dense"].update(factory="ipnext.examples.click_ranker.parts:NoSuch")
    )
    with pytest.raises(IpnextError, match="NoSuch"):
        await client.update_model(broken, who="test")
    after_refusal = await client.get_model(model_name)
    assert (
        after_refusal.spec == spec and after_refusal.sets == before.sets and after_refusal.spec_changes == []
    )

    # The same spec: no change.
    same = await client.update_model(spec, who="test")
    assert same.kind == UpdateKind.NONE and same.outcome == "no change"

    # A gate: in place, the replicas keep running.
    gated = changed(spec, lambda d: d["rollout"]["gates"][0].update(max=0.02))
    result = await client.update_model(gated, who="test-gate")
    assert (result.kind, result.outcome) == (UpdateKind.IN_PLACE, "applied in place")
    assert result.changes == ["rollout.gates: " + result.changes[0].split(": ", 1)[1]]
    state = await client.get_model(model_name)
    assert state.spec == gated and state.serving_set == serving
    change = state.spec_changes[-1]
    assert (change.number, change.who, change.kind) == (1, "test-gate", "in_place")
    # A serving check after the change has run to its end (the one it asked for, or a later
    # one): nothing in Serve changed.
    ran = checks_run(state)
    await poll_until(
        lambda: client.get_model(model_name),
        lambda s: checks_run(s) > ran,
        timeout_s=SHOWN_WITHIN_S,
        interval_s=0.5,
        what="a serving check after the in-place change",
    )
    assert replica_pids(stack, app) == pids

    # Traffic: a new placement for the same set, moved to by a capacity move.
    busier = changed(gated, lambda d: d["traffic"]["peak_qps"].update({"us-east": 600}))
    result = await client.update_model(busier, who="test-traffic")
    assert result.kind == UpdateKind.CAPACITY and result.plan_revision is not None
    assert result.outcome.startswith("capacity move to placement revision"), result.outcome
    grown = await settled(
        client,
        model_name,
        "the capacity move done",
        lambda s: s.plan is not None and s.plan.deployments != before.plan.deployments,  # type: ignore[union-attr]
    )
    assert grown.serving_set == serving and grown.spec == busier
    assert replicas(grown) > replicas(before), (before.plan, grown.plan)

    # Hardware: a new set of the same snapshots under the new spec, rolled out under load.
    rehosted = changed(busier, lambda d: d["parts"]["dense"]["hardware"]["cpu-std"].update(qps=250))
    async with Load(stack.serve_url, f"/us-east/models/{model_name}/predict", headers=keyed(stack)) as load:
        result = await client.update_model(rehosted, who="test-hardware")
        assert result.kind == UpdateKind.NEW_SET and result.set_id is not None
        assert result.outcome == f"rolling out as {result.set_id}"
        assert result.changes == ["parts.dense.hardware.cpu-std.qps: 300.0 -> 250.0"]
        pending = await client.get_model(model_name)
        assert pending.spec == busier and pending.spec_pending is not None  # not before it serves
        with pytest.raises(IpnextError, match="is rolling out with set"):  # one update at a time
            await client.update_model(busier, who="test")
        done = await client.wait_until_serving(model_name, result.set_id, timeout_s=240)
    assert done.spec == rehosted and done.spec_pending is None
    new = next(s for s in done.sets if s.id == result.set_id)
    old = next(s for s in done.sets if s.id == serving)
    assert {p: r.snapshot_id for p, r in new.parts.items()} == {
        p: r.snapshot_id for p, r in old.parts.items()
    }
    assert [c.outcome for c in done.spec_changes] == [
        "applied in place",
        grown.spec_changes[-1].outcome,
        f"applied: {result.set_id} serves",
    ]
    assert [c.who for c in done.spec_changes] == ["test-gate", "test-traffic", "test-hardware"]
    # The gate changed in place is the one this rollout judged.
    assert done.rollout is not None
    limits = {g.limit for g in done.rollout.gates if g.metric == "error_rate"}
    assert limits == {0.02}, done.rollout.gates
    assert load.failed() == [], load.failed()[:3]
    assert {a.set for a in load.answers} <= {serving, result.set_id}
    served = await client.predict(model_name, {"user": 1, "items": [4]})
    assert served.set == result.set_id
