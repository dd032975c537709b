"""Experiments' statistics for a dashboard that looks all the time: an always-valid test (mixture
SPRT) of an arm against control, with each side's variance estimated over unit hash buckets so
that a user's correlated values count as one cluster, plus Holm's correction across outcomes.

- **Counters.** Per arm and outcome, values are summed into `BUCKETS` buckets by a hash of their
  unit (`BucketSums`: count, sum, sum of squares per bucket), so counters stay bounded and merge
  across routers and regions by plain addition. Units spread at random over buckets, so bucket
  sums are independent draws, and the within-unit correlation stays inside a bucket.
- **Estimate.** The mean is the ratio estimator sum(totals) / sum(counts); its variance is the
  cluster-robust (delta-method sandwich) one over the non-empty buckets, never below the
  per-value variance / n, which is all there is for data without units (one bucket).
- **Test.** The mixture sequential probability ratio test of Johari, Koomen, Pekelis and Walsh
  ("Always Valid Inference: Continuous Monitoring of A/B Tests", Operations Research 2022) with
  Robbins' normal mixture over the difference: its p-value and confidence sequence hold at every
  look, so a dashboard may look after every value and stop whenever it likes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

from ipnext.contracts.counters import UNIT_BUCKETS

__all__ = [
    "BUCKETS",
    "MIN_VALUES",
    "MIXTURE_EFFECT_SD",
    "BucketSums",
    "Direction",
    "Estimate",
    "SequentialTest",
    "estimate",
    "favours",
    "holm",
    "running_p",
    "sequential_compare",
]

# Unit hash buckets per arm and outcome (the counters' `UNIT_BUCKETS`, 64). 64 keeps each counter
# at a fixed 3 x 64 numbers however many users come, and 64 clusters give the variance estimate
# 63 degrees of freedom (its own relative error about sqrt(2/63), 18%), which the mixture test
# absorbs; fewer buckets would make the variance, and so the error rate, noisy, and more would
# only cost counter space.
BUCKETS = UNIT_BUCKETS

# The mixture's spread tau, in per-value standard deviations (pooled over both arms, so it is
# scale-free: the same for clicks, revenue and milliseconds). The test is most powerful for
# effects near tau; 0.2 sd is a moderate effect, large enough that a blatant difference is
# called within a few dozen values (21 of 21 against 0 of 19 gives p < 0.01), while the cost for
# a small effect (0.1 sd) is only a logarithmic term in the evidence needed.
MIXTURE_EFFECT_SD = 0.2

# Values each side needs before the test speaks: the plug-in variance of a handful of values is
# too often far too small. Looked at after every value, A/A runs of a normal outcome from 2 values
# a side reached 5.3% false positives at alpha 5% (2000 runs of 300 values); from 10 they stay
# near 1-2% (tests/unit/test_sequential.py), and a blatant difference of 20-odd values a side can
# still be called.
MIN_VALUES = 10

# A per-value variance below this fraction of the mean square is rounding in squares/n - mean^2,
# not spread: the values were all equal.
_ROUNDING = 1e-12
_LOG_FLOAT_MAX = math.log(np.finfo(np.float64).max)

Direction = Literal["higher", "lower"]
K = TypeVar("K")
_Array = npt.NDArray[np.float64]
_Numbers = float | npt.NDArray[Any]  # one look, or an element per look or per experiment


@dataclass(frozen=True)
class BucketSums:
    """One arm's values of one outcome, summed per unit bucket."""

    counts: tuple[int, ...]  # values per bucket (len BUCKETS, or 1 for data without units)
    totals: tuple[float, ...]  # their sum per bucket
    squares: tuple[float, ...]  # their sum of squares per bucket
    binary: bool = True  # every value was 0 or 1

    def __post_init__(self) -> None:
        if not self.counts:
            raise ValueError("counts: no buckets; give one bucket per unit hash (or one for all)")
        for name in ("totals", "squares"):
            if len(getattr(self, name)) != len(self.counts):
                raise ValueError(
                    f"{name}: {len(getattr(self, name))} buckets, counts has {len(self.counts)}: "
                    "give one entry per bucket in each"
                )
        for bucket, (count, total, square) in enumerate(
            zip(self.counts, self.totals, self.squares, strict=True)
        ):
            if count < 0 or (count == 0 and (total != 0 or square != 0)):
                raise ValueError(f"counts: bucket {bucket} has {count} values and sum {total}: counts >= 0")
            if square < 0 or not math.isfinite(total) or not math.isfinite(square):
                raise ValueError(f"squares: bucket {bucket} has sum {total}, squares {square}: finite, >= 0")
            if self.binary and not 0 <= total <= count:
                raise ValueError(f"totals: bucket {bucket} sums {total} over {count} values, not 0/1 values")

    @classmethod
    def single(cls, count: int, total: float, squares: float, binary: bool) -> BucketSums:
        """One bucket: no unit structure known, so every value counts as independent."""
        return cls((count,), (total,), (squares,), binary)


@dataclass(frozen=True)
class Estimate:
    """An arm's mean of one outcome and the variance of that mean."""

    mean: float  # ratio estimator: sum(totals) / sum(counts)
    variance: float  # cluster-robust over non-empty buckets, never below the per-value variance / n
    values: int  # sum(counts)
    clusters: int  # non-empty buckets


@dataclass(frozen=True)
class SequentialTest:
    """An arm against control on one outcome at this look: the difference (arm - control), its
    always-valid confidence sequence, the mixture likelihood ratio and the always-valid p-value."""

    test: str
    control: float
    arm: float
    difference: float
    low: float
    high: float
    likelihood_ratio: float
    p_value: float  # min(1, 1 / likelihood_ratio)


# ---- the arithmetic, on arrays ---------------------------------------------------------------
# One implementation for one look and for a simulation's many: numbers, or numpy arrays of one
# shape with an element per look or per experiment.


class _Sums(NamedTuple):
    """One side's sufficient statistics, summed over its buckets."""

    values: _Numbers
    total: _Numbers
    squares: _Numbers
    clusters: _Numbers  # non-empty buckets
    spread: _Numbers  # sum over buckets of (bucket total - mean * bucket count)^2


class _Look(NamedTuple):
    """The mixture SPRT at one look (or many)."""

    arm: _Array  # means
    control: _Array
    log_ratio: _Array  # log of the mixture likelihood ratio
    half_width: _Array  # of the confidence sequence around the difference
    enough: npt.NDArray[np.bool_]  # both sides have MIN_VALUES


def _side(sums: _Sums) -> tuple[_Array, _Array]:
    """(mean, variance of the mean) of one side."""
    n, t, q, k, spread = (np.asarray(a, dtype=np.float64) for a in sums)
    with np.errstate(divide="ignore", invalid="ignore"):
        mean = t / n
        mean_square = q / n
        per_value = mean_square - mean**2
        per_value = np.where(per_value <= _ROUNDING * mean_square, 0.0, per_value)
        # CR1: the sandwich over k clusters with its k / (k - 1) small-sample factor.
        robust = np.where(k >= 2, k / (np.maximum(k, 2) - 1) * spread / n**2, 0.0)
        robust = np.where(robust * n <= _ROUNDING * mean_square, 0.0, robust)
    return mean, np.maximum(robust, per_value / n)


def _mixture(arm: _Sums, control: _Sums, binary: bool | npt.NDArray[np.bool_], alpha: float) -> _Look:
    """The mixture SPRT of arm against control; `binary` when both sides' values are 0 or 1."""
    (m1, v1), (m0, v0) = _side(arm), _side(control)
    n1, t1, q1 = (np.asarray(a, dtype=np.float64) for a in arm[:3])
    n0, t0, q0 = (np.asarray(a, dtype=np.float64) for a in control[:3])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        n = n1 + n0
        # Both arms' values together: under the null they share one distribution.
        pooled = np.maximum((q1 + q0) / n - ((t1 + t0) / n) ** 2, 0.0)
        difference = m1 - m0
        variance = v1 + v0
        # A rate's spread under the null, so 0 of 19 against 21 of 21 is not 0 / 0.
        variance = np.where(binary, np.maximum(variance, pooled * (1 / n1 + 1 / n0)), variance)
        tau2 = MIXTURE_EFFECT_SD**2 * pooled
        # Robbins' normal mixture: the likelihood ratio of N(theta, V) against N(0, V) for the
        # observed difference, averaged over theta ~ N(0, tau^2).
        log_ratio = 0.5 * np.log(variance / (variance + tau2)) + tau2 * difference**2 / (
            2 * variance * (variance + tau2)
        )
        # The differences theta0 whose own ratio stays under 1 / alpha.
        half_width = np.sqrt(
            variance
            * (variance + tau2)
            / tau2
            * (2 * math.log(1 / alpha) + np.log((variance + tau2) / variance))
        )
        # No spread on either side: the difference is certain, or there is none.
        flat = variance == 0
        log_ratio = np.where(flat, np.where(difference != 0, np.inf, 0.0), log_ratio)
        half_width = np.where(flat, 0.0, half_width)
        # Spread, but none pooled (only by rounding): no evidence either way.
        log_ratio = np.where(~flat & (tau2 == 0), 0.0, log_ratio)
    return _Look(m1, m0, log_ratio, half_width, (n1 >= MIN_VALUES) & (n0 >= MIN_VALUES))


# ---- one look --------------------------------------------------------------------------------


def _buckets(sample: BucketSums) -> _Sums:
    """One side's sums, the spread taken bucket by bucket."""
    values, total = sum(sample.counts), math.fsum(sample.totals)
    mean = total / values if values else 0.0
    spread = math.fsum((t - mean * c) ** 2 for c, t in zip(sample.counts, sample.totals, strict=True))
    clusters = sum(1 for c in sample.counts if c > 0)
    return _Sums(values, total, math.fsum(sample.squares), clusters, spread)


def estimate(sample: BucketSums) -> Estimate | None:
    """The mean of one side and its cluster-robust variance; None without values."""
    sums = _buckets(sample)
    if sums.values == 0:
        return None
    mean, variance = _side(sums)
    return Estimate(
        mean=float(mean), variance=float(variance), values=int(sums.values), clusters=int(sums.clusters)
    )


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha: {alpha!r} is not a probability in (0, 1); 0.05 is usual")


def sequential_compare(arm: BucketSums, control: BucketSums, alpha: float) -> SequentialTest | None:
    """The mixture SPRT of arm against control at this look; None while either side has fewer
    than MIN_VALUES values. Its p-value is valid at whatever look the caller stops at, so
    `running_p` over looks is too."""
    _check_alpha(alpha)
    look = _mixture(_buckets(arm), _buckets(control), arm.binary and control.binary, alpha)
    if not look.enough:
        return None
    difference = float(look.arm - look.control)
    log_ratio, margin = float(look.log_ratio), float(look.half_width)
    return SequentialTest(
        test=f"mSPRT (normal mixture, tau={MIXTURE_EFFECT_SD:g} sd)",
        control=float(look.control),
        arm=float(look.arm),
        difference=difference,
        low=difference - margin,
        high=difference + margin,
        likelihood_ratio=math.exp(log_ratio) if log_ratio < _LOG_FLOAT_MAX else math.inf,
        p_value=min(1.0, math.exp(-log_ratio)),
    )


# ---- over looks and outcomes -----------------------------------------------------------------


def _check_p(name: str, p: float) -> None:
    if not 0 <= p <= 1:
        raise ValueError(f"{name}: {p!r} is not a p-value in [0, 1]")


def running_p(previous: float | None, now: float) -> float:
    """The always-valid p over every look so far: the least seen. Valid because the test's
    p-value is valid at any stopping time, and stopping at the best look is one."""
    _check_p("now", now)
    if previous is None:
        return now
    _check_p("previous", previous)
    return min(previous, now)


def holm(p_values: Mapping[K, float], alpha: float) -> dict[K, bool]:
    """Holm-Bonferroni step-down over outcomes: which hypotheses are rejected at family-wise
    error `alpha`. The smallest p faces alpha / m, the next alpha / (m - 1), and so on until
    one is not rejected; every later one is kept."""
    _check_alpha(alpha)
    for name, p in p_values.items():
        _check_p(f"p_values[{name!r}]", p)
    ordered = sorted(p_values, key=lambda name: p_values[name])
    rejected = dict.fromkeys(p_values, False)
    for rank, name in enumerate(ordered):
        if p_values[name] > alpha / (len(ordered) - rank):
            break
        rejected[name] = True
    return rejected


def favours(direction: Direction, difference: float) -> bool:
    """True when an arm `difference` (arm - control) is an improvement for an outcome where
    `direction` is better: "higher" (clicks, revenue) or "lower" (latency, errors)."""
    if direction == "higher":
        return difference > 0
    if direction == "lower":
        return difference < 0
    raise ValueError(f"direction: {direction!r} is neither 'higher' nor 'lower'")
