"""Lost regions without a server: the node check's judgement, the emergency problem and what it
relaxes (solved by the real planner), and the routing documents' failover rows."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError
from temporalio.testing import ActivityEnvironment

from ipnext.activities import _context
from ipnext.activities import fleet as fleet_activities
from ipnext.activities.fleet import ModelEntry, SolveFleetInput, SolveFleetResult
from ipnext.contracts.fleet import NodeSighting, RegionDownInput, RegionHealth, RegionState, RegionUpInput
from ipnext.contracts.plan import DeploymentPlacement, Plan, PlanningProblem
from ipnext.contracts.routing import failover_routes, routes_from_plan
from ipnext.errors import InfeasiblePlanError
from ipnext.planner import check_plan, solve
from ipnext.policy.regions import detect_changes, lost_region_problems, region_nodes
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet
from ipnext.spec.model import load_model_spec
from ipnext.spec.settings import load_settings
from ipnext.store.plans import PlanStore, StoredPlan

REPO = Path(__file__).resolve().parents[2]
RANKER = REPO / "examples" / "click_ranker" / "model.yaml"

THREE = Fleet.model_validate(
    {
        "regions": ["us-east", "us-west", "eu-west"],
        "hardware": {"cpu": {"kind": "cpu"}},
        "pools": [
            {"region": "us-east", "hardware": "cpu", "units": 8, "unit_cost": 1.0},
            {"region": "us-west", "hardware": "cpu", "units": 8, "unit_cost": 1.1},
            {"region": "eu-west", "hardware": "cpu", "units": 8, "unit_cost": 1.2},
        ],
        "latency_ms": {
            "us-east": {"us-west": 30, "eu-west": 40},
            "us-west": {"us-east": 30, "eu-west": 70},
            "eu-west": {"us-east": 40, "us-west": 70},
        },
    }
)


def _dep(name: str = "m/a", **update: object) -> DeploymentDemand:
    fields: dict[str, object] = {
        "name": name,
        "hardware": {"cpu": {"units": 1, "qps": 100}},
        "demand_qps": {"us-east": 100, "eu-west": 60},
        "latency_budget_ms": 50,
        "min_regions": 2,
        "survive_region_loss": True,
        "group": name.split("/")[0],
    }
    return DeploymentDemand.model_validate({**fields, **update})


# -- detection -----------------------------------------------------------------------------


def _states(**health: tuple[RegionHealth, bool]) -> dict[str, RegionState]:
    return {r: RegionState(region=r, health=h, detected=d) for r, (h, d) in health.items()}


def test_a_region_is_down_when_every_node_of_it_is_dead_and_not_before() -> None:
    up = (RegionHealth.UP, False)
    states = _states(**{"us-east": up, "eu-west": up, "us-west": up})
    nodes = [
        NodeSighting(node_id="head", alive=True, regions=[]),
        NodeSighting(node_id="e1", alive=True, regions=["us-east"]),
        NodeSighting(node_id="w1", alive=False, regions=["eu-west"]),
        NodeSighting(node_id="w2", alive=True, regions=["eu-west"]),  # a region partly lost still serves
        NodeSighting(node_id="u1", alive=False, regions=["us-west"]),
    ]
    changes = detect_changes(states, nodes)
    assert [(c.region, c.health) for c in changes] == [("us-west", RegionHealth.DOWN)]
    assert "u1" in changes[0].reason and changes[0].dead_nodes == ["u1"]
    # A region no node carries (the single-node stack declares them all on one node, or none) is
    # never judged.
    assert detect_changes(states, [NodeSighting(node_id="head", alive=False, regions=[])]) == []


def test_a_killed_node_ray_lists_without_its_resources_makes_its_region_down() -> None:
    # What Ray's table holds seconds after a region's node is killed: the node, dead, with no
    # resources left to say which region it carried; only the state's last sighting ties it.
    states = _states(**{"us-east": (RegionHealth.UP, False), "eu-west": (RegionHealth.UP, False)})
    states["eu-west"] = states["eu-west"].model_copy(update={"alive_nodes": ["w1"]})
    states["us-east"] = states["us-east"].model_copy(update={"alive_nodes": ["e1", "e2"]})
    nodes = [
        NodeSighting(node_id="w1", alive=False, regions=[]),
        NodeSighting(node_id="e1", alive=True, regions=["us-east"]),  # e2 gone from the table
    ]
    changes = detect_changes(states, nodes)
    assert [(c.region, c.health) for c in changes] == [("eu-west", RegionHealth.DOWN)]
    assert changes[0].dead_nodes == ["w1"]
    assert [(n.node_id, n.alive) for n in region_nodes("us-east", states["us-east"], nodes)] == [
        ("e1", True),
        ("e2", False),
    ]
    # Without the state's memory (runs that replay from before it) the region was never judged.
    assert detect_changes(states, nodes, remember=False) == []


def test_a_region_ipnext_found_down_comes_up_with_its_nodes_but_one_on_call_holds_down_stays() -> None:
    states = _states(**{"us-east": (RegionHealth.DOWN, True), "eu-west": (RegionHealth.DOWN, False)})
    nodes = [
        NodeSighting(node_id="old", alive=False, regions=["us-east"]),
        NodeSighting(node_id="new", alive=True, regions=["us-east"]),
        NodeSighting(node_id="w", alive=True, regions=["eu-west"]),
    ]
    changes = detect_changes(states, nodes)
    assert [(c.region, c.health) for c in changes] == [("us-east", RegionHealth.UP)]
    assert changes[0].alive_nodes == ["new"]


def test_on_call_inputs_name_the_field_that_is_missing() -> None:
    with pytest.raises(ValidationError, match="who"):
        RegionDownInput(region="eu-west", reason="fire", who="  ")
    with pytest.raises(ValidationError, match="reason"):
        RegionDownInput(region="eu-west", reason="", who="alice")
    with pytest.raises(ValidationError, match="region"):
        RegionUpInput(region="EU West", who="alice")
    assert RegionDownInput(region="eu-west", reason=" fire ", who="alice").reason == "fire"


# -- the emergency problem -------------------------------------------------------------------


def test_losing_a_region_relaxes_only_what_the_survivors_cannot_meet() -> None:
    problem = PlanningProblem(fleet=THREE, deployments=[_dep(min_regions=3)])
    first = lost_region_problems(problem, ["eu-west"])[0]
    assert sorted(p.region for p in first.problem.fleet.pools) == ["us-east", "us-west"]
    assert first.problem.fleet.regions == THREE.regions  # eu-west's callers still call
    dep = first.problem.deployments[0]
    assert dep.min_regions == 2 and dep.survive_region_loss  # two survivors: survival still possible
    assert [(r.constraint, r.was, r.now) for r in first.relaxed] == [("min_regions", "3", "2")]
    plan = solve(first.problem)
    assert check_plan(first.problem, plan) == []
    assert "eu-west" not in plan.deployments["m/a"].regions()
    # eu-west's callers are served from the survivors within the budget (us-east, 40 ms).
    assert plan.deployments["m/a"].fractions["eu-west"] == {"us-east": 1.0}


def test_with_one_survivor_survival_and_spread_are_dropped_and_far_callers_raise_the_budget() -> None:
    problem = PlanningProblem(fleet=THREE, deployments=[_dep(demand_qps={"us-east": 50, "us-west": 50})])
    first = lost_region_problems(problem, ["us-east", "eu-west"])[0]
    dep = first.problem.deployments[0]
    assert (dep.min_regions, dep.survive_region_loss) == (1, False)
    assert dep.latency_budget_ms == 50  # us-west's survivor is itself; us-east is 30 ms away
    assert sorted(r.constraint for r in first.relaxed) == ["min_regions", "survive_region_loss"]
    far = PlanningProblem(fleet=THREE, deployments=[_dep(demand_qps={"eu-west": 50}, min_regions=1)])
    attempt = lost_region_problems(far, ["us-east", "us-west"])[0]
    assert attempt.problem.deployments[0].latency_budget_ms == 50  # eu-west still hosts itself
    lost_home = lost_region_problems(far, ["eu-west", "us-east"])[0]
    assert lost_home.problem.deployments[0].latency_budget_ms == 70
    assert any(r.constraint == "latency_budget_ms" and "eu-west" in r.why for r in lost_home.relaxed)
    assert check_plan(lost_home.problem, solve(lost_home.problem)) == []


def test_when_the_survivors_are_too_small_for_spare_capacity_survival_goes_next() -> None:
    # One replica per pool carries 80 QPS: the two survivors carry 160 >= 140, but surviving
    # another loss would need all 140 in one of them.
    small = THREE.model_copy(update={"pools": [p.model_copy(update={"units": 1}) for p in THREE.pools]})
    problem = PlanningProblem(fleet=small, deployments=[_dep(demand_qps={"us-east": 90, "eu-west": 50})])
    attempts = lost_region_problems(problem, ["eu-west"])
    assert len(attempts) == 3
    with pytest.raises(InfeasiblePlanError):
        solve(attempts[0].problem)  # 160 QPS in a region of 2 x 80: survival cannot be met
    plan = solve(attempts[1].problem)
    assert check_plan(attempts[1].problem, plan) == []
    assert [str(r).split(":")[1].split()[0] for r in attempts[1].relaxed] == ["survive_region_loss"]


def test_no_region_left_or_an_unknown_one_is_refused_by_name() -> None:
    problem = PlanningProblem(fleet=THREE, deployments=[_dep()])
    with pytest.raises(InfeasiblePlanError, match="every region with pools is down"):
        lost_region_problems(problem, ["us-east", "us-west", "eu-west"])
    with pytest.raises(InfeasiblePlanError, match="mars"):
        lost_region_problems(problem, ["mars"])


def test_the_solve_activity_plans_without_the_down_region_and_stores_what_it_relaxed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "ipnext.yaml"
    config.write_text(f"fleet_file: {REPO / 'config' / 'fleet.dev.yaml'}\nstate_dir: state\n")
    monkeypatch.setattr(_context, "settings", lambda: load_settings(config))
    ranker = load_model_spec(RANKER)
    spread = ranker.model_copy(
        update={
            "availability": ranker.availability.model_copy(
                update={"min_regions": 2, "survive_region_loss": True}
            )
        }
    )
    env = ActivityEnvironment()

    def run(models: list[ModelEntry], down: list[str]) -> SolveFleetResult:
        result: SolveFleetResult = env.run(
            fleet_activities.solve_fleet_plan,
            SolveFleetInput(
                models=models, time_limit_s=20, churn_cost=0.05, made_by="test", down_regions=down
            ),
        )
        return result

    first = run([ModelEntry(spec=spread, plan=None)], [])
    assert first.relaxed == []
    before = first.changed["feed-ranker"]
    assert {r for p in before.deployments.values() for r in p.regions()} == {"us-east", "eu-west"}
    lost = run([ModelEntry(spec=spread, plan=before)], ["eu-west"])
    after = lost.changed["feed-ranker"]
    assert {r for p in after.deployments.values() for r in p.regions()} == {"us-east"}
    assert after.deployments["feed-ranker/embed"].fractions["eu-west"] == {"us-east": 1.0}
    assert sorted(x.split(":")[1].split()[0] for x in lost.relaxed) == ["min_regions", "survive_region_loss"]
    stored = PlanStore(tmp_path / "state").load()
    assert stored.down_regions == ["eu-west"]
    assert {r.constraint for r in stored.relaxed} == {"min_regions", "survive_region_loss"}
    shown = cli("--config", str(config), "plan", "show")
    assert shown.returncode == 0, shown.stderr
    assert "planned without the down regions: eu-west" in shown.stdout
    assert "relaxed feed-ranker: min_regions 2 -> 1" in shown.stdout
    assert "relaxed feed-ranker: survive_region_loss true -> false" in shown.stdout


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_the_cli_refuses_a_region_change_naming_the_field_before_asking_anyone(tmp_path: Path) -> None:
    config = tmp_path / "ipnext.yaml"
    # No Temporal at this address: a refusal here never reached it.
    config.write_text(
        f"fleet_file: {REPO / 'config' / 'fleet.dev.yaml'}\ntemporal: {{address: 127.0.0.1:9}}\n"
    )
    unknown = cli(
        "--config", str(config), "fleet", "region", "down", "mars", "--reason", "x", "--who", "alice"
    )
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("ipnext: region: 'mars' is not a region of the fleet"), unknown.stderr
    assert "Fix: name one of ['us-east', 'eu-west']" in unknown.stderr
    no_who = cli("--config", str(config), "fleet", "region", "down", "eu-west", "--reason", "x")
    assert no_who.returncode == 2 and "--who" in no_who.stderr
    empty = cli(
        "--config", str(config), "fleet", "region", "down", "eu-west", "--reason", " ", "--who", "alice"
    )
    assert empty.returncode == 2 and empty.stderr.startswith("ipnext: reason: empty; say why"), empty.stderr


def test_plans_stored_before_lost_regions_still_read(tmp_path: Path) -> None:
    old = {
        "revision": 1,
        "created_at": "2026-01-01T00:00:00Z",
        "made_by": "fleet-replan/run/abc",
        "models": ["m"],
        "moves": [],
        "plan": {"placements": [], "routing": [], "cost": 0.0},
        "pools": [],
        "units": {},
    }
    stored = StoredPlan.model_validate(old)
    assert stored.down_regions == [] and stored.relaxed == []


# -- routing around a down region ------------------------------------------------------------


def _two_part_plan() -> tuple[Plan, list[DeploymentDemand]]:
    deps = [
        _dep("m/a", survive_region_loss=False),
        _dep("m/b", survive_region_loss=False, hardware={"cpu": {"units": 1, "qps": 50}}),
    ]
    fractions = {
        "us-east": {"us-east": 1.0},
        "eu-west": {"eu-west": 0.5, "us-west": 0.5},
        "us-west": {"eu-west": 1.0},
    }
    replicas = {
        "m/a": {"us-east": {"cpu": 2}, "us-west": {"cpu": 4}, "eu-west": {"cpu": 1}},
        "m/b": {"us-east": {"cpu": 4}, "us-west": {"cpu": 2}, "eu-west": {"cpu": 2}},
    }
    plan = Plan(
        deployments={n: DeploymentPlacement(replicas=r, fractions=fractions) for n, r in replicas.items()},
        cost=1.0,
        solver="test",
    )
    return plan, deps


def test_failover_keeps_surviving_shares_and_sends_orphaned_sources_to_spare_capacity() -> None:
    plan, deps = _two_part_plan()
    routes = routes_from_plan("m", plan)
    out = failover_routes(routes, plan, deps, THREE, ["eu-west"])
    assert out["us-east"] == {"us-east": 1.0}  # untouched
    assert out["eu-west"] == {"us-west": 1.0}  # its surviving share, renormalized
    # us-west's callers were served only by eu-west: they go to the regions within 50 ms of
    # us-west (us-east 30 ms, itself 0), by spare capacity. Capacity is the weakest part's:
    # us-east min(2x100, 4x50) x 0.8 = 160, us-west min(4x100, 2x50) x 0.8 = 80. Load from the
    # plan: us-east 100 (its own callers), us-west 30 (half of eu-west's 60). Spare: 60 and 50.
    assert out["us-west"] == pytest.approx({"us-east": 60 / 110, "us-west": 50 / 110})
    assert failover_routes(routes, plan, deps, THREE, []) == routes


def test_failover_of_a_source_with_no_survivor_in_budget_goes_to_the_nearest() -> None:
    plan, deps = _two_part_plan()
    routes = {"eu-west": {"eu-west": 1.0}}
    out = failover_routes(routes, plan, deps, THREE, ["eu-west", "us-east"])
    assert out == {"eu-west": {"us-west": 1.0}}  # 70 ms, over the 50 ms budget, but the only one
    assert failover_routes(routes, plan, deps, THREE, ["eu-west", "us-east", "us-west"]) == {}


def test_failover_rows_sum_to_one() -> None:
    plan, deps = _two_part_plan()
    for down in (["us-east"], ["us-west"], ["eu-west"], ["us-east", "eu-west"]):
        out = failover_routes(routes_from_plan("m", plan), plan, deps, THREE, down)
        for row in out.values():
            assert sum(row.values()) == pytest.approx(1.0)
            assert not set(row) & set(down)


def test_a_plan_whose_solve_began_before_the_latest_one_is_kept_but_never_becomes_latest(
    tmp_path: Path,
) -> None:
    """The Schedule's run, cancelled by an emergency replan, may still finish its solve after
    the emergency one: its plan is stored under the next number, and `plan show` stays on the
    emergency plan."""
    store = PlanStore(tmp_path)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)

    def stored(revision: int, started_after_s: float | None, down: list[str]) -> StoredPlan:
        return StoredPlan(
            revision=revision,
            created_at=t0 + timedelta(seconds=100 + revision),
            made_by="test",
            models=[],
            moves=[],
            plan={"placements": [], "routing": [], "cost": 0.0},
            pools=[],
            units={},
            down_regions=down,
            solve_started_at=None if started_after_s is None else t0 + timedelta(seconds=started_after_s),
        )

    store.save(stored(1, None, []))  # stored before solves were timed: always latest
    assert store.next_revision() == 2
    store.save(stored(2, 50, ["eu-west"]))  # the emergency replan, begun at t0 + 50 s
    store.save(stored(3, 10, []))  # the Schedule's run, begun at t0 + 10 s, done last
    assert store.latest_revision() == 2 and store.load().down_regions == ["eu-west"]
    assert store.load(3).down_regions == [] and store.next_revision() == 4
    store.save(stored(4, 60, []))  # the region's return replan, begun later: latest again
    assert store.latest_revision() == 4


def test_when_the_survivors_cannot_hold_the_spares_they_are_dropped_after_survival() -> None:
    """A model with a spare replica per region: with a region lost, the survivors first keep the
    spares; when they cannot hold them, the spares go (said in the relaxations) before spread."""
    small = THREE.model_copy(update={"pools": [p.model_copy(update={"units": 1}) for p in THREE.pools]})
    spare = _dep(demand_qps={"us-east": 90, "eu-west": 50}, survive_region_loss=False, spare_replicas=1)
    attempts = lost_region_problems(PlanningProblem(fleet=small, deployments=[spare]), ["eu-west"])
    assert [a.problem.deployments[0].spare_replicas for a in attempts] == [1, 0, 0]
    assert [(r.constraint, r.was, r.now) for r in attempts[1].relaxed] == [("spare_replicas", "1", "0")]
    with pytest.raises(InfeasiblePlanError):
        solve(attempts[0].problem)  # a region of one replica cannot keep one back
    assert check_plan(attempts[1].problem, solve(attempts[1].problem)) == []
