"""The names Temporal stores, frozen: workflow types, their signal, query and update names, the
activity names and the patch ids. Histories and Schedules in a running cluster hold these strings;
a rename is a nondeterminism error or an orphaned workflow for every run already recorded, so a
refactor that moves code (issue 38's floor plan) must leave this list as it is."""

from __future__ import annotations

import re
from typing import cast

from temporalio import activity, workflow
from temporalio.client import Client

from ipnext.client.worker import WORKFLOWS, worker_activities

from .test_layering import REPO

# workflow type -> (signals, queries, updates)
WORKFLOW_NAMES = {
    "ModelWorkflow": (
        ["apply_plan", "arms_moved", "experiment_ended", "reconcile", "rollout_ended"],
        ["get"],
        ["delete", "promote", "publish", "start_experiment", "update_model"],
    ),
    "RolloutWorkflow": (["abort", "override_freeze", "pause", "resume"], ["status"], []),
    "SnapshotWatchWorkflow": ([], [], []),
    "FleetReplanWorkflow": ([], [], []),
    "ValidateModelWorkflow": ([], [], []),
    "FleetWorkflow": ([], ["regions"], ["region_down", "region_up"]),
    "ExperimentWorkflow": (["move_arms", "stop"], ["status"], []),
}
ACTIVITY_NAMES = [
    "cancel_scheduled_replan",
    "check_pools",
    "check_regions",
    "collect_models",
    "deploy_set_apps",
    "discover_snapshots",
    "ensure_watch_schedule",
    "experiment_outcome",
    "freeze_windows",
    "plan_placement",
    "publish_new_snapshots",
    "read_metrics",
    "read_observed_demand",
    "reconcile_serving",
    "remove_apps",
    "rollout_outcome",
    "route_around_regions",
    "route_traffic",
    "solve_fleet_plan",
    "sync_pinned_references",
    "teardown_model",
    "validate_model_spec",
    "validate_snapshot_set",
    "verify_pinned_set",
]
PATCH_IDS = [
    "bake-baseline-first",
    "bake-holds-while-serving-unchecked",
    "capacity-move-retried",
    "capacity-move-without-down-regions",
    "dead-nodes-by-id",
    "experiment-arms-take-capacity-moves",
    "experiment-arms-take-in-place-replans",
    "observed-demand",
    "pinned-store-references",
    "pool-check",
    "remove-down-regions-apps",
    "restore-after-outside-end",
    "rollout-cancel-aborts",
    "rollout-not-completed-fails",
    "rollout-serving-check",
    "serving-reconcile",
]


def test_workflow_signal_query_and_update_names_are_unchanged() -> None:
    found = {}
    for cls in WORKFLOWS:
        d = workflow._Definition.from_class(cls)
        assert d is not None
        found[d.name] = (
            sorted(k for k in d.signals if k),
            sorted(k for k in d.queries if k),
            sorted(k for k in d.updates if k),
        )
    assert found == WORKFLOW_NAMES


def test_activity_names_are_unchanged() -> None:
    """Every activity the worker registers, by the name Temporal schedules it under."""
    names = set()
    for fn in worker_activities(cast(Client, object())):  # bound, never called
        d = activity._Definition.from_callable(fn)
        assert d is not None
        names.add(d.name)
    assert sorted(names) == ACTIVITY_NAMES


def test_patch_ids_are_unchanged() -> None:
    found = set()
    for f in (REPO / "workflows").glob("*.py"):
        found |= set(re.findall(r'_PATCH = "([^"]+)"', f.read_text()))
    assert sorted(found) == PATCH_IDS
