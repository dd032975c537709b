"""The LLM engine behind asyncio: requests stream their text as it is generated, new ones join
the running batch at the next step, and a request whose reader goes away is cancelled (its
cache blocks return to the pool).

One background task owns the engine. It applies new requests and cancellations between steps
(so the engine is never touched from two places at once) and runs each `step()` in a worker
thread, so the event loop keeps accepting requests while the model computes. A request that
fails (when added, or in a step) fails alone, with a `GenerationError`, and is never run again;
if the driver itself dies, every request it held fails and `check_health` says so, as it does
when work waits and no step has finished for `stall_seconds`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch

from ipnext.errors import GenerationError
from ipnext.serving.llm.engine import LLMEngine, SamplingParams, Sequence
from ipnext.serving.llm.metrics import LLMMetrics
from ipnext.serving.llm.text import TextCodec

__all__ = ["Completion", "LLMService", "Prefilled", "TextDelta"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TextDelta:
    """A piece of a streamed answer; the last one carries `finish_reason` and the usage."""

    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Prefilled:
    """A prompt prefilled here, to be decoded elsewhere: its tokens, the first sampled token,
    and the prompt's keys and values (n_layers, 2, n_kv_heads, tokens, head_dim)."""

    prompt: list[int]
    first_token: int
    kv: torch.Tensor


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    deltas: asyncio.Queue[TextDelta | GenerationError] = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: str = ""  # text streamed so far
    done: bool = False
    prefill_only: bool = False
    handed: Prefilled | None = None  # prefilled elsewhere: decode from here
    prefilled: asyncio.Future[Prefilled] | None = None


class LLMService:
    def __init__(
        self,
        engine: LLMEngine,
        codec: TextCodec,
        metrics: LLMMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.codec = codec
        self.metrics = metrics or LLMMetrics()
        engine.eos_tokens = frozenset(codec.eos_ids)
        engine.stop_check = self._hit_stop
        self._incoming: list[_Request] = []
        self._cancelled: list[_Request] = []
        self._live: dict[int, _Request] = {}  # sequence id -> request
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None
        self._closing = False
        self._death: str | None = None  # why the driver task ended, when nobody closed it
        self._clock = clock
        self._progress_at = clock()  # the last step that ran a batch, or when work last arrived

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        """A prompt's tokens: text through the codec (a completion), or tokens made already
        (a chat prompt rendered with the template)."""
        return self.codec.prompt(prompt) if isinstance(prompt, str) else list(prompt)

    async def stream(self, prompt: str | list[int], params: SamplingParams) -> AsyncIterator[TextDelta]:
        """The answer to `prompt` as it is generated. Closing the iterator early cancels it."""
        tokens = self._tokens(prompt)
        self.engine.check(tokens, params)  # refuse before queueing, with the field and the fix
        async for delta in self._deltas(_Request(tokens, params)):
            yield delta

    def _submit(self, request: _Request) -> None:
        if self._death is not None:  # the replica is failing its health checks: Serve replaces it
            raise GenerationError(
                f"the LLM engine's driver stopped ({self._death}); this replica is being replaced"
            )
        self._incoming.append(request)
        self._ensure_driver()
        self._wake.set()

    async def _deltas(self, request: _Request) -> AsyncIterator[TextDelta]:
        self._submit(request)
        try:
            while True:
                delta = await request.deltas.get()
                if isinstance(delta, GenerationError):
                    raise delta
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not request.done:  # the reader went away: stop generating for it
                self._cancelled.append(request)
                self._wake.set()

    async def prefill(self, prompt: str | list[int], params: SamplingParams) -> Prefilled:
        """Disaggregated serving, first half: prefill the prompt and sample its first token."""
        tokens = self._tokens(prompt)
        self.engine.check(tokens, params)
        request = _Request(tokens, params, prefill_only=True)
        request.prefilled = asyncio.get_running_loop().create_future()
        self._submit(request)
        try:
            return await request.prefilled
        finally:
            if not request.done:
                self._cancelled.append(request)
                self._wake.set()

    async def stream_prefilled(self, handed: Prefilled, params: SamplingParams) -> AsyncIterator[TextDelta]:
        """Disaggregated serving, second half: decode from a prompt prefilled elsewhere."""
        self.engine.check(handed.prompt, params)
        request = _Request(handed.prompt, params, handed=handed)
        async for delta in self._deltas(request):
            yield delta

    async def complete(self, prompt: str | list[int], params: SamplingParams) -> Completion:
        parts: list[str] = []
        async for delta in self.stream(prompt, params):
            parts.append(delta.text)
            if delta.finish_reason is not None:
                return Completion(
                    "".join(parts), delta.finish_reason, delta.prompt_tokens, delta.completion_tokens
                )
        raise RuntimeError("the stream ended without a finish reason")  # pragma: no cover

    async def close(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None and not driver.done():  # a dead one was reported when it died
            self._closing = True
            driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await driver
            self._closing = False

    def check_health(self, stall_seconds: float) -> None:
        """Raise GenerationError when the driver task has died, or when work is pending and no
        step has run a batch for `stall_seconds` (a step that spins or hangs, a driver that
        stopped stepping). Idle, or never used: healthy."""
        if self._death is not None:
            raise GenerationError(f"the LLM engine's driver task died: {self._death}")
        pending = len(self._incoming) + len(self.engine.running) + len(self.engine.waiting)
        stalled = self._clock() - self._progress_at
        if pending and stalled > stall_seconds:
            raise GenerationError(
                f"the LLM engine made no progress for {stalled:.1f} s with {pending} requests pending "
                f"(stall_seconds {stall_seconds:g})"
            )

    # ---- the driver -------------------------------------------------------------------------

    def _ensure_driver(self) -> None:
        if self._driver is None:  # a driver that died stays dead: `_submit` refuses, health fails
            self._progress_at = self._clock()
            self._driver = asyncio.get_running_loop().create_task(self._drive())
            self._driver.add_done_callback(self._driver_ended)

    def _driver_ended(self, task: asyncio.Task[None]) -> None:
        """The driver ended without `close()`: a bug in the driver itself. Nothing will step the
        engine again, so every request it held fails now instead of waiting forever."""
        if self._closing:
            return
        error = None if task.cancelled() else task.exception()
        self._death = "cancelled" if error is None else f"{type(error).__name__}: {error}"
        logger.error("the LLM engine's driver task died (%s)", self._death, exc_info=error)
        for request in [*self._incoming, *self._live.values()]:
            self._fail(request, f"the LLM engine's driver stopped ({self._death})")
        self._incoming.clear()
        self._live.clear()

    async def _drive(self) -> None:
        while True:
            self._apply_changes()
            if not self.engine.has_work():
                self._wake.clear()
                if self._incoming or self._cancelled:
                    continue
                await self._wake.wait()
                self._progress_at = self._clock()  # idle until now: the stall clock starts here
                continue
            try:
                result = await asyncio.to_thread(self.engine.step)
            except Exception as err:  # step() fails what it ran itself; this is the thread around it
                self._fail_everything(err)
                continue
            if result.batch_size:
                self._progress_at = self._clock()
            self.metrics.observe_step(self.engine, result)
            for seq in result.failed:
                request = self._live.pop(seq.id, None)
                if request is not None:
                    self._fail(request, seq.error or "failed in an engine step")
            for seq_id in result.new_tokens:
                request = self._live.get(seq_id)
                if request is not None and request.seq is not None and not request.seq.finished:
                    self._guarded(request, lambda r: self._send_text(r, final=False))
            for seq in result.finished:
                request = self._live.pop(seq.id, None)
                if request is not None:
                    self._guarded(request, self._finish)
            await asyncio.sleep(0)  # let readers and new requests in between steps

    def _apply_changes(self) -> None:
        incoming, self._incoming = self._incoming, []
        for request in incoming:
            try:
                request.seq = self._add(request)
            except Exception as err:  # this request's own: it fails alone, never reaches a step
                self._fail(request, f"{type(err).__name__}: {err}", err)
                continue
            if request.seq.finished:  # a handed first token that already ends the answer
                self._guarded(request, self._finish)
                continue
            self._live[request.seq.id] = request
        for request in self._cancelled:
            if request.seq is not None and not request.seq.finished:
                self.engine.cancel(request.seq)
                self._live.pop(request.seq.id, None)
                self.metrics.cancelled += 1
        self._cancelled.clear()

    def _add(self, request: _Request) -> Sequence:
        if request.prefill_only:
            return self.engine.add_prefill(request.prompt, request.params)
        if request.handed is not None:
            handed = request.handed
            return self.engine.add_prefilled(handed.prompt, handed.first_token, handed.kv, request.params)
        return self.engine.add(request.prompt, request.params)

    def _guarded(self, request: _Request, deliver: Callable[[_Request], None]) -> None:
        """Deliver to one request; if that fails, the request fails (out of the engine), alone."""
        try:
            deliver(request)
        except Exception as err:
            if request.seq is not None:
                self.engine.fail(request.seq, err)
                self._live.pop(request.seq.id, None)
            self._fail(request, f"{type(err).__name__}: {err}", err)

    def _fail_everything(self, err: Exception) -> None:
        """A failure no request can be blamed for: every request in the engine fails (their blocks
        go back), the driver goes on with the requests that come next."""
        for request in list(self._live.values()):
            if request.seq is not None:
                self.engine.fail(request.seq, err)
            self._fail(request, f"{type(err).__name__}: {err}", err)
        self._live.clear()

    def _fail(self, request: _Request, why: str, cause: BaseException | None = None) -> None:
        """End one request with a GenerationError its reader raises (the router's 500)."""
        if request.done:
            return
        request.done = True
        self.metrics.failed += 1
        logger.error("an LLM request failed: %s", why, exc_info=cause)
        error = GenerationError(f"generation failed: {why}")
        if request.prefilled is not None:
            if not request.prefilled.done():
                request.prefilled.set_exception(error)
        else:
            request.deltas.put_nowait(error)

    def _send_text(self, request: _Request, final: bool) -> None:
        assert request.seq is not None
        text = self.codec.stable_text(request.seq.output)
        stops = request.params.stop
        if stops and not final:  # hold back what could still become a stop string
            text = text[: max(len(request.sent), len(text) - max(len(s) for s in stops) + 1)]
        if len(text) > len(request.sent):
            request.deltas.put_nowait(TextDelta(text[len(request.sent) :]))
            request.sent = text

    def _finish(self, request: _Request) -> None:
        seq = request.seq
        assert seq is not None
        if request.prefilled is not None:
            assert seq.kv is not None
            prefilled = Prefilled(list(seq.prompt), seq.output[0], seq.kv)
            request.done = True  # only once its answer is sure to go out (else `_fail` must tell it)
            if not request.prefilled.done():
                request.prefilled.set_result(prefilled)
            self.metrics.observe_finished(seq)
            return
        text = self.codec.decode(seq.output)
        if seq.finish_reason == "stop":
            cut = self.codec.find_stop(text, request.params.stop)
            text = text[:cut] if cut is not None else text
        tail = text[len(request.sent) :] if text.startswith(request.sent) else ""
        last = TextDelta(tail, seq.finish_reason or "length", len(seq.prompt), len(seq.output))
        request.done = True
        request.deltas.put_nowait(last)
        self.metrics.observe_finished(seq)

    def _hit_stop(self, seq: Sequence) -> bool:
        return self.codec.find_stop(self.codec.decode(seq.output), seq.params.stop) is not None
