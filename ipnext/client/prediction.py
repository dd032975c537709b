"""Predictions with nothing but the serving URL: `PredictionClient` (sync) and
`AsyncPredictionClient` (async), both over httpx.

    with PredictionClient("http://127.0.0.1:8000") as serving:
        reply = serving.predict("feed-ranker", {"user": 3, "items": [1, 2]}, source="us-east")

The serving region for a caller's source comes from the model's routing document
(`GET /models/<name>/routing`, see ipnext.contracts.routing), cached for the document's TTL; a 404 from
the chosen region fetches the document once more and tries again (with no document to fetch,
the other regions of the one in hand). A connection that breaks before an answer is sent once
more on a new one, and Serve's proxy answering that it knows no route for the path (a proxy
that just started) is asked again for up to `PROXY_ROUTES_WAIT_S`. A region that fails (no
connection, a broken one, or Serve's proxy answering for a router it cannot reach) is passed
over for the next region of `routing.fallback_order`, while the request's deadline
(`timeout_s`) lasts, and tried last for `region_down_s` after; so is a region whose router
answers that the model has no serving set there (`NO_SET_REASON`: a returning region before its
set runs), which is not tried last (it answered at once); one with no answer within
`region_timeout_s` keeps the request while the next region is asked beside it (the first
answer wins). No Temporal connection. Every constructor sends the same API key, whatever URL it is
given: `api_key=`, else IPNEXT_API_KEY, else the settings' key file (`client_api_key`).
Failures are `PredictionError`s carrying the HTTP status: 400 `PredictionBadRequestError`,
404 `PredictionNotFoundError`, 5xx `PredictionServerError`, none `PredictionTransportError`.
A model's document is refreshed by one request at a time (the others route on the expired one
meanwhile), and one whose refresh fails is kept a while (`STALE_IF_ERROR_S`): a drill saw 193
requests fail on "no routing document" while every region still answered.

One file over 600 lines on purpose: the async client's failover and its sync twin read together.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ConfigDict, ValidationError

from ipnext.contracts.http_routes import NO_SET_REASON
from ipnext.contracts.routing import (
    RoutingDocument,
    demand_path,
    fallback_order,
    feedback_path,
    predict_path,
    routing_path,
)
from ipnext.errors import (
    PredictionBadRequestError,
    PredictionDeadlineError,
    PredictionError,
    PredictionNotFoundError,
    PredictionOverloadedError,
    PredictionServerError,
    PredictionTransportError,
)
from ipnext.policy.demand import SOURCE_HEADER, DemandReport
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import bearer, client_key

__all__ = ["AsyncPredictionClient", "Prediction", "PredictionClient", "client_api_key"]

# Above the router's default deadline (30 s), so a slow model answers 504 before the client gives up.
DEFAULT_TIMEOUT_S = 40.0
# A region that gives no answer within this long has the next one asked beside it (the request
# may then run twice: predictions are reads). Above what a healthy model takes, far below the
# deadline, so a lost region costs one such wait, not the request.
DEFAULT_REGION_TIMEOUT_S = 10.0
# How long a region that did not answer is tried last, by every request of this client.
DEFAULT_REGION_DOWN_S = 30.0
# How long past its TTL a routing document is still used while fetching it again fails (the
# routing app restarting, or answering 404 while the writer puts its documents back).
STALE_IF_ERROR_S = 300.0
# How long a request is sent again while Serve's proxy answers that it knows no route for it (a
# proxy that just started, before its route table came: see `_until_routed`).
PROXY_ROUTES_WAIT_S = 5.0
# Serve's proxy speaks for a router it could not reach (its replica died: 500; none to send to:
# 503); a router's own error answers carry an `error_id`, and shedding carries `Retry-After`.
_PROXY_FAILURES = (500, 502, 503)
T = TypeVar("T")


class Prediction(BaseModel):
    """The response envelope: outputs, the set that answered, each part's snapshot, the variant,
    and the serving region the request went to."""

    model_config = ConfigDict(frozen=True)
    outputs: Any
    set: str
    parts: dict[str, str]
    variant: str | None = None
    region: str
    arm: str | None = None  # in an experiment: the arm of the request's unit
    request_id: str | None = None  # in an experiment: what `feedback` names (signed)


class AsyncPredictionClient:
    """Asynchronous predictions: `predict`, `predict_stream` and `routing`, with the routing
    documents cached for their TTL. The one implementation: `PredictionClient` runs it."""

    def __init__(
        self,
        url: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        region_timeout_s: float = DEFAULT_REGION_TIMEOUT_S,
        region_down_s: float = DEFAULT_REGION_DOWN_S,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        api_key: str | None = None,
    ) -> None:
        """`url`: the serving HTTP address (settings' `serve`, when None). `timeout_s`: a
        request's deadline, every region it tries included; `region_timeout_s`: how long a region
        may take to answer before the next is asked beside it; `region_down_s`: how long a region
        that did not answer is tried last. `api_key`: sent on every request as
        `Authorization: Bearer`; the key is found the same way with or without `url`: `api_key`
        when given (`""`: none), else IPNEXT_API_KEY, else the settings' key file, the one
        `ipnext dev up` writes (see `client_api_key`)."""
        settings = None
        if url is None:
            settings = load_settings()
            url = settings.serve_url
        api_key = client_api_key(api_key, settings)
        self.url = url
        self._clock = clock
        self._rng = random.Random()
        self._timeout_s = timeout_s
        self._region_timeout_s = region_timeout_s
        self._region_down_s = region_down_s
        self._down: dict[str, float] = {}  # region -> until when it is tried last
        self._documents: dict[str, tuple[RoutingDocument, float]] = {}  # model -> (document, fetched at)
        self._refreshing: dict[str, asyncio.Future[RoutingDocument]] = {}  # model -> its fetch in flight
        self._http = httpx.AsyncClient(
            base_url=self.url, timeout=timeout_s, transport=transport, headers=bearer(api_key)
        )

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **options: Any) -> AsyncPredictionClient:
        """The settings' serving URL, and the key `client_api_key` finds with these settings."""
        settings = settings or load_settings()
        # "" when none: the constructor must not look again, in other settings than these
        options["api_key"] = client_api_key(options.get("api_key"), settings) or ""
        return cls(settings.serve_url, **options)

    async def __aenter__(self) -> AsyncPredictionClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def routing(self, model: str, *, refresh: bool = False) -> RoutingDocument:
        """The model's routing document: the cached one while its TTL runs, else fetched. A
        fetch that fails when the TTL ran out keeps the expired one for up to `STALE_IF_ERROR_S`
        (the regions it names still answer for themselves, and a router that no longer serves
        the model says 404, which fetches again with `refresh`, where a failure is raised)."""
        if refresh:
            return await self._fetch(model, refresh=True)
        cached = self._cached(model)
        if cached is not None:
            return cached
        # One refresh of a model at a time: while it runs, the other requests route on the
        # expired document (when there is one) instead of each fetching it again. The task is
        # shielded: a request whose deadline passes does not cancel the refresh others wait on.
        running = self._refreshing.get(model)
        if running is None or running.done():
            running = asyncio.ensure_future(self._fetch(model, refresh=False))
            running.add_done_callback(_retrieved)  # its failure is raised to whoever awaits it
            self._refreshing[model] = running
        else:
            stale = self._stale(model)
            if stale is not None:
                return stale
        return await asyncio.shield(running)

    async def _fetch(self, model: str, refresh: bool) -> RoutingDocument:
        """GET the model's document (twice on a broken connection); on failure, unless this is
        a `refresh` after a router's 404, the expired document while it is not too old."""
        try:
            try:
                response = await _until_routed(lambda: self._http.get(routing_path(model)), self._clock)
            except httpx.TransportError:
                # Once more, on a new connection: a kept-alive one may lead to a lost node's proxy
                # (every node's proxy shares the serving port).
                try:
                    response = await _until_routed(lambda: self._http.get(routing_path(model)), self._clock)
                except httpx.TransportError as err:
                    raise _transport_error(err, model, None, self.url) from None
            return self._store(model, response)
        except PredictionError:
            stale = None if refresh else self._stale(model)
            if stale is None:
                raise
            return stale

    async def demand(self, model: str, region: str, window_seconds: float = 60.0) -> DemandReport | None:
        """The model's observed demand in one serving region, by source; None where no router of
        it answers there or it recorded nothing yet."""
        try:
            response = await self._http.get(
                demand_path(model, region), params={"window_seconds": window_seconds}
            )
        except httpx.TransportError as err:
            raise _transport_error(err, model, region, self.url) from None
        if response.status_code in (404, 503):
            return None
        if response.status_code != 200:
            raise _status_error(response, model, region)
        return DemandReport.model_validate(response.json())

    async def predict(
        self,
        model: str,
        inputs: Any,
        *,
        source: str | None = None,
        region: str | None = None,
        key: str | None = None,
        unit: str | int | None = None,
    ) -> Prediction:
        """POST to the region the routing document picks for `source` (or to `region`, if given:
        then to that region only). `key` makes both the region and the set sticky for that key;
        `unit` (a user id) is the experiment's unit: its arm, the same on every request.
        A region that does not answer is passed over for the next (see the module's docstring)."""
        body = _body(inputs, key, unit)
        deadline = self._clock() + self._timeout_s

        async def attempt(target: str, limit: float) -> httpx.Response:
            return await _once_more_if_broken(
                lambda: self._http.post(
                    predict_path(model, target), json=body, headers=_source_header(source)
                ),
                limit,
                self._clock,
            )

        response, target = await self._failover(model, source, key, region, deadline, attempt)
        return _prediction(response, model, target)

    async def _failover(
        self,
        model: str,
        source: str | None,
        key: str | None,
        region: str | None,
        deadline: float,
        attempt: Callable[[str, float], Awaitable[httpx.Response]],
    ) -> tuple[httpx.Response, str]:
        """Send by `attempt` to the regions in fallback order until one answers: the answer (to
        read, and close if streamed) and its region. A region that fails (no connection, a
        broken one, a proxy speaking for a router it cannot reach) is given up at once for the
        next. One that has not answered within `region_timeout_s` is not given up: the next
        region is asked beside it (a hedge; predictions are reads), and the first answer wins,
        the others are cancelled. So a dead region that holds a request (its proxy waiting for a
        router that will never come back) costs `region_timeout_s`, and a slow live one still
        answers. A 404 fetches the document again, once."""
        if region is not None:
            order = [region]
        else:
            order = self._order(await self.routing(model), source, key)
        refreshed = region is not None
        failure: PredictionError | None = None
        unrouted: PredictionError | None = None  # a refresh after a 404 that found no document
        tried: list[str] = []
        index = 0
        running: dict[asyncio.Task[httpx.Response], str] = {}
        ask_next = True
        try:
            while True:
                left = deadline - self._clock()
                if left <= 0:
                    break
                if ask_next and index < len(order):
                    target = order[index]
                    index += 1
                    tried.append(target)
                    running[asyncio.ensure_future(attempt(target, left))] = target
                if not running:
                    break  # every region failed
                # Wait for an answer; with regions left to ask, only `region_timeout_s` long.
                wait = min(self._region_timeout_s, left) if index < len(order) else left
                done, _ = await asyncio.wait(running, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if not done:  # no answer in time: hedge on the next region, try this one last for now
                    for slow in running.values():
                        self._down[slow] = self._clock() + self._region_down_s
                    ask_next = True
                    continue
                ask_next = False
                for task in done:
                    target = running.pop(task)
                    try:
                        response = task.result()
                    except httpx.TransportError as err:
                        failure = _transport_error(err, model, target, self.url)
                    except TimeoutError:
                        failure = PredictionTransportError(
                            f"predict {model} in {target}: no answer within the deadline from {self.url}",
                            model=model,
                            region=target,
                        )
                    else:
                        if (
                            response.status_code == 404
                            and not _unrouted_by_proxy(response)
                            and (not refreshed or unrouted is not None)
                        ):
                            await response.aclose()
                            if unrouted is None:
                                refreshed = True
                                try:
                                    fresh = self._order(await self.routing(model, refresh=True), source, key)
                                except PredictionError as err:
                                    unrouted = err
                            if unrouted is not None:
                                # No fresh document (the routing app putting its documents back
                                # while a region's router comes up: a region drill's return): the
                                # other regions of the one in hand, this one known down; if none
                                # answers, the routing's own failure says why.
                                failure = unrouted
                                self._down[target] = self._clock() + self._region_down_s
                                ask_next = True
                                continue
                            order, index = [r for r in fresh if r not in running.values()], 0
                            ask_next = True
                            continue
                        unserved = await _unserved(response)
                        if not unserved and not _proxy_failure(response):
                            self._down.pop(target, None)
                            return response, target
                        await response.aread()
                        failure = _status_error(response, model, target)
                        await response.aclose()
                        if unserved:  # it answered at once: asked first again next time
                            ask_next = True
                            continue
                    self._down[target] = self._clock() + self._region_down_s
                    ask_next = True  # a region that failed: the next one at once
        finally:
            await _cancel_attempts(running)
        if failure is None:  # the deadline passed before any region answered
            failure = PredictionTransportError(
                f"predict {model}: the deadline of {self._timeout_s:.1f}s passed", model=model
            )
        if len(tried) > 1:
            raise type(failure)(
                f"predict {model}: none of {', '.join(tried)} answered; the last: {failure}",
                status_code=failure.status_code,
                model=model,
                region=failure.region,
                error_id=failure.error_id,
            ) from failure
        raise failure

    def _order(self, document: RoutingDocument, source: str | None, key: str | None) -> list[str]:
        """The regions to try, in fallback order, those that did not answer lately last."""
        order = fallback_order(document, source, key, self._rng)
        if not order:
            raise PredictionNotFoundError(
                f"model {document.model!r} routes no traffic anywhere "
                f"(routing generation {document.generation}).",
                model=document.model,
                fix="wait until a snapshot set serves (`ipnext model get " + document.model + "`)",
            )
        now = self._clock()
        return sorted(order, key=lambda r: self._down.get(r, 0.0) > now)

    async def feedback(
        self, model: str, answer: Prediction | str, outcome: Mapping[str, float], *, region: str | None = None
    ) -> dict[str, Any]:
        """An experiment answer's `outcome` (e.g. {"click": 1}), counted for the arm its signed `request_id`
        names, sent to the region that gave it; PredictionError 400 (forged id), 410 (ended)."""
        request_id = answer.request_id if isinstance(answer, Prediction) else answer
        if not request_id:
            raise ValueError("answer: it carries no request_id (it was not given in an experiment)")
        target = region or (answer.region if isinstance(answer, Prediction) else None)
        target = target or self._order(await self.routing(model), None, None)[0]
        body = {"request_id": request_id, "outcome": dict(outcome)}
        response = await _within(self._http.post(feedback_path(model, target), json=body), self._timeout_s)
        if response.status_code != 200:
            raise _status_error(response, model, target)
        return dict(response.json())

    async def predict_stream(
        self,
        model: str,
        inputs: Any,
        *,
        source: str | None = None,
        region: str | None = None,
        key: str | None = None,
        unit: str | int | None = None,
    ) -> AsyncGenerator[Prediction, None]:
        """The answer piece by piece (server-sent events; a generative part streams its text, any
        other model answers in one piece). Leaving the loop early closes the connection, which
        cancels the request in the part."""
        body = {**_body(inputs, key, unit), "stream": True}
        deadline = self._clock() + self._timeout_s

        async def attempt(target: str, limit: float) -> httpx.Response:
            # Until the answer's head: once pieces flow, the stream is this region's.
            request = self._http.build_request(
                "POST", predict_path(model, target), json=body, headers=_source_header(source)
            )
            return await _once_more_if_broken(
                lambda: self._http.send(request, stream=True), limit, self._clock
            )

        response, target = await self._failover(model, source, key, region, deadline, attempt)
        try:
            if response.status_code != 200:
                await response.aread()
                raise _status_error(response, model, target)
            async for line in response.aiter_lines():
                piece = _event(line, model, target)
                if piece is not None:
                    yield piece
        except httpx.TransportError as err:
            raise _transport_error(err, model, target, self.url) from None
        finally:
            await response.aclose()

    def _cached(self, model: str) -> RoutingDocument | None:
        entry = self._documents.get(model)
        if entry is None:
            return None
        document, fetched = entry
        return document if self._clock() - fetched < document.ttl_seconds else None

    def _stale(self, model: str) -> RoutingDocument | None:
        entry = self._documents.get(model)
        if entry is None:
            return None
        document, fetched = entry
        return document if self._clock() - fetched < document.ttl_seconds + STALE_IF_ERROR_S else None

    def _store(self, model: str, response: httpx.Response) -> RoutingDocument:
        document = _document(response, model, self.url)
        self._documents[model] = (document, self._clock())
        return document


class PredictionClient:
    """Synchronous predictions: `predict`, `predict_stream` and `routing`, for code without an
    event loop. It runs an `AsyncPredictionClient` on a private event loop in a daemon thread,
    so both clients are one implementation and behave alike; calls from several threads are
    served in turn by that loop. Close it (or use `with`) to stop the thread."""

    def __init__(self, url: str | None = None, **options: Any) -> None:
        """`url` and `options` (`timeout_s`, `transport`, `clock`, `api_key`) as
        `AsyncPredictionClient` takes them; a `transport` is an async one (`httpx.MockTransport`
        serves both kinds). The key: `api_key`, else IPNEXT_API_KEY, else the settings' key file,
        with or without `url` (`client_api_key`)."""
        self._client = AsyncPredictionClient(url, **options)
        self.url = self._client.url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ipnext-predictions", daemon=True)
        self._thread.start()

    @classmethod
    def from_settings(cls, settings: Settings | None = None, **options: Any) -> PredictionClient:
        """The settings' serving URL, and the key `client_api_key` finds with these settings."""
        settings = settings or load_settings()
        # "" when none: the constructor must not look again, in other settings than these
        options["api_key"] = client_api_key(options.get("api_key"), settings) or ""
        return cls(settings.serve_url, **options)

    def __enter__(self) -> PredictionClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def routing(self, model: str, *, refresh: bool = False) -> RoutingDocument:
        """The model's routing document: the cached one while its TTL runs, else fetched."""
        return self._run(self._client.routing(model, refresh=refresh))

    def predict(self, model: str, inputs: Any, **where: str | None) -> Prediction:
        """As `AsyncPredictionClient.predict` (keywords `source`, `region`, `key`): POST to the
        region the routing document picks for `source` (or to `region`, if given)."""
        return self._run(self._client.predict(model, inputs, **where))

    def feedback(
        self, model: str, answer: Prediction | str, outcome: Mapping[str, float], *, region: str | None = None
    ) -> dict[str, Any]:
        """As `AsyncPredictionClient.feedback`: outcomes of an answer given in an experiment."""
        return self._run(self._client.feedback(model, answer, outcome, region=region))

    def predict_stream(self, model: str, inputs: Any, **where: str | None) -> Iterator[Prediction]:
        """The answer piece by piece, as `AsyncPredictionClient.predict_stream` (same keywords:
        source, region, key). Leaving the loop early closes the connection, which cancels the
        request in the part."""
        pieces = self._client.predict_stream(model, inputs, **where)

        async def next_piece() -> Prediction | None:
            return await anext(pieces, None)

        try:
            while (piece := self._run(next_piece())) is not None:
                yield piece
        finally:
            self._run(pieces.aclose())

    def _run(self, call: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            call.close()
            raise PredictionError("this PredictionClient is closed; make a new one")
        return asyncio.run_coroutine_threadsafe(call, self._loop).result()


def client_api_key(api_key: str | None = None, settings: Settings | None = None) -> str | None:
    """The API key a prediction client sends, found in this order by every constructor (with a URL
    or without, and `from_settings`): 1. `api_key`, when given (`""` sends none); 2. the
    IPNEXT_API_KEY environment variable; 3. the settings' key file (`auth.api_key_file`, by default
    `<state_dir>/api-key`, which `ipnext dev up` writes), of `settings` or else `load_settings()`
    (IPNEXT_CONFIG or config/ipnext.yaml), read only when 1 and 2 give none. None: no key is sent."""
    if api_key is not None:
        return api_key.strip() or None
    return client_key(None) or client_key((settings or load_settings()).api_key_file())


# ---- the wire, converted once -------------------------------------------------------------


def _body(inputs: Any, key: str | None, unit: str | int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": inputs}
    if key is not None:
        body["key"] = key
    if unit is not None:
        body["unit"] = unit
    return body


async def _cancel_attempts(running: dict[asyncio.Task[httpx.Response], str]) -> None:
    """Cancel the attempts that lost (or outlived the deadline), closing any answer that came in
    meanwhile, so no connection is left open."""
    for task in running:
        task.cancel()
    for outcome in await asyncio.gather(*running, return_exceptions=True):
        if isinstance(outcome, httpx.Response):  # it answered before the cancel reached it
            await outcome.aclose()


async def _within(call: Awaitable[T], limit: float) -> T:
    """`call`, given `limit` seconds (TimeoutError after them; the request is cancelled)."""
    async with asyncio.timeout(limit):
        return await call


# A connection that broke before any answer came: most often a pooled keep-alive connection to
# a proxy that is gone (every node's proxy listens on the serving port, so a lost node leaves its
# connections in the pool while a new one reaches a live proxy).
_BROKEN = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


async def _once_more_if_broken(
    send: Callable[[], Awaitable[httpx.Response]], limit: float, clock: Callable[[], float]
) -> httpx.Response:
    """`send()` (through `_until_routed`) within `limit` seconds, sent once more on a new
    connection (httpx drops a broken one from its pool) if the connection broke before an
    answer, while the limit lasts: a region drill saw requests after a node's loss fail in both
    regions on pooled connections to its dead proxy. Predictions are reads, so a second send is
    safe; a second break is the region's failure (the caller fails over)."""
    started = clock()
    try:
        return await _within(_until_routed(send, clock), limit)
    except _BROKEN:
        left = limit - (clock() - started)
        if left <= 0:
            raise
        return await _within(_until_routed(send, clock), left)


async def _until_routed(
    send: Callable[[], Awaitable[httpx.Response]], clock: Callable[[], float]
) -> httpx.Response:
    """`send()`, and again after a pause (0.1 s, doubling) while Serve's proxy answers that it
    knows no route for the path (`_unrouted_by_proxy`), for up to `PROXY_ROUTES_WAIT_S`; then
    that answer, which the caller takes as the region's failure. A proxy that just started
    listens before its route table arrives, and on one machine every node's proxy shares the
    serving port: a region drill's node coming back answered 404 for a live region's router and
    for the routing document at once (CI, stop 29)."""
    started = clock()
    pause = 0.1
    while True:
        response = await send()
        if not _unrouted_by_proxy(response) or clock() - started + pause > PROXY_ROUTES_WAIT_S:
            return response
        await response.aclose()
        await asyncio.sleep(pause)
        pause *= 2


def _unrouted_by_proxy(response: httpx.Response) -> bool:
    """A 404 in plain text: Serve's proxy found no app for the path. Every 404 of ipnext's own
    (a router's, the routing app's) is JSON."""
    return response.status_code == 404 and not response.headers.get("content-type", "").startswith(
        "application/json"
    )


def _proxy_failure(response: httpx.Response) -> bool:
    """Serve's proxy answered for a router it could not reach (the region's node is lost, or its
    router replica died): a 5xx that is neither a router's answer (those carry an `error_id`)
    nor shedding (`Retry-After`: the region is up and says when to come back); or it still
    knew no route for the path after `PROXY_ROUTES_WAIT_S` (`_unrouted_by_proxy`)."""
    if _unrouted_by_proxy(response):
        return True
    if response.status_code not in _PROXY_FAILURES or "retry-after" in response.headers:
        return False
    if response.headers.get("content-type", "").startswith("application/json"):
        return False  # a router's (or the routing app's) own words
    return True


async def _unserved(response: httpx.Response) -> bool:
    """The region's router answered that its model has no serving set there (`NO_SET_REASON`):
    the region cannot answer this request, the next one may (a returning region before its set
    runs there). Reads the body of such a 503 only (a stream's pieces are left alone)."""
    if response.status_code != 503 or not response.headers.get("content-type", "").startswith(
        "application/json"
    ):
        return False
    await response.aread()
    body = _json_or_none(response)
    return isinstance(body, dict) and body.get("reason") == NO_SET_REASON


def _source_header(source: str | None) -> dict[str, str]:
    """The caller's source region, by which routers count observed demand (ipnext.policy.demand)."""
    return {SOURCE_HEADER: source} if source else {}


def _error_class(status: int) -> type[PredictionError]:
    if status in (400, 413):
        return PredictionBadRequestError
    if status == 404:
        return PredictionNotFoundError
    if status in (429, 503):
        return PredictionOverloadedError
    if status == 504:
        return PredictionDeadlineError
    if status >= 500:
        return PredictionServerError
    return PredictionError


def _words(answer: Any) -> tuple[str | None, str | None]:
    """The server's own words and error id from an error answer or event: the router's
    `{error_id, message}`, or an `error` (the routing app's answers)."""
    if not isinstance(answer, dict):
        return None, None
    message = answer.get("message", answer.get("error"))
    error_id = answer.get("error_id")
    return (None if message is None else str(message)), (None if error_id is None else str(error_id))


def _status_error(response: httpx.Response, model: str, region: str) -> PredictionError:
    """An error answer: what the server said (else the start of its text, e.g. Serve's proxy's
    plain-text 503), its error id, and when to retry from `Retry-After`."""
    status = response.status_code
    message, error_id = _words(_json_or_none(response))
    retry_after = response.headers.get("retry-after")
    return _error_class(status)(
        f"predict {model} in {region}: HTTP {status}: {message or response.text[:500]}",
        status_code=status,
        model=model,
        region=region,
        error_id=error_id,
        retry_after_s=float(retry_after) if retry_after and retry_after.isdigit() else None,
    )


def _json_or_none(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _transport_error(err: httpx.TransportError, model: str, region: str | None, url: str) -> PredictionError:
    where = f"predict {model} in {region}" if region else f"routing of {model}"
    return PredictionTransportError(
        f"{where}: no answer from {url}: {type(err).__name__}: {err}",
        model=model,
        region=region,
        fix="check that Ray Serve is up at that address (`ipnext dev status`), or set IPNEXT_SERVE__PORT",
    )


def _prediction(response: httpx.Response, model: str, region: str) -> Prediction:
    if response.status_code != 200:
        raise _status_error(response, model, region)
    try:
        return Prediction(**response.json(), region=region)
    except (ValueError, TypeError) as err:
        raise PredictionError(
            f"predict {model} in {region}: the answer is not a prediction envelope: {err}",
            status_code=response.status_code,
            model=model,
            region=region,
        ) from None


def _event(line: str, model: str, region: str) -> Prediction | None:
    """One server-sent event: a piece of the answer, None for a line that is not data, or the
    error the stream ended with (its `status`, 400 for the caller's mistake, else 500)."""
    if not line.startswith("data: "):
        return None
    try:
        event = json.loads(line.removeprefix("data: "))
    except ValueError as err:
        raise PredictionError(
            f"predict {model} in {region}: a stream event is not JSON: {err}",
            status_code=200,
            model=model,
            region=region,
        ) from None
    if "error" in event or "error_id" in event:
        status = int(event.get("status", 500))
        message, error_id = _words(event)
        raise _error_class(status)(
            f"predict {model} in {region}: {message}",
            status_code=status,
            model=model,
            region=region,
            error_id=error_id,
        )
    return Prediction(**event, region=region)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """Mark a shared fetch's failure as seen: the request that awaited it may have gone."""
    if not future.cancelled():
        future.exception()


def _document(response: httpx.Response, model: str, url: str) -> RoutingDocument:
    if _unrouted_by_proxy(response):
        raise PredictionNotFoundError(
            f"routing of {model}: Serve's proxy at {url} found no app for the path "
            f"(within {PROXY_ROUTES_WAIT_S:.0f}s): {response.text[:200]}",
            status_code=404,
            model=model,
            fix=(
                "check that the URL is ipnext's serving port, "
                "and that the routing app is up (`ipnext dev status`)"
            ),
        )
    if response.status_code == 404:
        raise PredictionNotFoundError(
            f"model {model!r} has no routing document at {url}: it is not registered, or serves nowhere yet.",
            status_code=404,
            model=model,
            fix=f"publish a snapshot set and wait until it serves (`ipnext model get {model}`)",
        )
    if response.status_code != 200:
        status = response.status_code
        raise _error_class(status)(
            f"routing of {model}: HTTP {status}: {_words(_json_or_none(response))[0] or response.text[:500]}",
            status_code=status,
            model=model,
        )
    try:
        return RoutingDocument.model_validate(response.json())
    except (ValueError, ValidationError) as err:
        raise PredictionError(
            f"routing of {model}: the answer is not a routing document: {err}", status_code=200, model=model
        ) from None
