"""How many torch threads the engine's steps use, when the part says `threads: auto`.

On a CPU the best count depends on what else the machine runs. Measured on 2 cores with the
benchmark's 20M-parameter Llama (bench/llm.py, workload A): 2 threads made 582 tokens/s against
1 thread's 370 on a quiet machine, but with one CPU-bound process beside them 2 threads fell
under 40 tokens/s (each parallel region waits for a thread the OS has descheduled) while 1
thread kept 358. No count fixed in advance is right on both machines, so `ThreadTuner` measures.

It runs one setting at a time and measures its speed as batched tokens per second over a window
of steps. It first measures each setting (1 up to the CPUs the process may use), keeps the
fastest, and then probes the others again from time to time: after `hold` windows, doubling
(up to `max_hold`) each time the probe loses and back to the first hold when it wins, so a
machine that changes (a neighbour starts or stops) is noticed within a few windows and a steady
one pays for few probes; a window on the best setting at under half its previous speed (a
neighbour just started) probes at once. A probe that is already slower than half the best speed ends at once,
so probing a setting that has become very slow costs a fraction of a window, not a window of
steps 10 times as long. torch's thread count is one setting for the whole process: the engine
that owns the process's compute (one LLM replica) tunes it.
"""

from __future__ import annotations

import os
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
    window: int = 16  # steps measured per window
    first_hold: int = 4  # windows on the best setting before the first probe
    max_hold: int = 64
    set_threads: Callable[[int], None] = torch.set_num_threads
    speeds: dict[int, float] = field(default_factory=dict)  # setting -> its last measured tokens/s
    current: int = 0
    switches: int = 0
    _best: int = 0
    _measuring: _Speed = field(default_factory=_Speed)
    _steps: int = 0
    _hold: int = 0
    _held: int = 0
    _probe_next: int = 0

    def __post_init__(self) -> None:
        if not self.choices or any(c < 1 for c in self.choices):
            raise ValueError(f"choices: thread counts >= 1, not {self.choices}")
        self.choices = sorted(set(self.choices))
        self._hold = self.first_hold
        self._use(self.choices[0])

    @classmethod
    def for_this_process(cls, **options: object) -> ThreadTuner:
        return cls(choices=list(range(1, available_cpus() + 1)), **options)  # type: ignore[arg-type]

    def _use(self, threads: int) -> None:
        if threads != self.current:
            self.set_threads(threads)
            self.switches += 1
        self.current = threads
        self._measuring = _Speed()
        self._steps = 0

    @property
    def best(self) -> int:
        return self._best or self.current

    def record(self, tokens: int, seconds: float) -> None:
        """One step's batched tokens and its duration; may change the thread count for the next."""
        if tokens <= 0:
            return
        self._measuring.tokens += tokens
        self._measuring.seconds += seconds
        self._steps += 1
        unmeasured = [c for c in self.choices if c not in self.speeds and c != self.current]
        probing = bool(self._best) and self.current != self._best
        too_slow = probing and self._measuring.rate() < 0.5 * self.speeds[self._best]
        if self._steps < self.window and not too_slow:
            return
        previous = self.speeds.get(self.current)
        self.speeds[self.current] = self._measuring.rate()
        if unmeasured:  # the first round: measure every setting once
            self._use(unmeasured[0])
            return
        if not self._best:
            self._best = max(self.speeds, key=lambda c: self.speeds[c])
            self._use(self._best)
            return
        if probing:  # a probe ends: the faster of the two stays
            if self.speeds[self.current] > self.speeds[self._best]:
                self._best, self._hold = self.current, self.first_hold
            else:
                self._hold = min(self.max_hold, self._hold * 2)
            self._held = 0
            self._use(self._best)
            return
        self._held += 1
        if previous and self.speeds[self.current] < 0.5 * previous:  # the machine changed: look now
            self._hold = self.first_hold
            self._held = self._hold
        if self._held >= self._hold and len(self.choices) > 1:
            others = [c for c in self.choices if c != self._best]
            self._use(others[self._probe_next % len(others)])
            self._probe_next += 1
        else:
            self._measuring, self._steps = _Speed(), 0
