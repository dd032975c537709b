"""The ipnext error hierarchy: every error a caller can act on names what was wrong and the fix.

IpnextError
├── SpecError              a model, fleet, demand or config file is malformed (field, value, fix)
├── SnapshotError          a snapshot failed validation: path, file, checksum, format, tensors
├── InfeasiblePlanError    the planner cannot meet a constraint (which one, and why)
├── PlanningTimeoutError   the planner found no plan within its time limit (not a proof of infeasibility)
├── ModelNotFoundError     no model of that name is registered
├── ModelExistsError       a model of that name is already registered
├── UpdateInputError       an update's payload is missing or not its input model (a hand-built client)
├── ExperimentError        an experiment, shadow or promote was refused (which, and why)
├── RolloutInputError      a rollout was started with an input that contradicts itself
├── RolloutStateError      a rollout reached a state its code rules out (a defect; the rollout fails)
├── ModelRecordError       a model's record contradicts itself (a defect; the model workflow fails)
├── ServingError           Ray Serve could not deploy or answer
│   ├── RolloutPausedError  the rollout a caller waits on paused: `.reason`, `.who`, `.status`
│   ├── RolloutStoppedError the rollout a caller waits on ended without the set serving: `.status`
│   └── PredictionError    a prediction (or routing document) request failed; `.status_code` (None: no answer)
│       ├── PredictionBadRequestError   HTTP 400/413: the request is the caller's mistake (also a ValueError)
│       ├── PredictionNotFoundError     HTTP 404: the model serves nowhere reachable (also a LookupError)
│       ├── PredictionServerError       HTTP 5xx, or an error event in a stream: the model failed to answer
│       │   ├── PredictionOverloadedError   HTTP 503/429: shed at once; `.retry_after_s` says when to retry
│       │   └── PredictionDeadlineError     HTTP 504: no answer within the model's deadline
│       └── PredictionTransportError    no HTTP answer: connection refused, timeout, broken stream
├── PartInputError         a request's inputs do not fit a part: the caller's mistake
│                          (HTTP 400; also a ValueError)
├── GenerationError        a generative part failed one answer: the server's fault
│                          (HTTP 500, counted; also a RuntimeError)
├── StackError             the dev stack could not start or stop
│   └── TemporalConnectionError  Temporal refused or did not answer the connection (address, TLS, key)
├── RegionStateError       a region change was refused: unknown region, no who or reason, the last region up
├── KernelInputError       a kernel got a tensor of the wrong shape, dtype, device or range
│                          (also a ValueError)
└── KernelBackendError     backend="triton" was asked for where the kernel cannot run (also a RuntimeError)
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointError",
    "ExperimentError",
    "GenerationError",
    "InfeasiblePlanError",
    "IpnextError",
    "KernelBackendError",
    "KernelInputError",
    "ModelExistsError",
    "ModelNotFoundError",
    "ModelRecordError",
    "NoPlacementError",
    "PartInputError",
    "PlanningTimeoutError",
    "PredictionBadRequestError",
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
    "RolloutStoppedError",
    "ServingError",
    "SnapshotError",
    "SpecError",
    "StackError",
    "TemporalConnectionError",
    "UpdateInputError",
    "error_from_wire",
]


class IpnextError(Exception):
    """Base of every error ipnext raises on purpose."""

    def __init__(
        self, message: str, *, field: str | None = None, value: Any = None, fix: str | None = None
    ) -> None:
        self.message = message  # without the fix
        self.field = field
        self.value = value
        self.fix = fix
        parts = [message]
        if fix:
            parts.append(f"Fix: {fix}")
        super().__init__(" ".join(parts))

    def wire_details(self) -> dict[str, Any]:
        """What crosses a process boundary beside the type name and `str(self)`: `field`, `value`,
        `fix` and a subclass's own attributes (`status_code`, `reason`, ...), as JSON values (any
        other value as its text). `error_from_wire` rebuilds the error from them."""
        return {k: _jsonable(v) for k, v in vars(self).items() if k != "message" and v is not None}


class SpecError(IpnextError, ValueError):
    """A spec (model.yaml, fleet.yaml, demand.yaml, ipnext.yaml) is malformed."""


class SnapshotError(IpnextError, ValueError):
    """A snapshot failed validation; nothing was changed."""


class CheckpointError(IpnextError, ValueError):
    """A Hugging Face checkpoint folder ipnext cannot serve: the message names the file, the
    field, what it holds and what is served."""


class UpdateInputError(IpnextError, ValueError):
    """A workflow update came without its payload, or with one that is not its input model: a
    client other than ipnext's (the SDK and CLI always send the model)."""


class ExperimentError(IpnextError):
    """An experiment, a shadow or a promote was refused: one runs already, the name ran before, the
    treatment is not a held set. Nothing changed."""


class RolloutInputError(IpnextError, ValueError):
    """A RolloutWorkflow was started with an input that contradicts itself (a defect of its caller)."""


class RolloutStateError(IpnextError):
    """A rollout reached a state its code rules out: a defect, so the rollout fails loudly."""


class ModelRecordError(IpnextError):
    """A model's record contradicts itself (a queued set it does not know, a rollout of a set it
    never had): a defect, so the model workflow fails loudly rather than guess."""


class InfeasiblePlanError(IpnextError):
    """No placement meets every constraint; the message names the one that fails."""


class NoPlacementError(InfeasiblePlanError):
    """The exact MIP over every block proved that no placement fits the pools; the message
    names the pools short and by how much."""


class PlanningTimeoutError(IpnextError):
    """The planner found no plan that fits the pools within its time limit; a plan may exist."""


class ModelNotFoundError(IpnextError, LookupError):
    """No model of that name is registered."""


class ModelExistsError(IpnextError):
    """A model of that name is already registered."""


class ServingError(IpnextError):
    """Ray Serve could not deploy an app or answer a request."""


class RolloutPausedError(ServingError):
    """A set's rollout paused while a caller waited for the set to serve (`Client.
    wait_until_serving`): by on-call, by ipnext for too little traffic, or for a freeze window.
    The rollout stays paused; `fix` says how it goes on. `status` is its RolloutStatus."""

    reason: str = ""
    who: str = ""
    status: Any = None

    def __init__(
        self, message: str, *, reason: str, who: str, status: Any = None, fix: str | None = None
    ) -> None:
        super().__init__(message, fix=fix)
        self.reason = reason
        self.who = who
        self.status = status


class RolloutStoppedError(ServingError):
    """A set's rollout ended, or is rolling back, without the set serving (rolled back, aborted,
    failed, refused by a freeze window, or superseded by a newer set) while a caller waited.
    `status` is its RolloutStatus when one was read (None for a superseded set)."""

    status: Any = None

    def __init__(self, message: str, *, status: Any = None, fix: str | None = None) -> None:
        super().__init__(message, fix=fix)
        self.status = status


class PredictionError(ServingError):
    """A prediction request, or the fetch of a routing document, failed. `status_code` is the HTTP
    status of the answer (None when none came); `model` and `region` say where it was sent."""

    status_code: int | None = None
    model: str | None = None
    region: str | None = None
    error_id: str | None = None  # the id under which the router logged the failure
    retry_after_s: float | None = None  # from a `Retry-After` header

    def __init__(
        self,
        message: str,
        *,
        status_code: int | None = None,
        model: str | None = None,
        region: str | None = None,
        fix: str | None = None,
        error_id: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message, fix=fix)
        self.status_code = status_code
        self.model = model
        self.region = region
        self.error_id = error_id
        self.retry_after_s = retry_after_s


class PredictionBadRequestError(PredictionError, ValueError):
    """HTTP 400: the request is malformed or a part refused its inputs (`PartInputError` in the
    part); sending it again will not help."""


class PredictionNotFoundError(PredictionError, LookupError):
    """HTTP 404: no routing document for the model, or no router of it in the chosen region (the
    model is not registered, serves nowhere yet, or was deleted)."""


class PredictionServerError(PredictionError):
    """HTTP 5xx, or an error event in a stream: the model, a part or Serve failed to answer."""


class PredictionOverloadedError(PredictionServerError):
    """HTTP 503 or 429: the model's queue is full (or no set serves yet); the request was shed
    at once, and `retry_after_s` says when to send it again."""


class PredictionDeadlineError(PredictionServerError):
    """HTTP 504: the model did not answer within its deadline (`router.deadline_seconds`)."""


class PredictionTransportError(PredictionError):
    """No HTTP answer at all: the serving URL refused the connection, timed out, or a stream broke."""


class PartInputError(IpnextError, ValueError):
    """A request's inputs do not fit a part (a missing field, a value out of range). The router
    answers 400 and does not count it against the set: rollout gates judge the model, not the
    callers."""


class GenerationError(IpnextError, RuntimeError):
    """A generative part failed while generating one answer (its engine step raised, or the
    engine's driver stopped). The server's fault: the router answers 500 and counts it against
    the set. Only that answer fails; the part keeps serving the others."""


class StackError(IpnextError):
    """The dev stack could not start, or a component of it is not reachable."""


class TemporalConnectionError(StackError):
    """The worker, SDK or CLI could not connect to Temporal: nothing listens at the address, the
    TLS handshake failed (the server's certificate is not trusted, or it refused ours), or the
    server refused the credentials. The message names the address and whether TLS and a key were
    used, never the key."""


class RegionStateError(IpnextError, ValueError):
    """`fleet region down/up` was refused (an unknown region, no `who` or `reason`, the last region
    up): nothing changed."""


class KernelInputError(IpnextError, ValueError):
    """A kernel was called with a tensor of the wrong shape, dtype or device, or with out-of-range data."""


class KernelBackendError(IpnextError, RuntimeError):
    """`backend="triton"` was asked for where the Triton kernel cannot run; nothing falls back silently."""


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)


def _every_error_class(root: type[IpnextError] = IpnextError) -> dict[str, type[IpnextError]]:
    found = {root.__name__: root}
    for sub in root.__subclasses__():
        found |= _every_error_class(sub)
    return found


_FIX_MARK = " Fix: "


def error_from_wire(
    type_name: str | None, message: str, details: dict[str, Any] | None = None
) -> IpnextError:
    """The ipnext error a worker raised, rebuilt in the caller's process from what crossed:
    its class by `type_name` (IpnextError for a name this tree does not hold), `message` as its
    text, and `details` (`wire_details()`) as its attributes. Without details (an error a
    workflow raised by hand) the fix is read from the message's "Fix: ..." tail."""
    cls = _every_error_class().get(type_name or "", IpnextError)
    attrs = dict(details or {})
    fix = attrs.pop("fix", None)
    if fix is None and _FIX_MARK in message:
        fix = message.split(_FIX_MARK, 1)[1]
    bare = message.removesuffix(f"{_FIX_MARK}{fix}") if fix else message
    err = cls.__new__(cls)
    IpnextError.__init__(err, bare, field=attrs.pop("field", None), value=attrs.pop("value", None), fix=fix)
    for name, value in attrs.items():
        setattr(err, name, value)
    return err
