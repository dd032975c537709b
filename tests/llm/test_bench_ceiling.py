"""bench/llm.py's ceiling on the continuous/static throughput ratio: the arithmetic, and the
engine never doing better than the bounds it is built from (a bound the engine beat would be
no bound)."""

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
