"""SnapshotWatchWorkflow: one tick of a model's watch Schedule, publishing a new snapshot if there is one."""

from __future__ import annotations

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RETRY
    from ipnext.activities.metadata import WatchActivities
    from ipnext.contracts.model import WatchInput, WatchResult


@workflow.defn
class SnapshotWatchWorkflow:
    @workflow.run
    async def run(self, input: WatchInput) -> WatchResult:
        return await workflow.execute_activity_method(
            WatchActivities.publish_new_snapshots,
            input,
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary=f"look for new snapshots of {input.model}",
        )
