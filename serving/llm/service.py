"""The LLM engine behind asyncio: requests stream their text as it is generated, new ones join
the running batch at the next step, and a request whose reader goes away is cancelled (its
cache blocks return to the pool).

One background task owns the engine. It applies new requests and cancellations between steps
(so the engine is never touched from two places at once) and runs each `step()` in a worker
thread, so the event loop keeps accepting requests while the model computes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from ipnext.serving.llm.engine import LLMEngine, SamplingParams, Sequence
from ipnext.serving.llm.metrics import LLMMetrics
from ipnext.serving.llm.text import TextCodec

__all__ = ["Completion", "LLMService", "Prefilled", "TextDelta"]


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
    deltas: asyncio.Queue[TextDelta] = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: str = ""  # text streamed so far
    done: bool = False
    prefill_only: bool = False
    handed: Prefilled | None = None  # prefilled elsewhere: decode from here
    prefilled: asyncio.Future[Prefilled] | None = None


class LLMService:
    def __init__(self, engine: LLMEngine, codec: TextCodec, metrics: LLMMetrics | None = None) -> None:
        self.engine = engine
        self.codec = codec
        self.metrics = metrics or LLMMetrics()
        engine.eos_token = codec.eos
        engine.stop_check = self._hit_stop
        self._incoming: list[_Request] = []
        self._cancelled: list[_Request] = []
        self._live: dict[int, _Request] = {}  # sequence id -> request
        self._wake = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    async def stream(self, prompt: str, params: SamplingParams) -> AsyncIterator[TextDelta]:
        """The answer to `prompt` as it is generated. Closing the iterator early cancels it."""
        tokens = self.codec.prompt(prompt)
        self.engine.check(tokens, params)  # refuse before queueing, with the field and the fix
        async for delta in self._deltas(_Request(tokens, params)):
            yield delta

    def _submit(self, request: _Request) -> None:
        self._incoming.append(request)
        self._ensure_driver()
        self._wake.set()

    async def _deltas(self, request: _Request) -> AsyncIterator[TextDelta]:
        self._submit(request)
        try:
            while True:
                delta = await request.deltas.get()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            if not request.done:  # the reader went away: stop generating for it
                self._cancelled.append(request)
                self._wake.set()

    async def prefill(self, prompt: str, params: SamplingParams) -> Prefilled:
        """Disaggregated serving, first half: prefill the prompt and sample its first token."""
        tokens = self.codec.prompt(prompt)
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

    async def complete(self, prompt: str, params: SamplingParams) -> Completion:
        parts: list[str] = []
        async for delta in self.stream(prompt, params):
            parts.append(delta.text)
            if delta.finish_reason is not None:
                return Completion(
                    "".join(parts), delta.finish_reason, delta.prompt_tokens, delta.completion_tokens
                )
        raise RuntimeError("the stream ended without a finish reason")  # pragma: no cover

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver

    # ---- the driver -------------------------------------------------------------------------

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())

    async def _drive(self) -> None:
        while True:
            self._apply_changes()
            if not self.engine.has_work():
                self._wake.clear()
                if self._incoming or self._cancelled:
                    continue
                await self._wake.wait()
                continue
            result = await asyncio.to_thread(self.engine.step)
            self.metrics.observe_step(self.engine, result)
            for seq_id in result.new_tokens:
                request = self._live.get(seq_id)
                if request is not None and request.seq is not None and not request.seq.finished:
                    self._send_text(request, final=False)
            for seq in result.finished:
                request = self._live.pop(seq.id, None)
                if request is not None:
                    self._finish(request)
            await asyncio.sleep(0)  # let readers and new requests in between steps

    def _apply_changes(self) -> None:
        for request in self._incoming:
            if request.prefill_only:
                request.seq = self.engine.add_prefill(request.prompt, request.params)
            elif request.handed is not None:
                handed = request.handed
                request.seq = self.engine.add_prefilled(
                    handed.prompt, handed.first_token, handed.kv, request.params
                )
            else:
                request.seq = self.engine.add(request.prompt, request.params)
            if request.seq.finished:  # a handed first token that already ends the answer
                self._finish(request)
                continue
            self._live[request.seq.id] = request
        self._incoming.clear()
        for request in self._cancelled:
            if request.seq is not None and not request.seq.finished:
                self.engine.cancel(request.seq)
                self._live.pop(request.seq.id, None)
                self.metrics.cancelled += 1
        self._cancelled.clear()

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
            request.done = True
            assert seq.kv is not None
            if not request.prefilled.done():
                request.prefilled.set_result(Prefilled(list(seq.prompt), seq.output[0], seq.kv))
            self.metrics.observe_finished(seq)
            return
        text = self.codec.decode(seq.output)
        if seq.finish_reason == "stop":
            cut = self.codec.find_stop(text, request.params.stop)
            text = text[:cut] if cut is not None else text
        tail = text[len(request.sent) :] if text.startswith(request.sent) else ""
        request.done = True
        request.deltas.put_nowait(
            TextDelta(tail, seq.finish_reason or "length", len(seq.prompt), len(seq.output))
        )
        self.metrics.observe_finished(seq)

    def _hit_stop(self, seq: Sequence) -> bool:
        return self.codec.find_stop(self.codec.decode(seq.output), seq.params.stop) is not None
