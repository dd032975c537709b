"""`ipnext.sdk.Client`: every lifecycle verb from Python, async and typed.

    async with await Client.connect() as ipn:
        await ipn.publish_model(load_model_spec("model.yaml"))
        result = await ipn.publish_snapshot("feed-ranker", Path("snapshots/feed-ranker/v1"))
        await ipn.wait_until_serving("feed-ranker", result.set_id)
        reply = await ipn.predict("feed-ranker", {"user": 3, "items": [1, 2]}, source="us-east")

Errors are ipnext errors (ipnext.errors), translated from Temporal and HTTP at this boundary.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict
from temporalio.client import (
    Client as TemporalClient,
)
from temporalio.client import (
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from ipnext.config import Settings, load_settings
from ipnext.errors import (
    IpnextError,
    ModelExistsError,
    ModelNotFoundError,
    ServingError,
    error_from_type,
)
from ipnext.model import ModelSpec, SnapshotSetRequest, check_against_fleet, check_factories
from ipnext.registry import (
    DeleteInput,
    DeleteResult,
    ModelState,
    ModelWorkflowInput,
    PublishInput,
    PublishResult,
    model_workflow_id,
)
from ipnext.rollout import (
    AbortInput,
    FreezeOverride,
    PauseInput,
    ResumeInput,
    RolloutState,
    RolloutStatus,
)
from ipnext.snapshots import request_from_folder
from ipnext.temporal import MODEL_KEY, STATE_KEY, connect_client

__all__ = ["Client", "ModelSummary", "Prediction"]


class ModelSummary(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    state: str
    workflow_id: str


class Prediction(BaseModel):
    """The response envelope: outputs, the set that answered, each part's snapshot, the variant."""

    model_config = ConfigDict(frozen=True)
    outputs: Any
    set: str
    parts: dict[str, str]
    variant: str | None = None
    region: str


class Client:
    def __init__(self, temporal: TemporalClient, settings: Settings) -> None:
        self.temporal = temporal
        self.settings = settings
        self._http = httpx.AsyncClient(base_url=settings.serve_url, timeout=30.0)

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> Client:
        settings = settings or load_settings()
        try:
            temporal = await connect_client(settings)
        except RuntimeError as err:
            raise ServingError(
                f"cannot reach Temporal at {settings.temporal_address}: {err}",
                fix="run `ipnext dev up`, or set TEMPORAL_ADDRESS",
            ) from None
        return cls(temporal, settings)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # ---- models --------------------------------------------------------------------------

    async def publish_model(self, spec: ModelSpec) -> ModelState:
        """Register a model: checks it against the fleet and its code first, so a bad spec creates nothing."""
        check_against_fleet(spec, self.settings.fleet())
        check_factories(spec)
        try:
            handle = await self.temporal.start_workflow(
                "ModelWorkflow",
                ModelWorkflowInput(spec=spec),
                id=model_workflow_id(spec.name),
                task_queue=self.settings.temporal.task_queue,
                id_reuse_policy=WorkflowIDReusePolicy.ALLOW_DUPLICATE,
                id_conflict_policy=WorkflowIDConflictPolicy.FAIL,
                search_attributes=TypedSearchAttributes(
                    [
                        SearchAttributePair(MODEL_KEY, spec.name),
                        SearchAttributePair(STATE_KEY, "empty"),
                    ]
                ),
                static_summary=f"model {spec.name} (owner {spec.owner})",
            )
        except WorkflowAlreadyStartedError:
            raise ModelExistsError(
                f"model {spec.name!r} already exists.",
                field="name",
                value=spec.name,
                fix="publish snapshots to it, or delete it first to change its spec",
            ) from None
        return await self._query_state(handle.id)

    async def get_model(self, name: str) -> ModelState:
        return await self._query_state(model_workflow_id(name))

    async def list_models(self) -> list[ModelSummary]:
        """Running models, from Temporal visibility (which lags writes by a moment)."""
        found = []
        async for execution in self.temporal.list_workflows(
            'WorkflowType = "ModelWorkflow" AND ExecutionStatus = "Running"'
        ):
            attrs = execution.typed_search_attributes
            found.append(
                ModelSummary(
                    name=attrs.get(MODEL_KEY) or execution.id.removeprefix("model/"),
                    state=attrs.get(STATE_KEY) or "unknown",
                    workflow_id=execution.id,
                )
            )
        return sorted(found, key=lambda m: m.name)

    async def delete_model(self, name: str, who: str = "sdk") -> DeleteResult:
        handle = await self._running_model(name)
        try:
            result: DeleteResult = await handle.execute_update(
                "delete", DeleteInput(who=who), result_type=DeleteResult
            )
        except WorkflowUpdateFailedError as err:
            raise _translate(err) from None
        try:
            await handle.result()
        except WorkflowFailureError as err:
            raise _translate(err) from None
        return result

    # ---- snapshots -----------------------------------------------------------------------

    async def publish_snapshot(
        self,
        name: str,
        snapshot: Path | SnapshotSetRequest,
        who: str = "sdk",
        freeze_override: FreezeOverride | None = None,
    ) -> PublishResult:
        """Publish a snapshot set (a folder with a manifest, or a request); it is validated before
        anything changes. `freeze_override` lets its rollout start inside a freeze window."""
        request = request_from_folder(snapshot) if isinstance(snapshot, Path) else snapshot
        handle = await self._running_model(name)
        try:
            return await handle.execute_update(
                "publish",
                PublishInput(request=request, who=who, freeze_override=freeze_override),
                result_type=PublishResult,
            )
        except WorkflowUpdateFailedError as err:
            raise _translate(err) from None

    async def wait_until_serving(self, name: str, set_id: str, timeout_s: float = 300.0) -> ModelState:
        """Wait until `set_id` serves; raise if its rollout failed or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            state = await self.get_model(name)
            if state.serving_set == set_id and state.state == "serving":
                return state
            mine = next((s for s in state.sets if s.id == set_id), None)
            if mine is not None and mine.status in (
                "failed",
                "superseded",
                "rolled_back",
                "aborted",
                "refused",
            ):
                raise ServingError(f"{set_id} will not serve: {mine.status}: {mine.detail}")
            if time.monotonic() > deadline:
                raise ServingError(f"{set_id} not serving after {timeout_s:.0f}s (model is {state.state})")
            await asyncio.sleep(0.5)

    async def rollout_status(self, name: str) -> RolloutStatus | None:
        """The model's latest rollout: live from the RolloutWorkflow while it runs."""
        state = await self.get_model(name)
        last = state.rollout
        if last is None or state.state != "rolling_out" or not last.workflow_id:
            return last
        try:
            live: RolloutStatus = await self.temporal.get_workflow_handle(last.workflow_id).query(
                "status", result_type=RolloutStatus
            )
        except (RPCError, WorkflowQueryFailedError):
            return last  # between the model's record and the child's first task
        return live

    async def pause_rollout(self, name: str, reason: str, who: str = "sdk") -> RolloutStatus:
        """Hold the running rollout at its current split (gates still roll it back)."""
        return await self._signal_rollout(name, "pause", PauseInput(reason=reason, who=who))

    async def resume_rollout(self, name: str, who: str = "sdk") -> RolloutStatus:
        """Go on with a paused rollout; the bake of its current step starts again."""
        return await self._signal_rollout(name, "resume", ResumeInput(who=who))

    async def abort_rollout(self, name: str, reason: str, who: str = "sdk") -> RolloutStatus:
        """Roll the running rollout back to the previous set; it ends `aborted`."""
        return await self._signal_rollout(name, "abort", AbortInput(reason=reason, who=who))

    async def override_freeze(self, name: str, reason: str, who: str) -> RolloutStatus:
        """Let the running rollout go on through a freeze window (who and why stay in its history)."""
        return await self._signal_rollout(name, "override_freeze", FreezeOverride(reason=reason, who=who))

    async def _signal_rollout(self, name: str, signal: str, arg: BaseModel) -> RolloutStatus:
        status = await self.rollout_status(name)
        if status is None or status.state not in (RolloutState.RUNNING, RolloutState.PAUSED):
            raise ServingError(
                f"model {name} has no rollout running"
                + (f" (the last one, {status.workflow_id}, is {status.state.value})" if status else ""),
                fix="check `ipnext rollout status " + name + "`",
            )
        handle = self.temporal.get_workflow_handle(status.workflow_id)
        await handle.signal(signal, arg)
        return status

    # ---- predictions ---------------------------------------------------------------------

    async def predict(
        self,
        name: str,
        inputs: Any,
        *,
        source: str | None = None,
        region: str | None = None,
        key: str | None = None,
        state: ModelState | None = None,
    ) -> Prediction:
        """POST to the serving region the plan routes `source` to (or `region`, if given)."""
        region, body = await self._predict_request(name, inputs, source, region, key, state)
        response = await self._http.post(f"/{region}/models/{name}/predict", json=body)
        if response.status_code != 200:
            raise ServingError(
                f"predict {name} in {region}: HTTP {response.status_code}: {response.text[:500]}"
            )
        return Prediction(**response.json(), region=region)

    async def predict_stream(
        self,
        name: str,
        inputs: Any,
        *,
        source: str | None = None,
        region: str | None = None,
        key: str | None = None,
    ) -> AsyncIterator[Prediction]:
        """The answer piece by piece (server-sent events; a generative part streams its text,
        any other model answers in one piece). Leaving the loop early closes the connection,
        which cancels the request in the part."""
        region, body = await self._predict_request(name, inputs, source, region, key)
        body["stream"] = True
        async with self._http.stream("POST", f"/{region}/models/{name}/predict", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise ServingError(f"predict {name} in {region}: HTTP {response.status_code}: {text[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    raise ServingError(f"predict {name} in {region}: {event['error']}")
                yield Prediction(**event, region=region)

    # ---- helpers -------------------------------------------------------------------------

    async def _predict_request(
        self,
        name: str,
        inputs: Any,
        source: str | None,
        region: str | None,
        key: str | None,
        state: ModelState | None = None,
    ) -> tuple[str, dict[str, Any]]:
        """The serving region (the plan's for `source`, unless given) and the request body."""
        if region is None:
            region = _serving_region(state or await self.get_model(name), source)
        body: dict[str, Any] = {"inputs": inputs}
        if key is not None:
            body["key"] = key
        return region, body

    async def _running_model(self, name: str) -> Any:
        handle = self.temporal.get_workflow_handle(model_workflow_id(name))
        try:
            description = await handle.describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                raise _not_found(name) from None
            raise
        if description.status != WorkflowExecutionStatus.RUNNING:
            raise _not_found(name)
        return handle

    async def _query_state(self, workflow_id: str) -> ModelState:
        name = workflow_id.removeprefix("model/")
        handle = await self._running_model(name)
        try:
            return await handle.query("get", result_type=ModelState)
        except WorkflowQueryFailedError as err:
            raise ServingError(f"model {name}: query failed: {err}") from None


def _serving_region(state: ModelState, source: str | None) -> str:
    if not state.serving_apps:
        raise ServingError(
            f"model {state.spec.name} serves nowhere yet (state {state.state}).",
            fix="publish a snapshot set and wait until it serves",
        )
    if source is not None and state.plan is not None:
        first = next(iter(state.plan.deployments.values()))
        region = first.serving_region(source)
        if region in state.serving_apps:
            return region
    return sorted(state.serving_apps)[0]


def _not_found(name: str) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {name!r} is not registered.",
        field="name",
        value=name,
        fix="check `ipnext model list`",
    )


def _translate(err: Exception) -> IpnextError:
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__ or getattr(cause, "cause", None)
    if isinstance(cause, ApplicationError):
        return error_from_type(cause.type, cause.message)
    return IpnextError(str(err))
