"""Experiments at the router's seams, pure: the experiment route a router config carries, which app
a request with a unit runs on, the `unit` and feedback bodies, and outcomes in the set counters."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
from pydantic import ValidationError

from ipnext.contracts.counters import MetricsSnapshot, OutcomeTotals, SetCounters
from ipnext.contracts.router import ExperimentRoute, RouterConfig
from ipnext.serving.request_body import BodyError, parse_feedback_body, parse_request_body
from ipnext.serving.traffic import pick_apps

ROUTE = ExperimentRoute(
    experiment="exp-1",
    salt="salt-0123",
    control="control",
    arms={"control": "m.us-east.s1.r1", "treatment": "m.us-east.s2.r1"},
    split={"control": 50.0, "treatment": 50.0},
)
CONFIG = RouterConfig(generation=3, weights={"m.us-east.s1.r1": 100.0}, experiment=ROUTE)
BOTH = {"m.us-east.s1.r1", "m.us-east.s2.r1"}


def test_the_experiment_route_names_its_arms_consistently() -> None:
    data = ROUTE.model_dump()
    for change, words in (
        ({"control": "other"}, "control: 'other' is not one of the arms"),
        ({"split": {"control": 50.0}}, "split: names the arms"),
        ({"split": {"control": 60.0, "treatment": 60.0}}, "sum to 100"),
        ({"salt": "short"}, "at least 8 characters"),
    ):
        with pytest.raises(ValidationError, match=words):
            ExperimentRoute.model_validate({**data, **change})
    assert CONFIG.apps() == BOTH  # the routers describe both arms' apps
    stopped = CONFIG.model_copy(update={"experiment": None})
    assert stopped.apps() == {"m.us-east.s1.r1"}


def test_a_unit_runs_whole_on_its_arm_and_keeps_it() -> None:
    rng = random.Random(0)
    arms: dict[str, str] = {}
    for user in range(2000):
        picked = pick_apps(CONFIG, BOTH, key=None, rng=rng, unit=str(user))
        assert picked is not None and picked.arm is not None
        assert picked.base == picked.counted == ROUTE.arms[picked.arm] and picked.part_apps == {}
        arms[str(user)] = picked.arm
        again = pick_apps(CONFIG, BOTH, key=f"other-key-{user}", rng=rng, unit=str(user))
        assert again is not None and again.arm == picked.arm  # the rollout key plays no part
    share = Counter(arms.values())["treatment"] / len(arms)
    assert abs(share - 0.5) < 0.04, share


def test_an_unreachable_arm_answers_nothing_rather_than_another_arm() -> None:
    rng = random.Random(0)
    outcomes = [pick_apps(CONFIG, {"m.us-east.s1.r1"}, None, rng, unit=str(u)) for u in range(200)]
    assert None in outcomes  # treatment users wait for their arm
    assert all(p is None or p.arm == "control" for p in outcomes)


def test_a_request_without_a_unit_runs_as_outside_the_experiment() -> None:
    picked = pick_apps(CONFIG, BOTH, key=None, rng=random.Random(0))
    assert picked is not None and (picked.base, picked.arm) == ("m.us-east.s1.r1", None)


def test_the_unit_field_is_a_string_or_an_integer() -> None:
    assert parse_request_body(b'{"inputs": 1, "unit": 42}', 32)["unit"] == "42"
    assert parse_request_body(b'{"inputs": 1, "unit": "u-42"}', 32)["unit"] == "u-42"
    assert "unit" not in parse_request_body(b'{"inputs": 1}', 32)
    for unit, words in (
        ("true", "is not a string or an integer"),
        ('""', "1 to 256 characters"),
        ("[1]", "unit:"),
    ):
        with pytest.raises(BodyError, match=words) as caught:
            parse_request_body(b'{"inputs": 1, "unit": ' + unit.encode() + b"}", 32)
        assert caught.value.status == 400 and caught.value.message.startswith("unit:")


def test_feedback_bodies() -> None:
    ok = parse_feedback_body(
        json.dumps({"request_id": "x1.e.a.n.s", "outcome": {"click": 1, "dwell_s": 2.5}}).encode(), 32
    )
    assert ok.request_id == "x1.e.a.n.s" and ok.outcome == {"click": 1.0, "dwell_s": 2.5}
    for body, words in (
        (b"nope", "body is not JSON"),
        (b'{"request_id": "x"}', "body must be a JSON object"),
        (b'{"request_id": 5, "outcome": {"click": 1}}', "request_id:"),
        (b'{"request_id": "x", "outcome": {}}', "outcome: an object of 1 to 32"),
        (b'{"request_id": "x", "outcome": {"Click": 1}}', "outcome.Click: a name of lowercase"),
        (b'{"request_id": "x", "outcome": {"click": true}}', "outcome.click: True is not a finite number"),
        (b'{"request_id": "x", "outcome": {"click": "1"}}', "outcome.click: '1' is not a finite number"),
        (b'{"request_id": "x", "outcome": {"click": 1e999}}', "outcome.click: inf is not a finite number"),
    ):
        with pytest.raises(BodyError, match=words):
            parse_feedback_body(body, 32)


def totals(*values: float) -> OutcomeTotals:
    out = OutcomeTotals()
    for v in values:
        out = out.add(v)
    return out


def test_outcomes_add_diff_and_restart_like_the_other_counters() -> None:
    early = SetCounters(requests=10, outcomes={"click": totals(1, 0)})
    late = SetCounters(requests=20, outcomes={"click": totals(1, 0, 1, 1), "dwell": totals(3.0)})
    window = late.minus(early)
    assert window.requests == 10
    assert (window.outcomes["click"].count, window.outcomes["click"].total) == (2, 2.0)
    assert window.outcomes["dwell"] == totals(3.0)
    both = early.plus(late)
    assert both.outcomes["click"].count == 6 and both.outcomes["dwell"].count == 1
    assert SetCounters(requests=20, outcomes={"click": totals(1)}).went_down_from(
        early
    )  # fewer outcomes: restarted
    assert not late.went_down_from(early)
    # Through the metrics actor's snapshot: replica by replica, as the gates read it.
    before = MetricsSnapshot(replicas={"r1": {"app": early}})
    after = MetricsSnapshot(
        replicas={"r1": {"app": late}, "r2": {"app": SetCounters(outcomes={"click": totals(0)})}}
    )
    read = after.minus(before)["app"].outcomes["click"]
    assert (read.count, read.total) == (3, 2.0)
    # Counters from before outcomes existed read as having none.
    assert SetCounters.model_validate({"requests": 1, "errors": 0}).outcomes == {}
