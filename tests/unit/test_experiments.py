"""Experiments' arithmetic: sticky assignment, signed request ids, totals, and the significance
tests against scipy's own (Welch's t-test, and the chi-square test that the z-test squares to)."""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from ipnext.contracts.counters import UNIT_BUCKETS, SetCounters
from ipnext.policy.experiments import (
    OutcomeTotals,
    RequestId,
    RequestIdError,
    assign_arm,
    compare,
    compare_means,
    compare_rates,
    new_request_id,
    read_request_id,
    render_report,
    summarize,
    unit_bucket,
)
from ipnext.policy.sequential import holm

SECRET = b"s" * 32


def totals(values: list[float]) -> OutcomeTotals:
    out = OutcomeTotals()
    for v in values:
        out = out.add(v)
    return out


def test_assignment_is_sticky_split_as_asked_and_salted() -> None:
    split = {"control": 50.0, "treatment": 50.0}
    users = [str(u) for u in range(20_000)]
    first = {u: assign_arm(split, "salt-a", u) for u in users}
    assert all(assign_arm(split, "salt-a", u) == arm for u, arm in first.items())  # sticky
    share = Counter(first.values())["treatment"] / len(users)
    assert abs(share - 0.5) < 0.02, share
    other = {u: assign_arm(split, "salt-b", u) for u in users}
    moved = sum(first[u] != other[u] for u in users) / len(users)
    assert abs(moved - 0.5) < 0.03, moved  # another experiment's salt assigns independently
    uneven = Counter(assign_arm({"control": 90.0, "treatment": 10.0}, "salt-a", u) for u in users)
    assert abs(uneven["treatment"] / len(users) - 0.10) < 0.01, uneven
    with pytest.raises(ValueError, match=r"^split: no arm has a positive share"):
        assign_arm({"control": 0.0}, "s", "1")


def test_request_ids_carry_their_arm_bucket_and_time_and_refuse_tampering() -> None:
    request_id = new_request_id(SECRET, "exp-1", "treatment", 17, 1_765_000_000.7)
    assert read_request_id(SECRET, request_id) == RequestId("exp-1", "treatment", 17, 1_765_000_000)
    assert new_request_id(SECRET, "exp-1", "treatment", 17, 1_765_000_000.7) != request_id  # a nonce each
    forged = request_id.replace(".treatment.", ".control.")
    for bad, why in (
        (forged, "its signature does not match"),
        (request_id.replace(".17.", ".18."), "its signature does not match"),  # another unit's bucket
        (request_id.replace(".1765000000.", ".1865000000."), "its signature does not match"),  # later
        (request_id[:-1] + ("0" if request_id[-1] != "0" else "1"), "its signature does not match"),
        ("req-123", "not an experiment's request id"),
        ("x1" + request_id[2:], "not an experiment's request id"),
        ("x1.exp-1.control.00aa.11", "not an experiment's request id"),  # the old format: no bucket
    ):
        with pytest.raises(RequestIdError, match=why):
            read_request_id(SECRET, bad)
    with pytest.raises(RequestIdError, match="signature"):
        read_request_id(b"another secret", request_id)
    with pytest.raises(ValueError, match="no dots"):
        new_request_id(SECRET, "exp.1", "control", 0, 0.0)
    with pytest.raises(ValueError, match=r"bucket: 64 is not in \[0, 64\)"):
        new_request_id(SECRET, "exp-1", "control", 64, 0.0)


def test_units_spread_evenly_over_the_buckets_and_keep_theirs() -> None:
    buckets = Counter(unit_bucket("salt-a", str(u)) for u in range(64_000))
    assert set(buckets) == set(range(UNIT_BUCKETS))
    assert max(buckets.values()) < 1.1 * 1000 and min(buckets.values()) > 0.9 * 1000
    assert unit_bucket("salt-a", "42") == unit_bucket("salt-a", "42")
    assert [unit_bucket("salt-b", str(u)) for u in range(50)] != [
        unit_bucket("salt-a", str(u)) for u in range(50)
    ]


def test_totals_add_and_merge_to_the_same_as_all_at_once() -> None:
    rng = random.Random(3)
    values = [rng.gauss(5, 2) for _ in range(300)]
    whole = totals(values)
    halves = totals(values[:120]).merged(totals(values[120:]))
    assert halves.count == whole.count == 300 and not whole.binary
    assert math.isclose(halves.total, whole.total) and math.isclose(halves.squares, whole.squares)
    assert math.isclose(whole.variance() or 0, statistics.variance(values), rel_tol=1e-9)
    assert totals([1, 0, 1]).binary and not totals([1, 0, 2]).binary
    assert totals([3.0]).variance() is None and OutcomeTotals().mean() is None
    with pytest.raises(ValueError, match="finite"):
        OutcomeTotals().add(float("nan"))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    st.lists(st.floats(-100, 100), min_size=2, max_size=60),
    st.lists(st.floats(-100, 100), min_size=2, max_size=60),
)
def test_welch_matches_scipy(arm: list[float], control: list[float]) -> None:
    got = compare_means(totals(arm), totals(control))
    assert got is not None
    if statistics.variance(arm) < 1e-9 or statistics.variance(control) < 1e-9:
        return  # scipy answers nan there; ours says certain or none (below)
    want = stats.ttest_ind(arm, control, equal_var=False)
    interval = want.confidence_interval(0.95)
    assert got.statistic == pytest.approx(want.statistic, rel=1e-6, abs=1e-9)
    assert got.p_value == pytest.approx(want.pvalue, rel=1e-6, abs=1e-12)
    assert got.degrees_of_freedom == pytest.approx(want.df, rel=1e-6)
    assert (got.low, got.high) == (
        pytest.approx(interval.low, abs=1e-6),
        pytest.approx(interval.high, abs=1e-6),
    )
    assert got.difference == pytest.approx(statistics.fmean(arm) - statistics.fmean(control), abs=1e-9)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.integers(1, 5000), st.integers(1, 5000), st.data())
def test_the_rate_test_is_scipys_chi_square_without_correction(n1: int, n0: int, data: st.DataObject) -> None:
    x1 = data.draw(st.integers(0, n1))
    x0 = data.draw(st.integers(0, n0))
    got = compare_rates(x1, n1, x0, n0)
    assert got is not None and got.difference == pytest.approx(x1 / n1 - x0 / n0)
    if x1 + x0 in (0, n1 + n0):
        assert (got.statistic, got.p_value) == (0.0, 1.0)
        return
    chi2, p, _, _ = stats.chi2_contingency([[x1, n1 - x1], [x0, n0 - x0]], correction=False)
    assert got.statistic**2 == pytest.approx(chi2, rel=1e-6)
    assert got.p_value == pytest.approx(p, rel=1e-6, abs=1e-300)
    p1, p0 = x1 / n1, x0 / n0
    margin = stats.norm.ppf(0.975) * math.sqrt(p1 * (1 - p1) / n1 + p0 * (1 - p0) / n0)
    assert (got.low, got.high) == (
        pytest.approx(got.difference - margin),
        pytest.approx(got.difference + margin),
    )


def test_compare_picks_the_test_by_the_values() -> None:
    clicks = compare(totals([1, 0, 1, 1]), totals([0, 0, 1, 0]))
    assert clicks is not None and clicks.test == "two-proportion z"
    dwell = compare(totals([1.5, 2.0, 3.0]), totals([1.0, 1.2, 0.9]))
    assert dwell is not None and dwell.test == "welch t"
    assert compare(totals([1.0]), totals([2.0, 3.0])) is None  # too few values for a variance
    assert compare_rates(0, 0, 1, 2) is None
    same = compare_means(totals([2.0, 2.0]), totals([2.0, 2.0]))
    assert same is not None and (same.p_value, same.statistic) == (1.0, 0.0)
    apart = compare_means(totals([3.0, 3.0]), totals([2.0, 2.0]))
    assert apart is not None and apart.p_value == 0.0 and apart.statistic == math.inf


def test_a_real_difference_is_found_and_none_is_not() -> None:
    rng = random.Random(11)
    better = totals([float(rng.random() < 0.30) for _ in range(4000)])
    worse = totals([float(rng.random() < 0.25) for _ in range(4000)])
    same = totals([float(rng.random() < 0.25) for _ in range(4000)])
    found = compare(better, worse)
    assert found is not None and found.p_value < 0.01 and found.low > 0
    null = compare(same, worse)
    assert null is not None and null.p_value > 0.01 and null.low < 0 < null.high


def arm_counters(rate: float, n: int, seed: int, errors: int = 0) -> SetCounters:
    rng = random.Random(seed)
    counted = SetCounters(
        requests=n, errors=errors, outcomes={"click": totals([float(rng.random() < rate) for _ in range(n)])}
    )
    for _ in range(n):
        counted.observe("latency_ms", 5 + rng.random())
    return counted


def test_the_report_names_the_better_arm_and_prints_a_table() -> None:
    arms = {"control": arm_counters(0.20, 3000, 1), "treatment": arm_counters(0.26, 3000, 2, errors=3)}
    sets = {"control": "m@1", "treatment": "m@2"}
    report = summarize("exp-1", "feed-ranker", "control", arms, sets, metrics=["click:higher"])
    assert [a.arm for a in report.arms] == ["control", "treatment"]  # control first
    (clicks,) = [c for c in report.comparisons if c.outcome == "click"]
    assert clicks.test.startswith("mSPRT") and clicks.significant and clicks.difference > 0 and clicks.better
    (errors,) = [c for c in report.comparisons if c.outcome == "error_rate"]
    assert errors.value == pytest.approx(3 / 3000) and errors.control == 0 and errors.direction is None
    assert report.winner == "treatment"
    text = render_report(report)
    assert "experiment exp-1 of feed-ranker (control: control; arms assigned per user" in text
    assert "winner: treatment" in text and "arm better" in text and "99% interval (this look)" in text
    assert "method: always-valid p-values of the mixture SPRT (Johari et al. 2022)" in text
    row = next(line for line in text.splitlines() if line.startswith("treatment  m@2"))
    assert "3000" in row and "0.001" in row  # requests and error rate
    print(text)


def test_no_winner_without_evidence_or_directions_and_control_when_every_arm_is_worse() -> None:
    sets = {"control": "m@1", "b": "m@2"}
    same = {"control": arm_counters(0.2, 2000, 1), "b": arm_counters(0.2, 2000, 2)}
    report = summarize("exp-2", "m", "control", same, sets, metrics=["click:higher"])
    assert report.winner is None and "winner: none yet" in render_report(report)
    worse = {"control": arm_counters(0.3, 3000, 1), "b": arm_counters(0.2, 3000, 2)}
    assert summarize("exp-3", "m", "control", worse, sets, metrics=["click:higher"]).winner == "control"
    undecided = summarize("exp-3", "m", "control", worse, sets)  # no outcome says which way is better
    assert undecided.winner is None and "winner: none called" in render_report(undecided)
    assert [c.significant for c in undecided.comparisons if c.outcome == "click"] == [True]  # reported


def test_a_lower_is_better_outcome_is_called_the_right_way() -> None:
    """The old rule took bigger as better for every outcome: a treatment with lower latency lost."""
    rng = random.Random(3)

    def latencies(mean: float, seed: int) -> SetCounters:
        rng.seed(seed)
        values = [rng.gauss(mean, 20.0) for _ in range(2000)]
        outcome = OutcomeTotals()
        for unit, value in enumerate(values):
            outcome = outcome.add(value, bucket=unit % UNIT_BUCKETS)
        return SetCounters(requests=2000, outcomes={"latency_ms": outcome})

    arms = {"control": latencies(100.0, 1), "treatment": latencies(90.0, 2)}
    sets = {"control": "m@1", "treatment": "m@2"}
    lower = summarize("e", "m", "control", arms, sets, metrics=["latency_ms:lower"])
    assert lower.winner == "treatment"
    (latency,) = lower.comparisons[:1]
    assert latency.difference < 0 and latency.better and latency.direction == "lower"
    assert summarize("e", "m", "control", arms, sets, metrics=["latency_ms:higher"]).winner == "control"


def test_the_drill_a_clear_loss_stays_significant_and_the_p_value_only_falls_over_looks() -> None:
    """The issue's case once each id counts once: 0 of 19 clicks against 21 of 21, one unit each."""

    def clicks(values: list[float], salt: str) -> SetCounters:
        outcome = OutcomeTotals()
        for unit, value in enumerate(values):
            outcome = outcome.add(value, bucket=unit_bucket(salt, str(unit)))
        return SetCounters(requests=len(values), outcomes={"click": outcome})

    arms = {"control": clicks([1.0] * 21, "a"), "treatment": clicks([0.0] * 19, "b")}
    sets = {"control": "m@1", "treatment": "m@2"}
    report = summarize("e", "m", "control", arms, sets, metrics=["click:higher"])
    (click,) = [c for c in report.comparisons if c.outcome == "click"]
    assert click.p_value < 0.01 and click.significant and not click.better and report.winner == "control"
    # A later look with weaker evidence cannot take back what an earlier look found.
    later = summarize(
        "e", "m", "control", arms, sets, metrics=["click:higher"], least_p={"treatment/click": 1e-6}
    )
    assert [c.p_value for c in later.comparisons if c.outcome == "click"] == [1e-6]


def test_several_deciding_outcomes_are_corrected_together() -> None:
    """Holm over the deciding outcomes: an outcome significant alone at alpha is not, among three."""
    rng = random.Random(9)

    def counters(rates: dict[str, float], seed: int) -> SetCounters:
        rng.seed(seed)
        outcomes = {}
        for name, rate in rates.items():
            outcome = OutcomeTotals()
            for unit in range(3000):
                outcome = outcome.add(float(rng.random() < rate), bucket=unit % UNIT_BUCKETS)
            outcomes[name] = outcome
        return SetCounters(requests=3000, outcomes=outcomes)

    arms = {
        "control": counters({"a": 0.20, "b": 0.20, "c": 0.20}, 1),
        "treatment": counters({"a": 0.20, "b": 0.20, "c": 0.20}, 2),
    }
    sets = {"control": "m@1", "treatment": "m@2"}
    alone = summarize("e", "m", "control", arms, sets, alpha=0.5, metrics=["a:higher"])
    together = summarize(
        "e", "m", "control", arms, sets, alpha=0.5, metrics=["a:higher", "b:higher", "c:higher"]
    )
    p = {c.outcome: c.p_value for c in together.comparisons}
    decided = {c.outcome: c.significant for c in together.comparisons if c.direction}
    expected = holm({n: p[n] for n in "abc"}, 0.5)
    assert decided == expected
    assert {c.outcome: c.significant for c in alone.comparisons if c.direction} == {"a": p["a"] < 0.5}


def test_named_metrics_alone_decide_the_winner_and_the_report_says_so() -> None:
    """Treatment: more clicks, fewer purchases. Decided on both the evidence points both ways (no
    winner); decided on clicks it wins, on purchases control does; the table shows all outcomes."""
    rng = random.Random(5)

    def counters(click: float, buy: float, seed: int) -> SetCounters:
        rng.seed(seed)
        return SetCounters(
            requests=3000,
            outcomes={
                "click": totals([float(rng.random() < click) for _ in range(3000)]),
                "purchase": totals([float(rng.random() < buy) for _ in range(3000)]),
            },
        )

    arms = {"control": counters(0.20, 0.10, 1), "treatment": counters(0.26, 0.05, 2)}
    sets = {"control": "m@1", "treatment": "m@2"}
    both = ["click:higher", "purchase:higher"]
    assert summarize("e", "m", "control", arms, sets, metrics=both).winner is None
    on_clicks = summarize("e", "m", "control", arms, sets, unit="session", metrics=["click:higher"])
    assert on_clicks.winner == "treatment" and on_clicks.metrics == ["click:higher"]
    assert summarize("e", "m", "control", arms, sets, metrics=["purchase:higher"]).winner == "control"
    text = render_report(on_clicks)
    assert "arms assigned per session; the winner decided on click:higher" in text, text
    assert "purchase (n, mean)" in text  # still reported
