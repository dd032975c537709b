"""bench/llm.py's ceiling on the continuous/static throughput ratio: the arithmetic, and the
engine never doing better than the bounds it is built from (a bound the engine beat would be
no bound); and its loop (bench/llm_drive.py), which must give every engine the same chat turns."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams

from .conftest import TrainedLM

pytestmark = pytest.mark.timeout(300)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "llm.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_llm", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def test_the_ceiling_is_static_steps_over_continuous_steps(bench: ModuleType) -> None:
    ceiling = bench.step_ceiling
    # Batches [10, 1] and [1, 1]: static needs 10 + 1 steps; continuous ceil(13 / 2) = 7.
    assert ceiling([10, 1, 1, 1], 2) == pytest.approx(11 / 7)
    # Equal outputs leave continuous batching nothing to win.
    assert ceiling([5] * 32, 16) == pytest.approx(1.0)
    # A last, partial batch counts too: [3, 3] and [9]: static 3 + 9, continuous ceil(15 / 2).
    assert ceiling([3, 3, 9], 2) == pytest.approx(12 / 8)


def test_the_engine_takes_at_least_the_steps_the_ceiling_assumes(lm: TrainedLM, bench: ModuleType) -> None:
    rng = random.Random(3)
    batch = 4
    outputs = [rng.choice([2, 3, 5, 30]) for _ in range(12)]
    prompts = [[lm.codec.bos, *rng.choices(range(3, 200), k=rng.randint(4, 20))] for _ in outputs]
    steps = {}
    for batching in ("static", "continuous"):
        config = EngineConfig(
            block_size=4, kv_cache_bytes=4 << 20, max_num_seqs=batch, batching=batching, prefix_cache=False
        )
        engine = LLMEngine(lm.weights, lm.config, config)
        seqs = [
            engine.add(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts, outputs, strict=True)
        ]
        while engine.has_work():
            engine.step()
        assert [len(s.output) for s in seqs] == outputs
        steps[batching] = engine.stats.steps
    static_least = sum(max(outputs[i : i + batch]) for i in range(0, len(outputs), batch))
    continuous_least = math.ceil(sum(outputs) / batch)
    assert steps["static"] >= static_least
    assert steps["continuous"] >= continuous_least
    assert bench.step_ceiling(outputs, batch) == pytest.approx(static_least / continuous_least)


class _Slots:
    """A stand-in engine for bench/llm_drive.py's loop: `slots` sequences a step, one token each,
    the token a function of the request (so two runs can be compared), newest first or oldest
    first."""

    def __init__(self, slots: int, newest_first: bool) -> None:
        self.slots, self.newest_first = slots, newest_first
        self.queue: list[tuple[int, list[int], int]] = []
        self.outputs: dict[int, list[int]] = {}
        self.prompts: list[list[int]] = []

    def add(self, key: int, prompt: list[int], tokens: int) -> None:
        self.queue.append((key, prompt, tokens))
        self.outputs[key] = []
        self.prompts.append(prompt)

    def busy(self) -> bool:
        return bool(self.queue)

    def step(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        order = sorted(self.queue, key=lambda q: q[0], reverse=self.newest_first)[: self.slots]
        made, finished = {}, {}
        for key, prompt, tokens in order:
            self.outputs[key].append(len(prompt) % 97)
            made[key] = 1
            if len(self.outputs[key]) == tokens:
                finished[key] = self.outputs[key]
                self.queue.remove((key, prompt, tokens))
        return made, finished


def test_the_bench_loop_gives_every_engine_the_same_chat_turns() -> None:
    drive_module = importlib.util.spec_from_file_location("llm_drive", BENCH.parent / "llm_drive.py")
    assert drive_module is not None and drive_module.loader is not None
    llm_drive = importlib.util.module_from_spec(drive_module)
    sys.modules["llm_drive"] = llm_drive
    drive_module.loader.exec_module(llm_drive)
    prompts = []
    for newest_first in (False, True):
        engine = _Slots(slots=3, newest_first=newest_first)
        done, _ = llm_drive.drive(engine, llm_drive.workload_c(5, 4), turns=3, seed=5)
        assert len(done) == 4 * 3 and all(len(d.token_times) == d.request.tokens for d in done)
        by_turn = {(d.request.conversation, d.request.turn): d.request for d in done}
        for (conversation, turn), request in by_turn.items():
            if turn:  # the previous turn's prompt, its answer, then this turn's user tokens
                previous = by_turn[(conversation, turn - 1)]
                user, answer = llm_drive.chat_turn(5, conversation, turn)
                assert (
                    request.prompt == previous.prompt + [len(previous.prompt) % 97] * previous.tokens + user
                )
                assert request.tokens == answer
        prompts.append(sorted(engine.prompts))
    assert prompts[0] == prompts[1]  # the order engines finish in changes nothing
