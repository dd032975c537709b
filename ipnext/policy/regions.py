"""Lost regions decided (pure): a region is down when every Ray node carrying its resource is dead, and the
planning problem an emergency replan solves without the down regions."""

from __future__ import annotations

from collections.abc import Iterable

from ipnext.contracts.fleet import NodeSighting, RegionChange, RegionHealth, RegionState
from ipnext.contracts.plan import PlanningProblem
from ipnext.errors import InfeasiblePlanError
from ipnext.names import Frozen
from ipnext.spec.demand_file import DeploymentDemand
from ipnext.spec.fleet import Fleet

__all__ = [
    "Relaxation",
    "RelaxedProblem",
    "detect_changes",
    "lost_region_problems",
    "region_nodes",
    "surviving_hosts",
]


def _short(node_ids: Iterable[str]) -> str:
    return ", ".join(n[:12] for n in sorted(node_ids))


def region_nodes(
    region: str, state: RegionState, nodes: list[NodeSighting], *, remember: bool = True
) -> list[NodeSighting]:
    """The nodes of `region` in Ray's node table: those whose resources name it and, with
    `remember`, those the state last saw in it. Ray lists a dead node with no resources at all,
    so only its id ties it to its region; a node last seen alive there and gone from the table
    is counted dead."""
    if not remember:
        return [n for n in nodes if region in n.regions]
    known = set(state.alive_nodes) | set(state.dead_nodes)
    mine = [n for n in nodes if region in n.regions or n.node_id in known]
    listed = {n.node_id for n in nodes}
    gone = sorted(set(state.alive_nodes) - listed)
    return mine + [NodeSighting(node_id=node_id, alive=False, regions=[region]) for node_id in gone]


def detect_changes(
    regions: dict[str, RegionState], nodes: list[NodeSighting], *, remember: bool = True
) -> list[RegionChange]:
    """What Ray's node table says about each region, against what the state holds.

    A region is down when it had nodes and none of them is alive (a partly lost region still
    serves; its nodes as `region_nodes` finds them). A region no node ever carried (its
    resources not declared on this cluster) is left as it is. A region ipnext marked down comes
    up once a node of it is alive again; a region on-call marked down stays down until on-call
    says `region up`."""
    changes = []
    for region, state in sorted(regions.items()):
        mine = region_nodes(region, state, nodes, remember=remember)
        alive = sorted(n.node_id for n in mine if n.alive)
        dead = sorted(n.node_id for n in mine if not n.alive)
        if not mine:
            continue
        if state.health == RegionHealth.UP and not alive:
            changes.append(
                RegionChange(
                    region=region,
                    health=RegionHealth.DOWN,
                    reason=f"every Ray node of {region} is dead ({_short(dead)})",
                    dead_nodes=dead,
                )
            )
        elif state.health == RegionHealth.DOWN and state.detected and alive:
            changes.append(
                RegionChange(
                    region=region,
                    health=RegionHealth.UP,
                    reason=f"Ray nodes of {region} alive again ({_short(alive)})",
                    alive_nodes=alive,
                    dead_nodes=dead,
                )
            )
    return changes


# -- the emergency problem -------------------------------------------------------------------


class Relaxation(Frozen):
    """One constraint an emergency replan relaxed for the regions that survive."""

    subject: str  # the model (a group of deployments) or the deployment
    constraint: str  # min_regions | survive_region_loss | spare_replicas | latency_budget_ms
    was: str
    now: str
    why: str

    def __str__(self) -> str:
        return f"{self.subject}: {self.constraint} {self.was} -> {self.now} ({self.why})"


class RelaxedProblem(Frozen):
    problem: PlanningProblem
    relaxed: list[Relaxation]


def _blocks(deployments: list[DeploymentDemand]) -> list[list[int]]:
    """Deployment indices placed together (a model's parts share `group`), in the planner's order."""
    by_group: dict[str, list[int]] = {}
    blocks: list[list[int]] = []
    for i, dep in enumerate(deployments):
        if dep.group is None:
            blocks.append([i])
        else:
            by_group.setdefault(dep.group, []).append(i)
    return blocks + list(by_group.values())


def surviving_hosts(fleet: Fleet, members: list[DeploymentDemand]) -> list[str]:
    """Regions of `fleet` with a pool that holds a replica of every one of `members`."""
    hosts = []
    for region in fleet.regions:
        fits = all(
            any(
                (pool := fleet.pool(region, hw)) is not None and pool.units >= o.units
                for hw, o in d.hardware.items()
            )
            for d in members
        )
        if fits:
            hosts.append(region)
    return hosts


def lost_region_problems(problem: PlanningProblem, down: list[str]) -> list[RelaxedProblem]:
    """The problems an emergency replan tries in turn, each relaxing more, for the fleet without
    the `down` regions' pools (they stay traffic sources: their callers still call).

    First: `min_regions` lowered to the regions that can still host each model, and
    `survive_region_loss` dropped where fewer than two can; a source with no surviving region
    within the latency budget gets the budget raised to its nearest surviving host (rather than
    no capacity planned for its callers). Then, should the surviving pools be too small for
    spare capacity, `survive_region_loss` dropped everywhere; then spare replicas dropped
    everywhere (`spare_replicas` 0); then `min_regions` 1 everywhere.
    Raises InfeasiblePlanError when no region with pools survives."""
    fleet = problem.fleet
    unknown = sorted(set(down) - set(fleet.regions))
    if unknown:
        raise InfeasiblePlanError(
            f"down regions {unknown} are not regions of the fleet {fleet.regions}.",
            field="down_regions",
            value=unknown,
            fix="name regions of the fleet file",
        )
    kept = [p for p in fleet.pools if p.region not in down]
    if not kept:
        raise InfeasiblePlanError(
            f"every region with pools is down ({sorted(down)}): nothing is left to plan on.",
            field="down_regions",
            value=sorted(down),
            fix="bring a region back (`ipnext fleet region up REGION --who ...`)",
        )
    survivors = fleet.model_copy(update={"pools": kept})
    deployments = list(problem.deployments)
    relaxed: list[Relaxation] = []
    for members in _blocks(deployments):
        group = [deployments[i] for i in members]
        subject = group[0].group or group[0].name
        hosts = surviving_hosts(survivors, group)
        if not hosts:
            raise InfeasiblePlanError(
                f"{subject}: no surviving region has pools for every part (down: {sorted(down)}).",
                field="down_regions",
                value=sorted(down),
                fix="bring a region back, or add pools of its hardware in a surviving region",
            )
        update: dict[str, object] = {}
        need = max(d.min_regions for d in group)
        if need > len(hosts):
            update["min_regions"] = len(hosts)
            relaxed.append(
                Relaxation(
                    subject=subject,
                    constraint="min_regions",
                    was=str(need),
                    now=str(len(hosts)),
                    why=f"only {hosts} can host it with {sorted(down)} down",
                )
            )
        if any(d.survive_region_loss for d in group) and len(hosts) < 2:
            update["survive_region_loss"] = False
            relaxed.append(
                Relaxation(
                    subject=subject,
                    constraint="survive_region_loss",
                    was="true",
                    now="false",
                    why=f"only {hosts} can host it: no second region to fail over to",
                )
            )
        budget = min(d.latency_budget_ms for d in group)
        sources = sorted({s for d in group for s, qps in d.demand_qps.items() if qps > 0})
        needed = budget
        for source in sources:
            nearest = min(survivors.latency(source, r) for r in hosts)
            if nearest > budget and nearest != float("inf"):
                needed = max(needed, nearest)
                relaxed.append(
                    Relaxation(
                        subject=subject,
                        constraint="latency_budget_ms",
                        was=f"{budget:g}",
                        now=f"{nearest:g}",
                        why=f"source {source}: its nearest surviving region is {nearest:g} ms away",
                    )
                )
        if needed > budget:
            update["latency_budget_ms"] = needed
        for i in members:
            deployments[i] = deployments[i].model_copy(update=update)
    first = PlanningProblem(fleet=survivors, deployments=deployments, current=problem.current)
    attempts = [RelaxedProblem(problem=first, relaxed=relaxed)]
    survive = sorted({d.group or d.name for d in deployments if d.survive_region_loss})
    if survive:
        deployments = [d.model_copy(update={"survive_region_loss": False}) for d in deployments]
        relaxed = relaxed + [
            Relaxation(
                subject=s,
                constraint="survive_region_loss",
                was="true",
                now="false",
                why="the surviving pools cannot also hold spare capacity for another lost region",
            )
            for s in survive
        ]
        attempts.append(
            RelaxedProblem(problem=first.model_copy(update={"deployments": deployments}), relaxed=relaxed)
        )
    for constraint, was_of, now, why in (
        (
            "spare_replicas",
            lambda d: d.spare_replicas if d.spare_replicas > 0 else None,
            0,
            "the surviving pools cannot also hold a spare replica per part and region",
        ),
        (
            "min_regions",
            lambda d: d.min_regions if d.min_regions > 1 else None,
            1,
            "the surviving pools cannot spread it over more regions",
        ),
    ):
        found = sorted({d.group or d.name: was_of(d) for d in deployments if was_of(d) is not None}.items())
        if not found:
            continue
        deployments = [d.model_copy(update={constraint: now}) for d in deployments]
        relaxed = relaxed + [
            Relaxation(subject=s, constraint=constraint, was=str(n), now=str(now), why=why) for s, n in found
        ]
        attempts.append(
            RelaxedProblem(problem=first.model_copy(update={"deployments": deployments}), relaxed=relaxed)
        )
    return attempts
