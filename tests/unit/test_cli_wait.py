"""`ipnext snapshot publish --wait` (what the getting-started page runs) and `ipnext rollout watch`,
with the SDK client faked at its seam (`with_client`): one line per change of the rollout, then
the regions it serves in; a pause that needs a person ends the wait with the SDK's error (the
CLI's `main` prints it on one line, exit 2); `rollout watch` exits 0 only on a completed rollout.
The real path runs on a Temporal dev server in tests/workflows/test_wait.py."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ipnext.client.cli import parser
from ipnext.client.cli import rollout as rollout_cli
from ipnext.client.cli import snapshot as snapshot_cli
from ipnext.client.rollout_wait import paused_error, progress_line
from ipnext.contracts.rollout import INSUFFICIENT_TRAFFIC, IPNEXT, GateReading, PauseRecord, RolloutStatus
from ipnext.errors import RolloutPausedError, RolloutStoppedError, ServingError
from ipnext.names import RolloutOutcome, RolloutState


def status(
    step: str, split: dict[str, float], state: RolloutState = RolloutState.RUNNING, **more: Any
) -> Any:
    return RolloutStatus(
        model="m",
        set_id="m@2",
        from_set_id="m@1",
        state=state,
        step=step,
        traffic_percent=split,
        workflow_id="rollout/m/m@2",
        **more,
    )


class FakeClient:
    def __init__(self, statuses: list[RolloutStatus], error: Exception | None = None) -> None:
        self.statuses, self.error = statuses, error
        self.published: dict[str, Any] = {}
        self.wait_options: dict[str, Any] = {}

    async def publish_snapshot(self, model: str, folder: Path, **options: Any) -> Any:
        self.published = {"model": model, "folder": folder, **options}
        return SimpleNamespace(set_id="m@2", status="queued")

    async def wait_until_serving(
        self, model: str, set_id: str, timeout_s: float, on_progress: Any, **options: Any
    ) -> Any:
        self.wait_options = {"timeout_s": timeout_s, **options}
        for seen in self.statuses:
            on_progress(seen)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(serving_apps={"us-east": "m.us-east.s2.r1", "eu-west": "m.eu-west.s2.r1"})


def run(monkeypatch: pytest.MonkeyPatch, client: FakeClient, *argv: str) -> None:
    async def with_client(settings: Any, action: Any) -> Any:
        return await action(client)

    monkeypatch.setattr(snapshot_cli, "with_client", with_client)
    args = parser().parse_args(["snapshot", "publish", "m", "snaps/m/v2", *argv])
    args.run(args, None)


def test_the_wait_prints_each_change_then_where_the_set_serves(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    client = FakeClient(
        [
            status("step 1/3 (10%): scaling the new set up", {"m@1": 100, "m@2": 0}),
            status("step 1/3 (10%): baking", {"m@1": 90, "m@2": 10}),
            status("done", {"m@2": 100}, state=RolloutState.COMPLETED),
        ]
    )
    run(monkeypatch, client, "--wait", "--timeout", "60")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "published m@2 (queued)"
    assert lines[1].endswith(
        "rollout/m/m@2 running: step 1/3 (10%): scaling the new set up; traffic m@1 100%, m@2 0%"
    )
    assert lines[2].endswith("rollout/m/m@2 running: step 1/3 (10%): baking; traffic m@1 90%, m@2 10%")
    assert lines[3].endswith("rollout/m/m@2 completed: done; traffic m@2 100%")
    assert all(line.startswith("  +") and "s rollout/" in line for line in lines[1:4])
    assert lines[4] == "m@2 serves in ['eu-west', 'us-east']" and len(lines) == 5
    assert client.published["folder"] == Path("snaps/m/v2") and client.published["hold"] is False
    # A CI step's question: waits through the pauses that end by themselves, a line every 10 s.
    assert client.wait_options == {"timeout_s": 60.0, "through_traffic_pause": True, "heartbeat_s": 10.0}


def test_a_pause_ends_the_wait_with_who_why_and_how_to_go_on(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pause = PauseRecord(reason=INSUFFICIENT_TRAFFIC, who=IPNEXT, at=datetime(2026, 12, 6, tzinfo=UTC))
    paused = status(
        "step 1/3 (10%): baking", {"m@1": 90, "m@2": 10}, state=RolloutState.PAUSED, pauses=[pause]
    )
    client = FakeClient([paused], error=paused_error("m", paused, waiting_for="m@2"))
    with pytest.raises(RolloutPausedError) as raised:
        run(monkeypatch, client, "--wait")
    assert "send the model traffic" in str(raised.value.fix) and raised.value.who == IPNEXT
    assert (
        capsys.readouterr()
        .out.splitlines()[1]
        .endswith("paused: step 1/3 (10%): baking; traffic m@1 90%, m@2 10%")
    )


def test_the_progress_line_says_how_many_requests_the_window_still_needs() -> None:
    waiting = GateReading(
        region="us-east",
        metric="error_rate",
        value=None,
        old_value=None,
        limit=None,
        requests=3,
        judged=False,
        breached=False,
    )
    line = progress_line(status("step 1/3 (10%): baking", {"m@2": 10}, gates=[waiting], min_requests=20))
    assert "needs 17 more request(s) on the new set (min_requests 20)" in line, line
    judged = waiting.model_copy(update={"requests": 25, "judged": True})
    assert "needs" not in progress_line(status("baking", {"m@2": 10}, gates=[judged], min_requests=20))


class WatchedClient:
    def __init__(self, statuses: list[RolloutStatus]) -> None:
        self.statuses = statuses

    async def rollout_status(self, model: str) -> RolloutStatus:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


def watch(monkeypatch: pytest.MonkeyPatch, client: Any, *argv: str) -> None:
    async def with_client(settings: Any, action: Any) -> Any:
        return await action(client)

    monkeypatch.setattr(rollout_cli, "with_client", with_client)
    args = parser().parse_args(["rollout", "watch", "m", "--interval", "0", *argv])
    args.run(args, None)


@pytest.mark.parametrize(
    "state", [RolloutState.ROLLED_BACK, RolloutState.ABORTED, RolloutState.CANCELLED, RolloutState.FAILED]
)
def test_rollout_watch_exits_0_only_on_a_completed_rollout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], state: RolloutState
) -> None:
    running = status("step 1/3 (10%): baking", {"m@1": 90, "m@2": 10})
    done = status("done", {"m@2": 100}, state=RolloutState.COMPLETED, outcome=RolloutOutcome.COMPLETED)
    watch(monkeypatch, WatchedClient([running, done]))
    assert "COMPLETED" in capsys.readouterr().out
    ended = status(
        "traffic back on the previous set",
        {"m@1": 100},
        state=state,
        outcome=RolloutOutcome(state.value),
        detail="gate breached: us-east error_rate 0.27",
    )
    with pytest.raises(RolloutStoppedError) as stopped:
        watch(monkeypatch, WatchedClient([running, ended]))
    outcome = state.value.replace("_", " ")
    assert str(stopped.value).startswith(f"m@2 will not serve: {outcome}: gate breached"), stopped.value
    assert "\n" not in str(stopped.value)


def test_rollout_watch_gives_up_at_its_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    paused = status("step 1/3 (10%): baking", {"m@1": 90, "m@2": 10}, state=RolloutState.PAUSED)
    with pytest.raises(ServingError, match="still paused at step 1/3"):
        watch(monkeypatch, WatchedClient([paused]), "--timeout", "0")


def test_a_wait_reads_through_a_few_not_found_answers_but_not_a_deleted_model() -> None:
    """An overloaded Temporal dev server once answered NOT_FOUND for a running model: a wait
    reads on through a few such answers; a model that stays missing ends the wait."""
    import asyncio

    from ipnext.client import rollout_wait
    from ipnext.contracts.model import ModelState
    from ipnext.errors import ModelNotFoundError
    from ipnext.names import ModelStatus

    serving = SimpleNamespace(serving_set="m@2", state=ModelStatus.SERVING, sets=[])

    class Flaky:
        def __init__(self, misses: int) -> None:
            self.misses, self.reads = misses, 0

        async def get_model(self, name: str) -> ModelState:
            self.reads += 1
            if self.reads <= self.misses:
                raise ModelNotFoundError(f"model {name!r} is not registered")
            return serving  # type: ignore[return-value]

        async def rollout_status(self, name: str) -> None:
            return None

    rollout_wait.WAIT_INTERVAL_S, interval = 0.0, rollout_wait.WAIT_INTERVAL_S
    try:
        flaky = Flaky(misses=rollout_wait.NOT_FOUND_READS - 1)
        assert asyncio.run(rollout_wait.wait_until_serving(flaky, "m", "m@2", 30)) is serving
        gone = Flaky(misses=10**6)
        with pytest.raises(ModelNotFoundError):
            asyncio.run(rollout_wait.wait_until_serving(gone, "m", "m@2", 30))
        assert gone.reads == rollout_wait.NOT_FOUND_READS
    finally:
        rollout_wait.WAIT_INTERVAL_S = interval
