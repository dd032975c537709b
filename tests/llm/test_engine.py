"""The LLM engine against the plain one-request-at-a-time loop: with continuous batching,
chunked prefill, preemption and the prefix cache all on, greedy outputs are the same tokens;
cancellation gives the blocks back; sampling settings; bad requests are refused up front."""

from __future__ import annotations

import random

import pytest
import torch

from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams, Sequence

from .conftest import TrainedLM

pytestmark = pytest.mark.timeout(300)

SYSTEM = "you answer in short facts. counting: one two three four five six. ada is a red fox. "
QUESTIONS = [
    "two plus three is",
    "counting: one two",
    "every day the gold",
    "bo lives by the",
    "four plus one is",
    "cyd is a blue",
    "counting: three",
    "the owl walks to the",
]


def run(engine: LLMEngine, arrivals: list[tuple[int, list[int], SamplingParams]]) -> list[Sequence]:
    """Add each request at its step (requests join a running batch), step until all are done;
    the sequences come back in the order of `arrivals`."""
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    added: dict[int, Sequence] = {}
    step = 0
    while pending or engine.has_work():
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            added[i] = engine.add(arrivals[i][1], arrivals[i][2])
        engine.step()
        step += 1
        assert step < 5000, "the engine stopped making progress"
    return [added[i] for i in range(len(arrivals))]


def mixed_requests(lm: TrainedLM, seed: int) -> list[tuple[int, list[int], SamplingParams]]:
    rng = random.Random(seed)
    requests = []
    for i, question in enumerate(QUESTIONS * 2):
        text = (SYSTEM if i % 2 == 0 else "") + question
        requests.append(
            (rng.randrange(0, 30), lm.codec.prompt(text), SamplingParams(max_tokens=rng.randrange(8, 40)))
        )
    return requests


@pytest.mark.parametrize("schedule", ["decode_first", "prefill_first", "short_prompts_first"])
def test_greedy_tokens_equal_the_one_at_a_time_loop_with_every_feature_on(
    lm: TrainedLM, schedule: str
) -> None:
    config = EngineConfig(
        schedule=schedule,
        block_size=4,
        kv_cache_bytes=28 * 2048,  # 28 blocks of 4 tokens: too few for the batch, so it preempts
        max_num_seqs=8,
        max_batched_tokens=24,  # prompts of 30+ tokens prefill in chunks beside running decodes
    )
    engine = LLMEngine(lm.weights, lm.config, config)  # no eos: every request runs to max_tokens
    assert engine.cache.pool.num_blocks == 28
    requests = mixed_requests(lm, seed=3)
    done = run(engine, requests)
    for seq, (_, prompt, params) in zip(done, requests, strict=True):
        expected = lm.reference.generate(prompt, params.max_tokens)
        assert seq.output == expected, (
            lm.codec.decode(prompt),
            lm.codec.decode(seq.output),
            lm.codec.decode(expected),
        )
    stats = engine.stats
    assert stats.preemptions > 0  # the small cache made it recompute some sequences
    assert stats.prefix_hit_rate() > 0.2  # the shared system prompt came from the cache
    assert max(stats.batch_sizes) > 4  # requests really ran together
    assert any(len(s.prompt) > config.max_batched_tokens for s in done)  # so some prefill was chunked
    assert engine.cache.pool.used_count() == 0


@pytest.mark.parametrize(
    ("schedule", "short", "alone"),
    [
        ("decode_first", 128, False),
        ("prefill_first", 128, True),
        ("short_prompts_first", 128, True),  # 24 tokens of prompt work a step: short
        ("short_prompts_first", 2, False),  # over 2: long, beside the decodes
    ],
)
def test_prefill_first_runs_a_new_prompt_in_steps_of_its_own_and_decode_first_beside_the_decodes(
    lm: TrainedLM, schedule: str, short: int, alone: bool
) -> None:
    """Three sequences decoding, then a 2-chunk prompt arrives. Prefill first (or short prompts
    first, for a prompt that is short): its two chunks run alone (its first token after two
    short steps), then all four decode together. Decode first: each of those steps also carries
    the three decode rows."""
    config = EngineConfig(
        block_size=4,
        kv_cache_bytes=400 * 2048,
        max_num_seqs=8,
        max_batched_tokens=24,
        schedule=schedule,
        short_prompt_tokens=short,
    )
    engine = LLMEngine(lm.weights, lm.config, config)
    decoding = [engine.add(lm.codec.prompt(q), SamplingParams(max_tokens=30)) for q in QUESTIONS[:3]]
    while any(not s.output for s in decoding):
        engine.step()
    prompt = lm.codec.prompt(SYSTEM + QUESTIONS[3])
    assert config.max_batched_tokens < len(prompt) <= 2 * config.max_batched_tokens
    new = engine.add(prompt, SamplingParams(max_tokens=30))
    steps = []
    while not new.output:
        result = engine.step()
        steps.append((result.batch_size, sorted(result.new_tokens)))
    others = sorted(s.id for s in decoding)
    if alone:
        assert steps == [(1, []), (1, [new.id])], steps  # the decode rows waited two steps
    else:
        assert steps == [(4, others), (4, sorted([*others, new.id]))], steps
    result = engine.step()  # and then everyone decodes in one step again
    assert result.batch_size == 4 and sorted(result.new_tokens) == sorted([*others, new.id])


def test_static_batching_gives_the_same_tokens_one_batch_at_a_time(lm: TrainedLM) -> None:
    config = EngineConfig(block_size=4, kv_cache_bytes=400 * 2048, max_num_seqs=4, batching="static")
    engine = LLMEngine(lm.weights, lm.config, config, eos_token=lm.codec.eos)
    requests = [(0, p, s) for _, p, s in mixed_requests(lm, seed=5)[:8]]
    for _, prompt, params in requests:
        engine.add(prompt, params)
    batches: list[set[int]] = []
    while engine.has_work():
        running = {s.id for s in engine.running}
        engine.step()
        admitted = {s.id for s in engine.running} - running
        if admitted:
            assert not running, "static batching admitted into a running batch"
            batches.append(admitted)
    assert [len(b) for b in batches] == [4, 4]


def test_a_cancelled_sequence_gives_its_blocks_back(lm: TrainedLM) -> None:
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4, kv_cache_bytes=200 * 2048))
    keep = engine.add(lm.codec.prompt("ada is a red"), SamplingParams(max_tokens=30))
    for _ in range(3):
        engine.step()
    before = engine.cache.pool.used_count()
    gone = engine.add(lm.codec.prompt(SYSTEM + "bo lives by the"), SamplingParams(max_tokens=200))
    for _ in range(6):
        engine.step()
    assert engine.cache.pool.used_count() > before + 5
    engine.cancel(gone)
    assert gone.finish_reason == "cancelled" and gone.blocks == []
    assert engine.cache.pool.used_count() == len(keep.blocks)  # only what the other sequence holds


def test_seeded_sampling_repeats_and_top_p_one_token_is_greedy(lm: TrainedLM) -> None:
    prompt = lm.codec.prompt("cyd is a blue")
    outputs = []
    for _ in range(2):
        engine = LLMEngine(lm.weights, lm.config, eos_token=lm.codec.eos)
        seq = engine.add(prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=7))
        while engine.has_work():
            engine.step()
        outputs.append(seq.output)
    assert outputs[0] == outputs[1]
    engine = LLMEngine(lm.weights, lm.config, eos_token=lm.codec.eos)
    nucleus = engine.add(prompt, SamplingParams(max_tokens=20, temperature=1.0, top_p=1e-6, seed=1))
    while engine.has_work():
        engine.step()
    assert nucleus.output == lm.reference.generate(prompt, 20, stop_token=lm.codec.eos)


def test_stop_strings_end_a_sequence(lm: TrainedLM) -> None:
    codec = lm.codec
    prompt = codec.prompt("ada is a red")
    expected = lm.reference.generate(prompt, 40)
    words = codec.decode(expected).split()
    stop = words[len(words) // 2]  # a word the greedy answer reaches halfway

    def stopped(seq: Sequence) -> bool:
        return codec.find_stop(codec.decode(seq.output), seq.params.stop) is not None

    engine = LLMEngine(lm.weights, lm.config, stop_check=stopped)
    seq = engine.add(prompt, SamplingParams(max_tokens=40, stop=[stop]))
    while engine.has_work():
        engine.step()
    assert seq.finish_reason == "stop", (stop, codec.decode(expected))
    assert seq.output == expected[: len(seq.output)] and len(seq.output) < len(expected)
    assert stop in codec.decode(seq.output) and stop not in codec.decode(seq.output[:-1])


def test_requests_that_could_never_run_are_refused(lm: TrainedLM) -> None:
    engine = LLMEngine(lm.weights, lm.config, EngineConfig(block_size=4, kv_cache_bytes=10 * 2048))
    with pytest.raises(ValueError, match="max_tokens: the request needs up to 13 cache blocks"):
        engine.add(list(range(1, 21)), SamplingParams(max_tokens=32))
    with pytest.raises(ValueError, match="prompt: expected at least one token"):
        engine.add([], SamplingParams())
    with pytest.raises(ValueError, match="exceeds the model's max_seq_len"):
        engine.add([1] * 1000, SamplingParams(max_tokens=100))
    assert not engine.has_work()


def test_the_runner_multiplies_by_onednn_prepacked_weights_where_torch_has_them() -> None:
    """The float32 products go through oneDNN's prepacked weights wherever torch has oneDNN
    (2.5x faster than `mm` on an AMD EPYC: bench/llm.py), with `mm`'s answers; other dtypes
    keep plain matrices."""
    from ipnext.serving.llm.runner import _Linear

    mm = _Linear(torch.float32)
    assert mm.packed == torch.backends.mkldnn.is_available()
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(96, 40, generator=generator)
    packed = mm.pack(w)
    for rows in (1, 7, 16, 33):
        x = torch.randn(rows, 96, generator=generator)
        assert torch.allclose(mm(x, packed), x @ w, rtol=1e-5, atol=1e-4)
    assert not _Linear(torch.bfloat16).packed
