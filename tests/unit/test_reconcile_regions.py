"""The serving check against a region's node: a region with no live Ray node is left alone
(nothing is applied there, so no router version is made that no replica can start), and a
router Serve gave up on in a live region is applied again at the next generation. The activity
runs in Temporal's ActivityEnvironment against a writer and a Serve status held in memory (the
seams `_context.writer`, `control.serve_applications`, `control.live_regions`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from temporalio.testing import ActivityEnvironment

from ipnext.activities import _context, reconcile
from ipnext.activities.reconcile import ReconcileInput, ReconcileResult, reconcile_serving
from ipnext.contracts.plan import DeploymentPlacement, Plan
from ipnext.serving import control
from ipnext.serving.app_health import given_up
from ipnext.serving.layout import ROUTING_APP, deployed_router, render_router_app, router_app_name
from ipnext.serving.pool_layout import is_placeholder, serving_apps
from ipnext.spec.model import ModelSpec, SetStatus, SnapshotRef, SnapshotSet
from ipnext.spec.settings import Settings

REPO = Path(__file__).resolve().parents[2]
REGIONS = ("us-east", "eu-west")
SPEC = ModelSpec.model_validate(
    {
        "name": "rc-model",
        "owner": "tests",
        "parts": {"embed": {"factory": "m:f", "hardware": {"cpu-std": {"units": 1, "qps": 100}}}},
        "dag": [["input", "embed"], ["embed", "output"]],
        "traffic": {"peak_qps": {"us-east": 10, "eu-west": 10}},
        "latency_budget_ms": 50,
    }
)
SERVING_SET = SnapshotSet(
    id="rc-model@1",
    number=1,
    version="v1",
    parts={"embed": SnapshotRef(uri="file:///snap/v1", sha256="a" * 64, snapshot_id="rc-model/embed@v1")},
    status=SetStatus.SERVING,
    published_at=datetime(2026, 12, 1, tzinfo=UTC),
)
PLAN = Plan(
    deployments={
        "rc-model/embed": DeploymentPlacement(
            replicas={r: {"cpu-std": 1} for r in REGIONS}, fractions={r: {r: 1.0} for r in REGIONS}
        )
    },
    cost=2.0,
    solver="test",
    revision=1,
)
APPS = {r: f"rc-model.{r}.s1.r1" for r in REGIONS}


def deployment(status: str, trigger: str, **replicas: int) -> SimpleNamespace:
    return SimpleNamespace(
        status=f"DeploymentStatus.{status}",
        status_trigger=f"DeploymentStatusTrigger.{trigger}",
        replica_states=replicas,
        message=f"{status} because {trigger}",
    )


def app(status: str, **deployments: SimpleNamespace) -> SimpleNamespace:
    return SimpleNamespace(status=f"ApplicationStatus.{status}", message="", deployments=deployments)


RUNNING_APP = app("RUNNING", router=deployment("HEALTHY", "CONFIG_UPDATE_COMPLETED", RUNNING=1))


class _Method:
    def __init__(self, call: Any) -> None:
        self.remote = call


@dataclass
class Cluster:
    """The writer's desired state and Serve's status, in memory: an apply makes its apps RUNNING."""

    held: dict[str, dict[str, Any]] = field(default_factory=dict)
    listed: dict[str, Any] = field(default_factory=dict)
    live: set[str] = field(default_factory=lambda: set(REGIONS))
    applied: list[list[str]] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # The worker's shared status read, when a test holds one a tick old (None: always fresh).
    shared: dict[str, Any] | None = None
    reads: list[float] = field(default_factory=list)  # the age each status read accepted

    def serve_applications(self, max_age_s: float = 0.0) -> dict[str, Any]:
        self.reads.append(max_age_s)
        return dict(self.shared if self.shared is not None and max_age_s > 0 else self.listed)

    def pooled(self, names: list[str]) -> dict[str, list[str]]:
        return {n: serving_apps(self.held[n]) for n in names if is_placeholder(self.held.get(n, {}))}

    def writer(self) -> SimpleNamespace:
        def apply(
            upserts: list[dict[str, Any]], removes: list[str], envelope: Any = None, fold: Any = None
        ) -> int:
            self.applied.append(sorted(a["name"] for a in upserts))
            for name in removes:
                self.removed.append(name)
                self.held.pop(name, None)
                self.listed.pop(name, None)
            for config in upserts:
                self.held[config["name"]] = config
                self.listed[config["name"]] = RUNNING_APP
            return len(self.applied)

        return SimpleNamespace(
            app_names=_Method(lambda: sorted(self.held)),
            app_configs=_Method(lambda names: {n: self.held.get(n) for n in names}),
            apply=_Method(apply),
            redeploy=_Method(lambda envelope=None: 0),
            routing_generation=_Method(lambda model: 1),
            pooled=_Method(
                lambda names: {
                    n: serving_apps(self.held[n]) for n in names if is_placeholder(self.held.get(n, {}))
                }
            ),
        )


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Cluster:
    cluster = Cluster()
    settings = Settings(
        state_dir=tmp_path, fleet_file=REPO / "examples" / "planning" / "fleet-3-regions.yaml"
    )
    writer = cluster.writer()
    monkeypatch.setattr(_context, "settings", lambda: settings)
    monkeypatch.setattr(_context, "writer", lambda: writer)
    monkeypatch.setattr(reconcile, "_ray_get", lambda ref: ref)
    monkeypatch.setattr(control, "serve_applications", cluster.serve_applications)
    monkeypatch.setattr(control, "live_regions", lambda: set(cluster.live))
    monkeypatch.setattr(control, "wait_apps_running", lambda names, timeout_s, heartbeat=None: None)
    monkeypatch.setattr(control, "wait_served", lambda writer, names, timeout_s, heartbeat=None: None)
    return cluster


def check(cluster: Cluster) -> ReconcileResult:
    input = ReconcileInput(spec=SPEC, serving_set=SERVING_SET, plan=PLAN, apps=APPS)
    result: ReconcileResult = ActivityEnvironment().run(reconcile_serving, input)
    return result


def test_a_region_with_no_live_node_is_left_alone(cluster: Cluster) -> None:
    cluster.live = {"us-east"}
    result = check(cluster)
    assert result.left_alone == ["eu-west"]
    assert cluster.applied == [sorted([APPS["us-east"], router_app_name("rc-model", "us-east")])]
    assert not [n for n in cluster.held if "eu-west" in n], sorted(cluster.held)
    # Once a node of it is alive again, its apps are checked, and pushed since the writer lost them.
    cluster.live = set(REGIONS)
    again = check(cluster)
    assert again.left_alone == []
    assert cluster.applied[-1] == sorted([APPS["eu-west"], router_app_name("rc-model", "eu-west")])


def test_a_router_serve_gave_up_on_is_applied_again_at_the_next_generation(cluster: Cluster) -> None:
    check(cluster)  # everything applied once and RUNNING
    name = router_app_name("rc-model", "eu-west")
    before = deployed_router(cluster.held[name])
    assert before is not None
    cluster.listed[name] = app("UNHEALTHY", router=deployment("UNHEALTHY", "REPLICA_STARTUP_FAILED"))
    result = check(cluster)
    assert cluster.applied[-1] == [name]
    after = deployed_router(cluster.held[name])
    assert after is not None and after.config.generation == before.config.generation + 1
    assert result.generations["eu-west"] == after.config.generation
    assert any(line.startswith(f"{name}: Serve gave up starting router") for line in result.repaired)


def test_a_router_whose_replica_serve_is_replacing_is_not_applied_again(cluster: Cluster) -> None:
    check(cluster)
    applied = len(cluster.applied)
    name = router_app_name("rc-model", "eu-west")
    # A replica failed its health check and Serve starts its replacement: nothing to deploy, and
    # the check reports the app as it is.
    cluster.listed[name] = app("UNHEALTHY", router=deployment("UNHEALTHY", "HEALTH_CHECK_FAILED", STARTING=1))
    with pytest.raises(Exception, match=f"Serve app {name} is ApplicationStatus.UNHEALTHY"):
        check(cluster)
    assert len(cluster.applied) == applied


def test_the_models_idle_check_removes_set_apps_the_record_does_not_know(cluster: Cluster) -> None:
    """A rollout terminated from the Temporal UI never ran its cleanup: its set's apps keep
    running. The idle check removes every set app of the model the record does not name, held
    by the writer or only listed by Serve; another model's apps and the routers stay. A
    rollout's own check (its `sets`) removes nothing."""
    check(cluster)
    terminated = {f"rc-model.{r}.s2.r1": {"name": f"rc-model.{r}.s2.r1"} for r in REGIONS}
    cluster.held |= terminated
    cluster.listed |= dict.fromkeys(terminated, RUNNING_APP)
    cluster.listed["rc-model.us-east.s3.r2"] = RUNNING_APP  # only Serve has it (a writer restarted)
    others = {"rc-model-2.us-east.s2.r1", "rc-model.us-east", ROUTING_APP}
    cluster.listed |= dict.fromkeys(others, RUNNING_APP)
    setup = list(cluster.applied)
    rollout = ReconcileInput(
        spec=SPEC,
        serving_set=SERVING_SET,
        plan=PLAN,
        apps=APPS,
        sets=[reconcile.SetTarget(snapshot_set=SERVING_SET, plan=PLAN)],
    )
    ActivityEnvironment().run(reconcile_serving, rollout)
    assert cluster.removed == []
    result = check(cluster)
    assert sorted(cluster.removed) == sorted([*terminated, "rc-model.us-east.s3.r2"])
    assert others <= set(cluster.listed) and set(APPS.values()) <= set(cluster.held)
    assert [line for line in result.repaired if "not in the record" in line] == [
        f"{n}: not in the record (a rollout that did not clean up); removed" for n in sorted(cluster.removed)
    ]
    assert cluster.applied[: len(setup)] == setup
    cluster.live = {"us-east"}  # a serving app of a lost region is the record's: kept
    assert check(cluster).repaired == [] and set(APPS.values()) <= set(cluster.held)


def test_given_up_reads_serves_status() -> None:
    assert given_up(RUNNING_APP) is None
    replacing = app("UNHEALTHY", router=deployment("UNHEALTHY", "HEALTH_CHECK_FAILED", STARTING=1))
    assert given_up(replacing) is None
    failed = app("UNHEALTHY", router=deployment("UNHEALTHY", "REPLICA_STARTUP_FAILED", STARTING=0))
    assert (
        given_up(failed)
        == "Serve gave up starting router (UNHEALTHY: UNHEALTHY because REPLICA_STARTUP_FAILED)"
    )
    # A deployment with a replica of its version running has not been given up on.
    serving = app("UNHEALTHY", router=deployment("UNHEALTHY", "REPLICA_STARTUP_FAILED", RUNNING=1))
    assert given_up(serving) is None
    assert given_up(SimpleNamespace(deployments=None)) is None


def test_a_leftover_a_router_still_routes_to_goes_only_after_the_router_moved(cluster: Cluster) -> None:
    """A rollout terminated at 30%: its router still sends 30% to the new set's app. The check
    puts the router back on the serving set and keeps the app; the next check removes it (both
    at once left a request routed there before the switch waiting on a vanished app until its
    deadline: CI, a 504 in the on-call drill)."""
    check(cluster)
    name = router_app_name("rc-model", "us-east")
    terminated = "rc-model.us-east.s2.r1"
    had = deployed_router(cluster.held[name])
    assert had is not None
    split = had.config.model_copy(update={"weights": {APPS["us-east"]: 70.0, terminated: 30.0}})
    cluster.held[name] = render_router_app("rc-model", "us-east", split, SPEC.router)
    cluster.held[terminated] = {"name": terminated}
    cluster.listed[terminated] = RUNNING_APP
    first = check(cluster)
    assert cluster.removed == [] and any(
        line.startswith(f"{name}: router weights") for line in first.repaired
    )
    moved = deployed_router(cluster.held[name])
    assert moved is not None and terminated not in moved.config.apps()
    check(cluster)
    assert cluster.removed == [terminated]


def test_a_shared_status_read_a_tick_old_never_makes_a_repair_of_its_own(cluster: Cluster) -> None:
    """The periodic check reads Serve's status from the worker's shared read (one per tick for
    every model); what that read shows missing is confirmed on a read begun now before anything
    is pushed: an app deployed since the shared read is not pushed again."""
    cluster.listed[ROUTING_APP] = RUNNING_APP
    check(cluster)
    applied = list(cluster.applied)
    cluster.shared = {name: a for name, a in cluster.listed.items() if name != APPS["eu-west"]}
    cluster.reads.clear()
    result = check(cluster)
    assert result.repaired == [] and cluster.applied == applied
    assert cluster.reads[0] > 0 and 0.0 in cluster.reads  # shared first, then confirmed fresh
    # Quiet: the shared read alone answers the check.
    cluster.shared = dict(cluster.listed)
    cluster.reads.clear()
    assert check(cluster).repaired == []
    assert cluster.reads and all(age > 0 for age in cluster.reads), cluster.reads
    # Really missing: both reads miss it, and it is pushed.
    cluster.listed.pop(APPS["eu-west"])
    cluster.shared = dict(cluster.listed)
    repaired = check(cluster).repaired
    assert repaired == [f"{APPS['eu-west']}: missing in Serve"], repaired
