"""What the block solver's modules share: tolerances, work budgets, the state and level
shapes, and the result of a block and of one search."""

from __future__ import annotations

import math
from dataclasses import dataclass

TOL = 1e-9
WORK_BUDGET = 20_000  # per block; a unit is about one Python DP step (a few microseconds)
EASY_WORK = 1_500  # Python search before a run is priced by an LP and searched in arrays
NP_WORK_SCALE = 20  # array work units (state transitions) per Python work unit
MAX_OPTIONS = 4_000  # a region's options multiplied out, at most
LP_WORK = 500  # what one LP for multipliers counts as
FEW_DECLARATIONS = 8  # survive declarations tried without an LP to order them
BEAM = 6
RECENT_MULTS = 2  # multipliers of earlier runs a run is first bounded with
PROBES = 6  # declarations searched with a beam for an incumbent before any exact run
DOMINANCE_REFS = 512

Level = tuple[float, float, tuple[int, ...]]  # (capacity, cost, replicas per option)
Key = tuple[tuple[float, ...], int, tuple[float, ...]]  # (Hall row coverage, regions, survive sums)
Chosen = dict[int, list[int]]  # region -> level index per member


@dataclass
class FastResult:
    x: dict[int, int]  # option -> replicas
    f: dict[int, float]  # route -> fraction
    objective: float  # priced cost (+ churn)
    bound: float  # proven lower bound of the block's optimum (== objective when optimal)
    optimal: bool  # False: the work budget ran out; objective is the best found
    work: int = 0  # work units spent
    states: int = 0  # most DP states in one layer
    runs: int = 0  # DP runs (survive declarations searched)


@dataclass
class Outcome:
    """What one search of a run found."""

    cost: float  # best found under the incumbent given (or that incumbent)
    chosen: Chosen | None  # its levels, None if nothing beat the incumbent
    work: int
    peak: int
    left: float  # lower bound of the run's optimum if cut short, else inf


def below(value: float) -> float:
    """What a cost must stay under to beat `value` (by more than the tolerance)."""
    return value - TOL * max(1.0, abs(value)) if value < math.inf else math.inf
