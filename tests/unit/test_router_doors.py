"""The router's answers, what it counts, and its deadline, on the real `Router` class with fake
part handles at the Serve seam (`serve.get_deployment_handle`) and the metrics seams stubbed:
the table of docs/architecture/contracts.md ("what counts against a set"), row by row."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from ray.serve.exceptions import BackPressureError
from starlette.requests import Request

from ipnext.contracts.http_routes import DEADLINE_HEADER, NO_SET_REASON, SHED_REASON
from ipnext.contracts.router import RouterConfig
from ipnext.errors import PartInputError
from ipnext.names import poll_until
from ipnext.policy.admission import QueueDelay
from ipnext.serving import router as router_module
from ipnext.serving.choices import VariantRouter
from ipnext.serving.layout import RouterAppArgs, SetDescription
from ipnext.serving.set_routes import SetRoute
from ipnext.spec.model import RouterSpec

APP = "m.us-east.s1.r1"
DEADLINE_S = 0.3
WAIT_S = 30.0  # how long a test waits for a router's background work (a loaded CI box)
Behaviour = Callable[[dict[str, Any]], Any]  # a part's answer to its upstream values (async)


class FakeResponse:
    def __init__(self, coro: Any) -> None:
        self._coro = coro

    def __await__(self) -> Any:
        return self._coro.__await__()


class FakeStream:
    """What `.options(stream=True).stream.remote()` returns: async pieces, cancellable."""

    def __init__(self, pieces: AsyncIterator[Any]) -> None:
        self._pieces = pieces
        self.cancelled = False

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        return await self._pieces.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, part: str, parts: dict[str, Behaviour], streams: list[FakeStream]) -> None:
        self._part, self._parts, self._streams = part, parts, streams
        self.stream = self  # handle.options(stream=True).stream.remote(...)

    def options(self, **_: Any) -> FakeHandle:
        return self

    def remote(self, upstream: dict[str, Any]) -> Any:
        answer = self._parts[self._part](upstream)
        if hasattr(answer, "__anext__"):
            stream = FakeStream(answer)
            self._streams.append(stream)
            return stream
        return FakeResponse(answer)


def reply(output: Any) -> Behaviour:
    async def answer(upstream: dict[str, Any]) -> dict[str, Any]:
        return {"output": output, "snapshot_id": "m/part@v1"}

    return answer


def raising(err: BaseException) -> Behaviour:
    async def answer(upstream: dict[str, Any]) -> dict[str, Any]:
        raise err

    return answer


async def _forever(upstream: dict[str, Any]) -> dict[str, Any]:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


class Counted:
    def __init__(self) -> None:
        self.latencies: list[float | None] = []
        self.shed: list[str] = []

    def record(self, model: str, region: str, app: str, latency_ms: float | None) -> None:
        self.latencies.append(latency_ms)

    def record_variant(self, *args: Any) -> None:
        pass

    def record_shed(self, model: str, region: str, app: str) -> None:
        self.shed.append(app)


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch) -> Callable[..., tuple[Any, Counted, list[FakeStream]]]:
    def make(embed: Behaviour, dense: Behaviour, **limits: Any) -> tuple[Any, Counted, list[FakeStream]]:
        parts = {"embed": embed, "dense": dense}
        streams: list[FakeStream] = []
        monkeypatch.setattr(
            router_module.serve,
            "get_deployment_handle",
            lambda name, app_name: FakeHandle(name.split("-")[0], parts, streams),
        )
        counted = Counted()
        monkeypatch.setattr(router_module, "RouterPrometheus", lambda: counted)
        monkeypatch.setattr(router_module.CounterPusher, "ensure_running", lambda self: None)
        spec = RouterSpec(deadline_seconds=DEADLINE_S, **limits)
        router = router_module.Router.func_or_class(RouterAppArgs(model="m", region="us-east", router=spec))
        dag = [("input", "embed"), ("embed", "dense"), ("dense", "output")]
        described = SetDescription(
            set_id="m@1",
            dag=dag,
            order=["embed", "dense"],
            deployments={"embed": {"embed-cpu": 1.0}, "dense": {"dense-cpu": 1.0}},
        )
        router._routes = {APP: SetRoute(APP, described, VariantRouter(dag, ["embed", "dense"], {}))}
        router._config = RouterConfig(generation=1, weights={APP: 100})
        return router, counted, streams

    return make


def errors(counted: Counted) -> int:
    return sum(1 for latency in counted.latencies if latency is None)


async def test_an_answer_is_counted_with_its_latency(build: Any) -> None:
    router, counted, _ = build(reply({"u": 1}), reply([0.5]))
    body, status = await router.predict({"user": 1})
    assert status == 200 and body["outputs"] == [0.5] and body["set"] == "m@1"
    assert len(counted.latencies) == 1 and errors(counted) == 0


async def test_a_hung_part_answers_504_within_the_deadline_and_counts(build: Any) -> None:
    router, counted, _ = build(reply({"u": 1}), _forever)
    started = asyncio.get_running_loop().time()
    body, status = await router.predict({"user": 1})
    took = asyncio.get_running_loop().time() - started
    print(f"hung part: 504 after {took:.3f} s (deadline {DEADLINE_S} s)")
    assert status == 504 and body["message"].startswith(f"no answer within the deadline of {DEADLINE_S:g} s")
    assert set(body) == {"error_id", "message", "set"} and body["error_id"] in body["message"]
    assert errors(counted) == 1


async def test_a_part_failure_is_500_counted_and_its_words_stay_in_the_log(build: Any) -> None:
    secret = RuntimeError("worker pid 4242 at 10.1.2.3 failed in /srv/secret/parts.py")
    router, counted, _ = build(reply({"u": 1}), raising(secret))
    body, status = await router.predict({"user": 1})
    assert status == 500 and body["message"].startswith("part dense failed (error_id "), body
    assert "secret" not in json.dumps(body) and "4242" not in json.dumps(body)
    assert errors(counted) == 1


async def test_a_callers_mistake_is_400_and_not_counted(build: Any) -> None:
    router, counted, _ = build(raising(PartInputError("inputs.user: 9999 is out of range")), reply([1.0]))
    body, status = await router.predict({"user": 9999})
    assert status == 400 and body["message"] == "inputs.user: 9999 is out of range"
    assert counted.latencies == []


async def test_a_full_part_queue_behind_the_router_is_503_and_counts(build: Any) -> None:
    router, counted, _ = build(
        reply({"u": 1}), raising(BackPressureError(num_queued_requests=5, max_queued_requests=5))
    )
    body, status = await router.predict({"user": 1})
    assert status == 503 and body["message"].startswith("part dense is overloaded"), body
    assert errors(counted) == 1


async def test_no_serving_set_is_503_and_counts_nothing(build: Any) -> None:
    """Marked `NO_SET_REASON` (the SDK asks the next region), streamed or not: a stream is refused
    with a plain 503 before it starts, never a 200 whose first event is the refusal."""
    router, counted, _ = build(reply({}), reply([]))
    router._config = RouterConfig(generation=2, weights={})
    body, status = await router.predict({"user": 1})
    assert status == 503 and "has no serving set" in body["message"] and counted.latencies == []
    assert body["reason"] == NO_SET_REASON
    for raw in (b'{"inputs": {"user": 1}}', b'{"inputs": {"user": 1}, "stream": true}'):
        response = await router(request(raw))
        answer = json.loads(response.body)
        assert response.status_code == 503 and answer["reason"] == NO_SET_REASON, answer
    assert counted.latencies == []


async def test_the_deadline_covers_the_whole_stream(build: Any) -> None:
    async def pieces(upstream: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield {"output": "first", "snapshot_id": "m/dense@v1"}
        await asyncio.Event().wait()  # then nothing more, ever
        yield {"output": "never", "snapshot_id": "m/dense@v1"}

    router, counted, streams = build(reply({"u": 1}), pieces)
    events = [e async for e in router.stream({"user": 1})]
    assert events[0]["outputs"] == "first"
    assert events[1]["status"] == 504 and "deadline" in events[1]["message"] and events[1]["set"] == "m@1"
    assert len(events) == 2 and streams[0].cancelled  # the part's stream was stopped
    assert errors(counted) == 1


def request(body: bytes, headers: dict[str, str] | None = None) -> Request:
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)] or [b""]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/us-east/models/m/predict",
        "headers": raw,
        "query_string": b"",
    }
    return Request(scope, receive)


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"),
    [
        (b'{"inputs": {"user": 1}}' + b" " * 5000, {}, 413, "body: larger than 4096 bytes"),
        (b'{"inputs": 1}', {"content-length": "999999"}, 413, "body: larger than 4096 bytes"),
        (b'{"inputs": [[[[1]]]]}', {}, 400, "body: JSON nested 5 levels deep; at most 4"),
        (b'{"inputs": {"user": NaN}}', {}, 400, "inputs.user: not a finite number"),
        (b"[", {}, 400, "body is not JSON"),
    ],
)
async def test_the_http_door_refuses_before_any_part_and_counts_nothing(
    build: Any, body: bytes, headers: dict[str, str], status: int, words: str
) -> None:
    router, counted, _ = build(
        raising(AssertionError("a part was called")), reply([1.0]), max_body_bytes=4096, max_json_depth=4
    )
    response = await router(request(body, headers))
    answer = json.loads(response.body)
    assert response.status_code == status and answer["message"].startswith(words), answer
    assert set(answer) == {"error_id", "message"} and counted.latencies == []


async def test_a_bug_in_the_router_itself_answers_500_without_its_insides(build: Any) -> None:
    router, _, _ = build(reply({"u": 1}), reply([1.0]))

    async def broken(inputs: Any, key: str | None = None) -> Any:
        raise KeyError("/srv/ipnext/router.py internal state")

    router.predict = broken
    response = await router(request(b'{"inputs": {"user": 1}}'))
    answer = json.loads(response.body)
    assert response.status_code == 500 and answer["message"].startswith("the router failed (error_id ")
    assert "srv" not in response.body.decode()


async def test_requests_are_counted_by_the_callers_source_region(build: Any) -> None:
    """Observed demand (ipnext.policy.demand): the SDK's `x-ipnext-source`, else the router's region;
    a header that is not a region name is refused and counted nowhere."""
    router, _, _ = build(reply({"u": 1}), reply([0.5]))
    body = b'{"inputs": {"user": 1}}'
    for headers in ({"x-ipnext-source": "eu-west"}, {"x-ipnext-source": "eu-west"}, {}):
        assert (await router(request(body, headers))).status_code == 200
    refused = await router(request(body, {"x-ipnext-source": "../etc/passwd"}))
    assert refused.status_code == 400 and json.loads(refused.body)["message"].startswith("x-ipnext-source:")
    await router(request(b'{"inputs": NaN}', {"x-ipnext-source": "ap-south"}))  # refused at the door
    assert router._demand == {"eu-west": 2, "us-east": 1}


class SetIngress:
    """The `set` deployment's handle of one app: `describe` answers the app's description when
    the app is up, and never while it is not (a call to an app Serve does not run waits)."""

    def __init__(self, described: SetDescription) -> None:
        self.described = described
        self.up = asyncio.Event()
        self.describe = self

    def remote(self) -> FakeResponse:
        async def answer() -> SetDescription:
            await self.up.wait()
            return self.described

        return FakeResponse(answer())


async def test_a_config_naming_a_set_app_that_is_not_there_starts_the_router_and_routes_once_it_is(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The region drill's hang: a router started on a config naming a set app deleted meanwhile
    waited on it for good (Serve held the replica STARTING). Now the reconfigure ends in
    DESCRIBE_TIMEOUT_S with the app out of the draw (503, counted nowhere), and the app is routed
    to as soon as it describes itself; a routed app that stops answering keeps its route."""
    router, counted, _ = build(reply({"u": 1}), reply([0.5]))
    late = "m.us-east.s2.r1"
    ingress = SetIngress(described_as("m@2"))
    parts = {"embed": reply({"u": 1}), "dense": reply([0.7])}
    monkeypatch.setattr(
        router_module.serve,
        "get_deployment_handle",
        lambda name, app_name: ingress if name == "set" else FakeHandle(name.split("-")[0], parts, []),
    )
    monkeypatch.setattr(router_module, "DESCRIBE_TIMEOUT_S", 0.2, raising=False)
    monkeypatch.setattr(router_module, "CAPACITY_REFRESH_S", 0.05)
    router._routes = {}
    await asyncio.wait_for(router.reconfigure({"generation": 2, "weights": {late: 100}}), timeout=5)
    assert router.generation() == 2 and router._routes == {}
    body, status = await router.predict({"user": 1})
    assert status == 503 and "has no serving set" in body["message"] and counted.latencies == []
    ingress.up.set()  # the app comes up: the next refresh routes to it

    async def routed() -> bool:
        return late in router._routes

    await poll_until(routed, bool, timeout_s=WAIT_S, interval_s=0.02, what=f"{late} routed")
    body, status = await router.predict({"user": 1})
    assert status == 200 and body["set"] == "m@2" and body["outputs"] == [0.7], body
    # The app stops answering (its ingress restarting): a new config keeps the route it had.
    ingress.up = asyncio.Event()
    await asyncio.wait_for(router.reconfigure({"generation": 3, "weights": {late: 100}}), timeout=5)
    body, status = await router.predict({"user": 1})
    assert router.generation() == 3 and status == 200 and body["set"] == "m@2", body
    router._following.cancel()


def described_as(set_id: str) -> SetDescription:
    dag = [("input", "embed"), ("embed", "dense"), ("dense", "output")]
    return SetDescription(
        set_id=set_id,
        dag=dag,
        order=["embed", "dense"],
        deployments={"embed": {"embed-cpu": 1.0}, "dense": {"dense-cpu": 1.0}},
    )


# ---- admission by time (ipnext/policy/admission.py) -----------------------------------------


def served(queue: QueueDelay, start: float, latency: float) -> None:
    queue.finished(queue.started(start), start + latency)


def standing_queue(router: Any, wait_s: float) -> None:
    """This router's history: a 10 ms service time long ago; now a queue of `wait_s` that stands,
    draining at 10 requests/s (20 in the last 2 s), with 10 x `wait_s` requests still in flight."""
    queue = router._routes[APP].queue = QueueDelay(interval_s=60.0, base_window_s=3600.0, rate_window_s=2.0)
    now = time.monotonic()
    served(queue, now - 600, 0.010)
    for k in range(20):
        served(queue, now - 1.9 + 0.09 * k - (wait_s + 0.010), wait_s + 0.010)
    for _ in range(round(10 * wait_s)):
        queue.started(now - 0.1)


async def test_the_router_sheds_at_once_with_retry_after_and_counts_it_as_shed(build: Any) -> None:
    router, counted, _ = build(reply({"u": 1}), reply([0.5]), max_queue_wait_ms=100.0, retry_after_seconds=0)
    standing_queue(router, wait_s=2.0)
    answer = await router(request(json.dumps({"inputs": {"user": 1}}).encode()))
    body = json.loads(answer.body)
    assert answer.status_code == 503 and body["reason"] == SHED_REASON, body
    assert answer.headers["retry-after"] == "2" and body["retry_after"] == 2  # ceil(20 / 10 - 0.01 - 0.1)
    assert "would wait about 1990 ms in the queue, over its 100 ms" in body["message"]
    stream = await router(request(json.dumps({"inputs": {"user": 1}, "stream": True}).encode()))
    assert stream.status_code == 503 and json.loads(stream.body)["reason"] == SHED_REASON  # before it starts
    kept = router._counters[APP]
    assert (kept.shed, kept.requests, kept.errors) == (2, 0, 0) and counted.latencies == []
    assert counted.shed == [APP, APP]


async def test_without_the_setting_only_a_request_that_would_miss_its_deadline_is_shed(build: Any) -> None:
    router, _, _ = build(reply({"u": 1}), reply([0.5]))
    router._limits = router._limits.model_copy(update={"deadline_seconds": 30.0})
    standing_queue(router, wait_s=2.0)
    body = json.dumps({"inputs": {"user": 1}}).encode()
    short = await router(request(body, {DEADLINE_HEADER: "500"}))
    assert short.status_code == 503 and json.loads(short.body)["reason"] == SHED_REASON
    roomy = await router(request(body, {DEADLINE_HEADER: "10000"}))
    assert roomy.status_code == 200, roomy.body
    plain = await router(request(body))  # the router's own 30 s deadline leaves room
    assert plain.status_code == 200
    bad = await router(request(body, {DEADLINE_HEADER: "soon"}))
    assert bad.status_code == 400 and DEADLINE_HEADER in json.loads(bad.body)["message"]
    assert router._counters[APP].shed == 1 and router._counters[APP].requests == 2


async def test_answers_teach_the_router_its_service_time(build: Any) -> None:
    router, _, _ = build(reply({"u": 1}), reply([0.5]))
    queue = router._routes[APP].queue
    assert queue.service_s(time.monotonic()) is None
    _, status = await router.predict({"user": 1})
    assert status == 200 and queue.service_s(time.monotonic()) is not None
    assert queue.in_flight(time.monotonic()) == 0


async def test_a_set_with_a_part_not_running_yet_has_no_planned_capacity_to_shed_by(build: Any) -> None:
    """A part with no running replica (starting, or back after Ray was lost) has capacity 0 in the
    set's description: that is no capacity to bound admission by (every request was shed, and a
    rollout's bake after a restart saw no traffic). Its requests wait for the replicas instead."""
    router, _, _ = build(reply({"u": 1}), reply([0.5]), max_queue_wait_ms=100.0)
    dag = [("input", "embed"), ("embed", "dense"), ("dense", "output")]
    starting = SetDescription(
        set_id="m@1",
        dag=dag,
        order=["embed", "dense"],
        deployments={"embed": {"embed-cpu": 300.0}, "dense": {"dense-cpu": 0.0}},
    )
    router._routes = {APP: SetRoute(APP, starting, VariantRouter(dag, ["embed", "dense"], {}))}
    assert router._routes[APP].capacity_qps() is None
    for _ in range(20):
        router._routes[APP].queue.started(time.monotonic())  # requests waiting for the dense replica
    answer = await router(request(json.dumps({"inputs": {"user": 1}}).encode()))
    assert answer.status_code == 200, answer.body
    running = SetDescription(
        set_id="m@1",
        dag=dag,
        order=["embed", "dense"],
        deployments={"embed": {"embed-cpu": 300.0}, "dense": {"dense-cpu": 2.0}},
    )
    assert SetRoute(APP, running, VariantRouter(dag, ["embed", "dense"], {})).capacity_qps() == 2.0


async def test_a_request_cancelled_or_a_stream_closed_gives_back_its_place_in_the_queue(build: Any) -> None:
    """A request cancelled mid-flight (the client went away: Serve cancels the call) and a stream
    whose reader stopped both leave the set's queue. A token left behind stood as a queue that
    grew with its age: the region drill's router shed every request after its region came back."""

    async def never(upstream: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        await asyncio.Event().wait()  # no first piece, ever
        yield {"output": "never", "snapshot_id": "m/dense@v1"}

    for dense in (_forever, never):
        router, _, _ = build(reply({"u": 1}), dense)
        router._limits = router._limits.model_copy(update={"deadline_seconds": 60.0})
        queue = router._routes[APP].queue
        if dense is _forever:
            call: asyncio.Future[Any] = asyncio.ensure_future(router.predict({"user": 1}))
        else:
            call = asyncio.ensure_future(anext(router.stream({"user": 1})))
        await poll_until(
            lambda q=queue: asyncio.sleep(0, q.in_flight(time.monotonic())), bool, timeout_s=WAIT_S
        )
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert queue.in_flight(time.monotonic()) == 0, dense


async def test_a_hung_canary_is_no_queue_for_the_serving_set(
    build: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each set app has its own queue: requests hanging on a canary (the doors drill's hung
    snapshot) are shed or time out there, and the serving set's requests are admitted (they
    were shed as if they waited behind the canary's: 'would wait about 5003 ms, over its 4989')."""
    router, _, _ = build(reply({"u": 1}), reply([0.5]), max_queue_wait_ms=100.0)
    canary = "m.us-east.s2.r1"
    router._routes[canary] = SetRoute(
        canary, described_as("m@2"), VariantRouter([("input", "embed")], ["embed"], {})
    )
    hung = router._routes[canary].queue
    now = time.monotonic()
    served(hung, now - 10, 0.010)
    for _ in range(50):
        hung.started(now - 4.0, deadline_s=5.0)  # hanging for 4 s, nothing completes
    router._config = RouterConfig(generation=2, weights={APP: 100})
    body, status = await router.predict({"user": 1})
    assert status == 200 and body["set"] == "m@1", body
    router._config = RouterConfig(generation=3, weights={canary: 100})
    body, status = await router.predict({"user": 1})
    assert status == 503 and body["reason"] == SHED_REASON and router._counters[canary].shed == 1, body
