"""The prediction clients (sync and async) against an in-process fake of the serving layer
(httpx.MockTransport): typed answers, HTTP status -> error type, the routing document's TTL, the
one refetch after a 404, an expired document kept while its refresh fails, the source -> region
choice, streams, and `Client.predict` without Temporal.

One file over 600 lines on purpose: one fake of the serving layer, every client behaviour on it."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from ipnext.client.prediction import STALE_IF_ERROR_S
from ipnext.client.sdk import AsyncPredictionClient, Client, Prediction, PredictionClient
from ipnext.contracts.http_routes import NO_SET_REASON
from ipnext.contracts.routing import RoutingDocument, routing_model_of
from ipnext.errors import (
    IpnextError,
    PredictionBadRequestError,
    PredictionDeadlineError,
    PredictionError,
    PredictionNotFoundError,
    PredictionOverloadedError,
    PredictionServerError,
    PredictionTransportError,
    ServingError,
)
from ipnext.spec.settings import Settings

MODEL = "feed-ranker"
URL = "http://serving.test"
TTL = 5.0

Answer = tuple[int, Any]  # (status, JSON body) of a router
Router = Callable[[dict[str, Any]], Answer]


def envelope(region: str, set_id: str = f"{MODEL}@1") -> dict[str, Any]:
    return {"outputs": [0.5], "set": set_id, "parts": {"dense": f"{MODEL}/dense@v1"}, "variant": None}


def answers_ok(region: str) -> Router:
    return lambda body: (200, {**envelope(region), "outputs": [region, body["inputs"]]})


@dataclass
class FakeServing:
    """The routing app and the routers of each region, as the serving layer answers them."""

    documents: dict[str, RoutingDocument] = field(default_factory=dict)
    routers: dict[tuple[str, str], Router] = field(default_factory=dict)  # (region, model) -> router
    streams: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    fetches: int = 0
    posts: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (region, body)
    sources: list[str | None] = field(default_factory=list)  # each post's x-ipnext-source header
    down: bool = False
    lost: set[str] = field(default_factory=set)  # regions whose connections fail (a lost node's proxy)
    unreachable: set[str] = field(default_factory=set)  # regions Serve's proxy cannot reach: its 500
    unserved: set[str] = field(default_factory=set)  # regions whose router has no serving set yet
    routing_outage: str = ""  # the routing app's: "404", "500" or "down" (no connection)
    unrouted: int = 0  # the next requests Serve's proxy has no route table for (it just started)

    def route(self, routes: dict[str, dict[str, float]], generation: int = 1) -> None:
        self.documents[MODEL] = RoutingDocument(
            model=MODEL, generation=generation, ttl_seconds=TTL, routes=routes
        )

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if self.unrouted:  # Serve's proxy's own words: plain text
            self.unrouted -= 1
            return httpx.Response(404, text=f"Path '{path}' not found. Ping http://.../-/routes")
        model = routing_model_of(path)
        if model is not None:
            self.fetches += 1
            if self.routing_outage == "down":
                raise httpx.ConnectError("connection refused", request=request)
            if self.routing_outage:
                return httpx.Response(int(self.routing_outage), json={"message": "the routing app's outage"})
            doc = self.documents.get(model)
            if doc is None:
                return httpx.Response(404, json={"message": f"model {model!r} has no routing document"})
            return httpx.Response(200, json=doc.model_dump(mode="json"))
        region, _, model, _ = path.strip("/").split("/")
        body = json.loads(request.content)
        self.posts.append((region, body))
        if region in self.lost:
            raise httpx.RemoteProtocolError(
                "Server disconnected without sending a response.", request=request
            )
        if region in self.unreachable:  # the proxy's own words: plain text, no Retry-After
            return httpx.Response(500, text="Internal Server Error")
        self.sources.append(request.headers.get("x-ipnext-source"))
        if region in self.unserved:  # the router's own 503, streamed or not (serving/router.py)
            message = f"model {model} has no serving set in {region}"
            return httpx.Response(503, json={"error_id": "n1", "message": message, "reason": NO_SET_REASON})
        if body.get("stream"):
            pieces = self.streams.get((region, model))
            if pieces is None:
                return no_router()
            text = "".join(f"data: {json.dumps(p)}\n\n" for p in pieces)
            return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})
        router = self.routers.get((region, model))
        if router is None:
            return no_router()
        status, answer = router(body)
        if isinstance(answer, str):  # a plain-text answer, as Serve's proxy gives when it sheds
            return httpx.Response(status, text=answer, headers={"retry-after": "2"})
        return httpx.Response(status, json=answer)


def no_router() -> httpx.Response:
    """A path no router claims: the routing app (route prefix `/`) answers it, in JSON."""
    return httpx.Response(404, json={"message": "use GET /models/<name>/routing, /<region>/models/..."})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def serving() -> FakeServing:
    fake = FakeServing()
    fake.route({"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 1.0}})
    fake.routers[("us-east", MODEL)] = answers_ok("us-east")
    fake.routers[("eu-west", MODEL)] = answers_ok("eu-west")
    return fake


def sync_client(fake: FakeServing, clock: Clock | None = None) -> PredictionClient:
    return PredictionClient(URL, transport=httpx.MockTransport(fake.handle), clock=clock or Clock())


def async_client(fake: FakeServing, clock: Clock | None = None) -> AsyncPredictionClient:
    return AsyncPredictionClient(URL, transport=httpx.MockTransport(fake.handle), clock=clock or Clock())


# ---- answers and the region ---------------------------------------------------------------------


def test_a_prediction_is_typed_and_names_the_region_the_source_is_routed_to(serving: FakeServing) -> None:
    with sync_client(serving) as client:
        reply = client.predict(MODEL, {"user": 1}, source="eu-west")
        assert isinstance(reply, Prediction)
        assert reply.region == "eu-west" and reply.outputs == ["eu-west", {"user": 1}]
        assert reply.set == f"{MODEL}@1" and reply.parts == {"dense": f"{MODEL}/dense@v1"}
        assert reply.variant is None
        assert client.predict(MODEL, {"user": 1}, source="us-east").region == "us-east"
        client.predict(MODEL, {"user": 1}, region="us-east")
    assert serving.fetches == 1  # one document serves both sources
    # The caller's source rides along, so routers count observed demand by source (none: the
    # router counts its own region).
    assert serving.sources == ["eu-west", "us-east", None]


async def test_the_async_client_answers_the_same(serving: FakeServing) -> None:
    async with async_client(serving) as client:
        reply = await client.predict(MODEL, {"user": 1}, source="eu-west")
        assert reply.region == "eu-west" and reply.outputs == ["eu-west", {"user": 1}]
        assert (await client.routing(MODEL)).routes == serving.documents[MODEL].routes


def test_a_key_is_sent_and_sticks_to_one_region(serving: FakeServing) -> None:
    serving.route({"eu-west": {"eu-west": 0.5, "us-east": 0.5}})
    with sync_client(serving) as client:
        regions = {client.predict(MODEL, 1, source="eu-west", key="user-7").region for _ in range(20)}
        assert len(regions) == 1
        spread = {client.predict(MODEL, 1, source="eu-west", key=f"user-{i}").region for i in range(40)}
        assert spread == {"eu-west", "us-east"}
    assert all(body["key"].startswith("user-") for _, body in serving.posts)


def test_an_explicit_region_needs_no_document(serving: FakeServing) -> None:
    with sync_client(serving) as client:
        assert client.predict(MODEL, 1, region="us-east").region == "us-east"
    assert serving.fetches == 0 and "key" not in serving.posts[0][1]


# ---- status -> error type -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, PredictionBadRequestError),
        (413, PredictionBadRequestError),
        (404, PredictionNotFoundError),
        (405, PredictionError),
        (422, PredictionError),
        (500, PredictionServerError),
        (503, PredictionOverloadedError),
        (429, PredictionOverloadedError),
        (504, PredictionDeadlineError),
    ],
)
async def test_each_status_raises_its_error_type_with_the_status(
    serving: FakeServing, status: int, kind: type[PredictionError]
) -> None:
    serving.routers[("us-east", MODEL)] = lambda body: (
        status,
        {"error_id": "e1d", "message": f"refused with {status}"},
    )
    with sync_client(serving) as client, pytest.raises(kind) as sync_raised:
        client.predict(MODEL, 1, source="us-east")
    async with async_client(serving) as aclient:
        with pytest.raises(kind) as async_raised:
            await aclient.predict(MODEL, 1, source="us-east")
    for err in (sync_raised.value, async_raised.value):
        assert type(err) is kind and isinstance(err, ServingError) and isinstance(err, IpnextError)
        assert err.status_code == status and err.model == MODEL and err.region == "us-east"
        assert f"HTTP {status}: refused with {status}" in str(err) and err.error_id == "e1d"
        assert isinstance(err, PredictionServerError) == (status >= 500 or status == 429)


def test_an_overloaded_answer_says_when_to_retry(serving: FakeServing) -> None:
    """Serve's proxy sheds with its own plain-text body and a Retry-After header."""
    serving.routers[("us-east", MODEL)] = lambda body: (503, "Request dropped due to backpressure")
    with sync_client(serving) as client, pytest.raises(PredictionOverloadedError) as raised:
        client.predict(MODEL, 1, source="us-east")
    assert raised.value.retry_after_s == 2 and "HTTP 503: Request dropped due to backpressure" in str(
        raised.value
    )


def test_a_400_is_also_a_value_error_and_a_404_a_lookup_error(serving: FakeServing) -> None:
    serving.routers[("us-east", MODEL)] = lambda body: (
        400,
        {"error_id": "x", "message": "inputs.user: 9999 is unknown"},
    )
    with sync_client(serving) as client:
        with pytest.raises(ValueError, match=r"inputs\.user: 9999"):
            client.predict(MODEL, 1, source="us-east")
        with pytest.raises(LookupError):
            client.predict("absent", 1, source="us-east")


async def test_no_answer_at_all_is_a_transport_error_without_a_status(serving: FakeServing) -> None:
    serving.down = True
    with sync_client(serving) as client, pytest.raises(PredictionTransportError) as raised:
        client.predict(MODEL, 1, source="us-east")
    assert raised.value.status_code is None and URL in str(raised.value)
    async with async_client(serving) as aclient:
        with pytest.raises(PredictionTransportError):
            await aclient.predict(MODEL, 1, region="us-east")


def test_an_answer_that_is_not_an_envelope_is_a_prediction_error(serving: FakeServing) -> None:
    serving.routers[("us-east", MODEL)] = lambda body: (200, {"nope": 1})
    with sync_client(serving) as client, pytest.raises(PredictionError, match="not a prediction envelope"):
        client.predict(MODEL, 1, source="us-east")


def test_an_unknown_model_is_a_404_naming_it(serving: FakeServing) -> None:
    with sync_client(serving) as client, pytest.raises(PredictionNotFoundError) as raised:
        client.predict("absent", 1)
    assert raised.value.status_code == 404 and "'absent'" in str(raised.value)
    assert serving.posts == []


def test_a_document_that_routes_nowhere_is_not_found(serving: FakeServing) -> None:
    serving.route({})
    with sync_client(serving) as client, pytest.raises(PredictionNotFoundError, match="routes no traffic"):
        client.predict(MODEL, 1, source="us-east")


# ---- the document's TTL and the refetch after a 404 ----------------------------------------------


async def test_the_document_is_cached_for_its_ttl_then_fetched_again(serving: FakeServing) -> None:
    clock = Clock()
    with sync_client(serving, clock) as client:
        for _ in range(3):
            client.predict(MODEL, 1, source="us-east")
        assert serving.fetches == 1
        clock.now += TTL - 0.01
        client.predict(MODEL, 1, source="us-east")
        assert serving.fetches == 1
        serving.route({"us-east": {"eu-west": 1.0}}, generation=2)  # the model moved
        clock.now += 0.02
        assert client.predict(MODEL, 1, source="us-east").region == "eu-west"
        assert serving.fetches == 2 and client.routing(MODEL).generation == 2
    clock = Clock()
    async with async_client(serving, clock) as aclient:
        await aclient.predict(MODEL, 1, source="us-east")
        await aclient.predict(MODEL, 1, source="us-east")
        clock.now += TTL
        await aclient.predict(MODEL, 1, source="us-east")
    assert serving.fetches == 4


@pytest.mark.parametrize("use_async", [False, True])
async def test_a_404_refetches_the_document_once_and_follows_it(
    serving: FakeServing, use_async: bool
) -> None:
    def moved() -> None:  # the model left us-east before the cached document's TTL ran out
        del serving.routers[("us-east", MODEL)]
        serving.route({"us-east": {"eu-west": 1.0}}, generation=2)

    if use_async:
        async with async_client(serving) as aclient:
            assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
            moved()
            reply = await aclient.predict(MODEL, 1, source="us-east")
    else:
        with sync_client(serving) as client:
            assert client.predict(MODEL, 1, source="us-east").region == "us-east"
            moved()
            reply = client.predict(MODEL, 1, source="us-east")
    assert reply.region == "eu-west" and serving.fetches == 2
    assert [region for region, _ in serving.posts] == ["us-east", "us-east", "eu-west"]


def test_a_404_after_the_refetch_raises_without_a_loop(serving: FakeServing) -> None:
    serving.routers.clear()
    with sync_client(serving) as client, pytest.raises(PredictionNotFoundError) as raised:
        client.predict(MODEL, 1, source="us-east")
    assert raised.value.status_code == 404 and raised.value.region == "us-east"
    assert serving.fetches == 2 and len(serving.posts) == 2


def test_a_404_for_an_explicit_region_does_not_refetch(serving: FakeServing) -> None:
    with sync_client(serving) as client, pytest.raises(PredictionNotFoundError):
        client.predict(MODEL, 1, region="ap-south")
    assert serving.fetches == 0 and len(serving.posts) == 1


def test_a_model_deleted_under_a_cached_document_is_not_found_naming_it(serving: FakeServing) -> None:
    with sync_client(serving) as client:
        client.predict(MODEL, 1, source="us-east")
        serving.routers.clear()
        del serving.documents[MODEL]
        with pytest.raises(PredictionNotFoundError, match=f"'{MODEL}' has no routing document"):
            client.predict(MODEL, 1, source="us-east")


# ---- streams ----------------------------------------------------------------------------------


def pieces(*texts: str) -> list[dict[str, Any]]:
    return [{**envelope("us-east"), "outputs": {"text": t}} for t in texts]


async def test_a_stream_yields_typed_pieces_sync_and_async(serving: FakeServing) -> None:
    serving.streams[("us-east", MODEL)] = pieces("two", " plus", " three")
    with sync_client(serving) as client:
        got = list(client.predict_stream(MODEL, {"prompt": "p"}, source="us-east"))
    async with async_client(serving) as aclient:
        agot = [p async for p in aclient.predict_stream(MODEL, {"prompt": "p"}, source="us-east")]
    for replies in (got, agot):
        assert [p.outputs["text"] for p in replies] == ["two", " plus", " three"]
        assert all(isinstance(p, Prediction) and p.region == "us-east" for p in replies)
    assert all(body["stream"] is True for _, body in serving.posts)


def test_the_sync_client_runs_the_async_one_on_its_own_thread_until_closed(serving: FakeServing) -> None:
    """One implementation: the sync client drives an AsyncPredictionClient on a private loop;
    leaving a stream early closes it there, and a closed client says so instead of hanging."""
    serving.streams[("us-east", MODEL)] = pieces("a", "b", "c")
    client = sync_client(serving)
    for piece in client.predict_stream(MODEL, {}, source="us-east"):
        assert piece.outputs["text"] == "a"
        break
    assert client.predict(MODEL, {"user": 1}, source="us-east").region == "us-east"
    client.close()
    client.close()  # twice is fine
    assert not client._thread.is_alive()
    with pytest.raises(PredictionError, match="closed"):
        client.predict(MODEL, {"user": 1}, source="us-east")


@pytest.mark.parametrize(
    ("event", "kind", "status"),
    [
        (
            {"error_id": "a1", "message": "inputs.max_tokens: 0 is not >= 1", "status": 400},
            PredictionBadRequestError,
            400,
        ),
        (
            {"error_id": "b2", "message": "part decode failed (error_id b2)", "status": 500},
            PredictionServerError,
            500,
        ),
        (
            {"error_id": "c3", "message": "no answer within the deadline of 2 s", "status": 504},
            PredictionDeadlineError,
            504,
        ),
        ({"error": "RuntimeError: the part died"}, PredictionServerError, 500),  # before error ids
    ],
)
async def test_an_error_event_ends_a_stream_with_its_error_type(
    serving: FakeServing, event: dict[str, Any], kind: type[PredictionError], status: int
) -> None:
    serving.streams[("us-east", MODEL)] = [*pieces("a"), event]
    with sync_client(serving) as client, pytest.raises(kind) as raised:
        list(client.predict_stream(MODEL, {}, source="us-east"))
    assert raised.value.status_code == status and str(event.get("message", event.get("error"))) in str(
        raised.value
    )
    assert raised.value.error_id == event.get("error_id")
    async with async_client(serving) as aclient:
        with pytest.raises(kind):
            async for _ in aclient.predict_stream(MODEL, {}, source="us-east"):
                pass


async def test_a_stream_refetches_once_after_a_404(serving: FakeServing) -> None:
    serving.streams[("eu-west", MODEL)] = pieces("moved")
    async with async_client(serving) as aclient:
        await aclient.routing(MODEL)  # caches us-east for us-east
        serving.route({"us-east": {"eu-west": 1.0}}, generation=2)
        replies = [p async for p in aclient.predict_stream(MODEL, {}, source="us-east")]
    assert [p.region for p in replies] == ["eu-west"] and serving.fetches == 2
    with sync_client(serving) as client, pytest.raises(PredictionNotFoundError):
        list(client.predict_stream(MODEL, {}, region="us-east"))


# ---- a region that does not answer ---------------------------------------------------------------


def test_a_lost_region_is_passed_over_for_the_next_in_fallback_order_and_tried_last_after(
    serving: FakeServing,
) -> None:
    """us-east's callers are routed to us-east alone; with its node lost, they are answered from
    the region other sources use, and later requests go there first until region_down_s passed."""
    serving.lost.add("us-east")
    clock = Clock()
    client = PredictionClient(
        URL, transport=httpx.MockTransport(serving.handle), clock=clock, region_down_s=30.0
    )
    with client:
        assert client.predict(MODEL, 1, source="us-east").region == "eu-west"
        # A broken connection is sent once more (a pooled one may be to a gone proxy), then given up.
        assert [r for r, _ in serving.posts] == ["us-east", "us-east", "eu-west"]
        assert client.predict(MODEL, 1, source="us-east").region == "eu-west"
        assert [r for r, _ in serving.posts][3:] == ["eu-west"]  # not tried again while it is down
        serving.lost.clear()
        clock.now += 31
        assert client.predict(MODEL, 1, source="us-east").region == "us-east"  # back first


def test_a_proxy_failure_fails_over_but_a_routers_own_error_or_shedding_does_not(
    serving: FakeServing,
) -> None:
    serving.unreachable.add("us-east")
    with sync_client(serving) as client:
        assert client.predict(MODEL, 1, source="us-east").region == "eu-west"
    serving.unreachable.clear()
    serving.posts.clear()
    serving.routers[("us-east", MODEL)] = lambda body: (500, {"error_id": "e1", "message": "part failed"})
    with sync_client(serving) as client, pytest.raises(PredictionServerError, match="part failed"):
        client.predict(MODEL, 1, source="us-east")
    serving.routers[("us-east", MODEL)] = lambda body: (503, "Request dropped due to backpressure")
    with sync_client(serving) as client, pytest.raises(PredictionOverloadedError):
        client.predict(MODEL, 1, source="us-east")
    assert {r for r, _ in serving.posts} == {"us-east"}  # answers, each from the region asked


async def test_a_region_with_no_serving_set_yet_is_passed_over_and_asked_first_again(
    serving: FakeServing,
) -> None:
    """A returning region's router answers before its set runs there (a region drill's return saw
    it): the request goes on to the next region, streamed or not, and the next request asks the
    returning region first again (it answered at once, so it is not tried last). Asked for that
    region alone, the 503 is the caller's, naming it."""
    serving.unserved.add("eu-west")
    serving.streams[("us-east", MODEL)] = pieces("us-east")
    async with async_client(serving) as aclient:
        assert (await aclient.predict(MODEL, 1, source="eu-west")).region == "us-east"
        replies = [p async for p in aclient.predict_stream(MODEL, {}, source="eu-west")]
        assert {p.region for p in replies} == {"us-east"}
        assert [r for r, _ in serving.posts] == ["eu-west", "us-east"] * 2
        with pytest.raises(PredictionOverloadedError, match="no serving set in eu-west"):
            await aclient.predict(MODEL, 1, region="eu-west")
        serving.unserved.clear()
        assert (await aclient.predict(MODEL, 1, source="eu-west")).region == "eu-west"


async def test_a_region_that_does_not_answer_in_time_is_passed_over_within_the_deadline(
    serving: FakeServing,
) -> None:
    """A hung region (a proxy that accepted the connection, a router that never answers): after
    region_timeout_s the next region answers; with every region hung the deadline ends it."""
    hung: set[str] = {"us-east"}

    async def handle(request: httpx.Request) -> httpx.Response:
        region = request.url.path.strip("/").split("/")[0]
        if region in hung:
            await asyncio.sleep(30)
        return serving.handle(request)

    def client() -> AsyncPredictionClient:
        return AsyncPredictionClient(
            URL, transport=httpx.MockTransport(handle), timeout_s=1.0, region_timeout_s=0.3
        )

    async with client() as aclient:
        started = time.monotonic()
        reply = await aclient.predict(MODEL, 1, source="us-east")
        print(f"answered from {reply.region} {time.monotonic() - started:.2f}s after the first try")
        assert reply.region == "eu-west"
    hung.add("eu-west")
    async with client() as aclient:
        with pytest.raises(PredictionTransportError, match="none of us-east, eu-west answered") as raised:
            await aclient.predict(MODEL, 1, source="us-east")
        assert raised.value.status_code is None and raised.value.model == MODEL
    hung.clear()
    async with client() as aclient:  # an explicit region is that region only
        serving.lost.add("us-east")
        with pytest.raises(PredictionTransportError):
            await aclient.predict(MODEL, 1, region="us-east")


async def test_the_last_region_left_has_the_rest_of_the_deadline(serving: FakeServing) -> None:
    """A model served in one region waits for it as long as the deadline allows: passing it over
    would leave nowhere to go."""
    serving.route({"us-east": {"us-east": 1.0}})

    async def slow(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/routing"):
            await asyncio.sleep(0.5)
        return serving.handle(request)

    transport = httpx.MockTransport(slow)
    async with AsyncPredictionClient(URL, transport=transport, timeout_s=5, region_timeout_s=0.1) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
    assert [r for r, _ in serving.posts] == ["us-east"]


async def test_a_slow_live_region_is_not_given_up_for_one_known_down(serving: FakeServing) -> None:
    """eu-west's router is gone (its callers failed over, so the client knows it): us-east, slow
    under load but live, keeps its request while eu-west is asked beside it, and answers."""
    serving.route({"us-east": {"us-east": 1.0}, "eu-west": {"eu-west": 1.0}})
    serving.lost.add("eu-west")

    async def slow(request: httpx.Request) -> httpx.Response:
        if "/us-east/" in request.url.path:
            await asyncio.sleep(0.5)
        return serving.handle(request)

    transport = httpx.MockTransport(slow)
    async with AsyncPredictionClient(URL, transport=transport, timeout_s=5, region_timeout_s=0.1) as aclient:
        # A caller of eu-west: eu-west fails, us-east (the last left) answers; eu-west is known down.
        assert (await aclient.predict(MODEL, 1, source="eu-west")).region == "us-east"
        serving.posts.clear()
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
    # us-east first; past region_timeout_s eu-west was asked beside it (and failed, twice: a broken
    # connection is sent once more): us-east's request was never dropped for it.
    assert sorted(r for r, _ in serving.posts) == ["eu-west", "eu-west", "us-east"]


async def test_a_region_that_holds_requests_costs_region_timeout_even_with_every_region_marked(
    serving: FakeServing,
) -> None:
    """The region bench's failure: us-east had once failed (a proxy answer), so both regions were
    marked; then eu-west's node died and its proxy held requests to their deadline. A caller of
    eu-west must be answered from us-east after region_timeout_s, not after the deadline."""
    serving.unreachable.add("us-east")
    hung: set[str] = set()

    async def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path.strip("/").split("/")[0] in hung:
            await asyncio.sleep(60)
        return serving.handle(request)

    transport = httpx.MockTransport(handle)
    async with AsyncPredictionClient(URL, transport=transport, timeout_s=20, region_timeout_s=0.2) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "eu-west"  # us-east marked
        serving.unreachable.clear()
        hung.add("eu-west")
        started = time.monotonic()
        reply = await aclient.predict(MODEL, 1, source="eu-west")
        took = time.monotonic() - started
        print(f"answered from {reply.region} {took:.2f}s after the first try (deadline 20 s)")
        assert reply.region == "us-east"
        assert took < 10, took  # a region_timeout_s, not the deadline (the old rule waited 20 s)
        # Now eu-west is marked and us-east answered: us-east comes first, eu-west is not asked.
        serving.posts.clear()
        assert (await aclient.predict(MODEL, 1, source="eu-west")).region == "us-east"
        assert [r for r, _ in serving.posts] == ["us-east"]


async def test_a_stream_fails_over_before_its_first_piece(serving: FakeServing) -> None:
    serving.streams[("eu-west", MODEL)] = pieces("elsewhere")
    serving.streams[("us-east", MODEL)] = pieces("lost")
    serving.lost.add("us-east")
    async with async_client(serving) as aclient:
        replies = [p async for p in aclient.predict_stream(MODEL, {}, source="us-east")]
    assert {p.region for p in replies} == {"eu-west"}
    assert [r for r, _ in serving.posts] == ["us-east", "us-east", "eu-west"]


@pytest.mark.parametrize("broken", [httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError])
async def test_a_connection_that_breaks_once_is_sent_again_in_the_same_region(
    serving: FakeServing, broken: type[httpx.TransportError]
) -> None:
    """A pooled keep-alive connection to a lost node's proxy breaks on use, while a new connection
    reaches a live proxy of the same region (a region drill's requests failed in both regions
    so): the request is sent once more there, and the region is not marked down."""
    serving.streams[("us-east", MODEL)] = pieces("again")
    breaks = {"left": 1}

    def handle(request: httpx.Request) -> httpx.Response:
        if not request.url.path.endswith("/routing") and breaks["left"]:
            breaks["left"] -= 1
            serving.posts.append(("broken", {}))
            raise broken("connection reset by peer", request=request)
        return serving.handle(request)

    async with AsyncPredictionClient(URL, transport=httpx.MockTransport(handle)) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        assert [r for r, _ in serving.posts] == ["broken", "us-east"]
        breaks["left"] = 1
        replies = [p async for p in aclient.predict_stream(MODEL, {}, source="us-east")]
        assert {p.region for p in replies} == {"us-east"}
        serving.posts.clear()  # no region was given up: us-east is still asked first
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        assert [r for r, _ in serving.posts] == ["us-east"]


# ---- the control client delegates, with no Temporal call ----------------------------------------


async def test_client_predict_goes_through_the_prediction_client_without_temporal(
    serving: FakeServing,
) -> None:
    class NoTemporal:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"predict must not touch Temporal (it called {name})")

    client = Client(NoTemporal(), Settings())  # type: ignore[arg-type]
    await client.predictions.aclose()
    client.predictions = async_client(serving)
    async with client:
        reply = await client.predict(MODEL, {"user": 1}, source="eu-west")
        assert reply.region == "eu-west"
        serving.streams[("us-east", MODEL)] = pieces("x")
        assert [p.outputs async for p in client.predict_stream(MODEL, {}, source="us-east")] == [
            {"text": "x"}
        ]


@pytest.mark.parametrize("outage", ["404", "500", "down"])
async def test_an_expired_document_serves_on_while_its_refresh_fails(
    serving: FakeServing, outage: str
) -> None:
    """The routing app answers 404 or 500 or nothing when the TTL runs out: the expired document
    still routes (its regions answer for themselves), until STALE_IF_ERROR_S past its TTL."""
    clock = Clock()
    async with async_client(serving, clock) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        clock.now += TTL + 1
        serving.routing_outage = outage
        reply = await aclient.predict(MODEL, 1, source="us-east")
        assert reply.region == "us-east" and serving.fetches >= 2  # it did try to refresh
        clock.now += STALE_IF_ERROR_S
        with pytest.raises(PredictionError):
            await aclient.predict(MODEL, 1, source="us-east")


async def test_one_refresh_at_a_time_the_others_route_on_the_expired_document(serving: FakeServing) -> None:
    clock = Clock()

    async def slow_routing(request: httpx.Request) -> httpx.Response:
        if routing_model_of(request.url.path) is not None:
            await asyncio.sleep(0.05)
        return serving.handle(request)

    transport = httpx.MockTransport(slow_routing)
    async with AsyncPredictionClient(URL, transport=transport, clock=clock) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        clock.now += TTL + 1
        replies = await asyncio.gather(*(aclient.predict(MODEL, 1, source="us-east") for _ in range(5)))
        assert [r.region for r in replies] == ["us-east"] * 5
        assert serving.fetches == 2  # the first and one refresh, not one per request
        clock.now += 1  # the refreshed document is fresh: no fetch
        await aclient.predict(MODEL, 1, source="us-east")
    assert serving.fetches == 2


async def test_a_404_with_no_fresh_document_goes_on_to_the_other_regions(serving: FakeServing) -> None:
    """A region drill's return: us-east's router was not up yet (404) while the routing app put
    its documents back (404 too). The request is not lost: the document in hand has eu-west."""
    async with async_client(serving) as aclient:
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        router = serving.routers.pop(("us-east", MODEL))
        document = serving.documents.pop(MODEL)
        reply = await aclient.predict(MODEL, 1, source="us-east")
        assert reply.region == "eu-west"
        assert [r for r, _ in serving.posts][1:] == ["us-east", "eu-west"]
        serving.routers[("us-east", MODEL)], serving.documents[MODEL] = router, document


async def test_a_proxy_without_its_routes_yet_is_asked_again_after_a_pause(serving: FakeServing) -> None:
    """A region drill's node coming back: its new proxy took connections on the shared serving
    port before its route table came, and answered 404 in plain text for a live region's router
    and for the routing document alike (CI, stop 29). Both are sent again, not taken as the
    model's absence."""
    async with async_client(serving) as aclient:
        serving.unrouted = 2  # the document's fetch, then its retry, meet the new proxy
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        assert serving.fetches == 1
        serving.unrouted = 2  # and the prediction twice
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "us-east"
        assert [r for r, _ in serving.posts] == ["us-east", "us-east"]  # answered posts only


async def test_a_proxy_that_keeps_no_route_fails_the_region_over_and_names_itself(
    serving: FakeServing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After PROXY_ROUTES_WAIT_S the proxy's 404 is the region's failure (the next region is
    asked), and for the document a clear error: the URL may not be ipnext's serving port."""
    monkeypatch.setattr("ipnext.client.prediction.PROXY_ROUTES_WAIT_S", 0.25)
    async with AsyncPredictionClient(URL, transport=httpx.MockTransport(serving.handle)) as aclient:
        await aclient.routing(MODEL)
        serving.unrouted = 3  # 0.1 + 0.2 s of pauses: given up before a third pause
        assert (await aclient.predict(MODEL, 1, source="us-east")).region == "eu-west"
        assert serving.unrouted == 0 and serving.fetches == 1  # no refresh: not the router's 404
    serving.unrouted = 1000
    async with AsyncPredictionClient(URL, transport=httpx.MockTransport(serving.handle)) as aclient:
        with pytest.raises(PredictionNotFoundError, match="found no app for the path") as err:
            await aclient.predict(MODEL, 1, source="us-east")
        assert "serving port" in str(err.value)
