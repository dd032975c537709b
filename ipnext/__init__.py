"""ipnext: the whole life of a model deployment, from publishing to serving.

What a user needs is importable from here, and loaded only when first used (PEP 562): every Ray
Serve replica imports `ipnext.serving.*`, and with it this package, so nothing heavy may run at
`import ipnext`. The names:

- clients: `Client` (the lifecycle, over Temporal), `PredictionClient` and
  `AsyncPredictionClient` (predictions with only the serving URL) and their `Prediction`;
- specs and settings: `ModelSpec`, `load_model_spec`, `SnapshotRef`, `Settings`, `load_settings`;
- what the SDK answers: `ModelState`, `RolloutStatus`;
- snapshot folders: `Manifest`, `write_snapshot`, `import_checkpoint`; the API key header
  `key_header`;
- every error (`ipnext.errors`): `IpnextError` and its tree, each with its `fix`.

Where everything lives (docs/ARCHITECTURE.md): `spec/` what people write, `contracts/` what
crosses a process boundary, `policy/` pure decisions, `store/` the files ipnext keeps, `client/`
the SDK, CLI, worker and dev stack; beside them the card's layers `workflows`, `activities`,
`planner`, `serving`, `kernels` and `examples`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads them
    from ipnext.client.prediction import AsyncPredictionClient, Prediction, PredictionClient
    from ipnext.client.sdk import Client
    from ipnext.contracts.model import ModelState
    from ipnext.contracts.rollout import RolloutStatus
    from ipnext.errors import (
        CheckpointError,
        ExperimentError,
        GenerationError,
        InfeasiblePlanError,
        IpnextError,
        KernelBackendError,
        KernelInputError,
        ModelExistsError,
        ModelNotFoundError,
        ModelRecordError,
        PartInputError,
        PlanningTimeoutError,
        PredictionBadRequestError,
        PredictionDeadlineError,
        PredictionError,
        PredictionNotFoundError,
        PredictionOverloadedError,
        PredictionServerError,
        PredictionTransportError,
        RegionStateError,
        RolloutInputError,
        RolloutPausedError,
        RolloutStateError,
        RolloutStoppedError,
        ServingError,
        SnapshotError,
        SpecError,
        StackError,
        TemporalConnectionError,
        UpdateInputError,
    )
    from ipnext.spec.model import ModelSpec, SnapshotRef, load_model_spec
    from ipnext.spec.settings import Settings, load_settings
    from ipnext.store.keys import key_header
    from ipnext.store.snapshots import Manifest, import_checkpoint, write_snapshot

__version__ = "0.1.0"

__all__ = [
    "AsyncPredictionClient",
    "CheckpointError",
    "Client",
    "ExperimentError",
    "GenerationError",
    "InfeasiblePlanError",
    "IpnextError",
    "KernelBackendError",
    "KernelInputError",
    "Manifest",
    "ModelExistsError",
    "ModelNotFoundError",
    "ModelRecordError",
    "ModelSpec",
    "ModelState",
    "PartInputError",
    "PlanningTimeoutError",
    "Prediction",
    "PredictionBadRequestError",
    "PredictionClient",
    "PredictionDeadlineError",
    "PredictionError",
    "PredictionNotFoundError",
    "PredictionOverloadedError",
    "PredictionServerError",
    "PredictionTransportError",
    "RegionStateError",
    "RolloutInputError",
    "RolloutPausedError",
    "RolloutStateError",
    "RolloutStatus",
    "RolloutStoppedError",
    "ServingError",
    "Settings",
    "SnapshotError",
    "SnapshotRef",
    "SpecError",
    "StackError",
    "TemporalConnectionError",
    "UpdateInputError",
    "__version__",
    "import_checkpoint",
    "key_header",
    "load_model_spec",
    "load_settings",
    "write_snapshot",
]

# name -> the module that defines it, imported on first use.
_EXPORTS: dict[str, str] = {
    # ipnext.client.sdk
    "Client": "ipnext.client.sdk",
    # ipnext.client.prediction
    "AsyncPredictionClient": "ipnext.client.prediction",
    "Prediction": "ipnext.client.prediction",
    "PredictionClient": "ipnext.client.prediction",
    # ipnext.spec.model
    "ModelSpec": "ipnext.spec.model",
    "SnapshotRef": "ipnext.spec.model",
    "load_model_spec": "ipnext.spec.model",
    # ipnext.spec.settings
    "Settings": "ipnext.spec.settings",
    "load_settings": "ipnext.spec.settings",
    # ipnext.contracts.model
    "ModelState": "ipnext.contracts.model",
    # ipnext.contracts.rollout
    "RolloutStatus": "ipnext.contracts.rollout",
    # ipnext.store.snapshots
    "Manifest": "ipnext.store.snapshots",
    "import_checkpoint": "ipnext.store.snapshots",
    "write_snapshot": "ipnext.store.snapshots",
    # ipnext.store.keys
    "key_header": "ipnext.store.keys",
    # ipnext.errors
    "CheckpointError": "ipnext.errors",
    "ExperimentError": "ipnext.errors",
    "GenerationError": "ipnext.errors",
    "InfeasiblePlanError": "ipnext.errors",
    "IpnextError": "ipnext.errors",
    "KernelBackendError": "ipnext.errors",
    "KernelInputError": "ipnext.errors",
    "ModelExistsError": "ipnext.errors",
    "ModelNotFoundError": "ipnext.errors",
    "ModelRecordError": "ipnext.errors",
    "PartInputError": "ipnext.errors",
    "PlanningTimeoutError": "ipnext.errors",
    "PredictionBadRequestError": "ipnext.errors",
    "PredictionDeadlineError": "ipnext.errors",
    "PredictionError": "ipnext.errors",
    "PredictionNotFoundError": "ipnext.errors",
    "PredictionOverloadedError": "ipnext.errors",
    "PredictionServerError": "ipnext.errors",
    "PredictionTransportError": "ipnext.errors",
    "RegionStateError": "ipnext.errors",
    "RolloutInputError": "ipnext.errors",
    "RolloutPausedError": "ipnext.errors",
    "RolloutStateError": "ipnext.errors",
    "RolloutStoppedError": "ipnext.errors",
    "ServingError": "ipnext.errors",
    "SnapshotError": "ipnext.errors",
    "SpecError": "ipnext.errors",
    "StackError": "ipnext.errors",
    "TemporalConnectionError": "ipnext.errors",
    "UpdateInputError": "ipnext.errors",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ipnext' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
