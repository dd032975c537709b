"""Experiments' arithmetic: which arm a unit gets, the signed request ids that carry it, and whether
an arm won (pure; the workflow, the router and the feedback route call it).

- **Assignment.** A unit (a user id, from the request's own `unit` field) gets its arm from a
  hash of the experiment's salt and the unit (`routing.weighted_draw`), so the same user sees
  the same arm for the whole experiment, in every region and across restarts, and the
  assignment is independent of the rollout `key`'s (another salt).
- **Request ids.** An answer's id names its experiment and arm, signed with HMAC-SHA256 under the
  platform's secret: `x1.<experiment>.<arm>.<nonce>.<signature>`. Feedback names the id, and the
  outcome is joined to the arm the id carries, so the join needs no store that grows with
  traffic, and a forged or altered id is refused.
- **Significance.** Per arm, requests, errors and each outcome's count, sum and sum of squares
  (mergeable across routers and continue-as-new). An outcome whose values are all 0 or 1 is a
  rate: two-proportion z-test (pooled for the p-value, unpooled for the interval); any other is a
  mean: Welch's t-test with Welch-Satterthwaite degrees of freedom. Both give the difference
  (arm minus control), its 95% confidence interval and a two-sided p-value.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from pydantic import Field

from ipnext.contracts import Frozen
from ipnext.routing import weighted_draw

__all__ = [
    "ArmTotals",
    "Comparison",
    "OutcomeTotals",
    "RequestIdError",
    "assign_arm",
    "compare",
    "compare_means",
    "compare_rates",
    "new_request_id",
    "read_request_id",
]

REQUEST_ID_VERSION = "x1"
SIGNATURE_HEX = 32  # 128 bits of HMAC-SHA256
CONFIDENCE = 0.95


def assign_arm(split: Mapping[str, float], salt: str, unit: str) -> str:
    """The arm of `unit` under `split` (arm -> percent): sticky for a unit while the split holds."""
    arm = weighted_draw(split, f"experiment:{salt}:{unit}")
    if arm is None:
        raise ValueError(f"split: no arm has a positive share in {dict(split)}")
    return arm


# ---- request ids -----------------------------------------------------------------------------


class RequestIdError(ValueError):
    """A request id that is not one of ours, or whose signature does not match."""


def _signature(secret: bytes, body: str) -> str:
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()[:SIGNATURE_HEX]


def new_request_id(secret: bytes, experiment: str, arm: str) -> str:
    """A fresh id for one answer of `experiment`'s `arm` (names without dots: ipnext names)."""
    if "." in experiment or "." in arm:
        raise ValueError(f"experiment and arm names have no dots: {experiment!r}, {arm!r}")
    body = f"{REQUEST_ID_VERSION}.{experiment}.{arm}.{secrets.token_hex(8)}"
    return f"{body}.{_signature(secret, body)}"


def read_request_id(secret: bytes, request_id: str) -> tuple[str, str]:
    """(experiment, arm) of an id `new_request_id` made with the same secret; RequestIdError else."""
    fields = request_id.split(".")
    if len(fields) != 5 or fields[0] != REQUEST_ID_VERSION:
        raise RequestIdError(f"request_id: not an experiment's request id: {request_id[:80]!r}")
    body, signature = request_id.rsplit(".", 1)
    if not hmac.compare_digest(_signature(secret, body), signature):
        raise RequestIdError(f"request_id: its signature does not match: {request_id[:80]!r}")
    return fields[1], fields[2]


# ---- totals ----------------------------------------------------------------------------------


class OutcomeTotals(Frozen):
    """One outcome of one arm: how many values, their sum and sum of squares, and whether every
    value was 0 or 1 (a rate)."""

    count: int = 0
    total: float = 0.0
    squares: float = 0.0
    binary: bool = True

    def add(self, value: float) -> OutcomeTotals:
        if not math.isfinite(value):
            raise ValueError(f"outcome: a finite number, got {value!r}")
        return OutcomeTotals(
            count=self.count + 1,
            total=self.total + value,
            squares=self.squares + value * value,
            binary=self.binary and value in (0.0, 1.0),
        )

    def minus(self, earlier: OutcomeTotals) -> OutcomeTotals:
        """What was added since `earlier` (cumulative totals, as counters are diffed)."""
        return OutcomeTotals(
            count=self.count - earlier.count,
            total=self.total - earlier.total,
            squares=self.squares - earlier.squares,
            binary=self.binary,
        )

    def merged(self, other: OutcomeTotals) -> OutcomeTotals:
        return OutcomeTotals(
            count=self.count + other.count,
            total=self.total + other.total,
            squares=self.squares + other.squares,
            binary=self.binary and other.binary,
        )

    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def variance(self) -> float | None:
        """The sample variance (n - 1), None under two values."""
        if self.count < 2:
            return None
        mean = self.total / self.count
        return max(0.0, (self.squares - self.count * mean * mean) / (self.count - 1))


class ArmTotals(Frozen):
    """What one arm served and was told: requests, failed ones, outcomes by name."""

    requests: int = 0
    errors: int = 0
    outcomes: dict[str, OutcomeTotals] = Field(default_factory=dict)

    def merged(self, other: ArmTotals) -> ArmTotals:
        names = sorted(set(self.outcomes) | set(other.outcomes))
        return ArmTotals(
            requests=self.requests + other.requests,
            errors=self.errors + other.errors,
            outcomes={
                n: self.outcomes.get(n, OutcomeTotals()).merged(other.outcomes.get(n, OutcomeTotals()))
                for n in names
            },
        )

    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None


# ---- significance ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """An arm against control on one measure: the difference (arm - control), its confidence
    interval, the statistic, the two-sided p-value, and which test gave them."""

    test: str  # "two-proportion z" or "welch t"
    control: float
    arm: float
    difference: float
    low: float
    high: float
    statistic: float
    p_value: float
    degrees_of_freedom: float | None = None


def _z(confidence: float) -> float:
    from scipy import special  # here: routers and workflows import this module, not the tests

    return math.sqrt(2) * float(special.erfinv(confidence))


def compare_rates(
    successes: int, trials: int, control_successes: int, control_trials: int, confidence: float = CONFIDENCE
) -> Comparison | None:
    """Two-proportion z-test of arm against control; None without trials on both sides."""
    from scipy import special

    if trials <= 0 or control_trials <= 0:
        return None
    p1, p0 = successes / trials, control_successes / control_trials
    pooled = (successes + control_successes) / (trials + control_trials)
    spread = math.sqrt(pooled * (1 - pooled) * (1 / trials + 1 / control_trials))
    difference = p1 - p0
    if spread == 0:  # both all 0 or all 1: no evidence of a difference either way
        statistic, p_value = 0.0, 1.0
    else:
        statistic = difference / spread
        p_value = float(special.erfc(abs(statistic) / math.sqrt(2)))
    error = math.sqrt(p1 * (1 - p1) / trials + p0 * (1 - p0) / control_trials)
    margin = _z(confidence) * error
    return Comparison(
        test="two-proportion z",
        control=p0,
        arm=p1,
        difference=difference,
        low=difference - margin,
        high=difference + margin,
        statistic=statistic,
        p_value=p_value,
    )


def compare_means(
    arm: OutcomeTotals, control: OutcomeTotals, confidence: float = CONFIDENCE
) -> Comparison | None:
    """Welch's t-test of arm against control; None under two values on either side."""
    from scipy import special

    v1, v0 = arm.variance(), control.variance()
    m1, m0 = arm.mean(), control.mean()
    if v1 is None or v0 is None or m1 is None or m0 is None:
        return None
    s1, s0 = v1 / arm.count, v0 / control.count
    difference = m1 - m0
    error = math.sqrt(s1 + s0)
    if error == 0:  # no spread on either side: the difference is certain, or there is none
        certain = difference != 0
        return Comparison(
            test="welch t",
            control=m0,
            arm=m1,
            difference=difference,
            low=difference,
            high=difference,
            statistic=math.copysign(math.inf, difference) if certain else 0.0,
            p_value=0.0 if certain else 1.0,
        )
    df = (s1 + s0) ** 2 / (s1**2 / (arm.count - 1) + s0**2 / (control.count - 1))
    statistic = difference / error
    p_value = 2 * float(special.stdtr(df, -abs(statistic)))
    margin = float(special.stdtrit(df, (1 + confidence) / 2)) * error
    return Comparison(
        test="welch t",
        control=m0,
        arm=m1,
        difference=difference,
        low=difference - margin,
        high=difference + margin,
        statistic=statistic,
        p_value=p_value,
        degrees_of_freedom=df,
    )


def compare(arm: OutcomeTotals, control: OutcomeTotals, confidence: float = CONFIDENCE) -> Comparison | None:
    """The test an outcome calls for: a rate when every value on both sides was 0 or 1, else a mean."""
    if arm.binary and control.binary:
        return compare_rates(round(arm.total), arm.count, round(control.total), control.count, confidence)
    return compare_means(arm, control, confidence)
