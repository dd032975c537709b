"""A model's experiments: ModelWorkflow's `start_experiment` Update, the ExperimentWorkflow child it
starts, and its end recorded. While one runs, the model holds what would change its sets: queued
sets wait without rolling out, and the serving checks pause (the experiment's routes would be
"repaired" away); they resume when it ends.

Capacity moves reach both arms while it runs. A replanned placement both can take in place (the
same placement revision: replica counts and routing change, no deployment gains or loses a
region or hardware; no region down): the control's apps take it at full size and the
treatment's at its share, here. Any other (new apps, or regions down): the model signals the
experiment `move_arms`, which brings both arms up on the new placement, switches every router
to them with the same salt and split (each unit keeps its arm), publishes the routing and
removes the old apps, then answers `arms_moved` with the control's new apps. Either way the
model's plan is the new one. A move that fails, or that the experiment's end overtakes, leaves
the replan pending until the end, when the control moves alone as any capacity move.

One experiment at a time, against the serving set (control) and a set published with hold
(treatment), split by unit or (a shadow) sent copies of the control's requests; it ends on its
own (duration, guardrail, on-call stop) and reports to the model with the `experiment_ended`
signal; after a continue-as-new the model also asks Temporal from time to time, so an experiment
terminated from the UI is noticed. `Experiments` is ModelWorkflow's collaborator over its
`ModelRun`: the workflow keeps the handlers' declarations and calls it; nothing here runs outside
a workflow.
"""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError, ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

with workflow.unsafe.imports_passed_through():
    from ipnext.activities import DEPLOY_TIMEOUT, HEARTBEAT_TIMEOUT, QUICK_TIMEOUT, RETRY
    from ipnext.activities.rollouts import RolloutActivities, RolloutOutcomeInput
    from ipnext.activities.serving import DeploySetInput, deploy_set_apps
    from ipnext.contracts.experiment import (
        ActiveExperiment,
        ExperimentInput,
        ExperimentStarted,
        ExperimentStatus,
        MoveArmsInput,
        PromoteInput,
        StartExperimentInput,
        StopExperimentInput,
    )
    from ipnext.contracts.model import ApplyPlanInput, PublishResult
    from ipnext.names import ExperimentWorkflowNames, SetStatus, experiment_workflow_id
    from ipnext.policy.shadow import render_shadow
    from ipnext.workflows._model_run import ModelRun
    from ipnext.workflows.experiment_workflow import ExperimentWorkflow

__all__ = ["EXPERIMENTS_KEPT", "START_EXPERIMENT_EXAMPLE", "Experiments"]

START_EXPERIMENT_EXAMPLE = (
    '{"name": "...", "treatment": "<model>@<n>", "duration_seconds": ..., "who": "..."}'
)
EXPERIMENTS_KEPT = 20  # ended experiments' results kept in the record
# Runs that started waiting on an experiment before in-place replans reached its arms.
ARMS_REPLAN_PATCH = "experiment-arms-take-in-place-replans"
# Runs from before replans needing new apps moved the arms too (those waited for the end).
ARMS_MOVE_PATCH = "experiment-arms-take-capacity-moves"
# How long the model waits for the experiment's answer to a move of its arms: two deploys, the
# routers and a removal, each an activity with its own retries; past it the replan waits.
ARMS_MOVE_TIMEOUT = timedelta(minutes=30)


class Experiments:
    """The experiments and shadows of one model run: `refuse_start` and `start` (the Update),
    `run` (the child from the model's loop to its end, a replan reaching both arms on the way),
    `refuse_promote` and `promote` (a held set queued for a rollout)."""

    def __init__(self, model: ModelRun) -> None:
        self.model = model

    def arms_replan(self, moves: bool) -> ApplyPlanInput | None:
        """The pending replan the running experiment's arms take now, if there is one: any (with
        `moves`), or one they can take in place (runs from before moves of the arms)."""
        r = self.model.record
        pending = r.pending_plan
        if pending is None or pending is self.model.arms_refused or r.plan is None:
            return None
        if not moves and not _in_place(pending, r.plan.revision):
            return None
        return pending

    async def _replan_arms(self, active: ActiveExperiment, pending: ApplyPlanInput) -> None:
        """Both arms on the replanned placement: in place where it keeps the apps, else moved to
        new apps by the experiment (`_move_arms`)."""
        r = self.model.record
        if r.plan is not None and not _in_place(pending, r.plan.revision):
            await self._move_arms(active, pending)
            return
        control, treatment = self.model.find(active.control), self.model.find(active.treatment)
        if control is None or treatment is None:
            return
        why = pending.cause or f"fleet plan {pending.fleet_revision}"
        try:
            for snapshot_set, scale in ((control, 1.0), (treatment, active.start.treatment_percent / 100)):
                await workflow.execute_activity(
                    deploy_set_apps,
                    DeploySetInput(
                        spec=self.model.spec, snapshot_set=snapshot_set, plan=pending.plan, scale=scale
                    ),
                    start_to_close_timeout=DEPLOY_TIMEOUT,
                    heartbeat_timeout=HEARTBEAT_TIMEOUT,
                    retry_policy=RETRY,
                    summary=f"{snapshot_set.id} at {scale:.0%} of the replanned placement ({why})",
                )
        except ActivityError as err:
            self.model.arms_refused = pending
            workflow.logger.warning(
                "%s: the experiment's arms could not take %s in place (%s): it waits for the end",
                self.model.spec.name,
                why,
                err.cause or err,
            )
            return
        self._arms_took(active, pending, None)

    async def _move_arms(self, active: ActiveExperiment, pending: ApplyPlanInput) -> None:
        """A replan that needs new apps (another placement revision, or regions down): the
        experiment moves both arms (it holds the treatment and the routes that split units
        between them; `ExperimentWorkflow._move`) and answers with the control's new apps. Until
        the answer the model waits; an experiment that refuses, or ends first, leaves the replan
        pending: after the end it moves the control alone, as any capacity move."""
        why = pending.cause or f"fleet plan {pending.fleet_revision}"
        move = str(workflow.uuid4())
        self.model.arms_moved = None
        await workflow.get_external_workflow_handle(active.workflow_id).signal(
            ExperimentWorkflowNames.MOVE_ARMS,
            MoveArmsInput(move=move, plan=pending.plan, down_regions=pending.down_regions, cause=why),
        )
        every = timedelta(seconds=self.model.input.rollout_check_seconds)
        waited = workflow.now()
        while workflow.now() - waited < ARMS_MOVE_TIMEOUT:
            try:
                await workflow.wait_condition(
                    lambda: (
                        (self.model.arms_moved is not None and self.model.arms_moved.move == move)
                        or self.model.experiment_ended is not None
                        or self.done()
                        or self.model.delete_by is not None
                    ),
                    timeout=every if self.model.experiment_child is None else ARMS_MOVE_TIMEOUT,
                )
                break
            except TimeoutError:  # after a continue-as-new no handle says it ended: ask Temporal
                await self._poll_experiment(active)
                if self.model.experiment_ended is not None:
                    break
        answer = self.model.arms_moved
        if answer is None or answer.move != move or answer.error:
            self.model.arms_refused = pending
            reason = answer.error if answer is not None and answer.move == move else "no answer"
            workflow.logger.warning(
                "%s: the experiment's arms did not move to %s (%s): it waits for the end",
                self.model.spec.name,
                why,
                reason,
            )
            return
        self._arms_took(active, pending, answer.control_apps)

    def _arms_took(
        self, active: ActiveExperiment, pending: ApplyPlanInput, apps: dict[str, str] | None
    ) -> None:
        """The model's plan is the replanned one (and its serving apps `apps`, when they moved)."""
        r = self.model.record
        r.plan = pending.plan
        if apps is not None:
            r.serving_apps = dict(apps)
        if r.pending_plan is pending:  # a newer replan that came meanwhile stays pending
            r.pending_plan = None
        why = pending.cause or f"fleet plan {pending.fleet_revision}"
        workflow.logger.info("%s: both arms of %s moved to %s", self.model.spec.name, active.name, why)
        self.model.upsert_state()

    def refuse_start(self, input: StartExperimentInput) -> None:
        """Raise ApplicationError for an experiment that cannot start now (no I/O)."""
        name, r = self.model.spec.name, self.model.record
        why = ""
        if self.model.delete_by is not None:
            why = "it is being deleted"
        elif r.serving_set is None:
            why = "nothing serves yet (the control is the serving set)"
        elif r.experiment is not None:
            why = f"experiment {r.experiment.name} runs (`ipnext experiment stop {name}` ends it)"
        elif r.active_rollout is not None or r.queued or r.spec_pending is not None:
            why = "a rollout runs or a set is queued: start it when the model serves alone"
        elif any(e.name == input.name for e in r.experiments):
            why = f"an experiment named {input.name!r} already ran: give this one its own name"
        if why:
            raise ApplicationError(f"model {name}: no experiment now: {why}.", type="ExperimentError")
        treatment = self.model.find(input.treatment)
        if treatment is None or treatment.status != SetStatus.HELD:
            held = [s.id for s in r.sets if s.status == SetStatus.HELD]
            raise ApplicationError(
                f"treatment: {input.treatment!r} is not a held set of {name} (held: {held or 'none'}). "
                "Fix: publish the candidate with `ipnext snapshot publish --hold`.",
                type="ExperimentError",
            )

    def refuse_undirected(self, input: StartExperimentInput) -> None:
        """The validator's alone (an update accepted before directions replays through `start`):
        a deciding outcome must say which way is better."""
        undirected = input.missing_directions()
        if undirected:
            first = undirected[0]
            raise ApplicationError(
                f"metrics: {first!r} does not say which way is better. Fix: name it {first}:higher "
                f"(clicks, revenue) or {first}:lower (latency, cost).",
                type="ExperimentError",
            )

    def start(self, input: StartExperimentInput) -> ExperimentStarted:
        """Record the experiment for the loop to start (it starts children one at a time)."""
        self.refuse_start(input)
        r = self.model.record
        active = ActiveExperiment(
            workflow_id=experiment_workflow_id(self.model.spec.name, input.name),
            name=input.name,
            control=r.serving_set or "",
            treatment=input.treatment,
            start=input,
        )
        r.experiment = active
        self.model.upsert_state()
        return ExperimentStarted(
            workflow_id=active.workflow_id, control=active.control, treatment=active.treatment
        )

    async def run(self) -> None:
        """Start the recorded experiment (unless a run before this one did) and wait for its end."""
        r = self.model.record
        active = r.experiment
        control, treatment = (
            self.model.find(active.control if active else None),
            self.model.find(active.treatment if active else None),
        )
        if active is None or control is None or treatment is None or r.plan is None:
            r.experiment = None
            return
        if not active.started:
            start = active.start
            self.model.experiment_ended = None
            self.model.experiment_child = await workflow.start_child_workflow(
                ExperimentWorkflow.run,
                ExperimentInput(
                    spec=self.model.spec,
                    plan=r.plan,
                    name=active.name,
                    salt=str(workflow.uuid4()),
                    control_set=control,
                    control_apps=dict(r.serving_apps),
                    treatment_set=treatment,
                    treatment_percent=start.treatment_percent,
                    duration_seconds=start.duration_seconds,
                    check_seconds=start.check_seconds,
                    alpha=start.alpha,
                    who=start.who,
                    history_limit=max(50, self.model.input.history_limit),
                    mode=start.mode,
                    shadow_max_in_flight=start.shadow_max_in_flight,
                    unit=start.unit,
                    metrics=list(start.metrics),
                ),
                id=active.workflow_id,
                static_summary=(
                    f"{self.model.spec.name}: {treatment.id} shadowing {control.id}"
                    if start.mode == "shadow"
                    else f"{self.model.spec.name}: {control.id} against {treatment.id}"
                ),
                parent_close_policy=ParentClosePolicy.ABANDON,
            )
            r.experiment = active = active.model_copy(update={"started": True})
            self.model.upsert_state()
        every = (
            None
            if self.model.experiment_child is not None
            else timedelta(seconds=self.model.input.rollout_check_seconds)
        )
        self.model.experiment_stopping = False
        self.model.arms_refused = None
        arms_follow = workflow.patched(ARMS_REPLAN_PATCH)
        arms_move = arms_follow and workflow.patched(ARMS_MOVE_PATCH)
        while self.model.experiment_ended is None:
            if (
                self.model.delete_by is not None and not self.model.experiment_stopping
            ):  # a delete ends it first
                self.model.experiment_stopping = True
                await workflow.get_external_workflow_handle(active.workflow_id).signal(
                    ExperimentWorkflowNames.STOP,
                    StopExperimentInput(who=self.model.delete_by, reason="the model is being deleted"),
                )
            try:
                await workflow.wait_condition(
                    lambda: (
                        self.model.experiment_ended is not None
                        or self.done()
                        or self.model.may_continue()
                        or (self.model.delete_by is not None and not self.model.experiment_stopping)
                        or (arms_follow and self.arms_replan(arms_move) is not None)
                    ),
                    timeout=every,
                )
            except TimeoutError:
                await self._poll_experiment(active)
                continue
            replanned = self.arms_replan(arms_move) if arms_follow else None
            if replanned is not None and self.model.experiment_ended is None and self.model.delete_by is None:
                await self._replan_arms(active, replanned)
                continue
            if (
                self.model.experiment_ended is None
                and self.done()
                and self.model.experiment_child is not None
            ):
                try:
                    self.model.experiment_ended = self.model.experiment_child.result()
                except ChildWorkflowError as err:
                    self.model.experiment_ended = self.lost(active, str(err.cause or err))
                continue
            if (
                self.model.experiment_ended is None
                and self.model.may_continue()
                and self.model.delete_by is None
            ):
                await workflow.wait_condition(
                    lambda: workflow.all_handlers_finished() and self.model.publishing == 0
                )
                if self.model.experiment_ended is None and self.model.delete_by is None:
                    workflow.continue_as_new(
                        self.model.input.model_copy(update={"record": r, "spec": self.model.spec})
                    )
                every = every or timedelta(seconds=self.model.input.rollout_check_seconds)
        ended, self.model.experiment_ended, self.model.experiment_child = (
            self.model.experiment_ended,
            None,
            None,
        )
        r.experiments = [*r.experiments, ended][-EXPERIMENTS_KEPT:]
        r.experiment = None
        if ended.shadow is not None and self.model.find(active.treatment) is not None:
            # The candidate's evidence stays on its record (it stays held: promote rolls it out).
            self.model.set_status(
                active.treatment, SetStatus.HELD, f"shadow {ended.name}: {render_shadow(ended.shadow)}"
            )
        self.model.reconcile_due = True  # a lost experiment may have left routes behind: put them right
        workflow.logger.info("model %s: experiment %s ended: %s", self.model.spec.name, ended.name, ended.end)
        self.model.upsert_state()

    async def _poll_experiment(self, active: ActiveExperiment) -> None:
        """Ask Temporal whether the experiment still runs (its end, when it has no handle here)."""
        outcome = await workflow.execute_activity_method(
            RolloutActivities.experiment_outcome,
            RolloutOutcomeInput(workflow_id=active.workflow_id),
            start_to_close_timeout=QUICK_TIMEOUT,
            retry_policy=RETRY,
            summary=f"is {active.workflow_id} still running?",
        )
        if not outcome.running and self.model.experiment_ended is None:
            self.model.experiment_ended = outcome.result or self.lost(active, outcome.how)

    def promote(self, input: PromoteInput) -> PublishResult:
        """Queue a held set for its rollout, which runs through the normal steps and gates."""
        self.refuse_promote(input)
        why = f": {input.reason}" if input.reason else ""
        self.model.set_status(input.set_id, SetStatus.VALIDATED, f"promoted by {input.who}{why}")
        self.model.record.queued.append(input.set_id)
        self.model.upsert_state()
        return PublishResult(set_id=input.set_id, status="queued")

    def refuse_promote(self, input: PromoteInput) -> None:
        r, name = self.model.record, self.model.spec.name
        held = [s.id for s in r.sets if s.status == SetStatus.HELD]
        found = self.model.find(input.set_id)
        why = ""
        if self.model.delete_by is not None:
            why = "it is being deleted"
        elif r.experiment is not None:
            why = f"experiment {r.experiment.name} runs: promote when it has ended"
        elif r.spec_pending is not None:
            why = f"update {r.spec_pending.change} of its spec is rolling out"
        elif found is None or found.status != SetStatus.HELD:
            why = f"{input.set_id!r} is not a held set (held: {held or 'none'})"
        if why:
            raise ApplicationError(f"model {name}: nothing promoted: {why}.", type="ExperimentError")

    def done(self) -> bool:
        return self.model.experiment_child is not None and self.model.experiment_child.done()

    def lost(self, active: ActiveExperiment, how: str) -> ExperimentStatus:
        """An experiment that ended without its report (terminated, failed): what the model knows."""
        end = f"ended without its report: {how}; the model's serving check puts its routers back"
        return active.status(self.model.spec.name, "ended", "failed", end)


def _in_place(pending: ApplyPlanInput, revision: int) -> bool:
    """A replan both arms take in place: the same placement revision (replica counts and routing
    change, no deployment gains or loses a region or hardware), no region down."""
    return not pending.down_regions and pending.plan.revision == revision
