"""Experiments' arithmetic: which arm a unit gets, the signed request ids that carry it, and whether
an arm won (pure; the workflow, the router and the feedback route call it).

- **Assignment.** A unit (a user id, from the request's own `unit` field) gets its arm from a
  hash of the experiment's salt and the unit (`routing.weighted_draw`), so the same user sees
  the same arm for the whole experiment, in every region and across restarts, and the
  assignment is independent of the rollout `key`'s (another salt). It also gets a bucket
  (`unit_bucket`, another salted hash, one of `UNIT_BUCKETS`), where its outcomes are summed.
- **Request ids.** An answer's id names its experiment, arm and unit bucket and when it was
  given, signed with HMAC-SHA256 under the platform's secret:
  `x2.<experiment>.<arm>.<bucket>.<issued s>.<nonce>.<signature>`. Feedback names the id, and
  the outcome is joined to the arm and bucket the id carries, so the join needs no store that
  grows with traffic, and a forged or altered id is refused. Each (id, outcome) is counted once,
  which the experiment's feedback ledger decides (`ipnext.store.feedback_ledger`), and not past
  the feedback window.
- **Significance.** Per arm, the arm's set app's counters (`counters.SetCounters`: requests,
  errors, latency histogram, and each outcome's count, sum and sum of squares, overall and per
  unit bucket, mergeable across routers, regions and continue-as-new). `summarize` tests each
  arm against control with the mixture SPRT over unit buckets (`policy.sequential`): always-valid
  p-values, kept as running minima over the experiment's looks, so a dashboard that looks every
  few seconds does not inflate the error; the winner is decided on outcomes that each declare
  their better direction, Holm-corrected across them. `compare` (two-proportion z, Welch's t)
  is the fixed-horizon test of one look, for comparisons that are not watched.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ipnext.contracts.counters import UNIT_BUCKETS, OutcomeTotals, SetCounters
from ipnext.contracts.experiment import ArmSummary, ExperimentReport, OutcomeComparison, metric_directions
from ipnext.contracts.routing import weighted_draw
from ipnext.policy.sequential import BucketSums, SequentialTest, favours, holm, running_p, sequential_compare

__all__ = [
    "Comparison",
    "RequestId",
    "RequestIdError",
    "assign_arm",
    "bucket_sums",
    "compare",
    "compare_means",
    "compare_rates",
    "comparison_key",
    "new_request_id",
    "read_request_id",
    "render_report",
    "summarize",
    "unit_bucket",
]

REQUEST_ID_VERSION = "x2"
SIGNATURE_HEX = 32  # 128 bits of HMAC-SHA256
CONFIDENCE = 0.95


def assign_arm(split: Mapping[str, float], salt: str, unit: str) -> str:
    """The arm of `unit` under `split` (arm -> percent): sticky for a unit while the split holds."""
    arm = weighted_draw(split, f"experiment:{salt}:{unit}")
    if arm is None:
        raise ValueError(f"split: no arm has a positive share in {dict(split)}")
    return arm


def unit_bucket(salt: str, unit: str) -> int:
    """The unit's bucket (0 to UNIT_BUCKETS - 1): its outcomes are summed with those of the other
    units of the bucket, and buckets are what the statistics take as independent samples (a
    unit's own values are correlated; units are spread over buckets at random)."""
    digest = hashlib.sha256(f"bucket:{salt}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % UNIT_BUCKETS


# ---- request ids -----------------------------------------------------------------------------


class RequestIdError(ValueError):
    """A request id that is not one of ours, or whose signature does not match."""


@dataclass(frozen=True)
class RequestId:
    """What a signed request id carries: the experiment and arm that answered, the bucket of the
    unit it answered, and when (whole seconds of the epoch), so feedback is joined without a
    store and refused once past the feedback window."""

    experiment: str
    arm: str
    bucket: int
    issued_at: int


def _signature(secret: bytes, body: str) -> str:
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()[:SIGNATURE_HEX]


def new_request_id(secret: bytes, experiment: str, arm: str, bucket: int, issued_at: float) -> str:
    """A fresh id for one answer of `experiment`'s `arm` to a unit of `bucket` at `issued_at`
    (names without dots: ipnext names)."""
    if "." in experiment or "." in arm:
        raise ValueError(f"experiment and arm names have no dots: {experiment!r}, {arm!r}")
    if not 0 <= bucket < UNIT_BUCKETS:
        raise ValueError(f"bucket: {bucket} is not in [0, {UNIT_BUCKETS})")
    body = f"{REQUEST_ID_VERSION}.{experiment}.{arm}.{bucket}.{int(issued_at)}.{secrets.token_hex(8)}"
    return f"{body}.{_signature(secret, body)}"


def read_request_id(secret: bytes, request_id: str) -> RequestId:
    """What an id `new_request_id` made with the same secret carries; RequestIdError else (an id
    of the older format, without its unit's bucket, is refused: it cannot be counted per unit)."""
    fields = request_id.split(".")
    if len(fields) != 7 or fields[0] != REQUEST_ID_VERSION:
        raise RequestIdError(f"request_id: not an experiment's request id: {request_id[:80]!r}")
    body, signature = request_id.rsplit(".", 1)
    if not hmac.compare_digest(_signature(secret, body), signature):
        raise RequestIdError(f"request_id: its signature does not match: {request_id[:80]!r}")
    return RequestId(experiment=fields[1], arm=fields[2], bucket=int(fields[3]), issued_at=int(fields[4]))


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


def bucket_sums(totals: OutcomeTotals) -> BucketSums:
    """An outcome's counters as the statistics take them: by unit bucket when every value came
    with one (feedback), else as independent values (a shadow's comparisons, an arm's errors)."""
    if totals.bucketed():
        return BucketSums(
            tuple(totals.bucket_counts),
            tuple(totals.bucket_totals),
            tuple(totals.bucket_squares),
            totals.binary,
        )
    return BucketSums.single(totals.count, totals.total, totals.squares, totals.binary)


def comparison_key(arm: str, outcome: str) -> str:
    """How a comparison is named in the experiment's running minima (`ExperimentState.least_p`)."""
    return f"{arm}/{outcome}"


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
    least_p: Mapping[str, float] | None = None,
) -> ExperimentReport:
    """The report of an experiment from each arm's counters (summed over its run so far).

    Each outcome of each arm is tested against control with the mixture SPRT
    (`policy.sequential`), on unit buckets, so it may be looked at as often as anyone likes; its
    p-value is the least over every look so far (`least_p`, the experiment's running minima,
    updated by the caller from `report.comparisons`). The winner is decided on `metrics`
    (`name:higher|lower`), Holm-corrected over all of them; the other outcomes and the error
    rate are reported, each at `alpha` alone."""
    least = least_p or {}
    directions = {name: d for name, d in metric_directions(list(metrics)).items() if d is not None}
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
    base = arms[control]
    found: dict[tuple[str, str], tuple[SequentialTest, float]] = {}
    for arm, counted in sorted(arms.items()):
        if arm == control:
            continue
        samples = {
            name: (bucket_sums(totals), bucket_sums(base.outcomes.get(name, OutcomeTotals())))
            for name, totals in sorted(counted.outcomes.items())
        }
        errors = OutcomeTotals(count=counted.requests, total=counted.errors, squares=counted.errors)
        base_errors = OutcomeTotals(count=base.requests, total=base.errors, squares=base.errors)
        samples["error_rate"] = (bucket_sums(errors), bucket_sums(base_errors))
        for name, (mine, theirs) in samples.items():
            tested = sequential_compare(mine, theirs, alpha)
            if tested is not None:
                p = running_p(least.get(comparison_key(arm, name)), tested.p_value)
                found[(arm, name)] = (tested, p)
    deciding = {key: p for key, (_, p) in found.items() if key[1] in directions}
    rejected = holm(deciding, alpha) if deciding else {}
    comparisons = []
    for (arm, name), (tested, p) in found.items():
        direction = directions.get(name)
        significant = rejected[(arm, name)] if direction is not None else p < alpha
        comparisons.append(
            OutcomeComparison(
                arm=arm,
                outcome=name,
                test=tested.test,
                control=tested.control,
                value=tested.arm,
                difference=tested.difference,
                low=tested.low,
                high=tested.high,
                p_value=p,
                significant=significant,
                direction=direction,
                better=None if direction is None else significant and favours(direction, tested.difference),  # type: ignore[arg-type]
            )
        )
    return ExperimentReport(
        experiment=experiment,
        model=model,
        control=control,
        alpha=alpha,
        arms=summaries,
        comparisons=comparisons,
        winner=_winner(control, comparisons),
        unit=unit,
        metrics=list(metrics),
        method=(
            f"always-valid p-values of the mixture SPRT (Johari et al. 2022) on {UNIT_BUCKETS} unit "
            f"buckets; the winner's {len(directions)} outcome(s) Holm-corrected at alpha {alpha:g}"
        ),
    )


def _winner(control: str, comparisons: list[OutcomeComparison]) -> str | None:
    verdicts: dict[str, set[bool]] = {}
    for c in comparisons:
        if c.direction is not None and c.significant:
            verdicts.setdefault(c.arm, set()).add(bool(c.better))
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
        "better",
        "difference",
        f"{1 - report.alpha:.0%} interval (this look)",
        "p (always valid)",
        "significant",
        "verdict",
    ]
    rows = [
        [
            c.arm,
            c.outcome,
            c.direction or ("lower" if c.outcome == "error_rate" else "-"),
            f"{c.difference:+.4g}",
            f"[{c.low:+.4g}, {c.high:+.4g}]",
            f"{c.p_value:.3g}",
            "yes" if c.significant else "no",
            _verdict(c),
        ]
        for c in report.comparisons
    ]
    lines += _table(header, rows)
    undecided = (
        "none yet (no arm differs significantly and consistently on the deciding outcomes)"
        if report.metrics
        else "none called (no --metric named an outcome and its direction)"
    )
    lines += ["", f"winner: {report.winner or undecided}"]
    if report.method:
        lines.append(f"method: {report.method}")
    return "\n".join(lines)


def _verdict(c: OutcomeComparison) -> str:
    if c.direction is None:
        return "reported" if c.outcome != "error_rate" else "guardrail"
    if not c.significant:
        return "no difference yet"
    return "arm better" if c.better else "arm worse"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
