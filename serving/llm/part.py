"""`LLMPart`: a generative part of the decoder family, by the part contract
(`factory(weights, config) -> part` with `__call__`, `stream` and `expected_tensors`). Its
snapshot is a Hugging Face checkpoint folder (the part gets its files as `CheckpointFiles`;
`ipnext.serving.llm.hf` reads the model, `chat` the tokenizer and chat template).

model.yaml:

    parts:
      lm:
        factory: ipnext.serving.llm.part:LLMPart
        config:
          max_seq_len: 1024   # the served context (default: the checkpoint's max_position_embeddings)
          engine: {kv_cache_bytes: 33554432, max_num_seqs: 16}

A request's `inputs` is `{"prompt": str, "max_tokens": int, "temperature": float, "top_p": float,
"stop": [str], "seed": int}` (all but the prompt optional), each field bounded (`SamplingParams`):
one out of bounds, of another JSON type, NaN or infinite is refused here, before the engine sees
it, with a `PartInputError` (HTTP 400) naming it. `__call__` answers
`{"text", "finish_reason", "prompt_tokens", "completion_tokens"}`; `stream` yields `{"text": delta}`
pieces and a last one that also carries the finish reason and the token counts. `check_health`
fails when the engine's driver died or stalls (Serve then replaces the replica).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any, Literal

import torch
from pydantic import Field, ValidationError, model_validator

from ipnext.contracts.counters import SetCounters
from ipnext.errors import CheckpointError, PartInputError
from ipnext.names import Frozen
from ipnext.serving.llm.chat import checkpoint_codec
from ipnext.serving.llm.engine import (
    GREEDY_BELOW,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    EngineConfig,
    LLMEngine,
    SamplingParams,
)
from ipnext.serving.llm.hf import expected_hf_tensors, from_files
from ipnext.serving.llm.metrics import LLMMetrics
from ipnext.serving.llm.service import LLMService, Prefilled, TextDelta
from ipnext.serving.llm.vllm_metrics import EngineStats

__all__ = [
    "ChatMessage",
    "LLMDecodePart",
    "LLMPart",
    "LLMPartConfig",
    "LLMPrefillPart",
    "LLMRequest",
    "Pinned",
]


class LLMPartConfig(Frozen):
    # Refused when given: the checkpoint's config.json is the model's shape (kept only so an old
    # model.yaml that still names it gets that said, not "extra field").
    model: dict[str, Any] | None = None
    # A checkpoint's served context: at most its max_position_embeddings (the default).
    max_seq_len: int | None = Field(default=None, gt=0)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # Disaggregated serving: how long a prefill part keeps the keys and values it handed on in
    # the object store. It owns them, and a reference nested in a Serve answer does not always
    # keep them alive until the decode part fetches them (CI saw one freed in between), so the
    # prefill part holds a reference of its own this long. The decode part must fetch within it.
    handoff_seconds: float = Field(default=60, gt=0)
    # ... and at most this many bytes of them at once: past it the oldest are let go first.
    handoff_max_bytes: int = Field(default=512 << 20, gt=0)
    # `check_health` fails when requests are pending and no engine step has run for this long
    # (a step that hangs or spins); a step is one batch of at most max_batched_tokens, far shorter.
    stall_seconds: float = Field(default=30, gt=0, allow_inf_nan=False)


MAX_MESSAGES = 1024  # turns in one conversation
MAX_CONTENT_PARTS = 64  # text parts of one message


class TextPart(Frozen):
    """A piece of a message's content, as OpenAI's API sends it: `{"type": "text", "text": ...}`."""

    type: Literal["text"]
    text: str = Field(strict=True)


class ChatMessage(Frozen):
    """One turn of a conversation: its role and its text (a string, or text parts, joined)."""

    role: str = Field(strict=True, min_length=1, max_length=64)
    content: (
        Annotated[str, Field(strict=True)] | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    )

    def for_template(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": text}


class LLMRequest(SamplingParams):
    """A generation request: a `prompt` (a completion) or `messages` (a chat, rendered with the
    checkpoint's chat template), exactly one, and the engine's sampling settings, whose fields
    and bounds it inherits (one definition of each)."""

    prompt: str | None = Field(default=None, min_length=1, strict=True)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    # null: as many as the model's context leaves after the prompt (OpenAI's chat default).
    max_tokens: int | None = Field(default=64, ge=1, strict=True)  # type: ignore[assignment]

    @model_validator(mode="after")
    def _one_input(self) -> LLMRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt (a completion) or messages (a chat), exactly one")
        return self

    def sampling(self, context_left: int = 1) -> SamplingParams:
        """The engine's settings; `context_left` (tokens the context holds after the prompt)
        stands in for a null max_tokens."""
        fields = self.model_dump(exclude={"prompt", "messages"})
        if fields["max_tokens"] is None:
            fields["max_tokens"] = max(1, context_left)
        return SamplingParams.model_validate(fields)


class LLMPart:
    """A generative part. Its snapshot is a Hugging Face checkpoint folder (`CheckpointFiles`:
    config.json, safetensors weights, tokenizer.json, tokenizer_config.json and its chat
    template, generation_config.json), whatever trained it: the example trainer writes one too."""

    def __init__(self, weights: Mapping[str, Any], config: dict[str, Any]) -> None:
        self.config = LLMPartConfig.model_validate(config)
        if self.config.model is not None:
            raise ValueError(
                "config.model: a Hugging Face checkpoint brings its own shape (config.json); "
                "remove config.model"
            )
        if not all(isinstance(data, bytes) for data in weights.values()):
            raise ValueError(
                "weights: an LLM part serves a Hugging Face checkpoint folder (config.json, safetensors, "
                "tokenizer.json), not one weights file; publish the folder (ipnext snapshot import-hf)"
            )
        checkpoint = from_files(weights, self.config.max_seq_len)
        self.codec = checkpoint_codec(weights, checkpoint)
        self.model_config = checkpoint.config
        self._expected = expected_hf_tensors(checkpoint.config, checkpoint.weights)
        self.engine = LLMEngine(checkpoint.weights, checkpoint.config, self.config.engine)
        self._service: LLMService | None = None
        self._observer: Callable[[str, float], None] | None = None

    def observe_with(self, observer: Callable[[str, float], None]) -> None:
        """Also report every TTFT, ITL and queue-time observation (metric, ms) to `observer`."""
        self._observer = observer
        if self._service is not None:
            self._service.metrics.observer = observer

    def expected_tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor of the snapshot, by its name there: validation checks the file headers."""
        return dict(self._expected)

    def serving_counters(self) -> SetCounters:
        """TTFT, ITL and queue-time histograms, cumulative: the host pushes them to the model's
        metrics actor beside the router's counters, where the rollout gates read them."""
        return self._service.metrics.latency if self._service is not None else SetCounters()

    def engine_stats(self) -> dict[str, Any]:
        """This replica's figures under vLLM's names (`vllm_metrics.EngineStats`), cumulative:
        the host pushes them to the model's metrics actor for `GET /metrics`."""
        stats = self._service.metrics.engine_stats if self._service is not None else EngineStats()
        return stats.model_dump()

    def status(self) -> dict[str, Any]:
        pool = self.engine.cache.pool
        summary = self._service.metrics.summary() if self._service is not None else {}
        return {
            "kv_cache_blocks": pool.num_blocks,
            "kv_cache_used_blocks": pool.used_count(),
            "running": len(self.engine.running),
            "waiting": len(self.engine.waiting),
            **summary,
        }

    async def check_health(self) -> None:
        """Raise when this part can no longer answer: its engine's driver task died, or work is
        pending and no step has finished for `stall_seconds`. The host's Serve `check_health`
        calls it; a part never used is healthy."""
        if self._service is not None:
            self._service.check_health(self.config.stall_seconds)

    @property
    def service(self) -> LLMService:
        if self._service is None:  # built inside the serving event loop, on first use
            self._service = LLMService(self.engine, self.codec, LLMMetrics(observer=self._observer))
        return self._service

    def _checked(self, inputs: dict[str, Any]) -> tuple[LLMRequest, list[int]]:
        """The request and its prompt's tokens, refused with PartInputError if it could never run
        on this engine (or is a chat for a model without a chat template)."""
        request = _request(inputs)
        try:
            if request.messages is not None:
                tokens = self.codec.chat_prompt([m.for_template() for m in request.messages])
            else:
                tokens = self.codec.prompt(str(request.prompt))
            self.engine.check(tokens, self._sampling(request, tokens))
        except CheckpointError as err:  # the template refused this conversation (raise_exception)
            raise PartInputError(f"inputs.messages: {err}") from None
        except ValueError as err:
            raise PartInputError(f"inputs.{err}") from None
        return request, tokens

    def _sampling(self, request: LLMRequest, tokens: list[int]) -> SamplingParams:
        return request.sampling(context_left=self.model_config.max_seq_len - len(tokens))

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        request, tokens = self._checked(inputs)
        done = await self.service.complete(tokens, self._sampling(request, tokens))
        return {
            "text": done.text,
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
        }

    async def stream(self, inputs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        request, tokens = self._checked(inputs)
        async for delta in self.service.stream(tokens, self._sampling(request, tokens)):
            yield _piece(delta)


def _piece(delta: TextDelta) -> dict[str, Any]:
    """A streamed piece: its text, and on the last one the finish reason and token counts."""
    piece: dict[str, Any] = {"text": delta.text}
    if delta.finish_reason is not None:
        piece |= {
            "finish_reason": delta.finish_reason,
            "prompt_tokens": delta.prompt_tokens,
            "completion_tokens": delta.completion_tokens,
        }
    return piece


# What a caller is told to send when a field is refused: every field's type and bounds.
_BOUNDS = (
    '{"prompt": "..." or "messages": [{"role": "user", "content": "..."}], '
    '"max_tokens": 64, "temperature": 0, "top_p": 1, "stop": [], "seed": null}: '
    "max_tokens an integer >= 1 (prompt tokens + max_tokens within the model's context), temperature "
    f"a finite number >= 0 (below {GREEDY_BELOW:g}: greedy), top_p a number in (0, 1], stop up to "
    f"{MAX_STOP_STRINGS} strings of 1 to {MAX_STOP_LENGTH} characters, seed an integer in "
    "[-2**63, 2**63) or null"
)


def _request(inputs: dict[str, Any]) -> LLMRequest:
    """The request from the part's upstream: the DAG's input, or the one upstream part's output."""
    raw = inputs.get("input") if "input" in inputs else next(iter(inputs.values()), None)
    try:
        return LLMRequest.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "prompt"  # neither or both: prompt, messages
        raise PartInputError(
            f"inputs.{where}: {first['msg']} (got {_shown(first.get('input'))}); send {_BOUNDS}"
        ) from None


def _shown(value: Any) -> str:
    """A refused value as the answer quotes it: its repr, cut short (a caller may send megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


class Pinned:
    """Object references held for `seconds` each, so their objects outlive the answers that
    carry them, within `max_bytes` of objects held at once (past it the oldest go first).
    Expired ones are dropped whenever another is kept or the count is read."""

    def __init__(
        self, seconds: float, max_bytes: int | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.seconds = seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._held: deque[tuple[float, int, Any]] = deque()  # (expires, bytes, reference)
        self.bytes = 0

    def keep(self, ref: Any, nbytes: int = 0) -> None:
        self._drop_expired()
        self._held.append((self._clock() + self.seconds, nbytes, ref))
        self.bytes += nbytes
        while self.max_bytes is not None and self.bytes > self.max_bytes and len(self._held) > 1:
            self._pop()

    def _drop_expired(self) -> None:
        now = self._clock()
        while self._held and self._held[0][0] <= now:
            self._pop()

    def _pop(self) -> None:
        self.bytes -= self._held.popleft()[1]

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._held)


class LLMPrefillPart(LLMPart):
    """Disaggregated serving, first part: prefills each prompt (batched with other prompts),
    samples its first token, and hands the prompt's keys and values on through the Ray object
    store (in a Serve replica; the tensor itself elsewhere) to the decode part downstream. It
    holds each handed reference for `handoff_seconds`, so the object is there when decode asks."""

    def __init__(self, weights: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
        super().__init__(weights, config)
        self.handed = Pinned(self.config.handoff_seconds, self.config.handoff_max_bytes)

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        request, tokens = self._checked(inputs)
        sampling = self._sampling(request, tokens)
        prefilled = await self.service.prefill(tokens, sampling)
        kv = _to_object_store(prefilled.kv)
        if not isinstance(kv, torch.Tensor):
            self.handed.keep(kv, prefilled.kv.numel() * prefilled.kv.element_size())
        return {
            "request": {**request.model_dump(), "max_tokens": sampling.max_tokens},  # resolved
            "prompt_tokens": prefilled.prompt,
            "first_token": prefilled.first_token,
            "kv": kv,
        }

    def status(self) -> dict[str, Any]:
        return {**super().status(), "handed_kv_held": len(self.handed), "handed_kv_bytes": self.handed.bytes}

    async def stream(self, inputs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield await self(inputs)


class LLMDecodePart(LLMPart):
    """Disaggregated serving, second part: takes the prefill part's output (its only upstream),
    writes the handed keys and values into its own paged cache and decodes from there."""

    async def __call__(self, inputs: dict[str, Any]) -> dict[str, Any]:
        pieces = [piece async for piece in self.stream(inputs)]
        last = pieces[-1]
        return {**last, "text": "".join(p["text"] for p in pieces)}

    async def stream(self, inputs: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        handed = next(iter(inputs.values()), None)
        if not isinstance(handed, dict) or not {"request", "prompt_tokens", "first_token", "kv"} <= set(
            handed
        ):
            raise ValueError("inputs: the decode part expects the prefill part's output as its one upstream")
        request = LLMRequest.model_validate(handed["request"])
        kv = await _from_object_store(handed["kv"])
        prefilled = Prefilled(list(handed["prompt_tokens"]), int(handed["first_token"]), kv)
        async for delta in self.service.stream_prefilled(prefilled, request.sampling()):
            yield _piece(delta)


def _to_object_store(kv: torch.Tensor) -> Any:
    """Inside a Serve replica, a reference into the object store; anywhere else the tensor."""
    import ray
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        serve.get_replica_context()
    except RayServeException:
        return kv
    return ray.put(kv)


async def _from_object_store(kv: Any) -> torch.Tensor:
    import ray

    tensor = await _fetch(kv) if isinstance(kv, ray.ObjectRef) else kv
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(
            f"inputs.kv: expected a tensor or an object reference to one, got {type(tensor).__name__}"
        )
    return tensor


async def _fetch(ref: Awaitable[Any]) -> Any:
    """The object behind a reference; an object that is gone is the request's error, named."""
    import ray

    try:
        return await ref
    except ray.exceptions.ObjectLostError as err:  # freed, its owner gone, or lost with its node
        raise ValueError(
            f"inputs.kv: the keys and values the prefill part handed on are gone from the object "
            f"store ({type(err).__name__}): its replica stopped, or they were fetched later than its "
            "config's handoff_seconds (or past handoff_max_bytes); fetch sooner or raise those"
        ) from None
