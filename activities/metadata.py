"""Metadata activities: find snapshots that training wrote, and the per-model watch Schedule
that publishes new ones by itself for models that opt in."""

from __future__ import annotations

from datetime import timedelta

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
from ipnext.contracts import Frozen, ModelWorkflowNames, Workflows, model_workflow_id, watch_schedule_id
from ipnext.model import SnapshotSetRequest
from ipnext.registry import (
    ModelState,
    PublishInput,
    PublishResult,
    WatchInput,
    WatchResult,
)
from ipnext.snapshots import discover, request_from_folder

__all__ = [
    "DiscoverInput",
    "DiscoverResult",
    "WatchActivities",
    "WatchScheduleInput",
    "discover_snapshots",
]


class DiscoverInput(Frozen):
    model: str
    known_versions: list[str] = []


class DiscoverResult(Frozen):
    requests: list[SnapshotSetRequest]  # oldest first


class WatchScheduleInput(Frozen):
    model: str
    interval_seconds: float
    enabled: bool


@activity.defn
def discover_snapshots(input: DiscoverInput) -> DiscoverResult:
    roots = _context.settings().snapshot_roots
    known = set(input.known_versions)
    return DiscoverResult(
        requests=[
            request_from_folder(folder)
            for folder, manifest in discover(roots, input.model)
            if manifest.version not in known
        ]
    )


class WatchActivities:
    """Activities that talk to Temporal itself (Schedules, the model's Update), sharing the worker's client."""

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
        """Publish the newest snapshot the model has not seen; older unseen ones would be superseded anyway."""
        handle = self._client.get_workflow_handle(model_workflow_id(input.model))
        state: ModelState = await handle.query(ModelWorkflowNames.GET, result_type=ModelState)
        known = [s.version for s in state.sets]
        found = discover_snapshots(DiscoverInput(model=input.model, known_versions=known))
        if not found.requests:
            return WatchResult(published=[])
        newest = found.requests[-1]
        try:
            result: PublishResult = await handle.execute_update(
                ModelWorkflowNames.PUBLISH,
                PublishInput(request=newest, who="snapshot-watcher"),
                result_type=PublishResult,
            )
        except WorkflowUpdateFailedError as err:
            # A bad snapshot is the trainer's to fix; report it and try again next interval.
            reason = str(err.cause) if err.cause else str(err)
            activity.logger.warning("snapshot %s of %s refused: %s", newest.version, input.model, reason)
            return WatchResult(published=[], rejected=[f"{newest.version}: {reason}"])
        return WatchResult(published=[result.set_id])
