"""The engine behind asyncio and as a part: concurrent streams give the reference answers, a
reader that goes away frees its cache blocks, stop strings never leak into the stream, and the
part checks its snapshot and its requests."""

from __future__ import annotations

import asyncio
import gc
import math
import weakref

import pytest
import ray
import torch
from pydantic import ValidationError

import ipnext.serving.llm.part as part_module
from ipnext.errors import PartInputError
from ipnext.names import poll_until
from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams
from ipnext.serving.llm.part import LLMDecodePart, LLMPart, LLMPrefillPart, LLMRequest, Pinned
from ipnext.serving.llm.service import LLMService
from ipnext.store.snapshots import inspect_safetensors

from .conftest import TrainedLM

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # how long a test waits for the engine's driver to act (a loaded CI box)

PROMPTS = [
    "ada is a red",
    "two plus three is",
    "counting: one two",
    "bo lives by the",
    "cyd is a blue",
    "four plus",
]


async def collect(service: LLMService, prompt: str, params: SamplingParams) -> tuple[list[str], str | None]:
    pieces, reason = [], None
    async for delta in service.stream(prompt, params):
        pieces.append(delta.text)
        reason = delta.finish_reason or reason
    return pieces, reason


async def test_concurrent_streams_answer_like_the_reference(lm: TrainedLM) -> None:
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4, max_batched_tokens=32))
    service = LLMService(engine, lm.codec)
    results = await asyncio.gather(*(collect(service, p, SamplingParams(max_tokens=30)) for p in PROMPTS))
    for prompt, (pieces, reason) in zip(PROMPTS, results, strict=True):
        expected = lm.reference.generate(lm.codec.prompt(prompt), 30, stop_token=lm.codec.eos)
        assert "".join(pieces) == lm.codec.decode(expected)
        assert reason == ("eos" if expected[-1] == lm.codec.eos else "length")
        assert len(pieces) > 2  # streamed piece by piece, not in one go
    summary = service.metrics.summary()
    assert summary["finished"] == len(PROMPTS) and summary["mean_batch_size"] > 1
    assert summary["ttft_ms"]["p50"] is not None and summary["itl_ms"]["p99"] is not None
    await service.close()


async def test_a_reader_that_goes_away_frees_its_blocks(lm: TrainedLM) -> None:
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    service = LLMService(engine, lm.codec)
    before = engine.cache.pool.used_count()
    stream = service.stream("ada is a red fox. " * 6, SamplingParams(max_tokens=400, ignore_eos=True))
    received = [await anext(stream) for _ in range(3)]
    assert engine.cache.pool.used_count() > before and all(d.finish_reason is None for d in received)
    await stream.aclose()  # the client went away

    async def freed() -> bool:
        return engine.cache.pool.used_count() == before and not engine.has_work()

    await poll_until(freed, bool, timeout_s=WAIT_S, interval_s=0.01, what="the reader's blocks freed")
    assert engine.cache.pool.used_count() == before and service.metrics.cancelled == 1
    await service.close()


async def test_stop_strings_never_reach_the_stream(lm: TrainedLM) -> None:
    expected = lm.codec.decode(
        lm.reference.generate(lm.codec.prompt("ada is a red"), 40, stop_token=lm.codec.eos)
    )
    stop = expected.split()[len(expected.split()) // 2]
    service = LLMService(LLMEngine(lm.weights, lm.config), lm.codec)
    pieces, reason = await collect(service, "ada is a red", SamplingParams(max_tokens=40, stop=[stop]))
    text = "".join(pieces)
    assert reason == "stop" and stop not in text and expected.startswith(text)
    assert text == expected[: expected.find(stop)]
    await service.close()


async def test_the_part_checks_its_snapshot_and_its_requests(lm: TrainedLM) -> None:
    config = {"engine": {"kv_cache_bytes": 4 << 20}}
    part = LLMPart(lm.files, config)
    header = inspect_safetensors(lm.folder / "model.safetensors")
    assert part.expected_tensors() == {name: (tuple(shape), dtype) for name, (shape, dtype) in header.items()}
    answer = await part({"input": {"prompt": "two plus three is", "max_tokens": 12}})
    expected = lm.reference.generate(lm.codec.prompt("two plus three is"), 12, stop_token=lm.codec.eos)
    assert answer["text"] == lm.codec.decode(expected) and answer["completion_tokens"] == len(expected)
    pieces = [p async for p in part.stream({"input": {"prompt": "two plus three is", "max_tokens": 12}})]
    assert "".join(p["text"] for p in pieces) == answer["text"] and pieces[-1]["finish_reason"]
    with pytest.raises(PartInputError, match=r"inputs\.max_tokens"):
        await part({"input": {"prompt": "hi", "max_tokens": 0}})
    with pytest.raises(PartInputError, match=r"inputs\.prompt"):
        await part({"input": {"max_tokens": 3}})
    with pytest.raises(PartInputError, match=r"inputs\.max_tokens: prompt"):
        await part({"input": {"prompt": "hi", "max_tokens": 5000}})
    with pytest.raises(ValueError, match=r"config\.model: a Hugging Face checkpoint brings its own shape"):
        LLMPart(lm.files, {**config, "model": {"vocab_size": 100}})
    with pytest.raises(ValueError, match="not one weights file"):
        LLMPart(lm.weights, config)
    await part.service.close()


async def test_every_latency_observation_reaches_the_observer(lm: TrainedLM) -> None:
    """The hook the part's host uses to export TTFT, ITL and queue time to Prometheus."""
    seen: list[tuple[str, float]] = []
    part = LLMPart(lm.files, {"engine": {"kv_cache_bytes": 4 << 20}})
    part.observe_with(lambda metric, ms: seen.append((metric, ms)))
    answer = await part({"input": {"prompt": "cyd is a blue", "max_tokens": 6, "ignore_eos": True}})
    assert answer["completion_tokens"] == 6
    assert [m for m, _ in seen].count("ttft_ms") == 1 and [m for m, _ in seen].count("itl_ms") == 5
    assert [m for m, _ in seen].count("queue_ms") == 1 and all(ms >= 0 for _, ms in seen)
    histograms = part.serving_counters().histograms
    assert sum(histograms["itl_ms"]) == 5 and sum(histograms["ttft_ms"]) == 1
    status = part.status()
    assert status["kv_cache_used_blocks"] == 0 and status["finished"] == 1
    await part.service.close()


async def test_the_disaggregated_pair_answers_like_the_single_part(lm: TrainedLM) -> None:
    config = {"engine": {"kv_cache_bytes": 4 << 20, "block_size": 4}}
    single = LLMPart(lm.files, config)
    prefill, decode = LLMPrefillPart(lm.files, config), LLMDecodePart(lm.files, config)

    async def pair(request: dict[str, object]) -> list[dict[str, object]]:
        handed = await prefill({"input": request})
        assert tuple(handed["kv"].shape) == (2, 2, 2, len(handed["prompt_tokens"]), 16)
        return [piece async for piece in decode.stream({"prefill": handed})]

    requests = [{"prompt": p, "max_tokens": n} for p, n in zip(PROMPTS, [1, 5, 20, 30, 12, 40], strict=True)]
    split = await asyncio.gather(*(pair(r) for r in requests))
    for request, pieces in zip(requests, split, strict=True):
        whole = await single({"input": request})
        assert "".join(str(p["text"]) for p in pieces) == whole["text"], request
        assert pieces[-1]["completion_tokens"] == whole["completion_tokens"]
        assert pieces[-1]["finish_reason"] == whole["finish_reason"]
    # The decode part never computed a prompt: it processed one token per step per answer (the
    # handed first token and each token after it but the last), never a prompt chunk.
    answered = [pieces[-1]["completion_tokens"] for pieces in split]
    assert decode.service.metrics.batched_tokens_sum == sum(int(str(k)) - 1 for k in answered)
    assert decode.status()["kv_cache_used_blocks"] == 0 and prefill.status()["kv_cache_used_blocks"] == 0
    with pytest.raises(ValueError, match="the prefill part's output"):
        await decode({"input": {"prompt": "hi"}})
    for part in (single, prefill, decode):
        await part.service.close()


def test_pinned_holds_each_reference_for_its_seconds() -> None:
    class Ref:  # stands in for a ray.ObjectRef: what matters is that something holds it
        pass

    now = [0.0]
    pinned = Pinned(60, clock=lambda: now[0])
    first, second = Ref(), Ref()
    watch = weakref.ref(first)
    pinned.keep(first)
    pinned.keep(second)
    del first
    gc.collect()
    assert watch() is not None and len(pinned) == 2  # the only reference left is the pin
    now[0] = 59.9
    pinned.keep(Ref())
    assert len(pinned) == 3 and watch() is not None
    now[0] = 60.5  # the first two expired: dropped when the next is kept
    pinned.keep(Ref())
    gc.collect()
    assert watch() is None and len(pinned) == 2
    now[0] = 200.0  # all expired: reading the count drops them too
    assert len(pinned) == 0 and pinned.bytes == 0


def test_pinned_lets_the_oldest_go_past_its_bytes() -> None:
    pinned = Pinned(60, max_bytes=100, clock=lambda: 0.0)
    refs = [object() for _ in range(4)]
    for ref in refs[:3]:
        pinned.keep(ref, 40)
    assert len(pinned) == 2 and pinned.bytes == 80  # the first went when the third came
    pinned.keep(refs[3], 500)  # one object over the bound is still held, alone
    assert len(pinned) == 1 and pinned.bytes == 500


async def test_the_prefill_part_holds_what_it_hands_on(
    lm: TrainedLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = {"engine": {"kv_cache_bytes": 4 << 20, "block_size": 4}}
    prefill = LLMPrefillPart(lm.files, {**config, "handoff_seconds": 30})
    assert prefill.handed.seconds == 30
    handed = await prefill({"input": {"prompt": PROMPTS[0], "max_tokens": 2}})
    assert isinstance(handed["kv"], torch.Tensor) and len(prefill.handed) == 0  # no Serve: no store
    # In a Serve replica the keys and values become an object reference (the seam, replaced here).
    monkeypatch.setattr(part_module, "_to_object_store", lambda kv: ("ref", kv.shape))
    handed = await prefill({"input": {"prompt": PROMPTS[1], "max_tokens": 2}})
    assert handed["kv"][0] == "ref" and len(prefill.handed) == 1
    status = prefill.status()
    assert status["handed_kv_held"] == 1
    assert status["handed_kv_bytes"] == 4 * math.prod(handed["kv"][1]) > 0  # float32 keys and values
    await prefill.service.close()
    with pytest.raises(ValidationError, match="handoff_seconds"):
        LLMPrefillPart(lm.files, {**config, "handoff_seconds": 0})


@pytest.mark.parametrize(
    "lost",
    [
        ray.exceptions.ReferenceCountingAssertionError("ab" * 14, "", ""),
        ray.exceptions.OwnerDiedError("ab" * 14, "", ""),
    ],
)
async def test_keys_and_values_gone_from_the_store_are_named_as_the_requests_error(lost: Exception) -> None:
    async def gone() -> None:
        raise lost

    with pytest.raises(
        ValueError, match=rf"inputs\.kv: .* are gone from the object store \({type(lost).__name__}\)"
    ):
        await part_module._fetch(gone())

    async def there() -> str:
        return "tensor"

    assert await part_module._fetch(there()) == "tensor"


async def test_a_chat_request_renders_the_checkpoints_template_and_answers_like_the_reference(
    lm: TrainedLM,
) -> None:
    part = LLMPart(lm.files, {"engine": {"kv_cache_bytes": 4 << 20}})
    messages = [
        {"role": "system", "content": "count with me"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "counting: one "}, {"type": "text", "text": "two"}],
        },
    ]
    tokens = lm.codec.chat_prompt(
        [{"role": "system", "content": "count with me"}, {"role": "user", "content": "counting: one two"}]
    )
    assert lm.codec.decode(tokens) == "system: count with me\nuser: counting: one two\nassistant:"
    answer = await part({"input": {"messages": messages, "max_tokens": 10}})
    expected = lm.reference.generate(tokens, 10, stop_token=lm.codec.eos)
    assert answer["text"] == lm.codec.decode(expected) and answer["prompt_tokens"] == len(tokens)
    pieces = [p async for p in part.stream({"input": {"messages": messages, "max_tokens": 10}})]
    assert "".join(p["text"] for p in pieces) == answer["text"]
    refused = {
        "both": {"prompt": "hi", "messages": messages},
        "neither": {"max_tokens": 3},
        "no-turns": {"messages": []},
        "role-not-text": {"messages": [{"role": 7, "content": "hi"}]},
        "image-part": {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    }
    for why, inputs in refused.items():
        with pytest.raises(PartInputError, match=r"^inputs") as err:
            await part({"input": inputs})
        assert "send" in str(err.value), why
    await part.service.close()


def test_a_null_max_tokens_runs_to_the_end_of_the_context() -> None:
    """OpenAI's chat default: as many tokens as the context leaves after the prompt."""
    request = LLMRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None})
    assert request.sampling(context_left=100).max_tokens == 100
    assert LLMRequest.model_validate({"prompt": "hi"}).sampling(context_left=100).max_tokens == 64
