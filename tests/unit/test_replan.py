"""Fleet replanning pieces without a server: durations, plan diffs and merges, the plan store,
the solve activity splitting a fleet plan back into per-model plans, and observed demand read
from the metrics actors and planned (`ipnext plan show` saying so)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from ipnext.activities import _context
from ipnext.activities import fleet as fleet_activities
from ipnext.activities.fleet import (
    ModelEntry,
    ReadDemandInput,
    ReadDemandResult,
    SolveFleetInput,
    SolveFleetResult,
)
from ipnext.contracts.plan import DeploymentPlacement, Plan, merge_plans, placement_revision, plan_moves
from ipnext.errors import IpnextError
from ipnext.policy.demand import DemandHistory, ModelDemand, SourceView, demand_report, plan_demand
from ipnext.spec.model import load_model_spec
from ipnext.spec.settings import load_settings
from ipnext.store.plans import PlanStore, StoredPlan, now

REPO = Path(__file__).resolve().parents[2]
RANKER = REPO / "examples" / "click_ranker" / "model.yaml"


def _plan(replicas: dict[str, dict[str, dict[str, int]]], revision: int = 1) -> Plan:
    deployments = {
        name: DeploymentPlacement(replicas=r, fractions={"us-east": {next(iter(r)): 1.0}})
        for name, r in replicas.items()
    }
    return Plan(deployments=deployments, cost=1.0, solver="test", revision=revision)


@pytest.mark.parametrize(("text", "every"), [("90s", 90), ("30m", 1800), ("6h", 21600), ("1.5d", 129600)])
def test_parse_every(text: str, every: int) -> None:
    from ipnext.store.plans import parse_every

    assert parse_every(text) == timedelta(seconds=every)


@pytest.mark.parametrize("text", ["6", "h", "10s", "6 hours", "-1h"])
def test_parse_every_rejects_with_the_fix(text: str) -> None:
    from ipnext.store.plans import parse_every

    with pytest.raises(IpnextError, match="--every"):
        parse_every(text)


def test_plan_moves_lists_every_changed_count_including_dropped_deployments() -> None:
    old = _plan({"m/a": {"us-east": {"cpu": 2}}, "m/b": {"us-east": {"cpu": 1}}})
    new = _plan({"m/a": {"us-east": {"cpu": 1}, "eu-west": {"gpu": 1}}, "m/c": {"eu-west": {"cpu": 3}}})
    assert [str(m) for m in plan_moves(old, new)] == [
        "m/a: eu-west/gpu 0 -> 1",
        "m/a: us-east/cpu 2 -> 1",
        "m/b: us-east/cpu 1 -> 0",
        "m/c: eu-west/cpu 0 -> 3",
    ]
    assert plan_moves(new, new) == []
    assert [m.after for m in plan_moves(None, old)] == [2, 1]


def test_merge_plans() -> None:
    merged = merge_plans([_plan({"a/x": {"r": {"h": 1}}}, 3), _plan({"b/y": {"r": {"h": 2}}}, 5)])
    assert merged is not None and sorted(merged.deployments) == ["a/x", "b/y"]
    assert merged.revision == 5 and merged.cost == 2.0
    assert merge_plans([]) is None


def test_plan_store_keeps_revisions_and_names_what_is_missing(tmp_path: Path) -> None:
    from ipnext.store.plans import StoredPlan, now

    store = PlanStore(tmp_path)
    assert store.latest_revision() == 0
    with pytest.raises(IpnextError, match="stored revisions: none"):
        store.load()
    for revision in (1, 2):
        plan = _plan({"m/a": {"us-east": {"cpu": revision}}}, revision)
        store.save(
            StoredPlan(
                revision=revision,
                created_at=now(),
                made_by="test",
                models=["m"],
                moves=plan_moves(None, plan),
                plan=plan.to_report(),
                pools=[],
                units={"m/a": {"cpu": 1}},
            )
        )
    assert store.latest_revision() == 2
    assert store.load().as_plan().deployments["m/a"].replicas == {"us-east": {"cpu": 2}}
    assert store.load(1).revision == 1
    with pytest.raises(IpnextError, match=r"stored revisions: \[1, 2\]"):
        store.load(7)


def test_solve_activity_stores_the_plan_and_hands_back_only_changed_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "ipnext.yaml"
    config.write_text(f"fleet_file: {REPO / 'config' / 'fleet.dev.yaml'}\nstate_dir: state\n")
    monkeypatch.setattr(_context, "settings", lambda: load_settings(config))
    ranker = load_model_spec(RANKER)
    other = ranker.model_copy(update={"name": "other"})
    env = ActivityEnvironment()

    def solve(models: list[ModelEntry]) -> SolveFleetResult:
        result: SolveFleetResult = env.run(
            fleet_activities.solve_fleet_plan,
            SolveFleetInput(models=models, time_limit_s=20, churn_cost=0.05, made_by="test"),
        )
        return result

    first = solve([ModelEntry(spec=ranker, plan=None), ModelEntry(spec=other, plan=None)])
    assert first.revision == 1 and sorted(first.changed) == ["feed-ranker", "other"]
    assert first.moves_total == len(first.moves) > 0
    ranker_plan = first.changed["feed-ranker"]
    assert sorted(ranker_plan.deployments) == ["feed-ranker/dense", "feed-ranker/embed"]
    assert ranker_plan.revision == 1 and ranker_plan.cost > 0
    # Solved again from those plans, nothing has a reason to move: no model is handed a plan.
    again = solve([ModelEntry(spec=spec, plan=first.changed[spec.name]) for spec in (ranker, other)])
    assert again.revision == 2 and again.changed == {} and again.moves == [] and again.moved_units == 0
    stored = PlanStore(tmp_path / "state").load()
    assert stored.revision == 2 and stored.models == ["feed-ranker", "other"]
    assert stored.units["feed-ranker/embed"] == {"cpu-highmem": 2}


def test_placement_revision_changes_only_with_the_layout() -> None:
    old = _plan({"m/a": {"us-east": {"cpu": 2}}}, 4)
    counts = {
        "m/a": DeploymentPlacement(replicas={"us-east": {"cpu": 5}}, fractions={"us-east": {"us-east": 1.0}})
    }
    assert placement_revision(old, counts) == 4  # replica counts change in place
    moved = {
        "m/a": DeploymentPlacement(replicas={"eu-west": {"cpu": 2}}, fractions={"us-east": {"eu-west": 1.0}})
    }
    assert placement_revision(old, moved) == 5
    other_hw = {"m/a": DeploymentPlacement(replicas={"us-east": {"cpu": 2, "gpu": 1}}, fractions={})}
    assert placement_revision(old, other_hw) == 5
    assert placement_revision(None, counts) == 1


def test_solve_plans_observed_demand_above_the_budget_and_plan_show_flags_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "ipnext.yaml"
    config.write_text(f"fleet_file: {REPO / 'config' / 'fleet.dev.yaml'}\nstate_dir: state\n")
    monkeypatch.setattr(_context, "settings", lambda: load_settings(config))
    ranker = load_model_spec(RANKER)  # declares us-east 60, eu-west 30
    seen = ModelDemand(
        model=ranker.name,
        window_seconds=60,
        history_seconds=7200,
        regions=["us-east"],
        sources={"us-east": SourceView(declared_qps=60, requests=60_000, rate_qps=900, peak_qps=1000)},
    )
    sizing = plan_demand(dict(ranker.traffic.peak_qps), seen, 0.2, 3600, ["us-east", "eu-west"])
    env = ActivityEnvironment()
    entries = [ModelEntry(spec=ranker, plan=None)]
    declared: SolveFleetResult = env.run(
        fleet_activities.solve_fleet_plan,
        SolveFleetInput(models=entries, time_limit_s=20, churn_cost=0.05, made_by="test"),
    )
    observed: SolveFleetResult = env.run(
        fleet_activities.solve_fleet_plan,
        SolveFleetInput(
            models=entries, time_limit_s=20, churn_cost=0.05, made_by="test", demand={ranker.name: sizing}
        ),
    )

    def dense_replicas(result: SolveFleetResult) -> int:
        placement = result.changed[ranker.name].deployments[f"{ranker.name}/dense"]
        return sum(n for by_hw in placement.replicas.values() for n in by_hw.values())

    # dense serves 300 qps a replica, 20% kept as headroom: 1200 + 30 qps need at least 6.
    assert dense_replicas(declared) == 1 and dense_replicas(observed) >= 6
    assert declared.demand[ranker.name].note == "observed demand not read"
    east = observed.demand[ranker.name].sources["us-east"]
    assert (east.used, east.planned_qps, east.observed_peak_qps, east.over_budget) == (
        "observed",
        1200,
        1000,
        True,
    )
    stored = PlanStore(tmp_path / "state").load()
    assert stored.demand == observed.demand
    shown = subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", "--config", str(config), "plan", "show"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert "feed-ranker: observed weighed in (7200 s of history" in shown.stdout
    assert "OVER BUDGET: observed 1000 > declared 60" in shown.stdout
    assert "planned        30 (declared; declared 30, observed peak 0)" in shown.stdout


def test_a_plan_stored_before_observed_demand_still_loads(tmp_path: Path) -> None:
    store = PlanStore(tmp_path)
    plan = _plan({"m/a": {"us-east": {"cpu": 1}}})
    stored = StoredPlan(
        revision=1,
        created_at=now(),
        made_by="t",
        models=["m"],
        moves=[],
        plan=plan.to_report(),
        pools=[],
        units={},
    )
    data = json.loads(stored.model_dump_json())
    del data["demand"]
    store.folder.mkdir(parents=True)
    (store.folder / "rev-000001.json").write_text(json.dumps(data))
    (store.folder / "latest.json").write_text(json.dumps({"revision": 1}))
    assert store.load().demand == {}


class _FakeActor:
    def __init__(self, report: dict[str, Any] | Exception) -> None:
        self.report = report
        self.demand = self

    def remote(self, window: float) -> dict[str, Any] | Exception:
        return self.report


def test_reading_observed_demand_sums_regions_and_a_dead_actor_leaves_declared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    config = tmp_path / "ipnext.yaml"
    config.write_text(
        f"fleet_file: {REPO / 'config' / 'fleet.dev.yaml'}\nstate_dir: state\n"
        "demand: {window_seconds: 10, margin: 0.5, min_history_seconds: 30}\n"
    )
    monkeypatch.setattr(_context, "settings", lambda: load_settings(config))
    monkeypatch.setattr(_context, "writer", lambda: None)
    now = time.time()
    start = int(now // 10) * 10 - 10  # the last ended window
    east, west = DemandHistory(), DemandHistory()
    east.record("r", {"us-east": 0}, start - 60)  # a minute of history before it
    east.record("r", {"us-east": 40}, start + 1)
    west.record("r", {"us-east": 20}, start + 2)
    actors: dict[str, Any] = {
        "ipnext-metrics/m/us-east": _FakeActor(demand_report(east, now, 10).model_dump(mode="json")),
        "ipnext-metrics/m/eu-west": _FakeActor(demand_report(west, now, 10).model_dump(mode="json")),
        "ipnext-metrics/dead/us-east": _FakeActor(ray.exceptions.RayActorError()),
    }

    def get_actor(name: str, namespace: str) -> Any:
        if name not in actors:
            raise ValueError(name)
        return actors[name]

    def get(value: Any, timeout: float) -> Any:
        if isinstance(value, Exception):
            raise value
        return value

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", get)
    declared = {"m": {"us-east": 2.0}, "dead": {"us-east": 2.0}, "quiet": {"us-east": 2.0}}
    result: ReadDemandResult = ActivityEnvironment().run(
        fleet_activities.read_observed_demand, ReadDemandInput(declared=declared, interval_s=3600)
    )
    m = result.demand["m"]
    assert m.observed and m.window_seconds == 10 and m.history_seconds >= 60
    assert m.sources["us-east"].observed_peak_qps == 6.0  # 60 requests over both regions in 10 s
    assert m.sources["us-east"].planned_qps == 9.0 and m.sources["us-east"].used == "observed"
    dead, quiet = result.demand["dead"], result.demand["quiet"]
    assert not dead.observed and "RayActorError" in dead.note and dead.demand_qps() == {"us-east": 2.0}
    assert not quiet.observed and quiet.note == "no observed demand"


def _empty_plan(revision: int) -> StoredPlan:
    plan = _plan({"m/a": {"us-east": {"cpu": 1}}}).to_report()
    return StoredPlan(
        revision=revision, created_at=now(), made_by="t", models=[], moves=[], plan=plan, pools=[], units={}
    )


def test_solves_finishing_together_never_share_a_revision(tmp_path: Path) -> None:
    """`claim_revision` under the store's lock: 4 processes of 8 threads claiming at once get 32
    different numbers, each above the stored ones; a save clears its claim."""
    store = PlanStore(tmp_path)
    store.save(_empty_plan(1))
    claimer = (
        "import sys; from concurrent.futures import ThreadPoolExecutor; from pathlib import Path\n"
        "from ipnext.store.plans import PlanStore\n"
        "store = PlanStore(Path(sys.argv[1]))\n"
        "with ThreadPoolExecutor(8) as pool:\n"
        "    print(*pool.map(lambda _: store.claim_revision(), range(8)))\n"
    )
    runs = [
        subprocess.Popen([sys.executable, "-c", claimer, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    claimed = [int(n) for run in runs for n in run.communicate(timeout=60)[0].split()]
    assert sorted(claimed) == list(range(2, 34)), claimed
    assert store.next_revision() == 34
    store.save(_empty_plan(2))
    assert not (store.folder / "rev-000002.claim").exists() and store.latest_revision() == 2
