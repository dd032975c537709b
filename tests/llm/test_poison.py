"""Poison inputs to the LLM part and failures inside the engine: a sampling value out of bounds
is refused (PartInputError, the router's 400) naming its field, and the part answers the next
request; a request that still fails in the engine fails alone (its blocks freed, never run
again) while the others complete; `check_health` fails on a dead driver and on a stall."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from typing import Any

import pytest

from ipnext.errors import GenerationError, PartInputError
from ipnext.names import poll_until
from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams, StepResult
from ipnext.serving.llm.part import LLMPart
from ipnext.serving.llm.service import LLMService

from .conftest import TrainedLM

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30.0  # how long a test waits for a health check to see what it should (a loaded CI box)

PROMPT = "two plus three is"

# (inputs beside the prompt, the field the refusal must name)
POISON: list[tuple[dict[str, Any], str]] = [
    ({"seed": 18446744073709551616}, "seed"),  # 2**64: add() raised "Overflow when unpacking long long"
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"temperature": math.inf}, "temperature"),  # what JSON's 1e999 parses to
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "0.7"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": math.nan}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens: prompt"),  # beyond the context: refused, never clamped
    ({"max_tokens": 10**30}, "max_tokens: prompt"),
    ({"stop": "done"}, "stop"),
    ({"stop": [7]}, "stop.0"),
    ({"stop": [""]}, "stop.0"),
    ({"stop": ["x" * 257]}, "stop.0"),
    ({"stop": ["s"] * 17}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logprobs": 5}, "logprobs"),
]


def part_for(lm: TrainedLM, **config: Any) -> LLMPart:
    return LLMPart(lm.files, {"engine": {"kv_cache_bytes": 4 << 20}, **config})


async def test_poison_values_are_refused_naming_the_field_and_the_part_answers_after(lm: TrainedLM) -> None:
    part = part_for(lm)
    expected = lm.codec.decode(lm.reference.generate(lm.codec.prompt(PROMPT), 8, stop_token=lm.codec.eos))
    for extra, field in POISON:
        started = time.perf_counter()
        with pytest.raises(PartInputError) as info:
            await part({"input": {"prompt": PROMPT, "max_tokens": 8, **extra}})
        message = str(info.value)
        assert message.startswith(f"inputs.{field}"), (extra, message)
        print(f"{extra!r:.60}: refused in {(time.perf_counter() - started) * 1000:.2f} ms: {message[:90]}")
        # The replica keeps answering: the next (normal) request gets the reference answer.
        answer = await part({"input": {"prompt": PROMPT, "max_tokens": 8}})
        assert answer["text"] == expected
    assert len(str(info.value)) < 1000  # a huge refused value is quoted cut short
    assert part.engine.cache.pool.used_count() == 0 and part.service.metrics.failed == 0
    await part.service.close()


async def test_values_at_the_bounds_are_served(lm: TrainedLM) -> None:
    part = part_for(lm)
    greedy = await part({"input": {"prompt": PROMPT, "max_tokens": 10}})
    # Below the floor (1e-5) a temperature is greedy: 1e-45 used to make the softmax NaN.
    tiny = await part({"input": {"prompt": PROMPT, "max_tokens": 10, "temperature": 1e-45}})
    assert tiny["text"] == greedy["text"] and tiny["completion_tokens"] == greedy["completion_tokens"]
    for seed in (2**63 - 1, -(2**63), 0):
        answer = await part(
            {"input": {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "top_p": 1, "seed": seed}}
        )
        again = await part(
            {"input": {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.8, "top_p": 1, "seed": seed}}
        )
        assert answer == again  # seeded: the same answer twice
    longest = lm.config.max_seq_len - len(lm.codec.prompt(PROMPT))
    answer = await part({"input": {"prompt": PROMPT, "max_tokens": longest, "stop": ["s" * 256] * 16}})
    assert answer["finish_reason"] in {"eos", "length"}
    await part.service.close()


async def collect(service: LLMService, prompt: str, params: SamplingParams) -> str:
    return "".join([delta.text async for delta in service.stream(prompt, params)])


async def test_a_request_that_fails_when_added_fails_alone(lm: TrainedLM) -> None:
    """A seed past the bounds, built without validation: what reached `add` before the bounds."""
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    service = LLMService(engine, lm.codec)
    poisoned = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "seed": 2**64})
    expected = lm.codec.decode(lm.reference.generate(lm.codec.prompt(PROMPT), 20, stop_token=lm.codec.eos))
    good, bad = await asyncio.gather(
        collect(service, PROMPT, SamplingParams(max_tokens=20)),
        collect(service, PROMPT, poisoned),
        return_exceptions=True,
    )
    assert good == expected
    assert isinstance(bad, GenerationError) and "Overflow" in str(bad)
    assert await collect(service, PROMPT, SamplingParams(max_tokens=20)) == expected  # the driver lives
    assert engine.cache.pool.used_count() == 0 and not engine.has_work()
    assert service.metrics.failed == 1
    service.check_health(stall_seconds=30)
    await service.close()


async def test_a_request_that_fails_in_a_step_fails_alone_and_is_never_run_again(lm: TrainedLM) -> None:
    """A NaN temperature (past the part's bounds) makes sampling raise inside `step()`; the
    greedy request in the same batch completes, and the failed sequence never runs again."""
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    service = LLMService(engine, lm.codec)
    poisoned = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "temperature": math.nan})
    steps: list[int] = []  # batch size of every step
    step = engine.step

    def counted() -> StepResult:
        result = step()
        steps.append(result.batch_size)
        return result

    engine.step = counted  # type: ignore[method-assign]
    expected = lm.codec.decode(lm.reference.generate(lm.codec.prompt(PROMPT), 30, stop_token=lm.codec.eos))
    started = time.perf_counter()
    good, bad = await asyncio.gather(
        collect(service, PROMPT, SamplingParams(max_tokens=30)),
        collect(service, "ada is a red", poisoned),
        return_exceptions=True,
    )
    print(f"one failed, one answered in {(time.perf_counter() - started) * 1000:.0f} ms, batches {steps}")
    assert good == expected
    assert isinstance(bad, GenerationError) and "probability tensor" in str(bad)
    assert steps[0] == 2 and set(steps[1:]) == {1}  # the failed one left after its first step
    assert engine.cache.pool.used_count() == 0 and not engine.has_work()
    await service.close()


class _BrokenForward:
    """A model runner whose batched forward raises while a marked token is in the batch."""

    def __init__(self, runner: Any, marked: int) -> None:
        self._runner = runner
        self.marked = marked
        self.calls_with_mark = 0

    def step(self, chunks: list[Any]) -> Any:
        if any(self.marked in chunk.tokens for chunk in chunks):
            self.calls_with_mark += 1
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return self._runner.step(chunks)


async def test_a_failed_batch_forward_fails_its_batch_and_the_driver_goes_on(lm: TrainedLM) -> None:
    """The batched forward pass cannot say whose row broke it: every sequence in that step
    fails (blocks freed, never replayed), and the next requests are served."""
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    marked = lm.codec.prompt("ada")[-1]
    broken = _BrokenForward(engine.runner, marked)
    engine.runner = broken  # type: ignore[assignment]
    service = LLMService(engine, lm.codec)
    results = await asyncio.gather(
        collect(service, "ada", SamplingParams(max_tokens=10)),
        collect(service, "ada", SamplingParams(max_tokens=10)),
        return_exceptions=True,
    )
    assert all(isinstance(r, GenerationError) and "illegal memory" in str(r) for r in results)
    assert broken.calls_with_mark == 1  # one step failed, nothing ran it again
    expected = lm.codec.decode(lm.reference.generate(lm.codec.prompt(PROMPT), 12, stop_token=lm.codec.eos))
    assert await collect(service, PROMPT, SamplingParams(max_tokens=12)) == expected
    assert engine.cache.pool.used_count() == 0 and service.metrics.failed == 2
    service.check_health(stall_seconds=30)
    await service.close()


class _WrappedEngine(LLMEngine):
    """The seam for faults the real engine does not make: a step that raises outright, a step
    that hangs until released, or a driver-side call that raises."""

    raise_in_step = False
    hang: threading.Event | None = None
    broken_has_work = False

    def step(self) -> StepResult:
        if self.raise_in_step:
            raise MemoryError("the step's worker thread ran out of memory")
        if self.hang is not None:
            self.hang.wait(timeout=30)
        return super().step()

    def has_work(self) -> bool:
        if self.broken_has_work:
            raise RuntimeError("a bug in the driver's own loop")
        return super().has_work()


async def test_a_step_that_raises_outright_fails_its_requests_and_the_driver_goes_on(lm: TrainedLM) -> None:
    engine = _WrappedEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    service = LLMService(engine, lm.codec)
    engine.raise_in_step = True
    with pytest.raises(GenerationError, match="MemoryError"):
        await collect(service, PROMPT, SamplingParams(max_tokens=5))
    engine.raise_in_step = False
    assert engine.cache.pool.used_count() == 0 and not engine.has_work()
    assert await collect(service, PROMPT, SamplingParams(max_tokens=5))
    await service.close()


async def test_check_health_fails_on_a_stall_and_passes_when_idle(lm: TrainedLM) -> None:
    part = part_for(lm, stall_seconds=0.3)
    await part.check_health()  # never used: healthy
    engine = _WrappedEngine(lm.weights, lm.config, part.config.engine)
    part.engine = engine
    await part.check_health()
    engine.hang = threading.Event()
    request = asyncio.ensure_future(part({"input": {"prompt": PROMPT, "max_tokens": 4}}))
    started = time.perf_counter()

    async def health() -> GenerationError | None:
        try:
            await part.check_health()
        except GenerationError as err:
            return err
        return None

    err = await poll_until(
        health,
        lambda e: e is not None,
        timeout_s=WAIT_S,
        interval_s=0.05,
        what="check_health seeing the stall",
    )
    assert "no progress" in str(err) and "stall_seconds 0.3" in str(err), err
    print(f"stall seen by check_health after {time.perf_counter() - started:.2f} s (stall_seconds 0.3)")
    engine.hang.set()
    answer = await request
    assert answer["completion_tokens"] == 4
    await part.check_health()  # idle again: healthy
    await part.service.close()


async def test_check_health_fails_on_a_dead_driver_and_nothing_hangs(lm: TrainedLM) -> None:
    engine = _WrappedEngine(lm.weights, lm.config, EngineConfig(block_size=4))
    service = LLMService(engine, lm.codec)
    assert await collect(service, PROMPT, SamplingParams(max_tokens=3))
    service.check_health(stall_seconds=30)
    engine.broken_has_work = True
    with pytest.raises(GenerationError, match="driver stopped"):  # it fails; it does not hang
        await asyncio.wait_for(collect(service, PROMPT, SamplingParams(max_tokens=3)), timeout=30)
    with pytest.raises(GenerationError, match="driver task died: RuntimeError: a bug"):
        service.check_health(stall_seconds=30)
    engine.broken_has_work = False
    with pytest.raises(GenerationError, match="being replaced"):  # refused at once, never queued
        await collect(service, PROMPT, SamplingParams(max_tokens=3))
    await service.close()
