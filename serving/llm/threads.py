"""How many torch threads the engine's steps use, when the part says `threads: auto`.

On a CPU the best count depends on what else the machine runs. Measured on 2 cores with the
benchmark's 20M-parameter Llama (bench/llm.py, workload A): 2 threads made 582 tokens/s against
1 thread's 370 on a quiet machine, but with one CPU-bound process beside them 2 threads fell
under 40 tokens/s (each parallel region waits for a thread the OS has descheduled) while 1
thread kept 358. No count fixed in advance is right on both machines, so `ThreadTuner` measures.

Speed is batched tokens per second, and a step's speed depends on what it holds (a prompt
chunk of 512 tokens runs many times faster per token than 16 decode rows), so two settings are
only ever compared over the same stretch of the workload: a trial alternates the held setting
and one other step by step, and takes the median, over up to `window` pairs of neighbouring
steps, of the other's speed over the held one's (a pair that straddles a change of step sizes
is one outlier among them). The first trials take every setting in turn (1 up to the CPUs the
process may use) against the best so far; then the best is held, and a trial against one of
the others runs from time to time: after `hold` windows of `window` steps, doubling (up to
`max_hold`) each time the other loses and back to the first hold when it wins, or at once when
a window on the held setting runs at under half the slowest window it had before (a neighbour
just started). A trial ends after three pairs when the median is already under 1/2 or over 2,
so trying a setting that has become very slow costs three steps. torch's thread count is one
setting for the whole process: the engine that owns the process's compute (one LLM replica)
tunes it.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["ThreadTuner", "available_cpus"]


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass
class _Speed:
    tokens: int = 0
    seconds: float = 0.0

    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class ThreadTuner:
    choices: list[int]
    window: int = 16  # pairs of steps in a trial; steps in a window while holding
    first_hold: int = 4  # windows on the best setting before the next trial
    max_hold: int = 64
    set_threads: Callable[[int], None] = torch.set_num_threads
    speeds: dict[int, float] = field(default_factory=dict)  # setting -> tokens/s in its last trial
    current: int = 0
    switches: int = 0  # thread count changes (each trial makes some)
    trials: int = 0
    _best: int = 0
    _other: int = 0  # the setting on trial against the best; 0: holding
    _untried: list[int] = field(default_factory=list)
    _ratios: list[float] = field(default_factory=list)  # the other's speed over the best's, per pair
    _pair_rate: float = 0.0  # the best's speed in the pair under way
    _totals: dict[int, _Speed] = field(default_factory=dict)
    _window: _Speed = field(default_factory=_Speed)
    _window_steps: int = 0
    _floor: float = 0.0  # the slowest window on the held setting since it won its place
    _hold: int = 0
    _held: int = 0
    _next_other: int = 0

    def __post_init__(self) -> None:
        if not self.choices or any(c < 1 for c in self.choices):
            raise ValueError(f"choices: thread counts >= 1, not {self.choices}")
        self.choices = sorted(set(self.choices))
        self._hold = self.first_hold
        self._best = self.choices[0]
        self._untried = self.choices[1:]
        self._use(self._best)
        if self._untried:
            self._start_trial(self._untried.pop(0))

    @classmethod
    def for_this_process(cls, **options: object) -> ThreadTuner:
        return cls(choices=list(range(1, available_cpus() + 1)), **options)  # type: ignore[arg-type]

    @property
    def best(self) -> int:
        return self._best

    def _use(self, threads: int) -> None:
        if threads != self.current:
            self.set_threads(threads)
            self.switches += 1
        self.current = threads

    def _start_trial(self, other: int) -> None:
        self.trials += 1
        self._other, self._ratios = other, []
        self._totals = {self._best: _Speed(), other: _Speed()}
        self._use(self._best)

    def record(self, tokens: int, seconds: float) -> None:
        """One step's batched tokens and duration, run at `current` threads; it may set
        another count for the next step."""
        if tokens <= 0 or seconds <= 0:
            return
        if self._other:
            self._record_trial(tokens, seconds)
        else:
            self._record_held(tokens, seconds)

    def _record_trial(self, tokens: int, seconds: float) -> None:
        total = self._totals[self.current]
        total.tokens += tokens
        total.seconds += seconds
        if self.current == self._best:  # the pair's first step
            self._pair_rate = tokens / seconds
            self._use(self._other)
            return
        self._ratios.append(tokens / seconds / self._pair_rate)
        ratio = statistics.median(self._ratios)
        decided = len(self._ratios) >= 3 and not 0.5 <= ratio <= 2.0
        if len(self._ratios) < self.window and not decided:
            self._use(self._best)
            return
        for c, speed in self._totals.items():
            self.speeds[c] = speed.rate()
        won = ratio > 1.0
        if not self._untried:  # after the first round, a lost trial waits longer for the next
            self._hold = self.first_hold if won else min(self.max_hold, 2 * self._hold)
        if won:  # a new setting: the slowest window is learnt again (the best kept keeps its own)
            self._best, self._floor = self._other, 0.0
        self._other = 0
        self._window, self._window_steps, self._held = _Speed(), 0, 0
        self._use(self._best)
        if self._untried:
            self._start_trial(self._untried.pop(0))

    def _record_held(self, tokens: int, seconds: float) -> None:
        self._window.tokens += tokens
        self._window.seconds += seconds
        self._window_steps += 1
        if self._window_steps < self.window:
            return
        rate = self._window.rate()
        slowed = self._floor > 0 and rate < 0.5 * self._floor
        self._floor = rate if not self._floor else min(self._floor, rate)
        self._window, self._window_steps = _Speed(), 0
        self._held += 1
        if len(self.choices) > 1 and (slowed or self._held >= self._hold):
            if slowed:
                self._hold = self.first_hold
            others = [c for c in self.choices if c != self._best]
            self._start_trial(others[self._next_other % len(others)])
            self._next_other += 1
