"""LLM engine benchmark on CPU: continuous batching against static batching, and the prefix cache,
each baseline measured in the same run on the same engine, model, batch size and cache.

    .venv/bin/python bench/llm.py [--requests 200] [--steps 150]

Workload (fixed, seeded): `--requests` requests all arriving at once; prompt lengths uniform in
16-256 tokens (windows of the example corpus, after <bos>); output lengths Zipf-like between 8
and 256 (P(L) proportional to 1/L), every request generating exactly its length (no eos stop).
The model is the example LLM (`examples/llm/train.py`), trained here first.

1. continuous vs static batching, both with at most 16 sequences per step, the same KV cache and
   token budget; throughput = generated tokens / wall time; TTFT (arrival to first token) and
   ITL (gaps between a request's tokens) p50 and p99.
2. the same workload with a shared 200-token system prompt before every prompt: TTFT with and
   without the prefix cache (continuous batching both times).

Prints the figures and writes bench/results/llm.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ipnext.examples.llm.train import DEFAULT_CONFIG, corpus, train
from ipnext.serving.llm.chat import checkpoint_codec
from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams, Sequence
from ipnext.serving.llm.hf import folder_files, from_files
from ipnext.serving.llm.text import TextCodec

REPO = Path(__file__).resolve().parents[1]
BATCH = 16
SYSTEM_TOKENS = 200


def zipf_length(rng: random.Random, low: int = 8, high: int = 256, by_rank: bool = False) -> int:
    """P(L) proportional to 1/L (the default), or to 1/(L - low + 1): Zipf over the lengths'
    ranks, which puts more weight on short answers (reported as a second workload)."""
    lengths = range(low, high + 1)
    weights = [1.0 / (n - low + 1 if by_rank else n) for n in lengths]
    return rng.choices(lengths, weights=weights)[0]


def workload(
    codec: TextCodec, requests: int, seed: int, by_rank: bool = False
) -> list[tuple[list[int], int]]:
    """(prompt tokens, output length) per request."""
    rng = random.Random(seed)
    stream: list[int] = []
    for text in corpus(seed=seed + 1, documents=4000):
        stream += codec.encode(text + " ")
    out = []
    for _ in range(requests):
        length = rng.randint(16, 256)
        start = rng.randrange(0, len(stream) - length)
        out.append(([codec.bos, *stream[start : start + length - 1]], zipf_length(rng, by_rank=by_rank)))
    return out


def step_bounds(outputs: list[int], batch: int) -> tuple[int, int]:
    """The fewest steps each policy needs: static runs each batch of `batch` requests until its
    longest output is done; continuous emits at most `batch` tokens in every step."""
    static = sum(max(outputs[i : i + batch]) for i in range(0, len(outputs), batch))
    return static, math.ceil(sum(outputs) / batch)


def step_ceiling(outputs: list[int], batch: int) -> float:
    """Static's fewest steps over continuous's. With a step cost that does not grow with the batch
    this bounds the throughput ratio; on a CPU, where a step of 16 costs more than a step of 5,
    the real ratio is lower."""
    static, continuous = step_bounds(outputs, batch)
    return static / continuous


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run(
    weights: dict[str, torch.Tensor],
    jobs: list[tuple[list[int], int]],
    config: EngineConfig,
    one_at_a_time: bool = False,
) -> dict[str, Any]:
    """Every job at once (or, with `one_at_a_time`, each arriving when the last finished)."""
    engine = LLMEngine(weights, DEFAULT_CONFIG, config)
    started = time.perf_counter()
    seqs: list[Sequence] = []
    for prompt, n in jobs if one_at_a_time else []:
        seqs.append(engine.add(prompt, SamplingParams(max_tokens=n)))
        while engine.has_work():
            engine.step()
    if not one_at_a_time:
        seqs = [engine.add(prompt, SamplingParams(max_tokens=n)) for prompt, n in jobs]
    while engine.has_work():
        engine.step()
    wall = time.perf_counter() - started
    generated = sum(len(s.output) for s in seqs)
    ttft = [(s.token_times[0] - s.arrival) * 1000 for s in seqs]
    itl = [(b - a) * 1000 for s in seqs for a, b in itertools.pairwise(s.token_times)]
    return {
        "wall_s": round(wall, 3),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 1),
        "ttft_ms": {"p50": round(percentile(ttft, 0.5), 1), "p99": round(percentile(ttft, 0.99), 1)},
        "itl_ms": {"p50": round(percentile(itl, 0.5), 2), "p99": round(percentile(itl, 0.99), 2)},
        "steps": engine.stats.steps,
        "mean_batch": round(statistics.fmean(engine.stats.batch_sizes), 2),
        "preemptions": engine.stats.preemptions,
        "prefix_hit_rate": round(engine.stats.prefix_hit_rate(), 3),
        "kv_blocks": engine.cache.pool.num_blocks,
    }


def line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name:<28} {r['tokens_per_s']:>8.1f} tok/s  wall {r['wall_s']:>6.1f} s  "
        f"TTFT p50 {r['ttft_ms']['p50']:>8.1f} ms p99 {r['ttft_ms']['p99']:>8.1f} ms  "
        f"ITL p50 {r['itl_ms']['p50']:>6.2f} ms p99 {r['itl_ms']['p99']:>7.2f} ms  "
        f"mean batch {r['mean_batch']:>5.2f}  preempted {r['preemptions']}  prefix hits {r['prefix_hit_rate']:.0%}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--steps", type=int, default=150, help="training steps of the example model")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--kv-cache-mb", type=int, default=32)
    parser.add_argument("--max-batched-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "llm.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as root:
        report = train(Path(root), "tiny-lm", "bench", steps=args.steps)
        files = folder_files(report.folder)  # the checkpoint the trainer wrote
    checkpoint = from_files(files)
    weights, codec = checkpoint.weights, checkpoint_codec(files, checkpoint)
    print(f"model: {DEFAULT_CONFIG} (trained {report.seconds:.1f} s, loss {report.loss:.3f})")
    print(f"torch threads: {torch.get_num_threads()}")
    jobs = workload(codec, args.requests, args.seed)
    prompt_lengths = [len(p) for p, _ in jobs]
    outputs = [n for _, n in jobs]
    print(
        f"workload: {len(jobs)} requests at once, prompts {min(prompt_lengths)}-{max(prompt_lengths)} tokens "
        f"(mean {statistics.fmean(prompt_lengths):.0f}), outputs {min(outputs)}-{max(outputs)} "
        f"(mean {statistics.fmean(outputs):.0f}, Zipf-like), batch size {BATCH}"
    )
    base = {
        "max_num_seqs": BATCH,
        "kv_cache_bytes": args.kv_cache_mb << 20,
        "max_batched_tokens": args.max_batched_tokens,
        "block_size": 16,
    }
    static = run(weights, jobs, EngineConfig(**base, batching="static", prefix_cache=False))
    print(line("static batching", static))
    continuous = run(weights, jobs, EngineConfig(**base, prefix_cache=False))
    print(line("continuous batching", continuous))
    ratio = continuous["tokens_per_s"] / static["tokens_per_s"]
    print(f"throughput: continuous / static = {ratio:.2f}x (goal: at least 4x)")
    least_static, least_continuous = step_bounds(outputs, BATCH)
    ceiling = least_static / least_continuous
    print(
        f"the ratio's ceiling on this workload, for any engine whose step costs the same at every "
        f"batch size: {ceiling:.2f}x (static needs at least the sum over its batches of the longest "
        f"output, {least_static} steps; continuous at least all outputs / {BATCH}, {least_continuous} "
        f"steps; this run's step counts: {static['steps']} / {continuous['steps']})"
    )

    system = [codec.bos, *(codec.encode(" ".join(corpus(seed=99, documents=60))))[:SYSTEM_TOKENS]]
    shared = [(system + prompt[1:], n) for prompt, n in jobs]
    no_cache = run(weights, shared, EngineConfig(**base, prefix_cache=False))
    print(line("system prompt, no cache", no_cache))
    cached = run(weights, shared, EngineConfig(**base, prefix_cache=True))
    print(line("system prompt, prefix cache", cached))
    ttft_ratio = no_cache["ttft_ms"]["p50"] / cached["ttft_ms"]["p50"]
    print(f"TTFT p50: without / with the prefix cache = {ttft_ratio:.2f}x (goal: at least 2x)")

    # Beside the goals: where the two baselines' gaps come from.
    sequential = shared[:40]
    alone_no_cache = run(weights, sequential, EngineConfig(**base, prefix_cache=False), one_at_a_time=True)
    alone_cached = run(weights, sequential, EngineConfig(**base, prefix_cache=True), one_at_a_time=True)
    alone_ratio = alone_no_cache["ttft_ms"]["p50"] / alone_cached["ttft_ms"]["p50"]
    print(line("one at a time, no cache", alone_no_cache))
    print(line("one at a time, prefix cache", alone_cached))
    print(f"TTFT p50 with no queue (40 requests one at a time): without / with = {alone_ratio:.2f}x")
    ranked = workload(codec, args.requests, args.seed, by_rank=True)
    ranked_static = run(weights, ranked, EngineConfig(**base, batching="static", prefix_cache=False))
    ranked_continuous = run(weights, ranked, EngineConfig(**base, prefix_cache=False))
    ranked_ratio = ranked_continuous["tokens_per_s"] / ranked_static["tokens_per_s"]
    print(line("rank-Zipf outputs, static", ranked_static))
    print(line("rank-Zipf outputs, continuous", ranked_continuous))
    print(
        f"throughput with outputs Zipf over rank (mean {statistics.fmean(n for _, n in ranked):.0f} tokens): "
        f"continuous / static = {ranked_ratio:.2f}x"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": DEFAULT_CONFIG.model_dump(),
                "workload": {"requests": len(jobs), "seed": args.seed, "batch": BATCH, **base},
                "static": static,
                "continuous": continuous,
                "throughput_ratio": round(ratio, 2),
                "throughput_ratio_ceiling": round(ceiling, 2),
                "system_prompt_no_cache": no_cache,
                "system_prompt_prefix_cache": cached,
                "ttft_p50_ratio": round(ttft_ratio, 2),
                "one_at_a_time_no_cache": alone_no_cache,
                "one_at_a_time_prefix_cache": alone_cached,
                "one_at_a_time_ttft_p50_ratio": round(alone_ratio, 2),
                "rank_zipf_static": ranked_static,
                "rank_zipf_continuous": ranked_continuous,
                "rank_zipf_throughput_ratio": round(ranked_ratio, 2),
            },
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
