"""The LLM benchmark's workloads and the loop that drives an engine through one, standard library
only: `bench/llm.py` runs it in its own process for ipnext's engine, and vLLM's runner imports it
in vLLM's interpreter (another venv), so every engine sees the same requests, the same arrival
times, the same chat turns and the same clock.

An engine is driven through `Stepper`: `add` a request, `step` once (every sequence that got
tokens in that step, and those that finished with their whole output). The loop stamps a token's
time when the step that made it returns, starts a request at its arrival time (a Poisson stream is
replayed in real time) and, for chats, sends a conversation's next turn (its whole history, the
answer just given and a new user turn) as soon as the previous answer finished. A turn's user
tokens and answer length depend only on the seed, the conversation and the turn, never on which
engine answered first.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

VOCAB = 2048  # the checkpoint's vocabulary; ids 0-2 are left to special tokens


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


class Stepper(Protocol):
    def add(self, key: int, prompt: list[int], tokens: int) -> None: ...

    def busy(self) -> bool: ...

    def step(self) -> tuple[dict[int, int], dict[int, list[int]]]:
        """One engine step: key -> tokens it made this step; key -> whole output, for those
        that finished."""
        ...


# ---- workloads ------------------------------------------------------------------------------


def zipf_length(rng: random.Random, low: int = 8, high: int = 256) -> int:
    """P(L) proportional to 1/L."""
    lengths = range(low, high + 1)
    return rng.choices(lengths, weights=[1.0 / n for n in lengths])[0]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def workload_a(seed: int, requests: int) -> list[Request]:
    """Throughput: every request at once, prompts 16-256 tokens, outputs 8-256 Zipf-like."""
    rng = random.Random(seed)
    return [Request(tokens(rng, rng.randint(16, 256)), zipf_length(rng)) for _ in range(requests)]


def workload_b(seed: int, requests: int, rate: float, system: int = 1000) -> list[Request]:
    """Prefix cache: a Poisson stream at `rate` requests/s, every prompt one shared `system`-token
    prompt plus 16-128 tokens of its own, outputs 16-64."""
    rng = random.Random(seed)
    shared = tokens(rng, system)
    at, out = 0.0, []
    for _ in range(requests):
        at += rng.expovariate(rate)
        out.append(Request(shared + tokens(rng, rng.randint(16, 128)), rng.randint(16, 64), arrival=at))
    return out


def chat_turn(seed: int, conversation: int, turn: int) -> tuple[list[int], int]:
    """A conversation's user turn: its 16-64 tokens and the length of the answer it gets (16-64)."""
    rng = random.Random(f"{seed}/{conversation}/{turn}")
    return tokens(rng, rng.randint(16, 64)), rng.randint(16, 64)


def workload_c(seed: int, conversations: int) -> list[Request]:
    """Chat: every conversation's first turn at once; `drive` sends the later ones."""
    firsts = []
    for c in range(conversations):
        user, answer = chat_turn(seed, c, 0)
        firsts.append(Request(user, answer, conversation=c))
    return firsts


# ---- the loop -------------------------------------------------------------------------------


def drive(
    engine: Stepper, requests: list[Request], *, turns: int = 1, seed: int = 0
) -> tuple[list[Done], float]:
    """Run the workload through the engine; every request's token times and the wall time."""
    pending = sorted(requests, key=lambda r: r.arrival)
    live: dict[int, Done] = {}
    done: list[Done] = []
    keys = itertools.count()
    started = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - started
        while pending and pending[0].arrival <= now:
            request = pending.pop(0)
            key = next(keys)
            live[key] = Done(request, started + request.arrival)
            engine.add(key, request.prompt, request.tokens)
        if not engine.busy():
            if pending:
                time.sleep(max(0.0, pending[0].arrival - (time.perf_counter() - started)))
            continue
        made, finished = engine.step()
        stamp = time.perf_counter()
        for key, count in made.items():
            live[key].token_times.extend([stamp] * count)
        for key, output in finished.items():
            answered = live.pop(key)
            done.append(answered)
            request = answered.request
            if request.conversation is not None and request.turn + 1 < turns:
                user, answer = chat_turn(seed, request.conversation, request.turn + 1)
                pending.append(
                    Request(
                        request.prompt + list(output) + user,
                        answer,
                        arrival=stamp - started,
                        conversation=request.conversation,
                        turn=request.turn + 1,
                    )
                )
                pending.sort(key=lambda r: r.arrival)
    return done, time.perf_counter() - started


# ---- figures --------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if ordered else math.nan


def figures(done: list[Done], wall: float, *, later_turns: bool = False) -> dict[str, Any]:
    """Tokens/s, TTFT and inter-token latency p50/p99 (ms); with `later_turns`, TTFT of chat
    turns 2 onwards only."""
    generated = sum(len(d.token_times) for d in done)
    timed = [d for d in done if d.request.turn >= 1] if later_turns else done
    ttft = [d.ttft * 1000 for d in timed]
    itl = [g * 1000 for d in done for g in d.gaps()]
    return {
        "requests": len(done),
        "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "tokens_per_s": round(generated / wall, 1),
        "ttft_ms": {"p50": round(percentile(ttft, 0.5), 1), "p99": round(percentile(ttft, 0.99), 1)},
        "itl_ms": {"p50": round(percentile(itl, 0.5), 2), "p99": round(percentile(itl, 0.99), 2)},
        "longest_prompt": max((len(d.request.prompt) for d in done), default=0),
    }
