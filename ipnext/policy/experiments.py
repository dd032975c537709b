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
- **Significance.** Per arm, the arm's set app's counters (`counters.SetCounters`: requests,
  errors, latency histogram, and each outcome's count, sum and sum of squares, mergeable across
  routers, regions and continue-as-new). An outcome whose values are all 0 or 1 is a
  rate: two-proportion z-test (pooled for the p-value, unpooled for the interval); any other is a
  mean: Welch's t-test with Welch-Satterthwaite degrees of freedom. Both give the difference
  (arm minus control), its 95% confidence interval and a two-sided p-value.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ipnext.contracts.counters import OutcomeTotals, SetCounters
from ipnext.contracts.experiment import ArmSummary, ExperimentReport, OutcomeComparison
from ipnext.contracts.routing import weighted_draw

__all__ = [
    "Comparison",
    "RequestIdError",
    "assign_arm",
    "compare",
    "compare_means",
    "compare_rates",
    "new_request_id",
    "read_request_id",
    "render_report",
    "summarize",
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


# ---- the report ------------------------------------------------------------------------------


def summarize(
    experiment: str,
    model: str,
    control: str,
    arms: Mapping[str, SetCounters],
    sets: Mapping[str, str],
    alpha: float = 0.01,
    *,
    unit: str = "user",
    metrics: Sequence[str] = (),
) -> ExperimentReport:
    """The report of an experiment from each arm's counters (summed over its run so far); the
    winner is decided on `metrics` (every outcome when none is named)."""
    summaries = [
        ArmSummary(
            arm=arm,
            set_id=sets[arm],
            requests=counted.requests,
            errors=counted.errors,
            error_rate=counted.errors / counted.requests if counted.requests else None,
            latency_p50_ms=counted.quantile_ms("latency_ms", 0.5),
            latency_p99_ms=counted.quantile_ms("latency_ms", 0.99),
            outcomes={name: (t.count, t.mean()) for name, t in sorted(counted.outcomes.items())},
        )
        for arm, counted in sorted(arms.items(), key=lambda item: (item[0] != control, item[0]))
    ]
    comparisons: list[OutcomeComparison] = []
    base = arms[control]
    for arm, counted in sorted(arms.items()):
        if arm == control:
            continue
        tests = {
            name: compare(totals, base.outcomes.get(name, OutcomeTotals()))
            for name, totals in sorted(counted.outcomes.items())
        }
        tests["error_rate"] = compare_rates(counted.errors, counted.requests, base.errors, base.requests)
        for name, found in tests.items():
            if found is not None:
                comparisons.append(
                    OutcomeComparison(
                        arm=arm,
                        outcome=name,
                        test=found.test,
                        control=found.control,
                        value=found.arm,
                        difference=found.difference,
                        low=found.low,
                        high=found.high,
                        p_value=found.p_value,
                        significant=found.p_value < alpha,
                    )
                )
    return ExperimentReport(
        experiment=experiment,
        model=model,
        control=control,
        alpha=alpha,
        arms=summaries,
        comparisons=comparisons,
        winner=_winner(control, comparisons, metrics),
        unit=unit,
        metrics=list(metrics),
    )


def _winner(control: str, comparisons: list[OutcomeComparison], metrics: Sequence[str] = ()) -> str | None:
    verdicts: dict[str, set[bool]] = {}
    for c in comparisons:
        if c.significant and c.outcome != "error_rate" and (not metrics or c.outcome in metrics):
            verdicts.setdefault(c.arm, set()).add(c.difference > 0)
    better = [arm for arm, signs in verdicts.items() if signs == {True}]
    worse = [arm for arm, signs in verdicts.items() if signs == {False}]
    if len(better) == 1:
        return better[0]
    if not better and worse and len(worse) == len(verdicts):
        return control  # every arm that differs is worse
    return None


def render_report(report: ExperimentReport) -> str:
    """The report as `ipnext experiment report` prints it: one row per arm, one per comparison."""

    def number(value: float | None, digits: int = 4) -> str:
        return "-" if value is None else f"{value:.{digits}g}"

    decided = f"; the winner decided on {', '.join(report.metrics)}" if report.metrics else ""
    lines = [
        f"experiment {report.experiment} of {report.model} (control: {report.control}; "
        f"arms assigned per {report.unit}{decided})",
        "",
    ]
    names = sorted({n for a in report.arms for n in a.outcomes})
    header = ["arm", "set", "requests", "error rate", "p50 ms", "p99 ms", *(f"{n} (n, mean)" for n in names)]
    rows = [
        [
            a.arm,
            a.set_id,
            str(a.requests),
            number(a.error_rate),
            number(a.latency_p50_ms),
            number(a.latency_p99_ms),
            *(f"{a.outcomes[n][0]}, {number(a.outcomes[n][1])}" if n in a.outcomes else "-" for n in names),
        ]
        for a in report.arms
    ]
    lines += _table(header, rows)
    lines.append("")
    header = [
        "arm",
        "outcome",
        "test",
        "difference",
        f"{CONFIDENCE:.0%} interval",
        "p",
        f"p < {report.alpha:g}",
    ]
    rows = [
        [
            c.arm,
            c.outcome,
            c.test,
            f"{c.difference:+.4g}",
            f"[{c.low:+.4g}, {c.high:+.4g}]",
            f"{c.p_value:.3g}",
            "yes" if c.significant else "no",
        ]
        for c in report.comparisons
    ]
    lines += _table(header, rows)
    lines += ["", f"winner: {report.winner or 'none yet (no arm differs significantly and consistently)'}"]
    return "\n".join(lines)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
