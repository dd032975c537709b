"""The engine's thread tuner (`threads: auto`) against a simulated machine whose speed per thread
count changes: it must settle on the faster count, follow a change of load, and pay little for
probing a count that has become very slow."""

from __future__ import annotations

import torch

from ipnext.serving.llm.engine import EngineConfig, LLMEngine, SamplingParams
from ipnext.serving.llm.threads import ThreadTuner, available_cpus

from .conftest import TrainedLM

QUIET = {1: 370.0, 2: 580.0}  # tokens/s per thread count (bench/llm.py, 2 cores, nothing beside)
BUSY = {1: 358.0, 2: 35.0}  # one CPU-bound process beside


class Machine:
    """Steps of 16 tokens whose duration follows the current load and the tuner's thread count."""

    def __init__(self, tuner_options: dict[str, int] | None = None) -> None:
        self.threads = 0
        self.tuner = ThreadTuner(choices=[1, 2], set_threads=self._set, **(tuner_options or {}))
        self.seconds = {1: 0.0, 2: 0.0}
        self.steps = {1: 0, 2: 0}

    def _set(self, threads: int) -> None:
        self.threads = threads

    def run(self, speeds: dict[int, float], steps: int) -> None:
        for _ in range(steps):
            threads = self.threads
            took = 16 / speeds[threads]
            self.seconds[threads] += took
            self.steps[threads] += 1
            self.tuner.record(16, took)


def test_a_quiet_machine_settles_on_the_faster_count_and_probes_rarely() -> None:
    machine = Machine()
    machine.run(QUIET, 5000)
    assert machine.tuner.best == 2 and machine.threads == 2
    assert machine.steps[1] < 0.05 * 5000, machine.steps  # the first round and a few probes
    assert machine.tuner.speeds[2] == QUIET[2]


def test_a_busy_machine_settles_on_one_thread_and_probing_two_costs_little_time() -> None:
    machine = Machine()
    machine.run(BUSY, 5000)
    assert machine.tuner.best == 1 and machine.threads == 1
    # Probes of 2 threads end after one step each: under 5% of the time went to them.
    assert machine.seconds[2] < 0.05 * (machine.seconds[1] + machine.seconds[2]), machine.seconds


def test_steps_of_different_sizes_do_not_mislead_it() -> None:
    """Phases of prompt chunks (512 tokens a step, many times the tokens/s of decode rows) and
    of decode steps (16 tokens), 37 steps each: 2 threads are faster in both, and a tuner that
    compared a prefill window on 1 thread with a decode window on 2 would keep 1."""
    prefill = {1: 2000.0, 2: 3200.0}
    machine = Machine()
    for phase in range(150):
        speeds, tokens = (prefill, 512) if phase % 2 else (QUIET, 16)
        for _ in range(37):
            took = tokens / speeds[machine.threads]
            machine.steps[machine.threads] += 1
            machine.tuner.record(tokens, took)
    assert machine.tuner.best == 2 and machine.threads == 2
    assert machine.steps[1] < 0.1 * sum(machine.steps.values()), machine.steps


def test_the_tuner_follows_the_machine_when_a_neighbour_starts_and_stops() -> None:
    machine = Machine({"max_hold": 8})
    machine.run(QUIET, 1000)
    assert machine.threads == 2
    before = dict(machine.steps)
    machine.run(BUSY, 200)  # a neighbour starts: the first slow window probes, and 1 wins
    assert machine.threads == 1
    assert machine.steps[2] - before[2] <= 2 * 16 + 1, machine.steps  # within two windows
    machine.run(QUIET, 8 * 16 * 3)  # it stops: a probe finds 2 faster again
    assert machine.threads == 2 and machine.tuner.best == 2


def test_the_choices_are_thread_counts() -> None:
    for bad in ([], [0, 1]):
        try:
            ThreadTuner(choices=bad, set_threads=lambda n: None)
        except ValueError as err:
            assert "choices" in str(err)
        else:
            raise AssertionError(f"{bad} accepted")
    assert ThreadTuner.for_this_process(set_threads=lambda n: None).choices == list(
        range(1, available_cpus() + 1)
    )


def test_an_engine_with_threads_auto_tunes_torch_threads_and_answers_the_same(lm: TrainedLM) -> None:
    before = torch.get_num_threads()
    try:
        prompt = [lm.codec.bos, *range(5, 30)]
        answers = []
        for threads in (1, "auto"):
            config = EngineConfig(block_size=4, kv_cache_bytes=4 << 20, threads=threads, prefix_cache=False)
            engine = LLMEngine(lm.weights, lm.config, config)
            if threads == "auto":
                engine.threads.window = 2  # type: ignore[union-attr]  # switch within the test's steps
            seqs = [engine.add(prompt, SamplingParams(max_tokens=12, ignore_eos=True)) for _ in range(3)]
            while engine.has_work():
                engine.step()
            answers.append([s.output for s in seqs])
            if threads == "auto":
                tuner = engine.threads
                assert tuner is not None and set(tuner.speeds) == set(tuner.choices)
                assert torch.get_num_threads() == tuner.current
        assert answers[0] == answers[1]  # greedy tokens do not depend on the thread count
    finally:
        torch.set_num_threads(before)
