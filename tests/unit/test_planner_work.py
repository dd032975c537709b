"""The planner's work limit (planner/work.py): the same instance, options and work limit give the
same plan in any process, whatever the hash seed and however long the work takes; the wall
clock is only the outer stop, and a solve it cut says so."""

from __future__ import annotations

import importlib
import itertools
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ipnext.contracts.plan import SolveOptions
from ipnext.errors import PlanningTimeoutError
from ipnext.planner import check_plan, solve, work
from ipnext.planner.generator import generate
from ipnext.planner.solve import STOPPED_BY_CLOCK
from ipnext.planner.work import Budget, Clock
from tests.unit.helpers import REPO

# One solve on the scalable path, with the worker pool (100 deployments: 66 blocks, past
# PARALLEL_MIN_BLOCKS): about 2 s of work on the bench's machine, run under a clock of 240 s, far
# past what the work takes there even on a loaded host (the test fails if the clock fires).
SOLVE = """
import json, sys
from ipnext.contracts.plan import SolveOptions
from ipnext.planner import solve
from ipnext.planner.generator import generate

if __name__ == "__main__":
    plan = solve(
        generate(2, 100, 4, 2, utilization=0.6),
        SolveOptions(work_limit=400_000, time_limit_s=240, exact_fallback=False, workers=2),
    )
    print(json.dumps({**plan.to_report(), "solve_seconds": None}))
"""


def _solve_in_a_process(hash_seed: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", SOLVE], cwd=REPO, env=env, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def test_one_instance_on_a_work_limit_gives_the_same_plan_under_two_hash_seeds() -> None:
    """Two processes (at once: each is slower for the other's load, which must not matter),
    PYTHONHASHSEED 0 and 4242: the same placements, routing, cost, bound and work spent."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(_solve_in_a_process, ["0", "4242"])
    assert first["stopped_by"] == second["stopped_by"] == "work", (first["lower_bound_method"], second)
    assert STOPPED_BY_CLOCK not in first["lower_bound_method"]
    assert first["placements"] and first["placements"] == second["placements"]
    assert first["routing"] == second["routing"]
    for key in ("cost", "objective", "lower_bound", "gap", "lower_bound_method", "work_units"):
        assert first[key] == second[key], key
    assert 0 < first["work_units"] <= 400_000


class _Ticks:
    """A clock that moves one second at every reading, whatever the machine's speed: the outer
    stop then fires after as many readings as the time limit has seconds."""

    def __init__(self) -> None:
        self._ticks = itertools.count()

    def monotonic(self) -> float:
        return float(next(self._ticks))


def test_a_solve_the_clock_cut_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outer clock fires while the rounds run (its readings, not the machine's speed, say
    when): the plan is still valid, and it says that the clock stopped it."""
    monkeypatch.setattr(work, "time", _Ticks())
    problem = generate(1, 40, 4, 2, utilization=0.6)
    options = SolveOptions(time_limit_s=60, work_limit=10**9, exact_fallback=False, workers=1)
    plan = solve(problem, options)
    assert plan.stopped_by == "clock"
    assert plan.lower_bound_method.endswith(f"; {STOPPED_BY_CLOCK}"), plan.lower_bound_method
    on_work = solve(problem, options.model_copy(update={"time_limit_s": 10**9, "work_limit": 500_000}))
    assert on_work.stopped_by == "work" and STOPPED_BY_CLOCK not in on_work.lower_bound_method


def test_the_search_stops_before_the_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The solve's outer stop is FINISH_SHARE of the time limit before it, so the step in flight
    and the plan's assembly end inside the limit (the bench measures how far inside)."""
    solve_module = importlib.import_module("ipnext.planner.solve")
    asked: list[float] = []

    def after(seconds: float) -> Clock:
        asked.append(seconds)
        return Clock()

    monkeypatch.setattr(solve_module.Clock, "after", staticmethod(after))
    options = SolveOptions(time_limit_s=60, work_limit=200_000, workers=1)
    solve(generate(1, 12, 4, 2, utilization=0.3), options)
    assert 0 < solve_module.FINISH_SHARE < 0.1
    assert asked == [pytest.approx(60 * (1 - solve_module.FINISH_SHARE))]


def test_no_plan_before_the_clock_says_the_clock_ran_out() -> None:
    """A clock that has passed before the first round: no plan, and the error names the clock
    (and the time limit as the fix), not the work limit it never reached."""
    problem = generate(1, 12, 4, 2, utilization=0.3)
    with pytest.raises(PlanningTimeoutError) as caught:
        solve(problem, SolveOptions(time_limit_s=1e-9, work_limit=10**12, exact_fallback=False, workers=1))
    assert "stopped by the clock: not reproducible" in caught.value.message
    assert "--time-limit" in str(caught.value)


def test_a_child_budget_is_a_deadline_on_the_work_counter() -> None:
    """Whoever spends, a child or its parent, uses up both; `until` ends at a share of the
    parent's whole, `share` at a share of what is left, `part` after so many units."""
    root = Budget(1_000, Clock())
    pricing = root.until(0.5)
    root.spend(100)  # spent outside the child: its end does not move
    assert pricing.left() == 400 and pricing.spent == 100
    pricing.spend(400)
    assert pricing.exhausted() and root.left() == 500
    half = root.share(0.5)
    assert half.total == 250
    part = half.part(1_000)  # never past its parent's end
    assert part.total == 250
    part.spend(250)
    assert half.exhausted() and not root.exhausted() and root.left() == 250
    assert root.detached().left() == 250 and root.detached(7).left() == 7
    assert not root.stopped_by_clock


class _Frozen:
    """A clock that reads what it is set to."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def test_the_clock_cuts_a_phase_only_when_it_will_stop_the_solve(monkeypatch: pytest.MonkeyPatch) -> None:
    """`clock_cuts`: while the work would run out before the clock (at the pace so far), the
    clock decides nothing; when the clock will stop the solve, a step that would end past the
    budget's end put on the clock (the same share of the clock's span as of the work limit)
    does not start, and the solve is then the clock's."""
    fake = _Frozen(100.0)
    monkeypatch.setattr(work, "time", fake)
    root = Budget(1_000, Clock.after(20.0))  # the clock's span: 100 s to 120 s
    pricing = root.until(0.6)  # ends at 600 units, so at 112 s on the clock
    fake.now = 110.0
    root.spend(900)  # 90 units a second: the last 100 units come at 111.1 s, before the clock
    assert not pricing.clock_cuts(1_000.0) and not root.stopped_by_clock

    fake.now = 110.0
    slow = Budget(1_000, Clock(deadline=120.0, start=100.0))
    slow_pricing = slow.until(0.6)
    slow.spend(100)  # 10 units a second: the work would last to 200 s, the clock stops at 120 s
    assert not slow_pricing.clock_cuts(1.5)  # ends at 111.5 s, before 112 s
    assert not slow.stopped_by_clock
    assert slow_pricing.clock_cuts(2.5)  # would end at 112.5 s
    assert slow.stopped_by_clock and not slow.exhausted()  # the solve goes on: it was steered
    assert not Budget(1_000, Clock()).clock_cuts(1e9)  # no clock, nothing to steer by


def test_a_clock_capped_phase_stops_at_its_share_of_the_time_only_when_the_clock_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`clock_capped`: while the work would run out first, the budget is unchanged; when the
    clock will stop the solve, the phase gets a stop of its own at its share of the clock's
    span, which steers the solve (not fires it) when it passes, and passes with the solve's."""
    fake = _Frozen(110.0)
    monkeypatch.setattr(work, "time", fake)
    fast = Budget(1_000, Clock(deadline=120.0, start=100.0))
    fast.spend(900)
    assert fast.clock_capped(0.5) is fast

    slow = Budget(1_000, Clock(deadline=120.0, start=100.0))
    slow.spend(100)  # the work would last to 200 s
    phase = slow.clock_capped(0.6)  # stops at 112 s
    assert phase is not slow and phase.left() == slow.left()
    assert slow.clock_capped(1.0) is slow  # no earlier than the solve's own stop
    assert not phase.exhausted() and not slow.stopped_by_clock
    phase.spend(10)
    assert slow.spent == 110  # one ledger
    fake.now = 112.5
    assert phase.exhausted() and phase.stopped_by_clock
    assert not slow.exhausted() and not slow.clock.fired and slow.stopped_by_clock  # steered
    fake.now = 121.0
    other = Budget(1_000, Clock(deadline=120.0, start=100.0))
    other.spend(100)
    fake.now = 110.0
    late = other.clock_capped(0.9)
    fake.now = 121.0
    assert late.exhausted() and other.clock.fired  # the solve's own stop passes it too


def test_at_fleet_scale_a_round_the_clock_has_no_time_for_is_not_started(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the clock says the next round would end past the pricing's share of the time the
    solve has, the rounds stop there (as they do for the work): the plan still comes from the
    columns, fits, and says that the clock made it."""
    monkeypatch.setattr(importlib.import_module("ipnext.planner.instance"), "FLEET_BLOCKS", 0)
    asked: list[float] = []

    def no_time(self: Budget, seconds: float) -> bool:
        asked.append(seconds)
        self.clock.steered = True
        return True

    monkeypatch.setattr(Budget, "clock_cuts", no_time)
    problem = generate(2, 30, 4, 2, utilization=0.6)
    options = SolveOptions(time_limit_s=600, work_limit=1_000_000, exact_fallback=False, workers=1)
    plan = solve(problem, options)
    assert asked and all(s >= 0 for s in asked)
    assert check_plan(problem, plan) == []
    assert plan.stopped_by == "clock"
    assert plan.lower_bound_method.endswith(f"; {STOPPED_BY_CLOCK}"), plan.lower_bound_method


def test_a_proof_of_infeasibility_is_charged_less_than_a_finished_search() -> None:
    """HiGHS proves a MIP infeasible in presolve or at its root LP: the charge is
    `MIP_INFEASIBLE_NNZ_WORK` a nonzero, not a finished root's `MIP_NNZ_WORK`, so the next,
    wider completing MIP still has work (complete.py). Both are fixed by the inputs and the
    answer, never by how long the call took."""
    from ipnext.planner.backend import solve_model
    from ipnext.planner.complete import build
    from ipnext.planner.instance import compile_problem

    inst = compile_problem(generate(2, 10, 3, 1, utilization=0.5))
    blocks = list(range(len(inst.blocks)))
    fits = build(inst, blocks, pool_capacity=inst.pool_units)
    none = build(inst, blocks, pool_capacity=inst.pool_units * 0)  # no room at all
    nnz = int(fits.matrix.nnz)
    assert int(none.matrix.nnz) == nnz
    found = solve_model(fits, work=10**9, budget=Budget(10**9))
    proof = solve_model(none, work=10**9, budget=Budget(10**9))
    assert found.status == "optimal" and proof.status == "infeasible"
    assert found.work == work.MIP_BASE_WORK + work.MIP_NNZ_WORK * nnz
    assert proof.work == work.MIP_BASE_WORK + work.MIP_INFEASIBLE_NNZ_WORK * nnz
    assert work.mip_charge(nnz, 1_000, finished=False, infeasible=True) == 1_000  # unfinished: its limit
