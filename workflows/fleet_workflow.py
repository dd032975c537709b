"""FleetWorkflow (id `fleet`): the regions' states, and what a lost region sets off.

It lives as long as the fleet. A region goes down by on-call (`region_down`, until
`region_up`) or by its own check of Ray's node table every `check_seconds` (every node of the
region dead; it comes up by itself once a node of it is alive again). On a change it sends the
down regions' callers to surviving regions at once (the routing documents), cancels the
Schedule's replan in flight, and starts a replan of its own: `fleet-replan/emergency-<n>`
without the down regions (constraints relaxed as their loss forces), `fleet-replan/return-<n>`
when a region came back. The search attributes and details show every region and its replan.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    ChildWorkflowError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import QUICK_TIMEOUT, RECONCILE_RETRY
    from ipnext.activities.pool_check import PoolCheckActivities, PoolCheckInput
    from ipnext.activities.regions import RegionActivities, RouteAroundInput, check_regions
    from ipnext.contracts.fleet import (
        DOWN_BY_IPNEXT,
        FleetReplanInput,
        FleetReplanResult,
        FleetState,
        FleetStatus,
        FleetWorkflowInput,
        RegionChangeResult,
        RegionDownInput,
        RegionEvent,
        RegionHealth,
        RegionsCheckInput,
        RegionState,
        RegionUpInput,
        ReplanRecord,
    )
    from ipnext.contracts.identity import attributed, caller_identity
    from ipnext.names import (
        REGIONS_DOWN_KEY,
        STATE_KEY,
        FleetWorkflowNames,
        Workflows,
        fleet_replan_id,
    )
    from ipnext.policy.regions import detect_changes, region_nodes
    from ipnext.workflows._signals import NO_PAYLOAD, update_input

__all__ = ["FleetWorkflow"]

DOWN_EXAMPLE = '{"region": "eu-west", "reason": "power loss in the data center", "who": "alice"}'
UP_EXAMPLE = '{"region": "eu-west", "who": "alice"}'
REFUSED = "RegionStateError"  # the type of a refused region change (ipnext.errors.RegionStateError)
EMERGENCY, RETURN = "emergency", "return"
# Ray lists a dead node without its resources: since this patch a region's nodes are also the
# ones its state last saw (by id), so a killed node makes its region down. Older runs replay without.
DEAD_NODES_PATCH = "dead-nodes-by-id"
POOL_CHECK_PATCH = "pool-check"  # the fleet checks the pools pooled models share


@workflow.defn
class FleetWorkflow:
    @workflow.init
    def __init__(self, input: FleetWorkflowInput) -> None:
        self._input = input
        self._state = input.state or FleetState()
        self._route_due = bool(self._state.down())  # a new run puts the routing right at once
        self._changed: list[str] = []  # regions changed since the last replan started

    # ---- on-call's doors -----------------------------------------------------------------

    @workflow.query(name=FleetWorkflowNames.REGIONS)
    def regions(self) -> FleetStatus:
        s = self._state
        return FleetStatus(
            regions=[s.regions[r] for r in sorted(s.regions)],
            down=s.down(),
            replans=list(s.replans),
            events=list(s.events),
            replan_due=s.replan_due,
            last_check=s.last_check,
            last_check_error=s.last_check_error,
            updated_at=s.last_check,
        )

    @workflow.update(name=FleetWorkflowNames.REGION_DOWN)
    def region_down(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> RegionChangeResult:
        input = update_input(raw, RegionDownInput, FleetWorkflowNames.REGION_DOWN, DOWN_EXAMPLE)
        current = self._state.regions[input.region]
        if current.health == RegionHealth.DOWN and not current.detected:
            return RegionChangeResult(
                region=input.region,
                health=RegionHealth.DOWN,
                changed=False,
                replan=current.replan,
                detail=f"already down since {current.since} by {current.who}: {current.reason}",
            )
        # Beside `who` (the payload's word), the update's `ipnext-identity` header: in the history
        # (replay reads the same), and no command depends on it, so older runs replay unchanged.
        identity = caller_identity()
        if current.health == RegionHealth.DOWN:  # ipnext found it down: now on-call holds it down
            self._state.regions[input.region] = current.model_copy(
                update={"detected": False, "who": input.who, "reason": input.reason, "identity": identity}
            )
            self._event(input.region, RegionHealth.DOWN, input.who, f"held down: {input.reason}", identity)
            self._publish()
            return RegionChangeResult(
                region=input.region,
                health=RegionHealth.DOWN,
                changed=True,
                replan=current.replan,
                detail="was down by ipnext's node check; now stays down until `region up`",
            )
        self._change(
            input.region, RegionHealth.DOWN, input.who, input.reason, detected=False, identity=identity
        )
        return self._change_result(input.region)

    @region_down.validator
    def _check_down(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = update_input(raw, RegionDownInput, FleetWorkflowNames.REGION_DOWN, DOWN_EXAMPLE)
        self._known(input.region)
        up = [r for r, s in self._state.regions.items() if s.health == RegionHealth.UP]
        if up == [input.region]:
            raise ApplicationError(
                f"region: {input.region!r} is the last region up (down: {self._state.down()}); with it "
                "down nothing is left to serve or to plan on. Fix: bring another region up first "
                "(`ipnext fleet region up REGION --who ...`).",
                type=REFUSED,
                non_retryable=True,
            )

    @workflow.update(name=FleetWorkflowNames.REGION_UP)
    def region_up(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> RegionChangeResult:
        input = update_input(raw, RegionUpInput, FleetWorkflowNames.REGION_UP, UP_EXAMPLE)
        current = self._state.regions[input.region]
        if current.health == RegionHealth.UP:
            return RegionChangeResult(
                region=input.region, health=RegionHealth.UP, changed=False, detail="already up"
            )
        reason = input.reason or f"on-call ended the outage ({current.reason})"
        self._change(
            input.region, RegionHealth.UP, input.who, reason, detected=False, identity=caller_identity()
        )
        return self._change_result(input.region)

    @region_up.validator
    def _check_up(self, raw: Any = NO_PAYLOAD, _extra: Any = None) -> None:
        input = update_input(raw, RegionUpInput, FleetWorkflowNames.REGION_UP, UP_EXAMPLE)
        current = self._known(input.region)
        if current.detected and current.dead_nodes and not current.alive_nodes:
            raise ApplicationError(
                f"region: {input.region!r} is down because every Ray node of it is dead "
                f"({', '.join(current.dead_nodes)}); ipnext would find it down again at its next check. "
                "Fix: bring its nodes back (it then comes up by itself).",
                type=REFUSED,
                non_retryable=True,
            )

    def _known(self, region: str) -> RegionState:
        state = self._state.regions.get(region)
        if state is None:
            known = sorted(self._state.regions)
            raise ApplicationError(
                f"region: {region!r} is not a region of the fleet ({known or 'none read yet'}). "
                f"Fix: name one of {known}"
                + ("" if known else ", once the fleet file was read (seconds)")
                + ".",
                type=REFUSED,
                non_retryable=True,
            )
        return state

    # ---- the life of the fleet -------------------------------------------------------------

    @workflow.run
    async def run(self, input: FleetWorkflowInput) -> None:
        await self._check()  # the fleet's regions first: the doors need them
        await self._check_pools()
        while True:
            if self._route_due:
                await self._route_around()
                continue
            if self._state.replan_due is not None:
                await self._replan()
                continue
            if self._history_full():
                await workflow.wait_condition(workflow.all_handlers_finished)
                if self._state.replan_due is None and not self._route_due:
                    workflow.continue_as_new(input.model_copy(update={"state": self._state}))
                continue
            try:
                await workflow.wait_condition(
                    lambda: self._route_due or self._state.replan_due is not None,
                    timeout=timedelta(seconds=input.check_seconds),
                )
            except TimeoutError:
                await self._check()
                await self._check_pools()

    async def _check(self) -> None:
        """Read the fleet file's regions and Ray's node table; apply what the nodes say."""
        try:
            seen = await workflow.execute_activity(
                check_regions,
                RegionsCheckInput(look_at_nodes=self._input.detect),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RECONCILE_RETRY,
                summary="read the fleet's regions and Ray's node table",
            )
        except ActivityError as err:
            self._state.last_check_error = _root_cause(err)
            self._publish()
            return
        s = self._state
        s.last_check, s.last_check_error = workflow.now(), seen.error
        for region in seen.regions:
            s.regions.setdefault(region, RegionState(region=region))
        for region in [r for r in s.regions if r not in seen.regions]:
            del s.regions[region]  # gone from the fleet file
        if seen.nodes is not None:
            remember = workflow.patched(DEAD_NODES_PATCH)
            changes = detect_changes(s.regions, seen.nodes, remember=remember)
            for region, state in list(s.regions.items()):
                mine = region_nodes(region, state, seen.nodes, remember=remember)
                s.regions[region] = state.model_copy(
                    update={
                        "alive_nodes": sorted(n.node_id for n in mine if n.alive),
                        "dead_nodes": sorted(n.node_id for n in mine if not n.alive),
                    }
                )
            for change in changes:
                current = s.regions[change.region]
                if change.health == RegionHealth.DOWN and current.health == RegionHealth.UP:
                    self._change(
                        change.region, RegionHealth.DOWN, DOWN_BY_IPNEXT, change.reason, detected=True
                    )
                elif change.health == RegionHealth.UP and current.detected:
                    self._change(
                        change.region, RegionHealth.UP, DOWN_BY_IPNEXT, change.reason, detected=False
                    )
        if s.down():  # put right a document republished from a plan meanwhile
            self._route_due = True
        self._publish()

    async def _check_pools(self) -> None:
        """One serving check for every pooled model (activities/pool_check.py): the models whose
        shared apps Serve lost are asked to check their own serving now."""
        if not workflow.patched(POOL_CHECK_PATCH):
            return
        s = self._state
        try:
            seen = await workflow.execute_activity_method(
                PoolCheckActivities.check_pools,
                PoolCheckInput(members=s.pool_members, asked=s.pool_asked),
                start_to_close_timeout=QUICK_TIMEOUT,
                retry_policy=RECONCILE_RETRY,
                summary="check the pools every pooled model shares",
            )
        except ActivityError as err:
            s.last_pool_check_error = _root_cause(err)
            return
        s.pool_members, s.pool_asked, s.last_pool_check_error = seen.members, seen.asked, seen.error

    def _change(
        self,
        region: str,
        health: RegionHealth,
        who: str,
        reason: str,
        *,
        detected: bool,
        identity: str | None = None,
    ) -> None:
        """Record a region's new health; the routing and a replan follow in the main loop. No
        await in here: a change is recorded whole or not at all."""
        s = self._state
        old = s.regions[region]
        s.regions[region] = old.model_copy(
            update={
                "health": health,
                "since": workflow.now(),
                "reason": reason,
                "who": who,
                "identity": identity,
                "detected": detected,
                "replan": "",
            }
        )
        self._event(region, health, who, reason, identity)
        self._changed.append(region)
        if health == RegionHealth.DOWN or s.replan_due == EMERGENCY:
            s.replan_due = EMERGENCY
        else:
            s.replan_due = RETURN
        self._route_due = True
        workflow.logger.info(
            "region %s %s by %s: %s", region, health.value, attributed(who, identity), reason
        )
        self._publish()

    def _event(
        self, region: str, health: RegionHealth, who: str, reason: str, identity: str | None = None
    ) -> None:
        self._state.record(
            RegionEvent(
                at=workflow.now(), region=region, health=health, who=who, reason=reason, identity=identity
            )
        )

    def _change_result(self, region: str) -> RegionChangeResult:
        s = self._state
        kind = s.replan_due or EMERGENCY
        return RegionChangeResult(
            region=region,
            health=s.regions[region].health,
            changed=True,
            replan=fleet_replan_id(kind, s.replans_started + 1),
            detail=f"down now: {s.down() or 'none'}",
        )

    async def _route_around(self) -> None:
        """Every serving model's routing document without the down regions (with none down:
        back to its plan's)."""
        self._route_due = False
        try:
            await workflow.execute_activity_method(
                RegionActivities.route_around_regions,
                RouteAroundInput(down=self._state.down()),
                start_to_close_timeout=QUICK_TIMEOUT * 4,
                retry_policy=RECONCILE_RETRY,
                summary=f"route around {', '.join(self._state.down()) or 'no region'}",
            )
        except ActivityError as err:  # tried again at the next check while a region is down
            workflow.logger.warning("routing around %s failed: %s", self._state.down(), _root_cause(err))

    async def _replan(self) -> None:
        s = self._state
        kind, s.replan_due = s.replan_due or EMERGENCY, None
        down = s.down()
        changed, self._changed = sorted(set(self._changed)), []
        reason = "; ".join(
            f"{r} {s.regions[r].health.value} ({s.regions[r].who}: {s.regions[r].reason})"
            for r in changed
            if r in s.regions
        )
        if kind == EMERGENCY:
            try:  # the Schedule's run planned with the region: the emergency one replaces it
                await workflow.execute_activity_method(
                    RegionActivities.cancel_scheduled_replan,
                    start_to_close_timeout=QUICK_TIMEOUT,
                    retry_policy=RECONCILE_RETRY,
                    summary="cancel the scheduled replan in flight",
                )
            except ActivityError as err:
                workflow.logger.warning("could not cancel the scheduled replan: %s", err.cause or err)
        handle = None
        for _ in range(10):  # a number a run before a reset used may still be running
            s.replans_started += 1
            workflow_id = fleet_replan_id(kind, s.replans_started)
            try:
                handle = await workflow.start_child_workflow(
                    Workflows.FLEET_REPLAN,
                    FleetReplanInput(
                        down_regions=down,
                        time_limit_s=self._input.replan_time_limit_s,
                        churn_cost=self._input.churn_cost,
                        reason=reason,
                    ),
                    id=workflow_id,
                    result_type=FleetReplanResult,
                    parent_close_policy=ParentClosePolicy.ABANDON,
                    static_summary=f"{kind} replan: {reason}"[:200],
                )
                break
            except WorkflowAlreadyStartedError:
                continue
        if handle is None:
            workflow.logger.error("no free replan id after %s", s.replans_started)
            return
        for region in changed:
            if region in s.regions:
                s.regions[region] = s.regions[region].model_copy(update={"replan": workflow_id})
        s.events = [
            e.model_copy(update={"replan": workflow_id}) if e.region in changed and not e.replan else e
            for e in s.events
        ]
        s.add_replan(
            ReplanRecord(workflow_id=workflow_id, kind=kind, down_regions=down, started_at=workflow.now())
        )
        self._publish()
        try:
            result: FleetReplanResult = await handle
        except ChildWorkflowError as err:
            s.finish_replan(workflow_id, outcome="failed", detail=_root_cause(err))
        else:
            s.finish_replan(
                workflow_id,
                outcome="applied",
                revision=result.revision,
                relaxed=list(result.relaxed),
                detail=f"applied to {', '.join(result.applied_to) or 'no model (no placement changed)'}",
            )
        self._publish()

    def _history_full(self) -> bool:
        info = workflow.info()
        return (
            info.is_continue_as_new_suggested()
            or info.get_current_history_length() >= self._input.history_limit
        )

    def _publish(self) -> None:
        """Search attributes and the UI's details: every region, and the replan it caused."""
        s = self._state
        down = s.down()
        workflow.upsert_search_attributes(
            [STATE_KEY.value_set("degraded" if down else "healthy"), REGIONS_DOWN_KEY.value_set(down)]
        )
        lines = [f"**{'degraded: ' + ', '.join(down) + ' down' if down else 'every region up'}**"]
        for region in sorted(s.regions):
            r = s.regions[region]
            line = f"- {region}: **{r.health.value}**"
            if r.since is not None:
                line += f" since {r.since:%Y-%m-%d %H:%M:%S} by {attributed(r.who, r.identity)}: {r.reason}"
            if r.replan:
                line += f" (replan {r.replan})"
            lines.append(line)
        for replan in s.replans[-5:]:
            relaxed = f"; relaxed {len(replan.relaxed)}" if replan.relaxed else ""
            lines.append(
                f"{replan.workflow_id}: {replan.outcome} "
                f"(revision {replan.revision}{relaxed}) {replan.detail}"
            )
        if s.last_check_error:
            lines.append(f"last check: {s.last_check_error}")
        workflow.set_current_details("\n\n".join(lines))


def _root_cause(err: BaseException) -> str:
    """The innermost failure's message (a child's activity's ApplicationError, not "Activity
    task failed"), for the record and the UI."""
    while isinstance(getattr(err, "cause", None), BaseException):
        err = err.cause  # type: ignore[attr-defined]
    return str(err)
