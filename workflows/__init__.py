"""Temporal workflows: deterministic orchestration of the lifecycle, one workflow per module.

- ModelWorkflow (`model/<name>`): the registry and system of record of one model.
- RolloutWorkflow (`rollout/<model>/<set id>`): moves serving to a new snapshot set.
- SnapshotWatchWorkflow: run by a model's watch Schedule to publish new snapshots.
"""
