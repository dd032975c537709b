"""A pooled model's caps in the pool router it shares (serving/model_slots.py): its
`max_ongoing_requests` run, `max_queued_requests` wait, the next is refused at once; one model
over its caps never holds up a pool-mate; a stream holds its slot until it ends. The pool router
runs without Serve, each model's `Router` replaced by a double at its seam."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ipnext.serving.layout import RouterAppArgs
from ipnext.serving.model_slots import ModelSlots, SlotsFull
from ipnext.serving.pool_layout import PoolRouterArgs
from ipnext.serving.pool_router import PoolRouter
from ipnext.spec.model import RouterSpec

pytestmark = pytest.mark.timeout(30)


async def test_slots_run_queue_then_refuse_and_a_waiter_that_leaves_frees_its_place() -> None:
    slots = ModelSlots(max_ongoing=2, max_queued=1)
    first, second = await slots.take(), await slots.take()
    queued = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    assert (slots.running, slots.waiting) == (2, 1)
    with pytest.raises(SlotsFull, match="2 requests running and 1 waiting"):
        await slots.take()
    first()
    first()  # a second release does nothing
    third = await queued
    assert (slots.running, slots.waiting, slots.refused) == (2, 0, 1)
    leaving = asyncio.ensure_future(slots.take())
    await asyncio.sleep(0)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert slots.waiting == 0
    second()
    third()
    async with slots.slot(), slots.slot():
        assert slots.running == 2
    assert slots.running == 0


@pytest.mark.parametrize(("args", "says"), [((0, 1), "max_ongoing"), ((1, -1), "max_queued")])
def test_bad_caps_name_the_setting(args: tuple[int, int], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        ModelSlots(*args)


class HeldRouter:
    """A model's router double: each request waits for `release`, then answers (a stream when
    `stream` is set, whose end waits for `end`)."""

    def __init__(self, stream: bool = False) -> None:
        self.release = asyncio.Event()
        self.end = asyncio.Event()
        self.stream = stream
        self.entered = 0

    async def __call__(self, request: Request) -> JSONResponse | StreamingResponse:
        self.entered += 1
        await self.release.wait()
        if not self.stream:
            return JSONResponse({"ok": True})

        async def pieces() -> AsyncIterator[bytes]:
            yield b"first"
            await self.end.wait()
            yield b"last"

        return StreamingResponse(pieces())

    async def predict(self, inputs: Any, **options: Any) -> tuple[dict[str, Any], int]:
        return {"ok": True}, 200


def pool_router(routers: dict[str, HeldRouter], max_ongoing: int, max_queued: int) -> Any:
    pool = PoolRouter.func_or_class(PoolRouterArgs(region="us-east"))  # type: ignore[attr-defined]
    spec = RouterSpec(max_ongoing_requests=max_ongoing, max_queued_requests=max_queued)
    for model, router in routers.items():
        pool._routers[model] = router
        pool._specs[model] = RouterAppArgs(model=model, region="us-east", router=spec)
        pool._slots[model] = ModelSlots(max_ongoing, max_queued)
    return pool


def request(model: str) -> Request:
    path = f"/us-east/models/{model}/predict"
    return Request({"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""})


async def test_a_model_over_its_caps_is_refused_and_its_pool_mate_is_not_held_up() -> None:
    hot, mate = HeldRouter(), HeldRouter()
    mate.release.set()
    pool = pool_router({"hot": hot, "mate": mate}, max_ongoing=1, max_queued=1)
    running = [asyncio.ensure_future(pool(request("hot"))) for _ in range(2)]  # one runs, one waits
    await asyncio.sleep(0.01)
    refused = await pool(request("hot"))
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert b"max_ongoing_requests" in refused.body
    assert (await pool(request("mate"))).status_code == 200  # its own slots, free
    assert hot.entered == 1
    hot.release.set()
    assert [r.status_code for r in await asyncio.gather(*running)] == [200, 200]
    assert pool._slots["hot"].running == 0


async def test_a_stream_holds_its_slot_until_it_ends() -> None:
    streaming = HeldRouter(stream=True)
    streaming.release.set()
    pool = pool_router({"llm": streaming}, max_ongoing=1, max_queued=1)
    response = await pool(request("llm"))
    assert isinstance(response, StreamingResponse)
    second = asyncio.ensure_future(pool(request("llm")))
    await asyncio.sleep(0.01)
    assert streaming.entered == 1  # the stream still holds the slot: the next one waits for it
    pieces = response.body_iterator.__aiter__()
    assert await pieces.__anext__() == b"first"
    streaming.end.set()
    assert [piece async for piece in pieces] == [b"last"]
    await second
    assert streaming.entered == 2
