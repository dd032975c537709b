"""The OpenAI door: OpenAI's API for every generative model, served by the routing app (the app
with route prefix `/`, on the head node, which holds every model's routing document).

    GET  /v1/models                       the generative models the caller's key may call
    POST /v1/completions                  {"model": ..., "prompt": ...}
    POST /v1/chat/completions             {"model": ..., "messages": [...]}
    ... and the same under /<region>/v1/  (that region's router, whatever the caller's source)

`model` names the ipnext model. Under `/v1` the region is drawn from the model's routing
document as the SDK draws it: by the caller's source region (the `x-ipnext-source` header), or
without one from every source's fractions pooled (`routing.pick_region`). The request then goes
through that region's router over a Serve handle (`Router.predict` / `Router.stream`), so
rollouts, gates, variants, deadlines and the set stamp work as for `.../predict`; the set that
answered is the `x-ipnext-set` response header and the `system_fingerprint`.

With API keys configured, every route needs one (`Authorization: Bearer <key>`, the openai
client's `api_key`): 401 without a known key, before the body is read or the route looked up;
403 for a model it may not call, once the body names it; `GET /v1/models`
lists only the models it may call. Errors are OpenAI's shape (`serving/openai_api.py`): 400 for
a bad field, naming it; 404 for a model that is not served (or not generative, or not in that
region); the router's 503 (a part's queue full) and 504 (deadline) pass through, counted
against the set as the router counts them; 503 when the router cannot be reached.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ray import serve
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ipnext.contracts.routing import RoutingTable, pick_region
from ipnext.policy.demand import SOURCE_HEADER, valid_source
from ipnext.serving.layout import ROUTER_DEPLOYMENT, router_app_name
from ipnext.serving.openai_api import (
    OpenAIError,
    OpenAIRequest,
    chunk_events,
    error_body,
    parse_request,
    response_body,
)
from ipnext.serving.request_body import BodyError, check_json_depth
from ipnext.store.keys import KeyCheck

__all__ = ["SET_HEADER", "OpenAIDoor", "openai_route"]

logger = logging.getLogger(__name__)

SET_HEADER = "x-ipnext-set"
# In an experiment: the arm of the caller's `user` (the unit) and the signed id feedback names.
ARM_HEADER, REQUEST_ID_HEADER = "x-ipnext-arm", "x-ipnext-request-id"
MAX_BODY_BYTES = 4 << 20  # a long conversation is tens of KiB
MAX_JSON_DEPTH = 16  # messages[i].content[j].text is five deep
_KINDS = {"completions": "completion", "chat/completions": "chat"}


def openai_route(path: str) -> tuple[str | None, str] | None:
    """(the region or None, the route under v1) of an OpenAI path; None for any other path."""
    parts = path.strip("/").split("/")
    if parts[0] == "v1":
        return None, "/".join(parts[1:])
    if len(parts) >= 2 and parts[1] == "v1" and valid_source(parts[0]):
        return parts[0], "/".join(parts[2:])
    return None


class OpenAIDoor:
    """The door's logic, given the routing table of the moment and the key check."""

    def __init__(self, keys: KeyCheck | None) -> None:
        self._keys = keys
        self._handles: dict[str, Any] = {}

    async def answer(self, request: Request, region: str | None, route: str, table: RoutingTable) -> Response:
        try:
            if self._keys is not None:  # first: without a known key, nothing is parsed or listed
                unknown = self._keys.refuse_unknown(request.headers.get("authorization"))
                if unknown is not None:
                    raise OpenAIError(*unknown, code="invalid_api_key" if unknown[0] == 401 else None)
            if route == "models":
                if request.method != "GET":
                    raise OpenAIError(405, "use GET /v1/models")
                return JSONResponse(self._models(request, table, region))
            kind = _KINDS.get(route)
            if kind is None:
                raise OpenAIError(
                    404, f"no route /v1/{route}: use /v1/models, /v1/completions or /v1/chat/completions"
                )
            if request.method != "POST":
                raise OpenAIError(405, f"use POST /v1/{route}")
            body = await _json_body(request)
            parsed = parse_request(kind, body)  # type: ignore[arg-type]
            self._check_key(request, parsed.model)
            document = table.documents.get(parsed.model)
            if document is None or not document.generative:
                raise OpenAIError(
                    404,
                    f"model {parsed.model!r} is not served here as a generative model "
                    "(GET /v1/models lists them)",
                    param="model",
                    code="model_not_found",
                )
            source = request.headers.get(SOURCE_HEADER)
            if source is not None and not valid_source(source):
                raise OpenAIError(400, f"{SOURCE_HEADER}: {source[:80]!r} is not a region name")
            target = region or pick_region(document, source, body.get("user"))
            served = {r for row in document.routes.values() for r in row}
            if target is None or (region is not None and region not in served):
                raise OpenAIError(
                    404,
                    f"model {parsed.model!r} serves in {sorted(served) or 'no region'}, not {region!r}",
                    param="model",
                    code="model_not_found",
                )
            return await self._forward(parsed, target, source or target, body.get("user"))
        except OpenAIError as err:
            return JSONResponse(err.body(), status_code=err.status)
        except Exception as err:  # the router unreachable (its region lost, Serve restarting)
            logger.warning("OpenAI door: %s: %s", request.url.path, err, exc_info=True)
            return JSONResponse(
                error_body(503, f"the model's router did not answer ({type(err).__name__}); retry later"),
                status_code=503,
            )

    def _check_key(self, request: Request, model: str) -> None:
        if self._keys is None:
            return
        refused = self._keys.refuse(request.headers.get("authorization"), model)
        if refused is not None:
            raise OpenAIError(refused[0], refused[1], code="invalid_api_key" if refused[0] == 401 else None)

    def _models(self, request: Request, table: RoutingTable, region: str | None) -> dict[str, Any]:
        """The generative models this key may call (in `region`, under /<region>/v1)."""
        listed = []
        for name, document in sorted(table.documents.items()):
            if not document.generative:
                continue
            if region is not None and region not in {r for row in document.routes.values() for r in row}:
                continue
            refused = self._keys.refuse(request.headers.get("authorization"), name) if self._keys else None
            if refused is not None and refused[0] != 403:
                raise OpenAIError(
                    refused[0], refused[1], code="invalid_api_key" if refused[0] == 401 else None
                )
            if refused is None:
                listed.append({"id": name, "object": "model", "created": 0, "owned_by": "ipnext"})
        return {"object": "list", "data": listed}

    def _router(self, model: str, region: str) -> Any:
        """The region's router handle, made once per app (a handle is reusable and costs a
        controller call to make)."""
        app = router_app_name(model, region)
        if app not in self._handles:
            self._handles[app] = serve.get_deployment_handle(ROUTER_DEPLOYMENT, app_name=app)
        return self._handles[app]

    async def _forward(self, parsed: OpenAIRequest, region: str, source: str, user: Any) -> Response:
        handle = self._router(parsed.model, region)
        key = user if isinstance(user, str) and user else None  # OpenAI's `user`: the sticky key and unit
        if parsed.stream:
            envelopes = handle.options(stream=True).stream.remote(parsed.inputs, key, source, key)
            first = await _first(envelopes)
            if "error_id" in first:  # nothing streamed yet: an answer with its status
                return _router_error(first, int(first.get("status", 500)))
            return StreamingResponse(
                chunk_events(parsed, _prepend(first, envelopes)),
                media_type="text/event-stream",
                headers=answer_headers(first),
            )
        try:
            envelope, status = await handle.predict.remote(parsed.inputs, key, source, key)
        except BackPressureError:
            raise OpenAIError(503, f"model {parsed.model!r} is overloaded in {region}; retry later") from None
        if status != 200:
            return _router_error(envelope, status)
        return JSONResponse(response_body(parsed, envelope), headers=answer_headers(envelope))


def answer_headers(envelope: dict[str, Any]) -> dict[str, str]:
    """The set that answered, and in an experiment the arm and the request id feedback names."""
    headers = {SET_HEADER: str(envelope.get("set", ""))}
    if envelope.get("arm"):
        headers[ARM_HEADER] = str(envelope["arm"])
    if envelope.get("request_id"):
        headers[REQUEST_ID_HEADER] = str(envelope["request_id"])
    return headers


async def _first(envelopes: Any) -> dict[str, Any]:
    try:
        first: dict[str, Any] = await anext(envelopes)
    except BackPressureError:
        raise OpenAIError(503, "the model's router is overloaded; retry later") from None
    except StopAsyncIteration:
        raise OpenAIError(500, "the model answered nothing") from None
    return first


async def _prepend(first: dict[str, Any], rest: Any) -> Any:
    """The first envelope, then the rest; when the caller goes away (Starlette closes this
    generator) the router's stream is cancelled, which stops the part's generation."""
    try:
        yield first
        async for envelope in rest:
            yield envelope
    finally:
        rest.cancel()


def _router_error(envelope: dict[str, Any], status: int) -> JSONResponse:
    """The router's refusal or failure (`{error_id, message}`) in OpenAI's shape, same status."""
    message = str(envelope.get("message", "the request failed"))
    param = message.split(":", 1)[0] if status == 400 and message.startswith("inputs.") else None
    headers = {SET_HEADER: str(envelope["set"])} if "set" in envelope else {}
    if isinstance(envelope.get("retry_after"), int):  # shed for its queue wait: when to come back
        headers["Retry-After"] = str(envelope["retry_after"])
    return JSONResponse(OpenAIError(status, message, param=param).body(), status_code=status, headers=headers)


async def _json_body(request: Request) -> Any:
    """The body as JSON: at most MAX_BODY_BYTES, nested at most MAX_JSON_DEPTH, no NaN or infinity."""
    declared = request.headers.get("content-length")
    too_big = OpenAIError(413, f"body: larger than {MAX_BODY_BYTES} bytes")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_big
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        check_json_depth(raw, MAX_JSON_DEPTH)
        return json.loads(raw, parse_constant=_no_constant)
    except BodyError as err:
        raise OpenAIError(err.status, err.message) from None
    except (ValueError, UnicodeDecodeError) as err:
        raise OpenAIError(400, f"body: not JSON ({err})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")
