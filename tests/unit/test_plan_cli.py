"""`ipnext plan solve`: the plan JSON, the summary, replanning against --current, and infeasible
demand exiting non-zero with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from ipnext.contracts.plan import Plan, PlanningProblem
from ipnext.planner import check_plan
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import load_fleet

REPO = Path(__file__).resolve().parents[2]
FLEET = REPO / "config" / "fleet.dev.yaml"
DEMAND = REPO / "examples" / "planning" / "demand.yaml"


def plan_solve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ipnext.client.cli", "plan", "solve", "--fleet", str(FLEET), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_solve_writes_a_valid_plan_and_replans_without_moves(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    done = plan_solve("--demand", str(DEMAND), "--out", str(out), "--time-limit", "30")
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["status"] == "optimal" and report["gap"] == 0
    assert report["lower_bound"] <= report["objective"]
    assert "units used" in done.stdout and "us-east" in done.stdout
    demand = [DeploymentDemand.model_validate(d) for d in yaml.safe_load(DEMAND.read_text())["deployments"]]
    problem = PlanningProblem(fleet=load_fleet(FLEET), deployments=demand)
    plan = Plan.from_report(report)
    assert check_plan(problem, plan) == []
    assert plan.cost == report["cost"] > 0

    again = plan_solve("--demand", str(DEMAND), "--current", str(out), "--out", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again.json").read_text())["moved_units"] == 0
    assert "moves against the current plan: 0 units" in again.stdout


def test_plan_solve_names_what_cannot_be_met(tmp_path: Path) -> None:
    data = yaml.safe_load(DEMAND.read_text())
    data["deployments"][2]["demand_qps"] = {"us-east": 100_000}
    demand = tmp_path / "demand.yaml"
    demand.write_text(yaml.safe_dump(data))
    done = plan_solve("--demand", str(demand), "--out", str(tmp_path / "plan.json"))
    assert done.returncode == 2
    assert (  # a NoPlacementError: the InfeasiblePlanError that the exact MIP proved
        done.stderr.startswith("ipnext: pools: no placement")
        and "proved it" in done.stderr
        and "ads-scorer/main needs 100000 QPS" in done.stderr
        and "short by" in done.stderr
    ), done.stderr
    assert not (tmp_path / "plan.json").exists()


def test_plan_solve_proves_when_the_pools_cannot_hold_the_demand_and_names_the_pool_short(
    tmp_path: Path,
) -> None:
    """Each deployment fits alone, the two together do not: the exact MIP over every block
    proves it, and the error names the pool short by how many units and the capacity that
    would fix it."""
    data = yaml.safe_load(DEMAND.read_text())
    scorer = next(d for d in data["deployments"] if d["name"] == "ads-scorer/main")
    option = scorer["hardware"]["cpu-std"]
    # 5 replicas, 10 of the 16 cpu-std units in us-east, the one region its budget reaches.
    scorer["demand_qps"] = {"us-east": 5 * option["qps"] * (1 - scorer.get("headroom", 0.0))}
    data["deployments"].append({**scorer, "name": "ads-scorer/copy"})
    demand = tmp_path / "demand.yaml"
    demand.write_text(yaml.safe_dump(data))
    done = plan_solve("--demand", str(demand), "--out", str(tmp_path / "plan.json"), "--time-limit", "60")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("ipnext: pools: no placement") and "proved it" in done.stderr, done.stderr
    assert "pools short: us-east/cpu-std by" in done.stderr, done.stderr
    assert "add capacity (us-east/cpu-std +" in done.stderr, done.stderr
    assert not (tmp_path / "plan.json").exists()
