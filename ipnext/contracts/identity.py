"""The operator identity the SDK and CLI send in a Temporal header, and how workflows read it.

Temporal records a client's `identity` in the history but never hands it to workflow code, and
authenticates neither it nor a payload's `who`. So the client adds `ipnext-identity` to every
start, signal and update it sends (`SendIdentity`), and the worker's inbound interceptor
(`ReadIdentity`) exposes it to the signal or update handler running (`caller_identity`): the
header is part of the event in the history, so reading it replays the same. A signal sent
without it (the Temporal UI, the `temporal` CLI, a bare SDK client) reads as UNATTRIBUTED.
The header is a claim of the sender, not a proof: only a Temporal server that maps credentials
to identities (and checks them) makes it one.
"""

from __future__ import annotations

import contextvars
import getpass
import socket
from collections.abc import Mapping
from typing import Any

from temporalio import client as temporal_client
from temporalio import worker as temporal_worker
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadConverter

__all__ = [
    "IDENTITY_HEADER",
    "UNATTRIBUTED",
    "ReadIdentity",
    "SendIdentity",
    "attributed",
    "caller_identity",
    "default_identity",
]

IDENTITY_HEADER = "ipnext-identity"
UNATTRIBUTED = "unattributed"  # recorded for a signal or update that carried no identity header
MAX_IDENTITY_CHARS = 200  # a longer header is cut: it is a label in a record, not a document

# The identity of the signal or update handler running now; set by ReadIdentity around the call.
_caller: contextvars.ContextVar[str] = contextvars.ContextVar("ipnext_caller_identity", default=UNATTRIBUTED)


def default_identity() -> str:
    """`<OS user>@<host>`: what the SDK and CLI send when `temporal.identity` is not set."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry and no USER/LOGNAME (some containers)
        user = "unknown-user"
    return f"{user}@{socket.gethostname()}"


def caller_identity() -> str:
    """In a signal or update handler: the sender's `ipnext-identity` header, or UNATTRIBUTED
    (none, an unreadable one, or a worker without ReadIdentity)."""
    return _caller.get()


def attributed(who: str, identity: str | None) -> str:
    """`who` as recorded, with the identity the change came with (None: recorded before ipnext
    read identities, or a change ipnext made itself)."""
    if identity is None:
        return who
    return f"{who} [{identity}]" if identity == UNATTRIBUTED else f"{who} [sent as {identity}]"


def _read_header(headers: Mapping[str, Payload]) -> str:
    payload = headers.get(IDENTITY_HEADER)
    if payload is None:
        return UNATTRIBUTED
    try:
        value = PayloadConverter.default.from_payload(payload, str)
    except Exception:  # a malformed header must not fail the workflow task: it attributes nothing
        return UNATTRIBUTED
    if not isinstance(value, str) or not value.strip():
        return UNATTRIBUTED
    return value.strip()[:MAX_IDENTITY_CHARS]


# ---- the client side -----------------------------------------------------------------------


class SendIdentity(temporal_client.Interceptor):
    """Adds `ipnext-identity: <identity>` to every workflow start, signal and update."""

    def __init__(self, identity: str) -> None:
        self.identity = identity

    def intercept_client(
        self, next: temporal_client.OutboundInterceptor
    ) -> temporal_client.OutboundInterceptor:
        return _SendIdentityOutbound(next, self.identity)


class _SendIdentityOutbound(temporal_client.OutboundInterceptor):
    def __init__(self, next: temporal_client.OutboundInterceptor, identity: str) -> None:
        super().__init__(next)
        self._header = PayloadConverter.default.to_payloads([identity])[0]

    def _with_header(self, headers: Mapping[str, Payload]) -> dict[str, Payload]:
        return {**headers, IDENTITY_HEADER: self._header}

    async def start_workflow(self, input: temporal_client.StartWorkflowInput) -> Any:
        input.headers = self._with_header(input.headers)
        return await super().start_workflow(input)

    async def signal_workflow(self, input: temporal_client.SignalWorkflowInput) -> None:
        input.headers = self._with_header(input.headers)
        await super().signal_workflow(input)

    async def start_workflow_update(self, input: temporal_client.StartWorkflowUpdateInput) -> Any:
        input.headers = self._with_header(input.headers)
        return await super().start_workflow_update(input)

    async def start_update_with_start_workflow(
        self, input: temporal_client.StartWorkflowUpdateWithStartInput
    ) -> Any:
        start, update = input.start_workflow_input, input.update_workflow_input
        start.headers = self._with_header(start.headers)
        update.headers = self._with_header(update.headers)
        return await super().start_update_with_start_workflow(input)


# ---- the worker side -----------------------------------------------------------------------


class ReadIdentity(temporal_worker.Interceptor):
    """Makes each signal's and update's identity header readable by its handler (`caller_identity`)."""

    def workflow_interceptor_class(
        self, input: temporal_worker.WorkflowInterceptorClassInput
    ) -> type[temporal_worker.WorkflowInboundInterceptor]:
        return _ReadIdentityInbound


class _ReadIdentityInbound(temporal_worker.WorkflowInboundInterceptor):
    # Each signal and update runs in a task of its own: the variable set here is that task's.

    async def handle_signal(self, input: temporal_worker.HandleSignalInput) -> None:
        token = _caller.set(_read_header(input.headers))
        try:
            await super().handle_signal(input)
        finally:
            _caller.reset(token)

    def handle_update_validator(self, input: temporal_worker.HandleUpdateInput) -> None:
        token = _caller.set(_read_header(input.headers))
        try:
            super().handle_update_validator(input)
        finally:
            _caller.reset(token)

    async def handle_update_handler(self, input: temporal_worker.HandleUpdateInput) -> Any:
        token = _caller.set(_read_header(input.headers))
        try:
            return await super().handle_update_handler(input)
        finally:
            _caller.reset(token)
