"""`heartbeat_throughout`: an activity blocked in one long call (the writer's first apply on a
Ray cluster just restarted) still heartbeats, so the workflows' heartbeat timeout does not end
an attempt that is only slow. Run in Temporal's ActivityEnvironment, which records heartbeats;
the activity waits for the beat it expects (no sleep stands in for it), so a machine's speed
changes how long the test takes, never what it finds."""

from __future__ import annotations

import threading

import pytest
from temporalio.testing import ActivityEnvironment

from ipnext.activities import _context
from ipnext.activities.reconcile import reconcile_serving
from ipnext.activities.serving import deploy_set_apps, route_traffic

PATIENCE_S = 60.0  # a failing test's wait, never a passing one's


@pytest.fixture(autouse=True)
def _fast_beats(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_context, "HEARTBEAT_EVERY_S", 0.01)


def _blocked_until_beats(beats: int, beaten: threading.Event, seen: list[object]) -> tuple[int, list[object]]:
    """What the activity sees: it blocks (as in one Ray call) until `beats` heartbeats came."""
    beaten.wait(PATIENCE_S)
    return len(seen), list(seen[:1])


def test_a_blocked_activity_heartbeats_from_beside_its_call_and_stops_when_it_returns() -> None:
    env, seen, beaten = ActivityEnvironment(), [], threading.Event()

    def on_heartbeat(*details: object) -> None:
        seen.append(details[0] if details else None)
        if len(seen) >= 3:
            beaten.set()

    env.on_heartbeat = on_heartbeat
    wrapped = _context.heartbeat_throughout(_blocked_until_beats)
    count, first = env.run(wrapped, 3, beaten, seen)
    assert count >= 3 and first == ["working"], (count, first)
    after = len(seen)
    # The helper thread was joined on return: nothing beats for an activity that ended.
    assert not any(t.name.startswith("heartbeat-") for t in threading.enumerate())
    assert len(seen) == after


def test_an_error_in_the_activity_ends_the_heartbeat_and_propagates() -> None:
    def fails() -> None:
        raise RuntimeError("Serve refused the config")

    with pytest.raises(RuntimeError, match="Serve refused"):
        ActivityEnvironment().run(_context.heartbeat_throughout(fails))
    assert not any(t.name.startswith("heartbeat-") for t in threading.enumerate())


@pytest.mark.parametrize("activity_fn", [reconcile_serving, deploy_set_apps, route_traffic])
def test_the_serve_activities_with_a_heartbeat_timeout_beat_throughout(activity_fn: object) -> None:
    """The activities the workflows run with `heartbeat_timeout` whose Ray calls block: each is
    wrapped (its activity name and input type still the function's own)."""
    from temporalio import activity

    defn = activity._Definition.from_callable(activity_fn)  # type: ignore[arg-type]
    assert defn is not None and defn.name == activity_fn.__name__  # type: ignore[attr-defined]
    assert getattr(activity_fn, "__wrapped__", None) is not None, "not wrapped by heartbeat_throughout"
    assert defn.arg_types and defn.arg_types[0].__name__.endswith("Input"), defn.arg_types


def _blocked_until_released(released: threading.Event) -> bool:
    """What a hung Ray call looks like to the activity: it returns only when the test lets it."""
    return released.wait(PATIENCE_S)


def _beats_until_they_stop(monkeypatch: pytest.MonkeyPatch, addresses: list[str | None]) -> tuple[int, int]:
    """Run a wrapped hung call; the cluster address reads `addresses` in turn (the last one
    repeats). Returns the beats seen when the helper said it stopped (its warning, the last thing
    it does), and those seen once the call returned."""
    monkeypatch.setattr(
        _context, "cluster_address", lambda: addresses.pop(0) if len(addresses) > 1 else addresses[0]
    )
    stopped, said = threading.Event(), []
    monkeypatch.setattr(
        _context.activity.logger,
        "warning",
        lambda message, *args, **_: (said.append(message % args), stopped.set()),
    )
    env, seen, released = ActivityEnvironment(), [], threading.Event()
    env.on_heartbeat = lambda *details: seen.append(details)
    runner = threading.Thread(
        target=env.run, args=(_context.heartbeat_throughout(_blocked_until_released), released)
    )
    runner.start()
    try:
        assert stopped.wait(PATIENCE_S), "the beats never stopped"
        at_stop = len(seen)
    finally:
        released.set()
        runner.join(PATIENCE_S)
    assert said and "no more heartbeats" in said[0], said
    return at_stop, len(seen)


def test_the_beats_stop_when_the_ray_cluster_moves_during_the_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head started again at a new address: the attempt's calls wait on a dead cluster, so
    its beats stop and the heartbeat timeout ends it; the retry connects to the new one."""
    addresses: list[str | None] = [
        "10.0.0.1:6379",
        "10.0.0.1:6379",
        "10.0.0.1:6379",
        "10.0.0.1:6379",
        "10.0.0.2:6379",
    ]
    stopped, later = _beats_until_they_stop(monkeypatch, addresses)
    assert stopped == 3 and later == stopped, (stopped, later)  # 3 beats on the first cluster, none after


def test_a_cluster_address_that_cannot_be_read_is_no_move(monkeypatch: pytest.MonkeyPatch) -> None:
    """A file mid-rewrite (None) is no evidence of a move: the beats go on, up to the limit."""
    monkeypatch.setattr(_context, "HEARTBEAT_LIMIT_S", 0.3)
    stopped, _ = _beats_until_they_stop(monkeypatch, ["10.0.0.1:6379", None, None, "10.0.0.1:6379"])
    assert stopped >= 5, stopped  # beats went on past the unreadable reads, until the limit


def test_the_beats_stop_after_the_limit_so_a_hung_call_ends_its_attempt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_context, "HEARTBEAT_LIMIT_S", 0.2)
    stopped, later = _beats_until_they_stop(monkeypatch, ["10.0.0.1:6379"])
    assert stopped >= 1 and later == stopped, (stopped, later)
