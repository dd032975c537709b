"""Observed demand (`ipnext.policy.demand`): per-replica diffs into slots, rates over ended windows,
restarts that never count twice, reports of several regions that add up, a history saved and
loaded across a metrics actor's restart, and what the fleet replan plans from it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ipnext.policy.demand import (
    DemandHistory,
    ModelDemand,
    SourceView,
    demand_report,
    load_history,
    model_demand,
    plan_demand,
    rates,
    save_history,
    valid_source,
)
from ipnext.serving.metrics import MetricsStore

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


def test_a_saved_history_loads_back_whole_and_goes_on_counting(tmp_path: Path) -> None:
    history = DemandHistory(keep_seconds=3600)
    history.record("r1", {"us-east": 120, "eu-west": 30}, T0 + 10)
    history.record("r1", {"us-east": 720, "eu-west": 30}, T0 + 70)
    path = tmp_path / "demand" / "m" / "us-east.json"
    save_history(history, path)
    loaded = load_history(path)
    assert loaded == history and list(path.parent.iterdir()) == [path]  # no temporary file left
    # The router kept running: its next cumulative push counts only what is new since the save.
    loaded.record("r1", {"us-east": 730, "eu-west": 30}, T0 + 130)
    assert demand_report(loaded, T0 + 135, 60).sources["us-east"].requests == 730


def test_a_missing_or_corrupt_history_file_starts_empty_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert load_history(tmp_path / "none.json") is None
    for text in ("{not json", '{"slots": {"x": 1}}', '{"keep_seconds": -1}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with caplog.at_level(logging.WARNING):
            assert load_history(bad) is None
        assert "corrupt, starting empty" in caplog.text
        caplog.clear()


def test_the_metrics_store_saves_its_history_and_a_new_one_loads_it(tmp_path: Path) -> None:
    path = tmp_path / "m" / "us-east.json"
    store = MetricsStore(str(path), save_seconds=0.0)  # saves on every push
    store.push_demand("r1", {"us-east": 40})
    store.push_demand("r2", {"eu-west": 5})
    again = MetricsStore(str(path))  # the actor restarted: its history is back
    report = again.demand(5.0)
    assert {s: d["requests"] for s, d in report["sources"].items()} == {"us-east": 40, "eu-west": 5}
    again.push_demand("r1", {"us-east": 45})  # r1 kept running: 5 new, not 45
    assert again.demand(5.0)["sources"]["us-east"]["requests"] == 45


def test_a_restarted_store_without_history_takes_first_pushes_as_baselines() -> None:
    history = DemandHistory()
    history.adopt("r1", {"us-east": 5000}, T0)  # hours of requests before the actor restarted
    history.record("r1", {"us-east": 5012}, T0 + 5)
    assert demand_report(history, T0 + 60, 60).sources["us-east"].requests == 12


def test_replicas_silent_for_as_long_as_history_is_kept_are_forgotten() -> None:
    history = DemandHistory(keep_seconds=60)
    history.record("old", {"us-east": 1}, T0)
    history.record("new", {"us-east": 1}, T0 + 300)
    assert set(history.replicas) == {"new"} and set(history.seen) == {"new"}


def _observed(history_seconds: float, peaks: dict[str, float]) -> ModelDemand:
    return ModelDemand(
        model="m",
        window_seconds=60,
        history_seconds=history_seconds,
        regions=["us-east"],
        sources={
            s: SourceView(declared_qps=None, requests=int(q * 60), rate_qps=q, peak_qps=q)
            for s, q in peaks.items()
        },
    )


def test_the_replan_plans_the_larger_of_declared_and_observed_peak_with_margin() -> None:
    declared = {"us-east": 10.0, "eu-west": 10.0}
    observed = _observed(7200, {"us-east": 30.0, "eu-west": 5.0, "ap-south": 2.0, "mars-1": 9.0})
    sizing = plan_demand(
        declared, observed, margin=0.2, min_history_seconds=3600, regions=["us-east", "eu-west", "ap-south"]
    )
    east, west, south = sizing.sources["us-east"], sizing.sources["eu-west"], sizing.sources["ap-south"]
    assert sizing.observed and (east.used, east.planned_qps, east.over_budget) == ("observed", 36.0, True)
    assert (west.used, west.planned_qps, west.over_budget) == ("declared", 10.0, False)
    assert (south.declared_qps, south.planned_qps, south.over_budget) == (0.0, 2.4, True)  # not declared
    assert "mars-1" not in sizing.sources and "mars-1" in sizing.note  # not a region of the fleet
    assert sizing.demand_qps() == {"ap-south": 2.4, "eu-west": 10.0, "us-east": 36.0}
    assert sizing.over_budget() == ["ap-south", "us-east"]
    # Within the margin of the budget: planned on the observed figure, but not over budget.
    close = plan_demand({"us-east": 10.0}, _observed(7200, {"us-east": 9.0}), 0.2, 3600, ["us-east"])
    assert close.sources["us-east"].used == "observed" and not close.sources["us-east"].over_budget


def test_too_little_history_or_none_plans_declared_demand_only() -> None:
    declared = {"us-east": 10.0}
    young = plan_demand(declared, _observed(600, {"us-east": 99.0}), 0.2, 3600, ["us-east"])
    assert not young.observed and young.demand_qps() == declared and "600 s of history" in young.note
    assert young.sources["us-east"].observed_peak_qps is None and young.over_budget() == []
    none = plan_demand(declared, None, 0.2, 3600, ["us-east"])
    assert not none.observed and none.demand_qps() == declared


def test_the_replans_peak_counts_only_windows_since_its_interval_began() -> None:
    history = DemandHistory()
    history.record("a", {"us-east": 600}, T0 + 1)  # 10 qps in minute 0
    history.record("a", {"us-east": 660}, T0 + 61)  # 1 qps in minute 1
    reports = {"us-east": demand_report(history, T0 + 125, 60)}
    assert model_demand("m", {}, reports, T0 + 125, 60).sources["us-east"].peak_qps == 10.0
    assert model_demand("m", {}, reports, T0 + 125, 60, since=T0 + 60).sources["us-east"].peak_qps == 1.0
