"""The one Temporal client factory: worker, SDK, CLI and tests all connect through `connect_client`,
which sets the pydantic data converter, the TLS and API key of `temporal` in the settings, and
(for the SDK and CLI) the operator identity header; a failure to connect is a TemporalConnectionError.
`temporal_errors` turns what the worker raised back into the caller's ipnext errors.

A process that connected lets go of Temporal's native runtime at exit, before the interpreter
finalizes (`_release_runtime_at_exit`): left to finalization, its Tokio threads call into a
Python that is half torn down, and a script that did all its work dies of SIGABRT or SIGSEGV
("PyGILState_Release: thread state ... must be current"; temporalio/sdk-python#300). Measured
on the 2-core development machine beside two busy cores: a script that only connects died in
8 of 40 runs as it exited; with the runtime let go at exit, in 0 of 40."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import ipaddress
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import temporalio.runtime
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, WorkflowExecutionStatus
from temporalio.api.failure.v1 import Failure
from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryReverseRequest
from temporalio.client import Client, WorkflowFailureError, WorkflowUpdateFailedError
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DefaultFailureConverter, PayloadConverter
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode, TLSConfig

from ipnext.contracts.identity import SendIdentity
from ipnext.contracts.rollout import ROLLOUT_FAILURE_TYPES
from ipnext.errors import IpnextError, SpecError, TemporalConnectionError, error_from_wire
from ipnext.spec.settings import Settings

__all__ = [
    "API_KEY_ENV",
    "DATA_CONVERTER",
    "TemporalConnection",
    "connect_client",
    "from_temporal",
    "stuck_reason",
    "temporal_connection",
    "temporal_errors",
]

API_KEY_ENV = "IPNEXT_TEMPORAL_API_KEY"


@dataclass(frozen=True)
class TemporalConnection:
    """What `connect_client` hands to Temporal: the address, TLS (None: plaintext), the API key."""

    address: str
    namespace: str
    tls: TLSConfig | None
    api_key: str | None

    def describe(self) -> str:
        """For errors and logs: never the key, only whether one is sent."""
        tls = "TLS" if self.tls is not None else "plaintext"
        key = ", with an API key" if self.api_key else ""
        return f"{self.address} (namespace {self.namespace}, {tls}{key})"


def _read(path: Path, field: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise SpecError(
            f"{field}: cannot read {path}: {err.strerror or err}.",
            field=field,
            value=str(path),
            fix=f"point {field} at a readable PEM file (relative paths are relative to the config file)",
        ) from None
    if not data.strip():
        raise SpecError(f"{field}: {path} is empty.", field=field, value=str(path), fix="give a PEM file")
    return data


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def temporal_connection(settings: Settings, environ: Mapping[str, str] | None = None) -> TemporalConnection:
    """Read the TLS files and the API key the settings name (no network). Raises SpecError naming
    the field when a file cannot be read, or when an API key would travel in plaintext beyond
    this machine."""
    environ = os.environ if environ is None else environ
    temporal = settings.temporal
    tls: TLSConfig | None = None
    if temporal.tls is not None:
        t = temporal.tls
        tls = TLSConfig(
            server_root_ca_cert=_read(t.ca_file, "temporal.tls.ca_file") if t.ca_file else None,
            client_cert=_read(t.cert_file, "temporal.tls.cert_file") if t.cert_file else None,
            client_private_key=_read(t.key_file, "temporal.tls.key_file") if t.key_file else None,
            domain=t.server_name,
        )
    api_key = environ.get(API_KEY_ENV, "").strip() or None
    if api_key is None and temporal.api_key_file is not None:
        api_key = _read(temporal.api_key_file, "temporal.api_key_file").decode().strip() or None
        if api_key is None:
            raise SpecError(
                f"temporal.api_key_file: {temporal.api_key_file} holds no key.",
                field="temporal.api_key_file",
                value=str(temporal.api_key_file),
                fix=f"write the key in it, or unset it (or set {API_KEY_ENV})",
            )
    address = settings.temporal_address
    if tls is not None and settings.temporal.address is None:
        raise SpecError(
            "temporal.tls is set but temporal.address is not: the dev server `ipnext dev up` starts "
            "listens on loopback without TLS.",
            field="temporal.address",
            value=None,
            fix="set temporal.address (or TEMPORAL_ADDRESS) to the TLS server, or remove temporal.tls",
        )
    if api_key is not None and tls is None and not _is_loopback(address):
        raise SpecError(
            f"temporal: an API key is configured but TLS is not, and {address} is not this machine: "
            "the key would cross the network in plaintext.",
            field="temporal.tls",
            value=None,
            fix="add a `temporal.tls` section (`tls: {}` trusts the system's CAs)",
        )
    return TemporalConnection(address=address, namespace=temporal.namespace, tls=tls, api_key=api_key)


class OutcomeFailureConverter(DefaultFailureConverter):
    """Temporal's failure converter, but a rollout's outcome (a rollout that did not complete
    fails its workflow with it: contracts.rollout.RolloutResult) carries no stack trace: it is
    an outcome, not a crash, and the trace would show the worker's file paths in the UI."""

    def to_failure(
        self, exception: BaseException, payload_converter: PayloadConverter, failure: Failure
    ) -> None:
        super().to_failure(exception, payload_converter, failure)
        if isinstance(exception, ApplicationError) and exception.type in ROLLOUT_FAILURE_TYPES:
            failure.stack_trace = ""


# Every client ipnext connects, and so every worker: pydantic payloads, outcome failures bare.
DATA_CONVERTER = dataclasses.replace(pydantic_data_converter, failure_converter_class=OutcomeFailureConverter)

_RUNTIME_RELEASED_AT_EXIT: list[bool] = []  # registered once per process


def _release_runtime_at_exit() -> None:
    """At exit (atexit runs before finalization, with every thread still whole): drop this
    process's reference to Temporal's default runtime and collect, so the native runtime shuts
    its threads down while Python can still serve them. A client the program still holds (a
    module global, a daemon thread's) keeps the runtime alive: then it goes at finalization,
    as it would without this."""
    runtime_ref = getattr(temporalio.runtime, "_runtime_ref", None)
    if runtime_ref is not None and hasattr(runtime_ref, "_default_runtime"):
        runtime_ref._default_runtime = None  # the next Runtime.default() makes a fresh one
    gc.collect()


def _register_runtime_release() -> None:
    if not _RUNTIME_RELEASED_AT_EXIT:
        _RUNTIME_RELEASED_AT_EXIT.append(True)
        atexit.register(_release_runtime_at_exit)


async def connect_client(settings: Settings, *, identity: str | None = None) -> Client:
    """A Temporal client for the settings' server. `identity` (the SDK's and CLI's operator)
    goes in the `ipnext-identity` header of every start, signal and update, and is the client's
    Temporal identity; the worker passes none. Connection refused, a TLS handshake refused either
    way, or credentials refused raise TemporalConnectionError naming the address and the fix."""
    connection = temporal_connection(settings)
    _register_runtime_release()
    try:
        return await Client.connect(
            connection.address,
            namespace=connection.namespace,
            data_converter=DATA_CONVERTER,
            tls=connection.tls if connection.tls is not None else False,
            api_key=connection.api_key,
            interceptors=[SendIdentity(identity)] if identity else [],
            identity=identity,  # None: Temporal's default (<pid>@<host>)
        )
    except (RuntimeError, RPCError) as err:
        raise TemporalConnectionError(
            f"cannot connect to Temporal at {connection.describe()}: {_first_line(err)}",
            field="temporal",
            value=connection.address,
            fix=_connect_fix(settings, connection),
        ) from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _connect_fix(settings: Settings, connection: TemporalConnection) -> str:
    if settings.temporal.address is None:
        return "run `ipnext dev up`, or set TEMPORAL_ADDRESS to a running Temporal"
    if connection.tls is None:
        return (
            "check that Temporal listens there; a server that requires TLS needs a `temporal.tls` "
            "section (ca_file, cert_file, key_file, server_name)"
        )
    return (
        "check that Temporal listens there, that temporal.tls.ca_file is the CA of its certificate, "
        "that temporal.tls.server_name is a name the certificate carries, and that the server "
        "accepts temporal.tls.cert_file (and the API key, if it asks for one)"
    )


RUNNING = WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING


async def stuck_reason(client: Client, workflow_id: str) -> str:
    """Why `workflow_id` acts on nothing now, or "": its workflow task failing again and again.
    Temporal shows that as a pending task past its first attempt, and between attempts (their
    backoff) only as the task failure last in its history, which is read too."""
    try:
        raw = (await client.get_workflow_handle(workflow_id).describe()).raw_description
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:  # past retention: nothing runs, nothing stuck
            return ""
        return f"Temporal could not describe it ({err.status.name}: {err.message})"
    pending = raw.pending_workflow_task if raw.HasField("pending_workflow_task") else None
    failed = pending.attempt - 1 if pending is not None else 0
    if pending is None and raw.workflow_execution_info.status == RUNNING:  # no task pending
        last = await client.workflow_service.get_workflow_execution_history_reverse(
            GetWorkflowExecutionHistoryReverseRequest(
                namespace=client.namespace,
                execution=WorkflowExecution(workflow_id=workflow_id),
                maximum_page_size=1,
            )
        )
        events = last.history.events
        if events and events[0].event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
            failed = 1
    if failed < 1:
        return ""
    return (
        f"its workflow task has failed {failed}{'+' if pending is None else ''} time(s) in a row, "
        "so it acts on nothing and answers from its last good state (its history in the Temporal "
        "UI shows the failure)"
    )


def from_temporal(err: BaseException) -> IpnextError:
    """The ipnext error behind a Temporal one: the first ApplicationError down its cause chain (an
    update's refusal, a workflow's or an activity's failure) rebuilt as the class it was raised as,
    with its fix and attributes (`ipnext.errors.error_from_wire`); else an IpnextError of its text."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__ or getattr(cause, "cause", None)
    if isinstance(cause, ApplicationError):
        details = cause.details[0] if cause.details and isinstance(cause.details[0], dict) else None
        return error_from_wire(cause.type, cause.message, details)
    return IpnextError(str(err))


@contextmanager
def temporal_errors() -> Iterator[None]:
    """Around a client's call of a workflow: a refused update or a failed workflow leaves as the
    ipnext error the worker raised (`from_temporal`). Other errors (an RPC's) pass unchanged."""
    try:
        yield
    except (WorkflowUpdateFailedError, WorkflowFailureError) as err:
        raise from_temporal(err) from None
