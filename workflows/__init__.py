"""Temporal workflows: deterministic orchestration of the lifecycle, one workflow per module.

- ModelWorkflow (`model/<name>`): the registry and system of record of one model.
- RolloutWorkflow (`rollout/<model>/<set id>`): moves serving to a new snapshot set.
- SnapshotWatchWorkflow: run by a model's watch Schedule to publish new snapshots.
"""

__all__ = [
    "experiment_workflow",
    "fleet_replan_workflow",
    "fleet_workflow",
    "model_workflow",
    "rollout_workflow",
    "validate_model_workflow",
    "watch_workflow",
]
