"""Shadow traffic without Ray: the comparison of two answers (Spearman against scipy's), the
summary of a candidate's counters, and a router's mirror (bounded, never holding the caller,
failures and hangs counted as the candidate's)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import spearmanr

from ipnext.contracts.counters import OutcomeTotals, SetCounters
from ipnext.contracts.router import RouterConfig, ShadowRoute
from ipnext.names import poll_until
from ipnext.policy.shadow import (
    DROPPED,
    compare_answers,
    flat_numbers,
    rank_correlation,
    render_shadow,
    summarize_shadow,
    top_k_overlap,
)
from ipnext.serving.shadow_mirror import ShadowMirror

pytestmark = pytest.mark.timeout(60)

SETTLE_S = 30.0  # how long a test waits for the mirrored requests to end (a loaded CI box)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=2, max_size=30))
def test_rank_correlation_is_spearmans_with_ties_averaged(pairs: list[tuple[int, int]]) -> None:
    a, b = [float(x) for x, _ in pairs], [float(y) for _, y in pairs]
    ours = rank_correlation(a, b)
    if len(set(a)) == 1 or len(set(b)) == 1:  # scipy answers nan: no ranking to correlate
        assert ours == (1.0 if len(set(a)) == len(set(b)) == 1 else 0.0)
    else:
        assert ours == pytest.approx(spearmanr(a, b).statistic, abs=1e-12)


def test_top_k_overlap_counts_the_served_top_k_the_candidate_keeps() -> None:
    served = [0.9, 0.8, 0.7, 0.1]
    assert top_k_overlap(served, [0.1, 0.8, 0.7, 0.9], k=3) == pytest.approx(2 / 3)
    assert top_k_overlap(served, served, k=3) == 1.0
    assert top_k_overlap(served, [0.0, 0.0, 0.1, 0.9], k=1) == 0.0
    assert top_k_overlap([0.2, 0.1, 0.0], [0.0, 0.1, 0.2], k=2) == 0.5
    assert top_k_overlap([0.2, 0.1], [0.1, 0.2], k=10) == 1.0  # k cut to the 2 items: both kept
    with pytest.raises(ValueError, match="one length"):
        top_k_overlap([1.0], [1.0, 2.0], k=1)


def test_a_comparison_is_the_largest_difference_and_for_rankings_their_agreement() -> None:
    same = compare_answers([0.5, 0.25, 0.125], [0.5, 0.25, 0.125], top_k=2)
    assert same == {
        "shadow.mismatch": 0.0,
        "shadow.max_abs_diff": 0.0,
        "shadow.differs": 0.0,
        "shadow.rank_correlation": 1.0,
        "shadow.top_k_overlap": 1.0,
    }
    moved = compare_answers([0.5, 0.25, 0.125], [0.125, 0.25, 0.5], top_k=1)
    assert moved["shadow.max_abs_diff"] == 0.375 and moved["shadow.differs"] == 1.0
    assert moved["shadow.rank_correlation"] == -1.0 and moved["shadow.top_k_overlap"] == 0.0
    # Not a ranking (one number; nested): the difference only.
    assert compare_answers(1.0, 1.5, 3) == {
        "shadow.mismatch": 0.0,
        "shadow.max_abs_diff": 0.5,
        "shadow.differs": 1.0,
    }
    nested = compare_answers({"b": [1, 2], "a": 3}, {"a": 3, "b": [1, 2.25]}, 3)
    assert nested["shadow.max_abs_diff"] == 0.25 and "shadow.rank_correlation" not in nested
    # Another shape, text, a non-finite number: a mismatch, no difference recorded.
    for a, b in (([1, 2], [1, 2, 3]), ("yes", "yes"), ([1.0], [float("nan")]), ({"a": 1}, {"b": 1})):
        assert compare_answers(a, b, 3) == {"shadow.mismatch": 1.0, "shadow.differs": 1.0}, (a, b)
    assert flat_numbers([True]) is None and flat_numbers([[1], {"x": 2}]) == [1.0, 2.0]


def test_a_summary_reads_the_candidates_counters() -> None:
    counters = SetCounters(requests=4, errors=1)
    for latency in (5.0, 6.0, 7.0):
        counters.observe("latency_ms", latency)
    for outcomes in (
        compare_answers([0.5, 0.25], [0.5, 0.25], 1),
        compare_answers([0.5, 0.25], [0.25, 0.5], 1),
        compare_answers([0.5, 0.25], [0.5], 1),
    ):
        for name, value in {DROPPED: 0.0, **outcomes}.items():
            counters.outcomes[name] = counters.outcomes.get(name, OutcomeTotals()).add(value)
    counters.outcomes[DROPPED] = counters.outcomes[DROPPED].add(1.0).add(0.0)  # one dropped, one failed
    summary = summarize_shadow(counters)
    assert (summary.mirrored, summary.dropped, summary.compared, summary.mismatched) == (5, 1, 3, 1)
    assert (summary.candidate_requests, summary.candidate_errors) == (4, 1)
    assert summary.differing == pytest.approx(2 / 3) and summary.max_abs_diff_mean == pytest.approx(0.125)
    assert summary.rank_correlation_mean == 0.0 and summary.top_k_overlap_mean == 0.5
    assert summary.candidate_p50_ms is not None and 5.0 <= summary.candidate_p50_ms <= 7.0
    line = render_shadow(summary)
    assert "5 mirrored, 1 dropped, 3 compared (1 of another shape)" in line and "rank correlation 0" in line
    assert summarize_shadow(SetCounters()).compared == 0 and "-" in render_shadow(
        summarize_shadow(SetCounters())
    )


def test_a_shadow_app_is_reached_but_never_weighted() -> None:
    route = ShadowRoute(shadow="s1", app="m.us-east.s2.r1", percent=50)
    config = RouterConfig(generation=1, weights={"m.us-east.s1.r1": 100.0}, shadow=route)
    assert config.apps() == {"m.us-east.s1.r1", "m.us-east.s2.r1"}
    with pytest.raises(ValueError, match="percent"):
        ShadowRoute(shadow="s1", app="a", percent=0)


class _Recorder:
    def __init__(self) -> None:
        self.counted: list[tuple[str, float | None]] = []
        self.noted: list[tuple[str, dict[str, float]]] = []

    def count(self, app: str, latency_ms: float | None) -> None:
        self.counted.append((app, latency_ms))

    def note(self, app: str, outcomes: dict[str, float]) -> None:
        self.noted.append((app, outcomes))


async def until_settled(mirror: ShadowMirror) -> None:
    """Once every mirrored request has ended: answered, failed, or past its deadline."""

    async def in_flight() -> int:
        return mirror.in_flight

    await poll_until(
        in_flight, lambda n: n == 0, timeout_s=SETTLE_S, interval_s=0.01, what="the mirror settled"
    )


async def test_the_mirror_never_holds_the_caller_and_drops_past_its_bound() -> None:
    seen = _Recorder()
    mirror = ShadowMirror(seen.count, seen.note)
    route = ShadowRoute(shadow="s1", app="cand", percent=100, max_in_flight=2)
    gate = asyncio.Event()

    async def slow() -> Any:
        await gate.wait()
        return [0.5, 0.25]

    for _ in range(3):
        mirror.send(route, [0.5, 0.25], slow, deadline_s=5)  # returns at once: nothing awaited
    assert mirror.in_flight == 2 and seen.counted == []
    assert [n[1] for n in seen.noted] == [{DROPPED: 0.0}, {DROPPED: 0.0}, {DROPPED: 1.0}]
    mirror.send(route, [1.0], None, deadline_s=5)  # the candidate not reachable yet: dropped
    assert seen.noted[-1] == ("cand", {DROPPED: 1.0})
    gate.set()
    await until_settled(mirror)
    assert [app for app, latency in seen.counted if latency is not None] == ["cand", "cand"]
    compared = [n for _, n in seen.noted if "shadow.max_abs_diff" in n]
    assert len(compared) == 2 and all(n["shadow.max_abs_diff"] == 0.0 for n in compared)


async def test_a_failing_or_hung_candidate_is_counted_as_its_failure() -> None:
    seen = _Recorder()
    mirror = ShadowMirror(seen.count, seen.note)
    route = ShadowRoute(shadow="s1", app="cand", percent=100)

    async def fails() -> Any:
        raise RuntimeError("part failed")

    async def hangs() -> Any:
        await asyncio.Event().wait()

    mirror.send(route, [1.0], fails, deadline_s=5)
    mirror.send(route, [1.0], hangs, deadline_s=0.05)
    await until_settled(mirror)
    assert seen.counted == [("cand", None), ("cand", None)]
    assert all("shadow.max_abs_diff" not in n for _, n in seen.noted)
