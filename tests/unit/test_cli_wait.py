"""`ipnext snapshot publish --wait` (what the getting-started page runs), with the SDK client
faked at its seam (`with_client`): one line per change of the rollout, then the regions it
serves in; a pause ends the wait with the SDK's error (the CLI's `main` prints it on one line,
exit 2). The real path runs on the stack in the rollout and on-call drills."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ipnext.client.cli import parser
from ipnext.client.cli import snapshot as snapshot_cli
from ipnext.client.sdk import paused_error
from ipnext.contracts.rollout import INSUFFICIENT_TRAFFIC, IPNEXT, PauseRecord, RolloutStatus
from ipnext.errors import RolloutPausedError
from ipnext.names import RolloutState


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

    async def publish_snapshot(self, model: str, folder: Path, **options: Any) -> Any:
        self.published = {"model": model, "folder": folder, **options}
        return SimpleNamespace(set_id="m@2", status="queued")

    async def wait_until_serving(self, model: str, set_id: str, timeout_s: float, on_progress: Any) -> Any:
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
