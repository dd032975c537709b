"""The ipnext worker: runs the lifecycle workflows and activities on the configured task queue.

Run it with `python -m ipnext.client.worker` (the dev stack does). It stops cleanly on
SIGTERM or SIGINT, finishing the activities it is running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from temporalio.client import Client
from temporalio.service import RPCError
from temporalio.worker import Worker

from ipnext.activities import spec_check
from ipnext.activities.fleet import FleetActivities, read_observed_demand, solve_fleet_plan
from ipnext.activities.freeze import freeze_windows
from ipnext.activities.metadata import WatchActivities, discover_snapshots
from ipnext.activities.pinned_refs import PinnedActivities
from ipnext.activities.plan import plan_placement
from ipnext.activities.pool_check import PoolCheckActivities
from ipnext.activities.reconcile import reconcile_serving
from ipnext.activities.regions import RegionActivities, check_regions
from ipnext.activities.rollouts import RolloutActivities
from ipnext.activities.serving import (
    deploy_set_apps,
    read_metrics,
    remove_apps,
    route_traffic,
    teardown_model,
)
from ipnext.activities.validate import validate_model_spec, validate_snapshot_set, verify_pinned_set
from ipnext.client.fleet import ensure_fleet_workflow
from ipnext.client.temporal import connect_client, temporal_connection
from ipnext.contracts.identity import ReadIdentity
from ipnext.names import ModelWorkflowNames, Workflows
from ipnext.spec.settings import Settings, load_settings
from ipnext.workflows.experiment_workflow import ExperimentWorkflow
from ipnext.workflows.fleet_replan_workflow import FleetReplanWorkflow
from ipnext.workflows.fleet_workflow import FleetWorkflow
from ipnext.workflows.model_workflow import ModelWorkflow
from ipnext.workflows.rollout_workflow import RolloutWorkflow
from ipnext.workflows.validate_model_workflow import ValidateModelWorkflow
from ipnext.workflows.watch_workflow import SnapshotWatchWorkflow

__all__ = ["INTERCEPTORS", "WORKFLOWS", "run_worker"]

WORKFLOWS = [
    ModelWorkflow,
    RolloutWorkflow,
    SnapshotWatchWorkflow,
    FleetReplanWorkflow,
    ValidateModelWorkflow,
    FleetWorkflow,
    ExperimentWorkflow,
]
# Signal and update handlers read the sender's `ipnext-identity` header (ipnext.contracts.identity).
INTERCEPTORS = [ReadIdentity()]
# Sync activities (Ray calls, hashing, torch loads) run on these threads.
ACTIVITY_THREADS = 8


def worker_activities(client: Client) -> list[Callable[..., Any]]:
    """Every activity the worker runs: the module-level ones, and those bound to the Temporal
    client they call (Schedules, other workflows' outcomes)."""
    watch = WatchActivities(client)
    fleet = FleetActivities(client)
    rollouts = RolloutActivities(client)
    regions = RegionActivities(client)
    pools = PoolCheckActivities(client)
    pinned = PinnedActivities(client)
    return [
        validate_model_spec,
        validate_snapshot_set,
        verify_pinned_set,
        pinned.sync_pinned_references,
        plan_placement,
        discover_snapshots,
        deploy_set_apps,
        route_traffic,
        read_metrics,
        freeze_windows,
        remove_apps,
        teardown_model,
        reconcile_serving,
        rollouts.rollout_outcome,
        rollouts.experiment_outcome,
        watch.ensure_watch_schedule,
        watch.publish_new_snapshots,
        fleet.collect_models,
        read_observed_demand,
        solve_fleet_plan,
        check_regions,
        regions.route_around_regions,
        regions.cancel_scheduled_replan,
        pools.check_pools,
    ]


async def run_worker(
    settings: Settings, ready_file: Path | None = None, stop: asyncio.Event | None = None
) -> None:
    client = await connect_client(settings)
    # What the log shows of the connection: TLS or not, a key or not (never the key).
    logging.getLogger(__name__).info("connected to Temporal at %s", temporal_connection(settings).describe())
    stop = stop or asyncio.Event()
    # The factory checker starts beside the worker's own start; a check waits for it if need be.
    threading.Thread(target=_warm_checker, name="factory-checker", daemon=True).start()
    try:
        with ThreadPoolExecutor(max_workers=ACTIVITY_THREADS) as executor:
            worker = Worker(
                client,
                task_queue=settings.temporal.task_queue,
                workflows=WORKFLOWS,
                activities=worker_activities(client),
                activity_executor=executor,
                interceptors=INTERCEPTORS,
            )
            async with worker:
                if ready_file is not None:
                    ready_file.write_text("ready\n")
                # This worker may start because the stack restarted: Serve may have lost every
                # app. Each model checks now rather than at its next interval.
                nudge = asyncio.create_task(_ask_models_to_reconcile(client))
                fleet_started = asyncio.create_task(_ensure_fleet(client, settings))
                await stop.wait()
                nudge.cancel()
                fleet_started.cancel()

    finally:
        spec_check.stop_checker()


async def _ask_models_to_reconcile(client: Client) -> None:
    """Signal `reconcile` to every running model workflow (best effort: a model this misses
    still checks at its next interval)."""
    log = logging.getLogger(__name__)
    try:
        query = f'WorkflowType = "{Workflows.MODEL}" AND ExecutionStatus = "Running"'
        async for execution in client.list_workflows(query):
            with contextlib.suppress(RPCError):
                await client.get_workflow_handle(execution.id).signal(ModelWorkflowNames.RECONCILE)
    except RPCError as err:
        log.warning("could not ask the models to check their serving: %s", err)


async def _ensure_fleet(client: Client, settings: Settings) -> None:
    """Start the `fleet` workflow (regions' states) unless it runs: every worker start makes
    sure of it, as `ipnext dev up` starts a worker."""
    try:
        run_id = await ensure_fleet_workflow(client, settings)
        logging.getLogger(__name__).info("fleet workflow running (run %s)", run_id)
    except RPCError as err:
        logging.getLogger(__name__).warning("could not start the fleet workflow: %s", err)


def _warm_checker() -> None:
    try:
        spec_check.start_checker()
    except Exception:  # the first check tries again, and fails its activity retryably
        logging.getLogger(__name__).exception("the factory checker did not start")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings()
    logging.getLogger(__name__).info("ipnext worker: %s", settings.describe_source())
    ready = settings.state_dir / "worker.ready"
    ready.unlink(missing_ok=True)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await run_worker(settings, ready, stop)
        finally:
            ready.unlink(missing_ok=True)

    asyncio.run(serve())


if __name__ == "__main__":
    main()
