"""The LLM engine's core: sequences, the continuous-batching scheduler and sampling, one
synchronous `step()` at a time (the async service drives it; tests and benchmarks may too).

Each step, the scheduler builds one batch under a token budget: first every running sequence
(a decode token, or the next chunk of a prompt still being prefilled), then waiting ones in
arrival order while there is room. A long prompt is prefilled in chunks of at most the budget,
so it never stalls the running decodes for more than one step. That is `schedule:
decode_first`. With `prefill_first` a step that has prompt work runs it alone instead, ahead of
the decode rows (they wait while prompts are admitted, bounded by `max_num_seqs`): a chat turn
whose history is cached gets its first token after one short step instead of one carrying every
other sequence's decode row (bench/llm.py, workload C), but a long prompt holds every decode row
back a whole step. `short_prompts_first`, the default, runs prompt work first only when it is
short (`short_prompt_tokens`): the cached chat turn's gain without the long prompt's cost.
Blocks come from the paged
cache; a new waiting sequence first takes the cached blocks of its prompt's prefix. When a
running sequence needs a block and none is free, the newest running sequence is preempted: its
blocks go back to the pool and it waits at the front of the queue, to be recomputed (its
tokens so far are kept, so its answer does not change). No request fails for lack of cache:
one that could never fit, even alone, is refused when submitted.

`batching="static"` is the baseline the benchmark compares with: a batch is admitted only when
the previous one has finished entirely.

`step()` never raises for a request's sake: a failure it can pin on one sequence (sampling, the
finish check) fails that sequence alone; one it cannot (the batched forward pass, the scheduler)
fails every sequence the step was running. A failed sequence ends with `finish_reason` "error",
leaves the engine and gives its blocks back; nothing runs it again.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import torch
from pydantic import Field, StringConstraints

from ipnext.names import Frozen
from ipnext.serving.llm.cache import KVCache, block_hashes
from ipnext.serving.llm.model import DecoderConfig
from ipnext.serving.llm.runner import Chunk, ModelRunner
from ipnext.serving.llm.threads import ThreadTuner

__all__ = [
    "GREEDY_BELOW",
    "MAX_STOP_LENGTH",
    "MAX_STOP_STRINGS",
    "SEED_MAX",
    "SEED_MIN",
    "EngineConfig",
    "EngineStats",
    "LLMEngine",
    "SamplingParams",
    "Sequence",
    "StepResult",
]

# The bounds of a request's sampling settings. A part refuses a request outside them (HTTP 400
# naming the field) before it reaches the engine, so no value a caller sends can fail a step.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator takes a 64-bit seed; past it, add() raised
# Below this temperature sampling is greedy: logits / 1e-45 are infinite, and their softmax NaN.
GREEDY_BELOW = 1e-5
MAX_STOP_STRINGS = 16  # every generated token is checked against each of them
MAX_STOP_LENGTH = 256  # characters of one stop string

StopString = Annotated[str, StringConstraints(strict=True, min_length=1, max_length=MAX_STOP_LENGTH)]


class SamplingParams(Frozen):
    """One request's sampling settings, each bounded and of its exact JSON type (strict: no
    "5" for 5, no true for 1, no NaN or infinity). `max_tokens` also has to fit the model's
    context with the prompt: `LLMEngine.check` refuses it otherwise (nothing is clamped)."""

    max_tokens: int = Field(default=64, ge=1, strict=True)
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False, strict=True)  # < GREEDY_BELOW: greedy
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False, strict=True)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, strict=True)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX, strict=True)
    ignore_eos: bool = Field(
        default=False, strict=True
    )  # generate max_tokens whatever comes (benchmarks, drills)


class EngineConfig(Frozen):
    block_size: int = Field(default=16, ge=1)
    kv_cache_bytes: int = Field(default=64 << 20, ge=1)
    max_num_seqs: int = Field(default=16, ge=1)  # sequences in one batch
    max_batched_tokens: int = Field(default=256, ge=1)  # tokens in one step (prefill chunks included)
    prefix_cache: bool = True
    batching: Literal["continuous", "static"] = "continuous"
    # "decode_first": every step runs the running sequences' decode rows, then admits prompts in
    # the budget left. "prefill_first": a step with prompt work (a waiting sequence with a free
    # slot, or a prompt still in chunks) runs that alone, so a new request's first token does not
    # wait for a step of every other sequence's decode rows; those wait a step instead (see
    # `_schedule`). For chat, where a turn's prompt is mostly cached and short to prefill.
    # "short_prompts_first" (the default): prefill first when the step's prompt work is at most
    # `short_prompt_tokens` (a chat turn whose history is cached), else decode first, so a long
    # prompt never holds every decode row back a whole step.
    schedule: Literal["decode_first", "prefill_first", "short_prompts_first"] = "short_prompts_first"
    short_prompt_tokens: int = Field(default=128, ge=1)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    backend: Literal["triton", "torch"] | None = None  # ipnext.kernels backend; None: by device
    # torch threads for the steps (one setting for the whole process): None leaves the process's
    # (a served replica sets 1); a count sets it; "auto" measures and keeps the fastest count
    # from 1 to the process's CPUs as the machine's load changes (ipnext.serving.llm.threads).
    threads: Annotated[int, Field(ge=1, le=1024, strict=True)] | Literal["auto"] | None = None


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    arrival: float
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose keys and values are in the cache
    hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks registered
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied when first admitted
    admitted: bool = False
    scheduled_at: float | None = None  # first time a step included it
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0
    finish_reason: str | None = None  # "length", "stop", "eos", "cancelled", "error"
    error: str | None = None  # why it failed (finish_reason "error")
    generator: torch.Generator | None = None
    # Disaggregated serving: a prefill-only sequence keeps its prompt's keys and values when it
    # finishes (`kv`); a sequence prefilled elsewhere brings them (`handed_kv`) and starts decoding.
    export_kv: bool = False
    kv: torch.Tensor | None = None  # (n_layers, 2, n_kv_heads, tokens, head_dim)
    handed_kv: torch.Tensor | None = None
    prefilled_elsewhere: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepResult:
    new_tokens: dict[int, int]  # sequence id -> the token sampled this step
    finished: list[Sequence]
    batch_size: int
    batched_tokens: int
    preempted: int
    failed: list[Sequence] = field(default_factory=list)  # failed this step, out of the engine


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)

    def prefix_hit_rate(self) -> float:
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


# Decides whether a sequence's output ends with one of its stop strings (the engine has no tokenizer).
StopCheck = Callable[["Sequence"], bool]


class LLMEngine:
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        model: DecoderConfig,
        config: EngineConfig | None = None,
        *,
        eos_token: int | Iterable[int] | None = None,
        stop_check: StopCheck | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config = config or EngineConfig()
        self.model = model
        dtype = getattr(torch, self.config.dtype)
        self.cache = KVCache(
            model.n_layers,
            model.n_kv_heads,
            model.head_dim,
            self.config.block_size,
            self.config.kv_cache_bytes,
            dtype,
        )
        self.runner = ModelRunner(weights, model, self.cache, dtype, self.config.backend)
        self.threads: ThreadTuner | None = None
        if self.config.threads == "auto":
            self.threads = ThreadTuner.for_this_process()
        elif self.config.threads is not None:
            torch.set_num_threads(self.config.threads)
        # Every id that ends a sequence (a Hugging Face generation_config may name several).
        self.eos_tokens: frozenset[int] = (
            frozenset()
            if eos_token is None
            else frozenset([eos_token] if isinstance(eos_token, int) else eos_token)
        )
        self.stop_check = stop_check
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = EngineStats()
        self._next_id = 0
        self._admitting: Sequence | None = None  # the waiting sequence the scheduler is admitting

    # ---- requests ---------------------------------------------------------------------------

    def add(self, prompt: list[int], params: SamplingParams | None = None) -> Sequence:
        """Queue a request; raises ValueError for one that could never run."""
        params = params or SamplingParams()
        self.check(prompt, params)
        seq = Sequence(id=self._next_id, prompt=list(prompt), params=params, arrival=self.clock())
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def add_prefill(self, prompt: list[int], params: SamplingParams) -> Sequence:
        """A prefill-only request: it stops at its first token and keeps its prompt's keys and
        values in `seq.kv`, to hand to a decode engine (`add_prefilled`)."""
        seq = self.add(prompt, params.model_copy(update={"max_tokens": 1}))
        seq.export_kv = True
        seq.params = params  # the limits of the whole request still apply to what follows
        return seq

    def add_prefilled(
        self, prompt: list[int], first_token: int, kv: torch.Tensor, params: SamplingParams | None = None
    ) -> Sequence:
        """A request whose prompt another engine prefilled: `kv` holds the prompt's keys and
        values, `first_token` the token it sampled. Decoding goes on from there."""
        params = params or SamplingParams()
        expected = (self.model.n_layers, 2, self.model.n_kv_heads, len(prompt), self.model.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(
                f"kv: expected shape {expected} for a {len(prompt)}-token prompt, got {tuple(kv.shape)}"
            )
        seq = self.add(prompt, params)
        seq.output = [first_token]
        seq.token_times = [self.clock()]
        seq.handed_kv = kv
        seq.prefilled_elsewhere = True
        reason = self._finish_reason(seq, first_token)
        if reason is not None:  # the first token already ends it: nothing to decode
            self.waiting.remove(seq)
            seq.handed_kv = None
            seq.finish_reason = reason
        return seq

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """ValueError naming the field and the fix when a request could never run here."""
        if not prompt:
            raise ValueError("prompt: expected at least one token, got none")
        longest = len(prompt) + params.max_tokens
        if longest > self.model.max_seq_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {longest} "
                f"exceeds the model's max_seq_len {self.model.max_seq_len}; "
                "lower max_tokens or shorten the prompt"
            )
        blocks = math.ceil(longest / self.config.block_size)
        if blocks > self.cache.pool.num_blocks:
            raise ValueError(
                f"max_tokens: the request needs up to {blocks} cache blocks, the pool holds "
                f"{self.cache.pool.num_blocks}; lower max_tokens or raise kv_cache_bytes"
            )
        if any(t < 0 or t >= self.model.vocab_size for t in prompt):
            raise ValueError(f"prompt: token ids must lie in [0, {self.model.vocab_size})")

    def cancel(self, seq: Sequence) -> None:
        """Stop a sequence now; its blocks return to the pool."""
        if seq.finished:
            return
        seq.finish_reason = "cancelled"
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def fail(self, seq: Sequence, error: BaseException) -> None:
        """End a sequence with `finish_reason` "error": out of the engine, its blocks back to the
        pool, never run again."""
        if seq.finished:
            return
        seq.finish_reason = "error"
        seq.error = f"{type(error).__name__}: {error}"
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.handed_kv = None
        self._free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def cache_usage(self) -> float:
        pool = self.cache.pool
        return pool.used_count() / pool.num_blocks

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> StepResult:
        """One batch forward and a token for each sequence whose chunk ends its tokens. Never
        raises for a request: what failed is in `StepResult.failed` (see the module's docstring)."""
        started = time.perf_counter()  # the tuner measures real time, whatever `clock` is
        try:
            result = self._step()
            if self.threads is not None:
                self.threads.record(result.batched_tokens, time.perf_counter() - started)
            return result
        except Exception as err:
            # Not pinned on one sequence (the scheduler, or the batched forward pass: one matrix
            # product over every sequence cannot say whose row broke it). Every sequence the step
            # was running fails; waiting ones were not in it and stay.
            failed = list(self.running)
            if self._admitting is not None and self._admitting not in failed:
                failed.append(self._admitting)  # left in the queue, it would fail every step after
            for seq in failed:
                self.fail(seq, err)
            return StepResult({}, [], len(failed), 0, 0, failed)

    def _step(self) -> StepResult:
        self._admitting = None
        batch, preempted = self._schedule()
        self._admitting = None
        if not batch:
            return StepResult({}, [], 0, 0, preempted)
        now = self.clock()
        chunks = []
        for seq, count in batch:
            if seq.scheduled_at is None:
                seq.scheduled_at = now
            start = seq.computed
            chunks.append(
                Chunk(
                    tokens=seq.tokens[start : start + count],
                    start=start,
                    blocks=list(seq.blocks),
                    sample=start + count == len(seq.tokens),
                )
            )
        logits = self.runner.step(chunks)
        new_tokens: dict[int, int] = {}
        finished: list[Sequence] = []
        failed: list[Sequence] = []
        row = 0
        now = self.clock()
        for (seq, count), chunk in zip(batch, chunks, strict=True):
            row += chunk.sample
            try:
                seq.computed += count
                if self.config.prefix_cache:
                    self._register_full_blocks(seq)
                if not chunk.sample:
                    continue
                token = self._sample(logits[row - 1], seq)
                seq.output.append(token)
                seq.token_times.append(now)
                reason = "prefilled" if seq.export_kv else self._finish_reason(seq, token)
                if seq.export_kv:
                    seq.kv = self._export_kv(seq, len(seq.prompt))
            except Exception as err:  # this sequence's own: it fails alone, the batch goes on
                self.fail(seq, err)
                failed.append(seq)
                continue
            new_tokens[seq.id] = token
            self.stats.generated_tokens += 1
            if reason is not None:
                seq.finish_reason = reason
                self.running.remove(seq)
                self._free(seq)
                finished.append(seq)
        self.stats.steps += 1
        self.stats.batch_sizes.append(len(batch))
        return StepResult(new_tokens, finished, len(batch), sum(c for _, c in batch), preempted, failed)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in self.eos_tokens and not seq.params.ignore_eos:
            return "eos"
        if seq.params.stop and self.stop_check is not None and self.stop_check(seq):
            return "stop"
        if len(seq.output) >= seq.params.max_tokens:
            return "length"
        return None

    def _sample(self, logits: torch.Tensor, seq: Sequence) -> int:
        params = seq.params
        if params.temperature < GREEDY_BELOW:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, 0) - sorted_probs < params.top_p  # the nucleus
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=seq.generator))

    # ---- scheduling -------------------------------------------------------------------------

    def _schedule(self) -> tuple[list[tuple[Sequence, int]], int]:
        """The step's batch of (sequence, tokens to compute) and how many sequences were
        preempted. Prefill first (`EngineConfig.schedule`): a batch of prompt work alone when
        there is some that can run, else the usual one. Decode rows wait only while prompts are
        admitted, so at most until `max_num_seqs` run (or the cache is full): a bound, not
        starvation."""
        schedule = self.config.schedule
        if schedule != "decode_first" and self.config.batching == "continuous":
            work = self._prompt_work(self.config.short_prompt_tokens)
            if work and (schedule == "prefill_first" or work <= self.config.short_prompt_tokens):
                batch, preempted = self._batch(decodes=False)
                if batch or preempted:
                    return batch, preempted
                # None could run (no blocks for the waiting prompt): the decode rows go on.
        return self._batch(decodes=True)

    def _prompt_work(self, enough: int) -> int:
        """Prompt tokens the next step could compute: the running prompts' chunks left, then the
        uncached tokens of the waiting ones a free slot would admit, up to the token budget
        (counted until past `enough`; the cache is only looked at, nothing taken)."""
        budget = self.config.max_batched_tokens
        work = sum(min(len(s.tokens) - s.computed, budget) for s in self.running if _prefilling(s))
        slots = self.config.max_num_seqs - len(self.running)
        for seq in self.waiting:
            if slots <= 0 or work > enough or work >= budget:
                break
            slots -= 1
            if seq.handed_kv is not None:
                work += 1  # prefilled elsewhere: its first decode row
                continue
            cached = 0
            if self.config.prefix_cache and not seq.blocks:
                for block_hash in block_hashes(seq.tokens[: len(seq.tokens) - 1], self.config.block_size):
                    if not self.cache.pool.holds(block_hash):
                        break
                    cached += self.config.block_size
            work += len(seq.tokens) - max(cached, seq.computed)
        return min(work, budget)

    def _batch(self, *, decodes: bool) -> tuple[list[tuple[Sequence, int]], int]:
        budget = self.config.max_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        preempted = 0
        index = 0
        while index < len(self.running):
            seq = self.running[index]
            count = min(len(seq.tokens) - seq.computed, budget)
            if count <= 0 or (not decodes and not _prefilling(seq)):
                index += 1
                continue
            if self._grow(seq, seq.computed + count):
                batch.append((seq, count))
                budget -= count
                index += 1
                continue
            victim = self.running[-1]  # the newest running sequence makes room
            self._preempt(victim)
            preempted += 1
            if victim is not seq:
                continue  # try `seq` again with the victim's blocks free
            batch = [(s, c) for s, c in batch if s is not victim]
        # Static batching admits a whole batch at once, and only into an empty engine; its
        # prompts then prefill over the next steps within the token budget.
        static = self.config.batching == "static"
        if static and self.running:
            return batch, preempted
        while (
            self.waiting
            and not preempted
            and (budget > 0 or static)
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self._admitting = self.waiting[0]
            if seq.handed_kv is not None:
                if not self._grow(seq, len(seq.tokens)):
                    break  # wait for blocks; the handed keys and values wait with it
                self._import_kv(seq, seq.handed_kv)
                seq.handed_kv = None
            elif self.config.prefix_cache:
                self._take_cached_prefix(seq)
            count = min(len(seq.tokens) - seq.computed, budget)
            if not self._grow(seq, seq.computed + count):
                self._free(seq)  # wait without holding blocks; try again next step
                break
            self.waiting.popleft()
            if not seq.admitted:
                seq.admitted = True
                self.stats.prompt_tokens += len(seq.prompt)
                self.stats.cached_prompt_tokens += seq.cached_tokens
            self.running.append(seq)
            if count:
                batch.append((seq, count))
                budget -= count
        return batch, preempted

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        """Blocks for `tokens` of `seq`; False (nothing taken) when the pool runs out."""
        needed = math.ceil(tokens / self.config.block_size) - len(seq.blocks)
        taken: list[int] = []
        for _ in range(needed):
            block = self.cache.pool.allocate()
            if block is None:
                for b in taken:
                    self.cache.pool.release(b)
                return False
            taken.append(block)
        seq.blocks.extend(taken)
        return True

    def _export_kv(self, seq: Sequence, tokens: int) -> torch.Tensor:
        layers = []
        for layer in range(self.model.n_layers):
            keys, values = self.cache.gather(layer, seq.blocks, tokens)
            layers.append(torch.stack([keys, values]))
        return torch.stack(layers).clone()

    def _import_kv(self, seq: Sequence, kv: torch.Tensor) -> None:
        """Write a handed prompt's keys and values into the sequence's blocks."""
        tokens = kv.shape[3]
        positions = torch.arange(tokens)
        blocks = torch.tensor(
            [seq.blocks[p // self.config.block_size] for p in range(tokens)], dtype=torch.long
        )
        offsets = positions % self.config.block_size
        dtype = self.cache.keys[0].dtype
        for layer in range(self.model.n_layers):
            keys = kv[layer, 0].transpose(0, 1).to(dtype)  # (tokens, n_kv_heads, head_dim)
            values = kv[layer, 1].transpose(0, 1).to(dtype)
            self.cache.write(layer, blocks, offsets, keys, values)
        seq.computed = tokens

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Reuse cached blocks of the prompt's prefix (never its last token: its logits are needed)."""
        if seq.blocks:
            return
        usable = block_hashes(seq.tokens[: len(seq.tokens) - 1], self.config.block_size)
        for block_hash in usable:
            block = self.cache.pool.take_cached(block_hash)
            if block is None:
                break
            seq.blocks.append(block)
            seq.hashes.append(block_hash)
        seq.computed = len(seq.blocks) * self.config.block_size
        if not seq.admitted:
            seq.cached_tokens = seq.computed

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.computed // self.config.block_size
        if full <= len(seq.hashes):
            return
        hashes = block_hashes(seq.tokens[: full * self.config.block_size], self.config.block_size)
        for i in range(len(seq.hashes), full):
            self.cache.pool.register(seq.blocks[i], hashes[i])
        seq.hashes = hashes

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _free(self, seq: Sequence) -> None:
        for block in seq.blocks:
            self.cache.pool.release(block)
        seq.blocks = []
        seq.hashes = []
        seq.computed = 0


def _prefilling(seq: Sequence) -> bool:
    """More than its next decode token still to compute: a prompt (or, after a preemption, a
    prompt and output) going through in chunks."""
    return len(seq.tokens) - seq.computed > 1
