"""Shadow traffic's arithmetic: how a candidate's answer compares to the one the caller got, and
what a window of comparisons says (pure; the router compares, the experiment workflow summarizes).

A router that mirrors a request to the candidate compares the two answers' outputs and records
the comparison as outcomes of the candidate's set app (`counters.SetCounters.outcomes`, names
below): so comparisons add up across routers and regions, diff into windows and survive
continue-as-new exactly as experiment outcomes do, with no store of their own.

- `shadow.max_abs_diff`: the largest absolute difference between the two outputs' numbers;
- `shadow.differs`: 1 when that is over `DIFFERS_ABOVE` (a rate);
- `shadow.mismatch`: 1 when the outputs do not even have the same shape (then no other number);
- for a ranking answer (a flat list of two or more scores): `shadow.rank_correlation`
  (Spearman's, ties averaged) and `shadow.top_k_overlap` (the share of the served top k that the
  candidate also ranks in its top k);
- `shadow.dropped`: per mirrored request, 1 when it was dropped because the candidate had
  `max_in_flight` shadow calls already (a rate: its total is the dropped count).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ipnext.contracts.experiment import ShadowSummary

__all__ = [
    "DIFFERS_ABOVE",
    "DROPPED",
    "compare_answers",
    "flat_numbers",
    "rank_correlation",
    "render_shadow",
    "summarize_shadow",
    "top_k_overlap",
]

PREFIX = "shadow."
MAX_ABS_DIFF = "shadow.max_abs_diff"
DIFFERS = "shadow.differs"
MISMATCH = "shadow.mismatch"
RANK_CORRELATION = "shadow.rank_correlation"
TOP_K_OVERLAP = "shadow.top_k_overlap"
DROPPED = "shadow.dropped"
# Outputs are rounded to 6 decimals by the example parts (and float32 holds about 7 digits):
# a difference at or under this is the same answer.
DIFFERS_ABOVE = 1e-6


def flat_numbers(value: Any) -> list[float] | None:
    """The numbers of a JSON output in order (nested lists and dicts by sorted key), or None
    when it holds anything else (text, null)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, list):
        numbers: list[float] = []
        for item in value:
            inner = flat_numbers(item)
            if inner is None:
                return None
            numbers += inner
        return numbers
    if isinstance(value, dict):
        return flat_numbers([value[k] for k in sorted(value)])
    return None


def _shape(value: Any) -> Any:
    if isinstance(value, list):
        return [_shape(v) for v in value]
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in sorted(value.items())}
    return type(value).__name__ if not isinstance(value, int | float) or isinstance(value, bool) else "n"


def _ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their average rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def rank_correlation(served: list[float], candidate: list[float]) -> float:
    """Spearman's rank correlation of two score lists of one length (at least 2): the Pearson
    correlation of their ranks. Two lists that cannot be ranked apart (all scores tied in one)
    correlate 1.0 when both are all tied, else 0.0."""
    if len(served) != len(candidate) or len(served) < 2:
        raise ValueError(
            f"rank_correlation: two lists of one length of at least 2, got {len(served)} and {len(candidate)}"
        )
    a, b = _ranks(served), _ranks(candidate)
    mean = (len(a) + 1) / 2
    da, db = [x - mean for x in a], [y - mean for y in b]
    norm = math.sqrt(sum(x * x for x in da) * sum(y * y for y in db))
    if norm == 0:
        return 1.0 if max(served) == min(served) and max(candidate) == min(candidate) else 0.0
    return sum(x * y for x, y in zip(da, db, strict=True)) / norm


def top_k_overlap(served: list[float], candidate: list[float], k: int) -> float:
    """The share of the served answer's top k (highest scores; ties by position) that the
    candidate's top k also holds; k is cut to the list's length."""
    k = min(k, len(served))
    if k < 1 or len(served) != len(candidate):
        raise ValueError(f"top_k_overlap: k of at least 1 and two lists of one length, got k={k}")

    def top(scores: list[float]) -> set[int]:
        return set(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k])

    return len(top(served) & top(candidate)) / k


def compare_answers(served: Any, candidate: Any, top_k: int) -> dict[str, float]:
    """The outcomes one comparison records (module docstring): outputs of the same shape give
    their largest difference, and ranking answers their rank agreement; others a mismatch."""
    a, b = flat_numbers(served), flat_numbers(candidate)
    if a is None or b is None or _shape(served) != _shape(candidate):
        return {MISMATCH: 1.0, DIFFERS: 1.0}
    diff = max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)
    if not math.isfinite(diff):
        return {MISMATCH: 1.0, DIFFERS: 1.0}
    found = {MISMATCH: 0.0, MAX_ABS_DIFF: diff, DIFFERS: 1.0 if diff > DIFFERS_ABOVE else 0.0}
    ranking = isinstance(served, list) and len(a) == len(served) and len(a) >= 2
    if ranking:
        found[RANK_CORRELATION] = rank_correlation(a, b)
        found[TOP_K_OVERLAP] = top_k_overlap(a, b, top_k)
    return found


def summarize_shadow(candidate: Any, windows: int = 1) -> ShadowSummary:
    """The summary of a candidate app's counters (`counters.SetCounters`, for a window or a total)."""
    outcomes: Mapping[str, Any] = candidate.outcomes

    def mean(name: str) -> float | None:
        totals = outcomes.get(name)
        return totals.mean() if totals is not None else None

    def total(name: str) -> int:
        totals = outcomes.get(name)
        return round(totals.total) if totals is not None else 0

    dropped = outcomes.get(DROPPED)
    return ShadowSummary(
        mirrored=dropped.count if dropped is not None else 0,
        dropped=total(DROPPED),
        compared=outcomes[DIFFERS].count if DIFFERS in outcomes else 0,
        candidate_requests=candidate.requests,
        candidate_errors=candidate.errors,
        candidate_p50_ms=candidate.quantile_ms("latency_ms", 0.5),
        candidate_p99_ms=candidate.quantile_ms("latency_ms", 0.99),
        mismatched=total(MISMATCH),
        differing=mean(DIFFERS),
        max_abs_diff_mean=mean(MAX_ABS_DIFF),
        rank_correlation_mean=mean(RANK_CORRELATION),
        top_k_overlap_mean=mean(TOP_K_OVERLAP),
        windows=windows,
    )


def render_shadow(summary: ShadowSummary) -> str:
    """One line for a terminal or the Temporal UI's details."""

    def num(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.4g}{unit}"

    line = (
        f"{summary.mirrored} mirrored, {summary.dropped} dropped, {summary.compared} compared "
        f"({summary.mismatched} of another shape); candidate {summary.candidate_errors} errors of "
        f"{summary.candidate_requests}, p50 {num(summary.candidate_p50_ms, ' ms')}, "
        f"p99 {num(summary.candidate_p99_ms, ' ms')}; differing {num(summary.differing)}, "
        f"max |diff| mean {num(summary.max_abs_diff_mean)}"
    )
    if summary.rank_correlation_mean is not None:
        line += (
            f", rank correlation {num(summary.rank_correlation_mean)}, "
            f"top-k overlap {num(summary.top_k_overlap_mean)}"
        )
    return line
