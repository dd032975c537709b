"""Metadata activities: find snapshots that training wrote, and the per-model watch Schedule
that publishes new ones by itself for models that opt in."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path

from temporalio import activity
from temporalio.client import (
    Client,
    Schedule,
    ScheduleActionStartWorkflow,
    ScheduleAlreadyRunningError,
    ScheduleIntervalSpec,
    ScheduleSpec,
    ScheduleUpdate,
    ScheduleUpdateInput,
    WorkflowUpdateFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from ipnext.activities import _context
from ipnext.contracts.model import ModelState, PublishInput, PublishResult, WatchInput, WatchResult
from ipnext.names import Frozen, ModelWorkflowNames, Workflows, model_workflow_id, watch_schedule_id
from ipnext.spec.model import SnapshotSetRequest
from ipnext.store.snapshots import discover, folder_fingerprint, request_from_folder

__all__ = [
    "DiscoverInput",
    "DiscoverResult",
    "RefusedSnapshots",
    "WatchActivities",
    "WatchScheduleInput",
    "discover_snapshots",
]


class DiscoverInput(Frozen):
    model: str
    known_versions: list[str] = []


class DiscoverResult(Frozen):
    requests: list[SnapshotSetRequest]  # oldest first
    fingerprints: list[str] = []  # per request: what changes when training writes it again
    unreadable: list[str] = []  # "<folder>: <why>" for folders whose manifest does not read


class WatchScheduleInput(Frozen):
    model: str
    interval_seconds: float
    enabled: bool


@activity.defn
def discover_snapshots(input: DiscoverInput) -> DiscoverResult:
    roots = _context.settings().snapshot_roots
    known = set(input.known_versions)
    unreadable: list[tuple[Path, str]] = []
    folders = [
        folder
        for folder, manifest in discover(roots, input.model, unreadable)
        if manifest.version not in known
    ]
    return DiscoverResult(
        requests=[request_from_folder(folder) for folder in folders],
        fingerprints=[folder_fingerprint(folder) for folder in folders],
        unreadable=[f"{folder}: {why}" for folder, why in unreadable],
    )


class RefusedSnapshots:
    """The snapshots the watcher offered a model and the model refused, in
    `<state>/watch/<model>.json`: version -> the folder's fingerprint and the reason.

    A refused snapshot is offered again only once training wrote its folder again (its
    fingerprint changed). Without this memory the watcher would publish the same bad snapshot
    every tick, and each refusal adds events to the model's history. The file is the worker's
    cache, not a record: lost or unreadable, it starts empty and costs one more refusal."""

    def __init__(self, state_dir: Path, model: str) -> None:
        self._path = state_dir / "watch" / f"{model}.json"

    def _read(self) -> dict[str, dict[str, str]]:
        try:
            data = json.loads(self._path.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def refused(self, version: str, fingerprint: str) -> bool:
        entry = self._read().get(version)
        return isinstance(entry, dict) and entry.get("fingerprint") == fingerprint

    def remember(self, version: str, fingerprint: str, reason: str) -> None:
        entries = self._read()
        entries[version] = {"fingerprint": fingerprint, "reason": reason, "at": datetime.now(UTC).isoformat()}
        self._path.parent.mkdir(parents=True, exist_ok=True)
        partial = self._path.with_name(f".{self._path.name}.{os.getpid()}")
        partial.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(partial, self._path)  # a reader sees the old file or the new one, never half


class WatchActivities:
    """Activities that talk to Temporal itself (Schedules, the model's Update),
    sharing the worker's client."""

    def __init__(self, client: Client) -> None:
        self._client = client

    @activity.defn
    async def ensure_watch_schedule(self, input: WatchScheduleInput) -> None:
        """Create, update or delete the model's watch Schedule to match its spec."""
        schedule_id = watch_schedule_id(input.model)
        handle = self._client.get_schedule_handle(schedule_id)
        if not input.enabled:
            try:
                await handle.delete()
            except RPCError as err:
                if err.status != RPCStatusCode.NOT_FOUND:
                    raise
            return
        settings = _context.settings()
        schedule = Schedule(
            action=ScheduleActionStartWorkflow(
                Workflows.WATCH,
                WatchInput(model=input.model),
                id=f"watch/{input.model}/run",
                task_queue=settings.temporal.task_queue,
            ),
            spec=ScheduleSpec(
                intervals=[ScheduleIntervalSpec(every=timedelta(seconds=input.interval_seconds))]
            ),
        )
        try:
            await self._client.create_schedule(schedule_id, schedule)
        except ScheduleAlreadyRunningError:

            def replace(_: ScheduleUpdateInput) -> ScheduleUpdate:
                return ScheduleUpdate(schedule=schedule)

            await handle.update(replace)

    @activity.defn
    async def publish_new_snapshots(self, input: WatchInput) -> WatchResult:
        """Publish the newest snapshot the model has not seen (older unseen ones would be
        superseded anyway); not again once the model refused it, until training writes it again."""
        handle = self._client.get_workflow_handle(model_workflow_id(input.model))
        state: ModelState = await handle.query(ModelWorkflowNames.GET, result_type=ModelState)
        known = [s.version for s in state.sets]
        found = discover_snapshots(DiscoverInput(model=input.model, known_versions=known))
        refused = RefusedSnapshots(_context.settings().state_dir, input.model)
        for line in found.unreadable:
            activity.logger.warning("snapshot folder of %s skipped: %s", input.model, line)
        if not found.requests:
            return WatchResult(published=[], rejected=found.unreadable)
        # Only the newest: an older unseen folder must never be published over a newer refusal.
        newest, fingerprint = found.requests[-1], found.fingerprints[-1]
        if refused.refused(newest.version, fingerprint):
            return WatchResult(published=[], rejected=found.unreadable)
        try:
            result: PublishResult = await handle.execute_update(
                ModelWorkflowNames.PUBLISH,
                PublishInput(request=newest, who="snapshot-watcher"),
                result_type=PublishResult,
            )
        except WorkflowUpdateFailedError as err:
            # A bad snapshot is the trainer's to fix: report it once, and offer it again only
            # when its folder changes.
            reason = str(err.cause) if err.cause else str(err)
            activity.logger.warning("snapshot %s of %s refused: %s", newest.version, input.model, reason)
            refused.remember(newest.version, fingerprint, reason)
            return WatchResult(published=[], rejected=[f"{newest.version}: {reason}", *found.unreadable])
        return WatchResult(published=[result.set_id], rejected=found.unreadable)
