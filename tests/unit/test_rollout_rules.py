"""The pure rollout rules: gate arithmetic over metrics windows, step weights and replica
scaling, and freeze windows."""

from __future__ import annotations

from datetime import UTC, date, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from ipnext.activities.freeze import load_freeze_calendar
from ipnext.contracts.counters import SetCounters
from ipnext.contracts.freeze import FreezeWindow, active_freeze
from ipnext.errors import SpecError
from ipnext.policy.gates import evaluate_gates, judge_window, mix_weights, scaled_replicas, window_counters
from ipnext.spec.model import GateSpec

GATES = [
    GateSpec(metric="error_rate", max=0.01),
    GateSpec(metric="latency_p99_ms", max_ratio_to_old=1.5, floor=20),
]


def counters(requests: int, errors: int = 0, latency_ms: float = 5.0) -> SetCounters:
    c = SetCounters(requests=requests, errors=errors)
    for _ in range(requests - errors):
        c.observe("latency_ms", latency_ms)
    return c


def test_healthy_new_set_passes_every_gate() -> None:
    readings = evaluate_gates(GATES, "us-east", counters(50), counters(500), min_requests=100)
    assert [r.breached for r in readings] == [False, False] and all(r.judged for r in readings)


def test_error_rate_over_its_max_breaches() -> None:
    readings = evaluate_gates(GATES, "us-east", counters(50, errors=1), counters(500), min_requests=100)
    assert readings[0].breached and readings[0].value == pytest.approx(0.02) and readings[0].limit == 0.01


def test_latency_against_the_old_set_never_fails_under_its_floor() -> None:
    slow_but_under_floor = evaluate_gates(
        GATES, "r", counters(50, latency_ms=14), counters(50, latency_ms=2), 10
    )
    assert not slow_but_under_floor[1].breached  # ~14 ms > 1.5 x ~2 ms, but under the 20 ms floor
    slow = evaluate_gates(GATES, "r", counters(50, latency_ms=90), counters(50, latency_ms=40), 10)
    assert slow[1].breached and slow[1].value == pytest.approx(90, rel=0.05)
    assert slow[1].old_value == pytest.approx(40, rel=0.05) and slow[1].limit == pytest.approx(
        1.5 * slow[1].old_value
    )


def test_gates_wait_for_enough_requests() -> None:
    readings = evaluate_gates(GATES, "r", counters(3, errors=3), counters(500), min_requests=100)
    assert not any(r.judged or r.breached for r in readings)
    # min_requests below the sample floor: judged from that many on.
    assert evaluate_gates(GATES, "r", counters(3, errors=3), counters(500), min_requests=3)[0].breached


def test_window_counters_diff_two_snapshots_over_the_apps() -> None:
    before = {"sets": {"a": counters(10).model_dump(), "b": counters(5, errors=1).model_dump()}}
    after = {"sets": {"a": counters(30).model_dump(), "b": counters(9, errors=3).model_dump()}}
    both = window_counters(before, after, {"a", "b"})
    assert (both.requests, both.errors) == (24, 2)
    assert sum(both.histograms["latency_ms"]) == 22
    assert window_counters(None, after, {"b"}).requests == 9


def by_replica(**replicas: dict[str, SetCounters]) -> dict[str, object]:
    """A metrics actor's snapshot: each replica's counters per set app (and their sums)."""
    sets: dict[str, SetCounters] = {}
    for apps in replicas.values():
        for app, c in apps.items():
            sets[app] = sets.get(app, SetCounters()).plus(c)
    return {
        "sets": {a: c.model_dump() for a, c in sets.items()},
        "replicas": {r: {a: c.model_dump() for a, c in apps.items()} for r, apps in replicas.items()},
    }


def test_a_restarted_metrics_actor_neither_loses_nor_invents_requests() -> None:
    before = by_replica(r1={"new": counters(10)}, r2={"new": counters(100, errors=1)})
    # The actor restarted empty; r1 has pushed again, r2 not yet: r2 counts nothing this time.
    refilling = by_replica(r1={"new": counters(15)})
    assert window_counters(before, refilling, {"new"}).requests == 5
    assert window_counters(before, by_replica(), {"new"}).requests == 0  # nobody pushed yet
    # r2 is back with its whole cumulative count: only what it served since `before` counts.
    after = by_replica(r1={"new": counters(20)}, r2={"new": counters(130, errors=1)})
    window = window_counters(before, after, {"new"})
    assert (window.requests, window.errors) == (10 + 30, 0)
    assert sum(window.histograms["latency_ms"]) == 40


def test_a_new_or_restarted_replica_counts_from_zero() -> None:
    before = by_replica(r1={"new": counters(50)})
    after = by_replica(r1={"new": counters(4, errors=2)}, r2={"new": counters(6)})  # r1 restarted
    window = window_counters(before, after, {"new"})
    assert (window.requests, window.errors) == (10, 2)
    assert all(n >= 0 for n in window.histograms["latency_ms"])
    readings, requests = judge_window(GATES, 5, ["r"], {"r": before}, {"r": after}, {"new"}, set())
    assert requests == 10 and readings[0].breached  # 2 of 10 failed: a real breach, from real requests


def test_judge_window_reads_every_region_and_sums_the_new_sets_requests() -> None:
    before = {"us-east": {"sets": {"new": counters(10).model_dump(), "old": counters(90).model_dump()}}}
    after = {
        "us-east": {"sets": {"new": counters(30).model_dump(), "old": counters(200).model_dump()}},
        "eu-west": {"sets": {"new": counters(12, errors=6).model_dump()}},  # no read before: all counts
    }
    readings, requests = judge_window(GATES, 10, ["eu-west", "us-east"], before, after, {"new"}, {"old"})
    assert requests == 20 + 12
    assert [(r.region, r.metric, r.breached) for r in readings] == [
        ("eu-west", "error_rate", True),
        ("eu-west", "latency_p99_ms", False),
        ("us-east", "error_rate", False),
        ("us-east", "latency_p99_ms", False),
    ]
    assert readings[0].describe() == "eu-west error_rate 0.5 (limit 0.01, 12 req) BREACH"
    assert readings[3].describe().endswith("(limit 20, 20 req) ok")


def test_mix_weights_moves_each_router_part_way() -> None:
    start = {"us-east": {"old": 100.0}}
    end = {"us-east": {"new-e": 100.0}, "eu-west": {"new-w": 100.0}}
    assert mix_weights(start, end, 25) == {
        "eu-west": {"new-w": 100.0},
        "us-east": {"new-e": 25.0, "old": 75.0},
    }
    assert mix_weights(start, end, 100)["us-east"] == {"new-e": 100.0}


@pytest.mark.parametrize(
    ("replicas", "share", "expected"), [(10, 0.01, 1), (10, 0.25, 3), (10, 0.5, 5), (3, 1.0, 3), (0, 0.5, 0)]
)
def test_scaled_replicas_round_up(replicas: int, share: float, expected: int) -> None:
    assert scaled_replicas(replicas, share) == expected


def test_freeze_windows_from_dates_and_datetimes() -> None:
    day = FreezeWindow.model_validate({"date": "2026-12-25", "reason": "holidays"})
    assert day.start == datetime(2026, 12, 25, tzinfo=UTC) and day.end == datetime(2026, 12, 26, tzinfo=UTC)
    span = FreezeWindow.model_validate(
        {"start": date(2026, 12, 24), "end": date(2026, 12, 26), "reason": "x"}
    )
    assert span.end == datetime(2026, 12, 27, tzinfo=UTC)  # the end day is included
    exact = FreezeWindow.model_validate(
        {"start": "2026-11-27T08:00:00", "end": "2026-11-27T20:00:00+00:00", "reason": "launch"}
    )
    assert active_freeze([day, span, exact], datetime(2026, 12, 25, 12, tzinfo=UTC)) == span
    assert active_freeze([day, span, exact], datetime(2026, 11, 27, 7, 59, tzinfo=UTC)) is None
    assert active_freeze([day, span, exact], datetime(2026, 11, 27, 8, tzinfo=UTC)) == exact


def test_bad_freeze_windows_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="not after start"):
        FreezeWindow.model_validate({"start": "2026-12-26", "end": "2026-12-24", "reason": "x"})
    with pytest.raises(ValidationError, match="give date"):
        FreezeWindow.model_validate({"reason": "x"})
    bad = tmp_path / "freeze.yaml"
    bad.write_text("freezes:\n  - {date: 2026-12-25}\n")
    with pytest.raises(SpecError, match="reason"):
        load_freeze_calendar(bad)
    good = tmp_path / "ok.yaml"
    good.write_text("freezes:\n  - {date: 2026-12-25, reason: holidays}\n")
    assert load_freeze_calendar(good)[0].reason == "holidays"
    assert load_freeze_calendar(None) == []


def test_watch_view_shows_each_changed_part_of_an_independent_rollout() -> None:
    from ipnext.client.cli.rollout import render_rollout
    from ipnext.contracts.rollout import RolloutStatus
    from ipnext.names import RolloutState

    status = RolloutStatus(
        model="m",
        set_id="m@2",
        from_set_id="m@1",
        state=RolloutState.RUNNING,
        step="dense step 1/2 (50%): baking",
        traffic_percent={"m@2": 75.0, "m@1": 25.0},
        workflow_id="rollout/m/m@2",
        steps=[50, 100, 50, 100],
        steps_done=2,
        part="dense",
        part_traffic={"embed": 100.0, "dense": 50.0},
    )
    view = render_rollout(status).splitlines()
    assert view[1].startswith("steps: [50%] [100%]  50%   100% ")
    assert view[3] == "parts on the new set: embed 100%, dense 50% (moving: dense)"
    synchronized = status.model_copy(update={"part": None, "part_traffic": {}})
    assert not any(line.startswith("parts on") for line in render_rollout(synchronized).splitlines())
