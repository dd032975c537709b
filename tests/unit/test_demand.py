"""Observed demand (`ipnext.demand`): per-replica diffs into slots, rates over ended windows,
restarts that never count twice, and reports of several regions that add up."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.demand import DemandHistory, demand_report, model_demand, rates, valid_source

T0 = 1_800_000_000.0  # on a minute boundary


def test_rates_count_only_ended_windows_and_the_peak_is_the_busiest() -> None:
    history = DemandHistory()
    # Minute 0: us-east sends 120 requests, eu-west 30; minute 1: us-east 600; minute 2 fills.
    history.record("r1", {"us-east": 120, "eu-west": 30}, T0 + 10)
    history.record("r1", {"us-east": 720, "eu-west": 30}, T0 + 70)
    history.record("r1", {"us-east": 730, "eu-west": 30}, T0 + 130)
    report = demand_report(history, T0 + 135, 60)
    east, west = report.sources["us-east"], report.sources["eu-west"]
    assert (east.requests, east.rate_qps, east.peak_qps) == (730, 10.0, 10.0)  # 600 in minute 1
    assert (west.requests, west.rate_qps, west.peak_qps) == (30, 0.0, 0.5)
    assert report.window_seconds == 60 and report.history_seconds == 125  # since the first push
    assert report.windows == {
        int(T0): {"us-east": 120, "eu-west": 30},
        int(T0) + 60: {"us-east": 600},
        int(T0) + 120: {"us-east": 10},
    }


def test_a_restarted_or_new_replica_counts_from_zero_never_twice() -> None:
    history = DemandHistory()
    history.record("r1", {"us-east": 50}, T0)
    history.record("r1", {"us-east": 50}, T0 + 5)  # the same counts again: nothing new
    history.record("r2", {"us-east": 7}, T0 + 5)  # a new replica: its 7 are new
    history.record("r1", {"us-east": 3}, T0 + 10)  # went down: it restarted, 3 are new
    assert demand_report(history, T0 + 60, 60).sources["us-east"].requests == 60


def test_history_older_than_it_keeps_is_dropped() -> None:
    history = DemandHistory(keep_seconds=120)
    history.record("r1", {"us-east": 10}, T0)
    history.record("r1", {"us-east": 20}, T0 + 300)
    assert demand_report(history, T0 + 300, 60).sources["us-east"].requests == 10


def test_reports_of_two_regions_add_up_window_by_window() -> None:
    east, west = DemandHistory(), DemandHistory()
    east.record("a", {"us-east": 60}, T0 + 1)
    west.record("b", {"us-east": 60}, T0 + 2)  # us-east's overflow served in eu-west
    summed: dict[int, dict[str, int]] = {}
    for history in (east, west):
        for start, counts in demand_report(history, T0 + 61, 60).windows.items():
            for source, n in counts.items():
                summed.setdefault(start, {})[source] = summed.setdefault(start, {}).get(source, 0) + n
    assert rates(summed, 60, T0 + 61)["us-east"].rate_qps == 2.0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.tuples(st.sampled_from(["r1", "r2"]), st.integers(0, 40), st.integers(0, 1000)), max_size=30)
)
def test_requests_in_the_report_are_the_sum_of_every_replicas_increases(
    pushes: list[tuple[str, int, int]],
) -> None:
    history, last, expected = DemandHistory(), {"r1": 0, "r2": 0}, 0
    for i, (replica, increase, restart_to) in enumerate(pushes):
        total = last[replica] + increase if restart_to % 7 else min(restart_to % 5, last[replica])
        new = total - last[replica] if total >= last[replica] else total
        expected += new
        last[replica] = total
        history.record(replica, {"us-east": total}, T0 + i)
    requests = demand_report(history, T0 + 999, 60).sources.get("us-east")
    assert (requests.requests if requests else 0) == expected


def test_sources_are_region_names() -> None:
    assert valid_source("us-east") and valid_source("eu-west-2")
    assert not any(valid_source(s) for s in ("", "US-EAST", "us east", "x" * 64, "../etc", "1abc"))


def test_a_models_demand_adds_its_regions_and_shows_declared_beside_observed() -> None:
    east, west = DemandHistory(), DemandHistory()
    east.record("a", {"us-east": 120, "ap-south": 6}, T0 + 1)
    west.record("b", {"us-east": 60}, T0 + 2)
    reports = {"us-east": demand_report(east, T0 + 61, 60), "eu-west": demand_report(west, T0 + 61, 60)}
    view = model_demand("m", {"us-east": 2.0, "eu-west": 1.0}, reports, T0 + 61, 60)
    assert view.regions == ["eu-west", "us-east"] and view.window_seconds == 60
    assert view.sources["us-east"].declared_qps == 2.0 and view.sources["us-east"].rate_qps == 3.0  # 180 / 60
    assert view.sources["eu-west"].declared_qps == 1.0 and view.sources["eu-west"].requests == 0
    assert view.sources["ap-south"].declared_qps is None and view.sources["ap-south"].peak_qps == 0.1
