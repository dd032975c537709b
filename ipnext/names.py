"""The names every tier shares: workflow ids and types, update/signal/query names, status
vocabularies, search attributes, the frozen base model, and `poll_until`.

Callers address workflows by these names instead of importing the workflow classes, so an
activity or the SDK never imports `ipnext.workflows` (the layering test enforces it). A
name is built here and parsed here, nowhere else.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # at run time `__getattr__` builds the keys, and only then loads temporalio
    from temporalio.common import SearchAttributeKey

__all__ = [
    "ARMS_KEY",
    "FLEET_WORKFLOW_ID",
    "MODEL_KEY",
    "REGIONS_DOWN_KEY",
    "REPLAN_SCHEDULE_ID",
    "REPLAN_WORKFLOW_ID",
    "STATE_KEY",
    "TRAFFIC_KEY",
    "FleetWorkflowNames",
    "Frozen",
    "ModelStatus",
    "ModelWorkflowNames",
    "PollTimeoutError",
    "RolloutOutcome",
    "RolloutState",
    "RolloutWorkflowNames",
    "SetStatus",
    "Workflows",
    "fleet_replan_id",
    "model_name_of",
    "model_workflow_id",
    "poll_until",
    "rollout_workflow_id",
    "validate_workflow_id",
    "wait_until",
    "watch_schedule_id",
]


class Frozen(BaseModel):
    """Every input, result and state that crosses Temporal or Serve: immutable, no unknown fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# -- workflow types, and the handlers each one answers ------------------------------------


class Workflows:
    """Workflow type names as registered on the worker (the class names)."""

    MODEL = "ModelWorkflow"
    ROLLOUT = "RolloutWorkflow"
    WATCH = "SnapshotWatchWorkflow"
    FLEET_REPLAN = "FleetReplanWorkflow"
    VALIDATE_MODEL = "ValidateModelWorkflow"
    FLEET = "FleetWorkflow"
    EXPERIMENT = "ExperimentWorkflow"


class ModelWorkflowNames:
    """Handlers of `ModelWorkflow`."""

    GET = "get"  # query -> ModelState
    PUBLISH = "publish"  # update PublishInput -> PublishResult
    DELETE = "delete"  # update DeleteInput -> DeleteResult
    UPDATE = "update_model"  # update UpdateModelInput -> UpdateModelResult: a new spec
    START_EXPERIMENT = "start_experiment"  # update StartExperimentInput -> ExperimentStarted
    EXPERIMENT_ENDED = "experiment_ended"  # signal ExperimentStatus, from the experiment at its end
    PROMOTE = "promote"  # update PromoteInput -> PublishResult: a held set queued for its rollout
    APPLY_PLAN = "apply_plan"  # signal ApplyPlanInput
    ROLLOUT_ENDED = "rollout_ended"  # signal RolloutEnded, from the rollout child at its end
    RECONCILE = "reconcile"  # signal, no input: check Serve against the record now (worker start)
    ARMS_MOVED = "arms_moved"  # signal ArmsMoved, from the experiment: a capacity move of its arms done


class RolloutWorkflowNames:
    """Handlers of `RolloutWorkflow` (also the Temporal UI's and `temporal workflow signal`'s names)."""

    STATUS = "status"  # query -> RolloutStatus
    PAUSE = "pause"  # signal PauseInput
    RESUME = "resume"  # signal ResumeInput
    ABORT = "abort"  # signal AbortInput
    OVERRIDE_FREEZE = "override_freeze"  # signal FreezeOverride


class ExperimentWorkflowNames:
    """Handlers of `ExperimentWorkflow`."""

    STATUS = "status"  # query -> ExperimentStatus
    STOP = "stop"  # signal StopExperimentInput: end it now, all traffic to control
    MOVE_ARMS = "move_arms"  # signal MoveArmsInput, from the model: both arms onto a new placement


class FleetWorkflowNames:
    """Handlers of `FleetWorkflow` (id `fleet`): the regions' states."""

    REGIONS = "regions"  # query -> FleetStatus
    REGION_DOWN = "region_down"  # update RegionDownInput -> RegionChangeResult
    REGION_UP = "region_up"  # update RegionUpInput -> RegionChangeResult


# -- ids ----------------------------------------------------------------------------------

_MODEL_PREFIX = "model/"
REPLAN_SCHEDULE_ID = "fleet-replan"
REPLAN_WORKFLOW_ID = "fleet-replan/run"
FLEET_WORKFLOW_ID = "fleet"


def fleet_replan_id(kind: str, number: int) -> str:
    """A replan FleetWorkflow starts: `fleet-replan/emergency-<n>` (a region went down) or
    `fleet-replan/return-<n>` (one came back), beside the Schedule's `fleet-replan/run`."""
    return f"{REPLAN_SCHEDULE_ID}/{kind}-{number}"


def model_workflow_id(model: str) -> str:
    return f"{_MODEL_PREFIX}{model}"


def model_name_of(workflow_id: str) -> str:
    """The model a `model/<name>` workflow id names; ValueError for any other id."""
    if not workflow_id.startswith(_MODEL_PREFIX) or len(workflow_id) == len(_MODEL_PREFIX):
        raise ValueError(f"{workflow_id!r} is not a model workflow id (model/<name>)")
    return workflow_id[len(_MODEL_PREFIX) :]


def rollout_workflow_id(model: str, set_id: str) -> str:
    return f"rollout/{model}/{set_id}"


def experiment_workflow_id(model: str, name: str) -> str:
    return f"experiment/{model}/{name}"


def validate_workflow_id(model: str, token: str) -> str:
    """A spec check's id: one per attempt (`token` is the caller's, e.g. a uuid)."""
    return f"validate/{model}/{token}"


def watch_schedule_id(model: str) -> str:
    return f"watch/{model}"


# -- search attributes (registered in temporal-dev.yaml) ----------------------------------
# Built on first use (PEP 562): every spec, contract and the prediction client import this module,
# and the data plane (`ipnext predict`, PredictionClient, a router) must not load temporalio.

if TYPE_CHECKING:
    MODEL_KEY: SearchAttributeKey[str]
    STATE_KEY: SearchAttributeKey[str]
    TRAFFIC_KEY: SearchAttributeKey[int]
    REGIONS_DOWN_KEY: SearchAttributeKey[Sequence[str]]  # FleetWorkflow's down regions
    ARMS_KEY: SearchAttributeKey[Sequence[str]]  # ExperimentWorkflow's "arm=set id"s

# name -> (SearchAttributeKey's constructor, the attribute's name in Temporal)
_SEARCH_ATTRIBUTES = {
    "MODEL_KEY": ("for_keyword", "IpnextModel"),
    "STATE_KEY": ("for_keyword", "IpnextState"),
    "TRAFFIC_KEY": ("for_int", "IpnextTrafficPercent"),
    "REGIONS_DOWN_KEY": ("for_keyword_list", "IpnextRegionsDown"),
    "ARMS_KEY": ("for_keyword_list", "IpnextArms"),
}


def __getattr__(name: str) -> Any:
    if name not in _SEARCH_ATTRIBUTES:
        raise AttributeError(f"module 'ipnext.names' has no attribute {name!r}")
    from temporalio.common import SearchAttributeKey

    constructor, attribute = _SEARCH_ATTRIBUTES[name]
    key = getattr(SearchAttributeKey, constructor)(attribute)
    globals()[name] = key  # once built, a plain attribute
    return key


# -- status vocabularies ------------------------------------------------------------------


class RolloutState(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    PAUSED = "paused"
    COMPLETED = "completed"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"
    REFUSED = "refused"  # a freeze window was in force when it was to start
    CANCELLED = "cancelled"  # Temporal's "Request Cancellation": rolled back like `abort`

    @property
    def is_terminal(self) -> bool:
        """True once the rollout has ended: nothing moves any more and signals are no-ops."""
        return self not in _LIVE_ROLLOUT

    @property
    def is_live(self) -> bool:
        """Running or paused: the states in which on-call signals act."""
        return self in (RolloutState.RUNNING, RolloutState.PAUSED)


_LIVE_ROLLOUT = frozenset({RolloutState.PENDING, RolloutState.RUNNING, RolloutState.PAUSED})


class RolloutOutcome(StrEnum):
    """How a rollout ended (`RolloutResult.outcome`). Only `completed` moved the traffic and
    completes the workflow (Temporal's COMPLETED); every other one left the traffic on the
    previous set and fails the workflow with its result (`RolloutResult.of_failure`)."""

    COMPLETED = "completed"
    ROLLED_BACK = "rolled_back"  # a gate breached
    ABORTED = "aborted"  # the `abort` signal
    CANCELLED = "cancelled"  # Temporal's cancellation (the UI's "Request Cancellation")
    FAILED = "failed"  # an activity failed for good; rolled back
    REFUSED = "refused"  # a freeze window was in force: nothing started

    @classmethod
    def of(cls, state: RolloutState) -> RolloutOutcome | None:
        """The outcome an ended rollout's state names; None while it is live."""
        return None if not state.is_terminal else cls(state.value)


class SetStatus(StrEnum):
    """`SnapshotSet.status`: where a published set is in its life."""

    VALIDATED = "validated"  # queued behind a running rollout
    HELD = "held"  # published with hold: validated and kept, never rolled out by itself
    ROLLING_OUT = "rolling_out"
    SERVING = "serving"
    RETIRED = "retired"  # served, then replaced by a newer set
    SUPERSEDED = "superseded"  # queued, then a newer set went first
    ROLLED_BACK = "rolled_back"
    ABORTED = "aborted"
    REFUSED = "refused"  # a freeze window was in force
    FAILED = "failed"
    CANCELLED = "cancelled"  # its rollout was cancelled from Temporal (rolled back like abort)

    @property
    def never_serves(self) -> bool:
        """The set's rollout ended without it serving: waiting for it is pointless."""
        return self in _NEVER_SERVES


_NEVER_SERVES = frozenset(
    {
        SetStatus.SUPERSEDED,
        SetStatus.ROLLED_BACK,
        SetStatus.ABORTED,
        SetStatus.REFUSED,
        SetStatus.FAILED,
        SetStatus.CANCELLED,
    }
)


class ModelStatus(StrEnum):
    """`ModelState.state`: what a model's registry workflow is doing."""

    EMPTY = "empty"  # registered, nothing serves yet
    ROLLING_OUT = "rolling_out"
    SERVING = "serving"
    DELETING = "deleting"


# -- polling (activities, SDK, CLI and tests; never workflow code, which has no wall clock) --

T = TypeVar("T")


class PollTimeoutError(TimeoutError):
    """`poll_until` ran out of time; `last` is the last value read (None if none was)."""

    def __init__(self, what: str, timeout_s: float, last: object) -> None:
        super().__init__(f"{what}: not reached within {timeout_s:g} s (last seen: {last!r})")
        self.last = last


async def poll_until(
    read: Callable[[], Awaitable[T]],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.25,
    what: str = "condition",
) -> T:
    """Call `read` until `done(value)` holds and return that value.

    Raises `PollTimeoutError` (naming `what` and the last value) once `timeout_s` has
    passed. An exception from `read` propagates at once: retrying what may be a lasting
    failure is the caller's decision.
    """
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        value = await read()
        if done(value):
            return value
        last = value
        if time.monotonic() >= deadline:
            raise PollTimeoutError(what, timeout_s, last)
        await asyncio.sleep(interval_s)


def wait_until(
    read: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.25,
    what: str = "condition",
) -> T:
    """The blocking twin of `poll_until`, for code without an event loop (Ray calls in
    activities, the dev stack). Same contract: the value once `done`, else PollTimeoutError."""
    deadline = time.monotonic() + timeout_s
    while not done(value := read()):
        if time.monotonic() >= deadline:
            raise PollTimeoutError(what, timeout_s, value)
        time.sleep(interval_s)
    return value
