"""The always-valid experiment statistics, by simulation: A/A experiments watched after every
value keep their false positives under alpha where a peeking z-test does not, unit buckets keep
them under alpha where counting every value as independent does not, a stated effect is found
with the stated power, plus the drill, Holm's correction and the input errors.

Simulations run many experiments at once through the module's array arithmetic (`_mixture`),
which `sequential_compare` also calls; `watch` checks the two agree at the last look.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest

from ipnext.policy import sequential
from ipnext.policy.sequential import (
    BUCKETS,
    MIN_VALUES,
    BucketSums,
    estimate,
    favours,
    holm,
    running_p,
    sequential_compare,
)

pytestmark = pytest.mark.timeout(60)

ALPHA = 0.05
Z_CRITICAL = 1.959963984540054  # two-sided 5%

# The power the docs may quote: clicks 10% -> 15% (a standardized effect of about 0.15 sd),
# found with >= 80% power within this many values per arm, watched after every value.
POWER_CONTROL_RATE = 0.10
POWER_ARM_RATE = 0.15
POWER_VALUES = 1500

Floats = npt.NDArray[np.float64]
Ints = npt.NDArray[np.int64]


def sums(counts: Ints, totals: Floats, squares: Floats, binary: bool) -> BucketSums:
    return BucketSums(
        tuple(int(c) for c in counts),
        tuple(float(t) for t in totals),
        tuple(float(q) for q in squares),
        binary,
    )


def watch(values: Floats, buckets: Ints, every: int, binary: bool = True) -> dict[str, Floats]:
    """Run experiments side by side: `values` and `buckets` are (runs, 2, values per arm), arm 0
    the treatment and arm 1 control; after every `every` values per arm, each run's always-valid p
    with unit buckets ("bucketed") and with every value independent ("naive"), and for binary
    values whether the fixed-horizon pooled z-test was significant (0) or not (1) ("z").
    Returns each one's running minimum per run."""
    runs, _, length = values.shape
    counts, totals, squares = (np.zeros(runs * 2 * BUCKETS) for _ in range(3))
    offset = (np.arange(runs * 2) * BUCKETS).reshape(runs, 2, 1)
    least = {name: np.ones(runs) for name in ("bucketed", "naive", "z")}
    last: dict[str, Floats] = {}
    for start in range(0, length, every):
        index = (offset + buckets[:, :, start : start + every]).ravel()
        new = values[:, :, start : start + every].ravel()
        counts += np.bincount(index, minlength=counts.size)
        totals += np.bincount(index, new, minlength=counts.size)
        squares += np.bincount(index, new**2, minlength=counts.size)
        c, t, q = (a.reshape(runs, 2, BUCKETS) for a in (counts, totals, squares))
        n, total, square = c.sum(-1), t.sum(-1), q.sum(-1)
        spread = ((t - (total / n)[..., None] * c) ** 2).sum(-1)
        for name, clusters in (("bucketed", (c > 0).sum(-1)), ("naive", np.ones_like(n))):
            arm, control = (
                sequential._Sums(n[:, a], total[:, a], square[:, a], clusters[:, a], spread[:, a])
                for a in (0, 1)
            )
            look = sequential._mixture(arm, control, binary, ALPHA)
            last[name] = np.where(look.enough, np.minimum(1.0, np.exp(-look.log_ratio)), 1.0)
            least[name] = np.minimum(least[name], last[name])
        rate = total.sum(-1) / n.sum(-1)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = (total[:, 0] / n[:, 0] - total[:, 1] / n[:, 1]) / np.sqrt(
                rate * (1 - rate) * (1 / n[:, 0] + 1 / n[:, 1])
            )
        least["z"] = np.minimum(least["z"], np.where(np.abs(z) > Z_CRITICAL, 0.0, 1.0))
    # The array arithmetic is the public function's: the same p at the last look, both ways.
    for run in range(3):
        bucketed = sequential_compare(
            sums(c[run, 0], t[run, 0], q[run, 0], binary),
            sums(c[run, 1], t[run, 1], q[run, 1], binary),
            ALPHA,
        )
        naive = sequential_compare(
            BucketSums.single(int(n[run, 0]), total[run, 0], square[run, 0], binary),
            BucketSums.single(int(n[run, 1]), total[run, 1], square[run, 1], binary),
            ALPHA,
        )
        assert bucketed is not None and naive is not None
        assert bucketed.p_value == pytest.approx(last["bucketed"][run], rel=1e-9, abs=1e-300)
        assert naive.p_value == pytest.approx(last["naive"][run], rel=1e-9, abs=1e-300)
        # The confidence sequence excludes 0 exactly when the p-value is significant.
        assert (bucketed.low > 0 or bucketed.high < 0) == (bucketed.p_value <= ALPHA)
    return least


def clicks(
    rng: np.random.Generator, rates: tuple[float, float], runs: int, length: int
) -> tuple[Floats, Ints]:
    """One click (0/1) per unit, units hashed at random into buckets: (values, buckets)."""
    values = (rng.random((runs, 2, length)) < np.array(rates)[None, :, None]).astype(np.float64)
    return values, rng.integers(0, BUCKETS, (runs, 2, length))


def clustered_clicks(
    rng: np.random.Generator, runs: int, length: int, units: int = 250
) -> tuple[Floats, Ints]:
    """A/A clicks from `units` users per arm, each with a click propensity ~ Beta(0.25, 2.25)
    (mean 0.1, strongly uneven) and 1-20 values, arriving in random order; the first `length`
    values of each arm, with their user's bucket."""
    sizes = rng.integers(1, 21, runs * 2 * units)
    propensity = rng.beta(0.25, 2.25, runs * 2 * units)
    bucket = rng.integers(0, BUCKETS, runs * 2 * units)
    group = np.repeat(np.repeat(np.arange(runs * 2), units), sizes)
    # Shuffled within each (run, arm): the group id plus a fraction in [0, 1) sorts by group first.
    order = np.argsort(group + rng.random(group.size), kind="stable")
    group, propensity, bucket = (
        group[order],
        np.repeat(propensity, sizes)[order],
        np.repeat(bucket, sizes)[order],
    )
    position = np.arange(group.size) - np.searchsorted(group, np.arange(runs * 2))[group]
    kept = position < length
    if kept.sum() != runs * 2 * length:
        raise RuntimeError("too few values per arm: raise `units`")
    values = (rng.random(kept.sum()) < propensity[kept]).astype(np.float64)
    return values.reshape(runs, 2, length), bucket[kept].reshape(runs, 2, length)


def test_aa_watched_after_every_value_keeps_alpha_where_peeking_z_does_not() -> None:
    values, buckets = clicks(np.random.default_rng(20240601), (0.1, 0.1), runs=400, length=1000)
    least = watch(values, buckets, every=1)
    sequential_rate, peeking_rate = (float((least[k] <= ALPHA).mean()) for k in ("bucketed", "z"))
    print(
        f"\nA/A, 400 runs x 1000 clicks per arm, looked at after every value: mSPRT {sequential_rate:.4f}, "
        f"peeking z-test {peeking_rate:.4f} (alpha {ALPHA})"
    )
    assert sequential_rate <= ALPHA
    assert peeking_rate > 3 * ALPHA


def test_clustered_aa_keeps_alpha_only_with_unit_buckets() -> None:
    values, buckets = clustered_clicks(np.random.default_rng(7), runs=400, length=2000)
    least = watch(values, buckets, every=10)
    bucketed_rate, naive_rate = (float((least[k] <= ALPHA).mean()) for k in ("bucketed", "naive"))
    print(
        f"\nclustered A/A, 400 runs x 2000 clicks per arm from 1-20 per user, looked at every 10: "
        f"bucketed {bucketed_rate:.4f}, every value independent {naive_rate:.4f} (alpha {ALPHA})"
    )
    assert bucketed_rate <= ALPHA
    assert naive_rate > 2 * ALPHA


def test_numeric_aa_from_the_minimum_values_keeps_alpha() -> None:
    """From MIN_VALUES a side on, the plug-in variance of a normal or a heavy-tailed outcome is
    good enough: A/A looked at after every value stays under alpha."""
    rng = np.random.default_rng(11)
    for name, values in (
        ("normal(100, 10)", rng.normal(100, 10, (1000, 2, 100))),
        ("lognormal(0, 2)", rng.lognormal(0, 2, (1000, 2, 100))),
    ):
        least = watch(values, rng.integers(0, BUCKETS, values.shape), every=1, binary=False)
        rate = float((least["bucketed"] <= ALPHA).mean())
        print(f"\nA/A {name}, 1000 runs x 100 values, from {MIN_VALUES} a side: {rate:.4f}")
        assert rate <= ALPHA


def test_stated_effect_is_found_with_80_percent_power() -> None:
    rates = (POWER_ARM_RATE, POWER_CONTROL_RATE)
    values, buckets = clicks(np.random.default_rng(3), rates, runs=300, length=POWER_VALUES)
    power = float((watch(values, buckets, every=1)["bucketed"] <= ALPHA).mean())
    print(
        f"\npower, clicks {POWER_CONTROL_RATE} -> {POWER_ARM_RATE}, {POWER_VALUES} values per arm, "
        f"watched after every value: {power:.3f}"
    )
    assert power >= 0.8


def test_lower_is_better_outcome_favours_the_arm_that_lowers_it() -> None:
    rng = np.random.default_rng(5)
    arms = []
    for mean_ms in (90.0, 100.0):  # treatment, control
        users = rng.normal(mean_ms, 15, 150)
        per_user = rng.integers(1, 6, 150)
        latency = np.repeat(users, per_user) + rng.normal(0, 20, per_user.sum())
        bucket = np.repeat(rng.integers(0, BUCKETS, 150), per_user)
        arms.append(
            BucketSums(
                tuple(int(c) for c in np.bincount(bucket, minlength=BUCKETS)),
                tuple(float(t) for t in np.bincount(bucket, latency, minlength=BUCKETS)),
                tuple(float(q) for q in np.bincount(bucket, latency**2, minlength=BUCKETS)),
                binary=False,
            )
        )
    result = sequential_compare(arms[0], arms[1], ALPHA)
    assert result is not None
    assert result.p_value <= ALPHA and result.high < 0 < -result.difference
    assert favours("lower", result.difference) and not favours("higher", result.difference)


def test_drill_all_clicks_against_none_is_certain_and_a_replay_stays_one_cluster() -> None:
    control = BucketSums(*one_per_bucket([1] * 21))
    treatment = BucketSums(*one_per_bucket([0] * 19))
    result = sequential_compare(treatment, control, ALPHA)
    assert result is not None
    print(f"\ndrill, 0 of 19 against 21 of 21: p {result.p_value:.4g}, difference {result.difference}")
    # Certain only through the pooled rate's spread under the null: a real interval, not 0 / 0.
    assert 0 < result.p_value < 0.01 and result.difference == -1.0
    assert result.low < -1.0 < result.high < 0
    # A side of all zeros has no spread to cluster, so the replay is shown on one with clicks:
    # 4 of 19 users clicked, then one non-clicker's value is counted 200 more times.
    counts, totals, squares = one_per_bucket([1] * 4 + [0] * 15)
    counts = (*counts[:10], counts[10] + 200, *counts[11:])  # bucket 10 holds a non-clicker
    replayed = estimate(BucketSums(counts, totals, squares))
    naive = estimate(BucketSums.single(sum(counts), sum(totals), sum(squares), binary=True))
    assert replayed is not None and naive is not None and replayed.clusters == 19
    mean = 4 / 219
    assert naive.variance == pytest.approx(mean * (1 - mean) / 219)
    assert replayed.variance > 3 * naive.variance


def one_per_bucket(values: list[int]) -> tuple[tuple[int, ...], tuple[float, ...], tuple[float, ...]]:
    rest = BUCKETS - len(values)
    return (
        (1,) * len(values) + (0,) * rest,
        tuple(map(float, values)) + (0.0,) * rest,
        tuple(map(float, values)) + (0.0,) * rest,
    )


def test_estimate_is_the_ratio_with_cluster_robust_variance() -> None:
    counts, totals, squares = (3, 1, 0, 2), (3.0, 0.0, 0.0, 1.0), (3.0, 0.0, 0.0, 1.0)
    result = estimate(BucketSums(counts, totals, squares))
    assert result is not None and (result.values, result.clusters) == (6, 3)
    mean = 4 / 6
    residuals = [t - mean * c for c, t in zip(counts, totals, strict=True)]
    robust = 3 / 2 * sum(r**2 for r in residuals) / 6**2
    assert result.mean == pytest.approx(mean)
    assert robust > mean * (1 - mean) / 6  # clicks bunched in one bucket: the clusters widen it
    assert result.variance == pytest.approx(robust)
    single = estimate(BucketSums.single(6, 4.0, 4.0, binary=True))
    assert single is not None and single.variance == pytest.approx(mean * (1 - mean) / 6)
    assert estimate(BucketSums((0, 0), (0.0, 0.0), (0.0, 0.0))) is None


def test_no_spread_is_certain_or_nothing_and_too_few_values_is_no_answer() -> None:
    def constant(value: float, n: int) -> BucketSums:
        return BucketSums.single(n, value * n, value**2 * n, binary=False)

    certain = sequential_compare(constant(90.0, MIN_VALUES), constant(100.0, MIN_VALUES), ALPHA)
    nothing = sequential_compare(constant(100.0, 50), constant(100.0, 50), ALPHA)
    assert certain is not None and certain.p_value == 0.0 and certain.low == certain.high == -10.0
    assert nothing is not None and nothing.p_value == 1.0
    assert sequential_compare(constant(90.0, MIN_VALUES - 1), constant(100.0, 50), ALPHA) is None


def test_holm_steps_down_and_running_p_is_the_least_so_far() -> None:
    # 0.001 <= 0.05/3, 0.02 <= 0.05/2, 0.04 <= 0.05/1: all three.
    assert holm({"click": 0.001, "revenue": 0.02, "latency_ms": 0.04}, ALPHA) == dict.fromkeys(
        ("click", "revenue", "latency_ms"), True
    )
    # 0.03 > 0.05/2 stops the steps: 0.04 is kept although it is under alpha alone.
    assert holm({"click": 0.001, "revenue": 0.03, "latency_ms": 0.04}, ALPHA) == {
        "click": True,
        "revenue": False,
        "latency_ms": False,
    }
    assert holm({"click": 0.02, "revenue": 0.02, "latency_ms": 0.02}, ALPHA) == dict.fromkeys(
        ("click", "revenue", "latency_ms"), False
    )
    assert holm({}, ALPHA) == {}
    seen: list[float] = []
    previous: float | None = None
    for p in (0.5, 0.2, 0.7, 0.1, 0.3):
        previous = running_p(previous, p)
        seen.append(previous)
    assert seen == [0.5, 0.2, 0.2, 0.1, 0.1]


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: BucketSums((1, 2), (1.0,), (1.0,)), "totals"),
        (lambda: BucketSums((1,), (1.0,), (1.0, 0.0)), "squares"),
        (lambda: BucketSums((), (), ()), "counts"),
        (lambda: BucketSums((-1,), (0.0,), (0.0,)), "counts"),
        (lambda: BucketSums.single(2, 3.0, 3.0, binary=True), "totals"),
        (lambda: sequential_compare(*(BucketSums.single(20, 2.0, 2.0, True),) * 2, alpha=1.0), "alpha"),
        (lambda: holm({"click": 0.01}, alpha=0.0), "alpha"),
        (lambda: holm({"click": 1.5}, alpha=0.05), "p_values"),
        (lambda: running_p(0.2, -0.1), "now"),
        (lambda: running_p(2.0, 0.1), "previous"),
        (lambda: favours("up", 1.0), "direction"),  # type: ignore[arg-type]
    ],
)
def test_input_errors_name_the_field(call: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        call()
