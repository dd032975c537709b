"""What the suite asked of the machine: the load average and the live dev-stack processes,
sampled every `SAMPLE_S` seconds by the process that runs the session (xdist's controller, or
the one pytest process), and their peaks printed at the run's end. A red run on a shared CI
machine then says whether the machine was overloaded (and by how many stacks at once) before
anyone reads a failure as a defect or as load."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ipnext.client.devstack.stack import STACK_ID_ENV

SAMPLE_S = 10.0
_NEEDLE = f"{STACK_ID_ENV}=".encode()


def live_stacks(proc: Path = Path("/proc")) -> dict[str, int]:
    """Stack id -> how many live processes carry it in their environment (every process a dev
    stack starts does, Ray's workers and replicas included)."""
    counts: dict[str, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_bytes().rsplit(b")", 1)[-1].split()[0]
        except (OSError, IndexError):
            continue  # gone, or not ours to read
        if state == b"Z":
            continue  # a zombie is not a live process
        for var in environ:
            if var.startswith(_NEEDLE):
                stack = var[len(_NEEDLE) :].decode(errors="replace")
                counts[stack] = counts.get(stack, 0) + 1
                break
    return counts


@dataclass
class Peak:
    value: float = 0.0
    at_s: float = 0.0  # seconds into the run
    detail: str = ""


@dataclass
class LoadRecord:
    """The peaks seen so far; `sample` is called from one thread at a time."""

    started: float = field(default_factory=time.monotonic)
    samples: int = 0
    load: Peak = field(default_factory=Peak)
    processes: Peak = field(default_factory=Peak)
    stacks: Peak = field(default_factory=Peak)

    def sample(self, load_1m: float, stacks: dict[str, int]) -> None:
        now = time.monotonic() - self.started
        self.samples += 1
        detail = ", ".join(f"{stack}: {n}" for stack, n in sorted(stacks.items())) or "none"
        if load_1m > self.load.value:
            self.load = Peak(load_1m, now, detail)
        if sum(stacks.values()) > self.processes.value:
            self.processes = Peak(sum(stacks.values()), now, detail)
        if len(stacks) > self.stacks.value:
            self.stacks = Peak(len(stacks), now, detail)

    def lines(self) -> list[str]:
        def at(peak: Peak) -> str:
            return f"at {peak.at_s / 60:.1f} min (stacks then: {peak.detail})"

        return [
            f"{self.samples} samples, one every {SAMPLE_S:g} s "
            f"over {(time.monotonic() - self.started) / 60:.1f} min "
            f"on {os.cpu_count()} cores",
            f"peak load average (1 min): {self.load.value:.1f} {at(self.load)}",
            f"peak live stack processes: {int(self.processes.value)} {at(self.processes)}",
            f"peak stacks at once: {int(self.stacks.value)} {at(self.stacks)}",
        ]


class LoadSampler:
    """Samples into a `LoadRecord` on a daemon thread until `stop`."""

    def __init__(self, interval_s: float = SAMPLE_S) -> None:
        self.record = LoadRecord()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite-load", daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> LoadRecord:
        self._stop.set()
        self._thread.join(timeout=5)
        self._take()  # the last moment counts too
        return self.record

    def _take(self) -> None:
        self.record.sample(os.getloadavg()[0], live_stacks())

    def _run(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self._interval_s):
                return


@dataclass
class UnitSpan:
    worker: str
    start: float  # epoch seconds, as pytest's reports carry them
    stop: float
    tests: int = 0


class UnitTimeline:
    """Which worker ran each work unit (tests/conftest.py), from when to when, built from the
    test reports' start and stop: the run's critical path, so the next balancing of the units
    reads a timeline, not a guess from --durations."""

    SHOWN_S = 30.0  # units shorter than this are summed per worker, not listed

    def __init__(self) -> None:
        self._spans: dict[str, UnitSpan] = {}

    def add(self, unit: str, worker: str, start: float, stop: float, test_done: bool) -> None:
        span = self._spans.setdefault(unit, UnitSpan(worker, start, stop))
        span.start, span.stop = min(span.start, start), max(span.stop, stop)
        span.tests += int(test_done)

    def lines(self) -> list[str]:
        if not self._spans:
            return []
        origin = min(s.start for s in self._spans.values())
        out = []
        for worker in sorted({s.worker for s in self._spans.values()}):
            mine = sorted(
                ((unit, s) for unit, s in self._spans.items() if s.worker == worker), key=lambda p: p[1].start
            )
            short = [s for _, s in mine if s.stop - s.start < self.SHOWN_S]
            busy = sum(s.stop - s.start for _, s in mine)
            end = max(s.stop for _, s in mine) - origin
            out.append(f"{worker}: ends at {end / 60:.1f} min, busy {busy / 60:.1f} min in {len(mine)} units")
            for unit, s in mine:
                if s.stop - s.start >= self.SHOWN_S:
                    out.append(
                        f"  {(s.start - origin) / 60:5.1f}-{(s.stop - origin) / 60:5.1f} min "
                        f"{unit} ({s.tests} tests)"
                    )
            if short:
                seconds = sum(s.stop - s.start for s in short)
                out.append(f"  and {len(short)} units under {self.SHOWN_S:g} s each, {seconds:.0f} s in all")
        return out
