"""The planner's unit of work and its ledger: every phase of a solve is budgeted in work units,
so that the same problem, options and work limit give the same plan on any machine at any load;
the wall clock is only the user's outer stop, and a solve it stopped says so.

One work unit is one step of the fast block solver's dynamic program (`block.common`: a state
transition in plain Python; `NP_WORK_SCALE` array transitions; one LP for its multipliers counts
`LP_WORK`). The solvers' own counts are exchanged into it:

- a HiGHS branch-and-bound node is `MIP_NODE_WORK` units plus one per nonzero of the model's
  matrix (a node re-solves its LP, whose iterations grow with the model): a MIP given w units
  may explore that many fewer nodes (`mip_max_nodes`). HiGHS's root (presolve, cuts,
  heuristics) is not limited by nodes; it grows with the model, `MIP_NNZ_WORK` units per
  nonzero of its matrix;
- a simplex iteration (HiGHS's `simplex_iteration_limit`, GLOP's `max_number_of_iterations`)
  is `LP_ITERATION_WORK` units.

A solver call is charged what it was allowed when it stopped at its limit, and an estimate from
the model's size when it finished (neither solver reports its node or iteration count through
OR-Tools' model_builder); both are fixed by the call's inputs, never by how long it took. Work
done around the solvers (repair's ejection chain, column swaps, the master's bookkeeping) is
charged where it is counted: a block placed, a swap weighed.

The rates, measured on the 2-core machine the bench rows come from (CPU time, one core, a
100-deployment instance of the bench's shape, seed 0): one DP unit took 4.3 us (146,583 units in
0.63 s over its 73 blocks, three times);
HiGHS nodes on the hardest blocks of the 1,000-deployment row 0.1-0.3 ms
(25-75 units) past roots of 0.15-0.4 s on matrices of 188-966 nonzeros, the whole 100-deployment
MIP's root 1.8 s on 5,429 nonzeros (76 units per nonzero), its LP relaxation 12 ms in about
1,000 iterations (HiGHS) and 22 ms in 1,000-3,000 (GLOP): 3-5 units an iteration. So
`UNITS_PER_SECOND` units are about a second of one core's solver work here. A whole solve
costs more per unit, as the Python around the solvers (building models, the master's
bookkeeping, reading answers back) is charged only in part: the 100-deployment bench row on
1.9M units took 19.5 s of CPU in one process, 10.3 us a unit, and on 5.59M units with two
workers (finished MIPs then charged 100 a nonzero) 38.9 s of CPU in all, 7.0 us a unit
(CPU time, which the load of a busy host does not
stretch: its wall times there were 95 s and 289 s).

Sub-budgets take a share of their parent: `share` of what is left now, `until` up to a share of
the parent's whole (the old "deadline = start + share x limit"); what a child spends its parents
spend too. The clock (`Clock`) is shared by a ledger and all its children: it never shortens a
budget, it stops the solve, and then `Clock.fired` says the result is not reproducible. One
exception: when the pace so far says the clock will stop the solve before the work runs out,
`Budget.clock_cuts` lets a phase decline a step that would end past its share of the time
(the fleet's pricing rounds and the first plan's roundings ask it), and `Clock.steered`
then says so; `Budget.clock_capped` gives a phase a stop of its own at its share of the time
(the first plan's completing MIPs, whose calls can run far past the work they are charged).
A solve the work limit ends is never steered.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = [
    "LP_ITERATION_WORK",
    "MIP_NNZ_WORK",
    "MIP_NODE_WORK",
    "UNITS_PER_SECOND",
    "Budget",
    "Clock",
    "ShareClock",
    "lp_charge",
    "mip_charge",
    "mip_nodes",
]

UNITS_PER_SECOND = 230_000  # about one core-second of the work above, on the bench's machine
MIP_NODE_WORK = 50  # a node's fixed part; see mip_nodes
MIP_NNZ_WORK = 50  # a finished MIP (its root, mostly), per nonzero of its matrix
# A MIP proven infeasible, per nonzero: HiGHS proves it in presolve or at the root LP, long
# before a root's cuts and heuristics. Measured on the completing MIPs (complete.py) of nine
# instances of the family (300-938 deployments, 94-96.5% full): 0.6-1.0 units' worth of CPU per
# nonzero for the six proven infeasible (0.01-0.19 s), 3-21 for the seven that found a plan.
# At 50 a nonzero, one proof over 81 blocks (55,120 nonzeros, 0.19 s) was charged 2.76 M units
# (12 s), and the wider MIP after it was never tried: no plan, 35 s before the clock.
MIP_INFEASIBLE_NNZ_WORK = 5
MIP_BASE_WORK = 1_000  # a MIP call's fixed part (building the model, presolve)
LP_ITERATION_WORK = 4
LP_NNZ_WORK = 1  # a finished LP, per nonzero (about an iteration per row)
LP_BASE_WORK = 200
# Of the clock left, what one solver call may take before it is stopped: the clock is the outer
# stop, so a call never outlives it, and a work limit meant for a second never hangs.
CALL_CLOCK_SHARE = 1.0
MIN_CALL_SECONDS = 0.05


@dataclass
class Clock:
    """The user's outer stop: a monotonic instant, and whether anything was cut by it."""

    deadline: float = math.inf
    fired: bool = False
    start: float = 0.0  # when the span began (`after`)
    steered: bool = False  # a phase was cut short for time before the stop (`Budget.clock_cuts`)

    @classmethod
    def after(cls, seconds: float) -> Clock:
        now = time.monotonic()
        return cls(now + seconds, start=now)

    def passed(self) -> bool:
        """Whether the outer stop is past (recorded: the result is then the clock's)."""
        if time.monotonic() >= self.deadline:
            self.fired = True
        return self.fired

    def seconds_left(self) -> float:
        """What a solver call may take: the time to the outer stop (at least a sliver)."""
        if self.deadline == math.inf:
            return 1e9
        return max(MIN_CALL_SECONDS, CALL_CLOCK_SHARE * (self.deadline - time.monotonic()))


@dataclass
class ShareClock(Clock):
    """A stop before the solve's clock (`Budget.clock_capped`): passed when either is."""

    outer: Clock | None = None

    def passed(self) -> bool:
        if self.outer is not None and self.outer.passed():
            self.fired = True
        elif time.monotonic() >= self.deadline:
            self.fired = True
            if self.outer is not None:
                self.outer.steered = True
        return self.fired


class Budget:
    """A ledger of work units (see the module docstring): one counter of what a solve has
    spent, and per budget the span of it that budget may use. A child's span lies inside its
    parent's, and whatever spends, the child or its parent, uses up both: a child is a
    deadline on the work counter, as a deadline is on the clock."""

    def __init__(self, total: int, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else Clock()
        self._counter = [0]  # shared by a root and its children
        self._start = 0
        self._end = max(0, int(total))
        self._root_end = self._end  # the work limit of the whole ledger

    def _child(self, end: float) -> Budget:
        child = Budget.__new__(Budget)
        child.clock, child._counter, child._root_end = self.clock, self._counter, self._root_end
        child._start = self._counter[0]
        child._end = max(child._start, min(self._end, int(end)))
        return child

    @property
    def total(self) -> int:
        return self._end - self._start

    @property
    def spent(self) -> int:
        return self._counter[0] - self._start

    def left(self) -> int:
        return max(0, self._end - self._counter[0])

    def spend(self, units: int) -> None:
        self._counter[0] += max(0, int(units))

    def exhausted(self) -> bool:
        """No work left, or the outer stop is past."""
        return self.left() <= 0 or self.clock.passed()

    def share(self, fraction: float) -> Budget:
        """A child with `fraction` of the work left now."""
        return self._child(self._counter[0] + fraction * self.left())

    def until(self, fraction: float) -> Budget:
        """A child that ends when this budget has spent `fraction` of its total."""
        return self._child(self._start + fraction * self.total)

    def part(self, units: float) -> Budget:
        """A child of at most `units`."""
        return self._child(self._counter[0] + units)

    def cap(self, units: float) -> int:
        """What one call of at most `units` may be given now."""
        return max(0, min(int(units), self.left()))

    def detached(self, units: int | None = None) -> Budget:
        """A new ledger on the same clock, of `units` or of what is left here: for work done
        elsewhere (a worker process), whose spend the caller charges here when it comes back."""
        return Budget(self.left() if units is None else units, self.clock)

    def _clock_binds(self) -> bool:
        """Whether, at the pace so far (work spent over the time since the clock started), the
        clock will stop the solve before its work limit runs out."""
        clock = self.clock
        now = time.monotonic()
        spent, elapsed = self._counter[0], now - clock.start
        if clock.deadline == math.inf or spent <= 0 or elapsed <= 0 or self._root_end <= 0:
            return False
        return now + (self._root_end - spent) * elapsed / spent > clock.deadline

    def clock_cuts(self, seconds: float) -> bool:
        """Whether a step of about `seconds` should not start, because the clock will stop the
        solve before its work limit runs out (`_clock_binds`) and the step would end past this
        budget's end put on the clock (the same share of the clock's span as of the ledger's
        work limit). Then the phases keep their shares of the time the solve has, not only of
        its work. When the work would run out first, the clock decides nothing and the answer
        is False. A True marks the clock as having steered the solve: the result is the
        clock's, not reproducible, though the solve goes on."""
        if not self._clock_binds():
            return False
        clock = self.clock
        end_at = clock.start + self._end / self._root_end * (clock.deadline - clock.start)
        if time.monotonic() + seconds <= end_at:
            return False
        clock.steered = True
        return True

    def clock_capped(self, fraction: float) -> Budget:
        """This budget, also stopped at `fraction` of the clock's span when the clock will stop
        the solve before its work limit (`_clock_binds`): for a phase whose solver calls may
        each take far longer than the work they are charged, so that what follows it keeps
        its time. Its stop is a clock of its own (`ShareClock`): when that fires, the solve's
        clock is marked steered, not fired. Unchanged (`self`) when the work limit binds."""
        clock = self.clock
        end_at = clock.start + fraction * (clock.deadline - clock.start)
        if end_at >= clock.deadline or not self._clock_binds():
            return self
        child = self._child(self._end)
        child.clock = ShareClock(end_at, start=clock.start, outer=clock)
        return child

    @property
    def stopped_by_clock(self) -> bool:
        return self.clock.fired or self.clock.steered


def mip_nodes(nnz: int, limit: int) -> int:
    """The branch-and-bound nodes a MIP given `limit` units may explore (module docstring)."""
    return max(1, limit // (MIP_NODE_WORK + nnz))


def mip_charge(nnz: int, limit: int, finished: bool, infeasible: bool = False) -> int:
    """What a MIP call given `limit` units is charged (module docstring); a proof of
    infeasibility at `MIP_INFEASIBLE_NNZ_WORK` a nonzero."""
    if not finished:
        return limit
    return min(limit, MIP_BASE_WORK + (MIP_INFEASIBLE_NNZ_WORK if infeasible else MIP_NNZ_WORK) * nnz)


def lp_charge(nnz: int, limit: int, finished: bool) -> int:
    """What an LP call given `limit` units is charged (module docstring)."""
    return limit if not finished else min(limit, LP_BASE_WORK + LP_NNZ_WORK * nnz)
