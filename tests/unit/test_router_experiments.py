"""The router in an experiment, on the real `Router` class with fake part handles (as in
test_router_doors) and the real feedback ledger behind a stand-in for its actor: a unit's answers
come from its arm and say so with a signed request id, and feedback on that id counts for the
arm, in the unit's bucket, once per (id, outcome) whichever router it reaches, while forged ids,
ended experiments, expired ids and bad bodies are refused with the status and the field."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import ray

from ipnext.contracts.router import ExperimentRoute, RouterConfig
from ipnext.policy.experiments import read_request_id, unit_bucket
from ipnext.serving import router as router_module
from ipnext.serving import router_feedback
from ipnext.serving.choices import VariantRouter
from ipnext.serving.layout import RouterAppArgs, SetDescription
from ipnext.serving.set_routes import SetRoute
from ipnext.spec.model import RouterSpec
from ipnext.store.feedback_ledger import FeedbackLedger, LedgerFullError
from ipnext.store.keys import KeyCheck, add_key
from tests.unit.test_router_doors import Counted, FakeHandle, reply

CONTROL, TREATMENT = "m.us-east.s1.r1", "m.us-east.s2.r1"
EXPERIMENT = ExperimentRoute(
    experiment="exp-1",
    salt="salt-0123",
    control="control",
    arms={"control": CONTROL, "treatment": TREATMENT},
    split={"control": 50.0, "treatment": 50.0},
)


class _Method:
    def __init__(self, call: Any) -> None:
        self._call = call

    def remote(self, *args: Any) -> Any:
        async def answer() -> Any:
            return self._call(*args)

        return answer()


class LedgerActor:
    """What a router uses of the ledger's actor (`serving.feedback_actor`), around the real
    ledger; `down` makes it fail as an unreachable actor would."""

    def __init__(self, ledger: FeedbackLedger) -> None:
        self.ledger = ledger
        self.down = False
        self.claim = _Method(self._claim)

    def _claim(self, request_id: str, issued_at: float, outcomes: list[str]) -> dict[str, str]:
        if self.down:
            raise ray.exceptions.RayActorError()
        try:
            found = self.ledger.claim(request_id, issued_at, outcomes)
        except LedgerFullError as err:  # as Ray hands a task's own exception to its caller
            raise ray.exceptions.RayTaskError("claim", "", err) from err
        return {name: str(verdict) for name, verdict in found.items()}


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> LedgerActor:
    actor = LedgerActor(FeedbackLedger(tmp_path / "feedback" / "exp-1.log", 3600.0, 1000))
    monkeypatch.setattr(router_feedback, "ledger_actor", lambda model, experiment: actor)
    return actor


@pytest.fixture
def router(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, ledger: LedgerActor) -> Any:
    return make_router(monkeypatch, tmp_path)


def make_router(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, region: str = "us-east") -> Any:
    parts = {"embed": reply({"u": 1}), "dense": reply([0.5])}
    monkeypatch.setattr(
        router_module.serve,
        "get_deployment_handle",
        lambda name, app_name: FakeHandle(name.split("-")[0], parts, []),
    )
    monkeypatch.setattr(router_module, "RouterPrometheus", Counted)
    monkeypatch.setattr(router_module.CounterPusher, "ensure_running", lambda self: None)
    keys = tmp_path / "api-keys.yaml"
    if not keys.exists():
        add_key(keys, "dev", ["*"])  # writes the request-signing secret with the first key
    made = router_module.Router.func_or_class(
        RouterAppArgs(model="m", region=region, router=RouterSpec(), keys_file=str(keys))
    )
    dag = [("input", "embed"), ("embed", "dense"), ("dense", "output")]
    routes = {}
    for number, app in enumerate((CONTROL, TREATMENT), start=1):
        described = SetDescription(
            set_id=f"m@{number}",
            dag=dag,
            order=["embed", "dense"],
            deployments={"embed": {"embed-cpu": 1.0}, "dense": {"dense-cpu": 1.0}},
        )
        routes[app] = SetRoute(app, described, VariantRouter(dag, ["embed", "dense"], {}))
    made._routes = routes
    made._config = RouterConfig(generation=1, weights={CONTROL: 100}, experiment=EXPERIMENT)
    made.fake_parts = parts  # a test may change what a part answers
    return made


async def feedback(router: Any, body: dict[str, Any] | bytes) -> tuple[dict[str, Any], int]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer: tuple[dict[str, Any], int] = await router.feedback(raw)
    return answer


async def test_a_units_answers_come_from_its_arm_with_a_signed_id(router: Any) -> None:
    seen: dict[str, str] = {}
    for user in range(40):
        for _ in range(2):
            body, status = await router.predict({"user": user}, unit=str(user))
            assert status == 200 and body["arm"] in EXPERIMENT.arms
            assert body["set"] == {"control": "m@1", "treatment": "m@2"}[body["arm"]]
            assert body["request_id"].startswith(f"x2.exp-1.{body['arm']}.")
            assert seen.setdefault(str(user), body["arm"]) == body["arm"]  # one arm per user
    assert set(seen.values()) == {"control", "treatment"}
    outside, status = await router.predict({"user": 1})
    assert (
        status == 200 and outside["arm"] is None and "request_id" not in outside and outside["set"] == "m@1"
    )


async def test_a_streamed_answer_says_its_arm_and_one_id_in_every_piece(router: Any) -> None:
    async def pieces(upstream: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        for word in ("a", "b"):
            yield {"output": word, "snapshot_id": "m/dense@v1"}

    router.fake_parts["dense"] = pieces
    streamed = [piece async for piece in router.stream({"user": 3}, unit="3")]
    assert [p["outputs"] for p in streamed] == ["a", "b"]
    arm = streamed[0]["arm"]
    assert arm in EXPERIMENT.arms and {p["arm"] for p in streamed} == {arm}
    assert len({p["request_id"] for p in streamed}) == 1 and streamed[0]["request_id"].startswith(
        f"x2.exp-1.{arm}."
    )


async def test_feedback_counts_for_the_arm_its_id_names_in_its_units_bucket(router: Any) -> None:
    body, _ = await router.predict({"user": 7}, unit="7")
    arm = body["arm"]
    assert read_request_id(router._keys.signing_secret(), body["request_id"]).bucket == unit_bucket(
        EXPERIMENT.salt, "7"
    )
    answer, status = await feedback(router, {"request_id": body["request_id"], "outcome": {"click": 1}})
    assert status == 200 and answer == {
        "experiment": "exp-1",
        "arm": arm,
        "recorded": ["click"],
        "already_recorded": [],
    }
    # A conversion later on the same answer is another outcome: it counts too.
    answer, status = await feedback(router, {"request_id": body["request_id"], "outcome": {"purchase": 12.5}})
    assert status == 200 and answer["recorded"] == ["purchase"]
    counted = router._counters[EXPERIMENT.arms[arm]].outcomes
    assert (counted["click"].count, counted["click"].total, counted["click"].binary) == (1, 1.0, True)
    assert counted["purchase"].count == 1 and counted["purchase"].bucketed()
    assert counted["click"].bucket_counts[unit_bucket(EXPERIMENT.salt, "7")] == 1
    other = EXPERIMENT.arms["treatment" if arm == "control" else "control"]
    assert "click" not in router._counters.get(other, router_module.SetCounters()).outcomes


async def test_a_replayed_id_counts_once_in_every_router_and_after_a_restart(
    router: Any, ledger: LedgerActor, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The forgery the issue found: one legitimate id posted 200 times counted 200 times. Now
    the first post counts; the rest, to this router, to another region's, and to a ledger
    started again from its log, are answered 200 and counted nowhere."""
    body, _ = await router.predict({"user": 7}, unit="7")
    sent = {"request_id": body["request_id"], "outcome": {"click": 0}}
    elsewhere = make_router(monkeypatch, tmp_path, region="eu-west")
    for post in range(200):
        answer, status = await feedback(router if post % 2 else elsewhere, sent)
        assert status == 200 and answer["recorded"] == ([] if post else ["click"]), (post, answer)
        assert answer["already_recorded"] == (["click"] if post else [])
    app = EXPERIMENT.arms[body["arm"]]
    total = sum(
        r._counters.get(app, router_module.SetCounters())
        .outcomes.get("click", router_module.OutcomeTotals())
        .count
        for r in (router, elsewhere)
    )
    assert total == 1
    ledger.ledger = FeedbackLedger(ledger.ledger.path, 3600.0, 1000)  # the actor started again
    answer, status = await feedback(router, sent)
    assert status == 200 and answer["recorded"] == [] and answer["already_recorded"] == ["click"]


async def test_feedback_is_refused_past_the_window_when_full_and_while_the_ledger_is_away(
    router: Any, ledger: LedgerActor
) -> None:
    body, _ = await router.predict({"user": 7}, unit="7")
    ledger.ledger = FeedbackLedger(None, 3600.0, 1, clock=lambda: 10.0**10)  # far later: expired
    answer, status = await feedback(router, {"request_id": body["request_id"], "outcome": {"click": 1}})
    assert status == 410 and "older than the feedback window" in answer["message"]
    ledger.ledger = FeedbackLedger(None, 3600.0, 1)  # room for one (id, outcome)
    answer, status = await feedback(
        router, {"request_id": body["request_id"], "outcome": {"click": 1, "buy": 1}}
    )
    assert status == 503 and "ledger is full" in answer["message"]
    ledger.down = True
    answer, status = await feedback(router, {"request_id": body["request_id"], "outcome": {"click": 1}})
    assert status == 503 and "did not answer" in answer["message"]
    assert all(not c.outcomes for c in router._counters.values())  # nothing counted in any case


async def test_forged_ended_and_malformed_feedback_is_refused(router: Any) -> None:
    body, _ = await router.predict({"user": 7}, unit="7")
    request_id = body["request_id"]
    other = "treatment" if body["arm"] == "control" else "control"
    forged = request_id.replace(f".{body['arm']}.", f".{other}.")
    cases: list[tuple[dict[str, Any] | bytes, int, str]] = [
        ({"request_id": forged, "outcome": {"click": 1}}, 400, "request_id: its signature does not match"),
        ({"request_id": "abc", "outcome": {"click": 1}}, 400, "request_id: not an experiment's request id"),
        ({"request_id": request_id, "outcome": {"click": "yes"}}, 400, "outcome.click:"),
        (b"[1, 2", 400, "body is not JSON"),
    ]
    for sent, status, words in cases:
        answer, got = await feedback(router, sent)
        assert got == status and answer["message"].startswith(words), answer
    router._config = router._config.model_copy(update={"experiment": None})  # the experiment ended
    answer, got = await feedback(router, {"request_id": request_id, "outcome": {"click": 1}})
    assert got == 410 and "experiment exp-1 is not running here" in answer["message"]
    assert all(not c.outcomes for c in router._counters.values())


async def test_without_a_signing_secret_answers_carry_no_id_and_feedback_is_503(
    router: Any, tmp_path: Path
) -> None:
    bare = tmp_path / "old-keys.yaml"
    bare.write_text("keys: []\n")  # a keys file from before experiments
    router._keys = KeyCheck(bare)
    body, status = await router.predict({"user": 7}, unit="7")
    assert status == 200 and body["arm"] in EXPERIMENT.arms and "request_id" not in body
    answer, got = await feedback(
        router, {"request_id": "x2.exp-1.control.0.0.00.11", "outcome": {"click": 1}}
    )
    assert got == 503 and "request_signing_secret" in answer["message"]


def test_openai_answers_carry_the_arm_and_request_id_as_headers() -> None:
    from ipnext.serving.openai_door import ARM_HEADER, REQUEST_ID_HEADER, SET_HEADER, answer_headers

    inside = {"set": "m@2", "arm": "treatment", "request_id": "x1.exp-1.treatment.ab.cd"}
    assert answer_headers(inside) == {
        SET_HEADER: "m@2",
        ARM_HEADER: "treatment",
        REQUEST_ID_HEADER: "x1.exp-1.treatment.ab.cd",
    }
    assert answer_headers({"set": "m@1", "arm": None}) == {SET_HEADER: "m@1"}
