"""The `ipnext` command line: the SDK's verbs plus the dev stack and the demo.

ipnext dev up [--nodes single|per-region] | down | status | hold|release NAME [--why W]
ipnext model publish FILE | update -f FILE [--snapshots FOLDER] [--who W] | get NAME | demand NAME [--window S] | list | adopt NAME | delete NAME
ipnext snapshot publish MODEL FOLDER [--wait [--timeout S]] [--override-freeze REASON --who NAME] [--hold]
ipnext snapshot import-hf DIR --model M --part P --version V
ipnext experiment start MODEL --name N --treatment SET --duration 3d [--split 50] | status|report|stop MODEL; shadow start MODEL --set SET --percent 10 | status|stop MODEL
ipnext rollout status|watch MODEL | pause|abort|override-freeze MODEL --reason R [--who W] | resume MODEL
ipnext predict MODEL --inputs JSON [--source REGION | --region REGION] [--key KEY]
ipnext serve export [-o FILE]
ipnext plan solve --fleet F --demand D [--current P] --out P | show [--revision N] [--json]
ipnext plan schedule --every 6h | --pause [NOTE] | --unpause | --trigger | --delete | --status
ipnext fleet region down REGION --reason R --who W | region up REGION --who W [--reason R] | regions [--json]
ipnext demo [--once]

One file over 600 lines on purpose: the parser tree and the handler of each verb, one screen
each, read as the command's reference; the work itself is in the SDK, the dev stack and
ipnext.entry (supervisor, schedules, fleet), which this file only calls.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ipnext.config import Settings, load_settings
from ipnext.entry.checkpoints import add_import_hf_parser, import_hf
from ipnext.entry.experiments import add_experiment_parser
from ipnext.entry.keys import add_auth_parser
from ipnext.entry.model_update import add_update_parser, update_model_command
from ipnext.errors import IpnextError, StackError

__all__ = ["main"]


def _print_json(value: Any) -> None:
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    print(json.dumps(value, indent=2, default=str))


async def _with_client(settings: Settings, action: Callable[[Any], Awaitable[Any]]) -> Any:
    from ipnext.sdk import Client

    async with await Client.connect(settings) as ipn:
        return await action(ipn)


def _model(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.model import load_model_spec

    if args.verb == "publish":
        spec = load_model_spec(args.file)
        state = asyncio.run(_with_client(settings, lambda c: c.publish_model(spec)))
        print(f"model {spec.name} registered (workflow model/{spec.name}, state {state.state})")
    elif args.verb == "update":
        update_model_command(args, settings)
    elif args.verb == "get":

        async def get(c: Any) -> tuple[Any, Any]:
            from ipnext.contracts import model_workflow_id

            state = await c.get_model(args.name)
            return state, await c.freshness(model_workflow_id(args.name), state.updated_at)

        state, fresh = asyncio.run(_with_client(settings, get))
        _print_json(state)
        print(fresh.describe(), file=sys.stderr)  # stdout stays JSON
    elif args.verb == "demand":
        window = args.window or settings.demand.window_seconds
        view = asyncio.run(_with_client(settings, lambda c: c.model_demand(args.name, window)))
        print(
            f"{view.model}: observed over {view.window_seconds:g} s windows, "
            f"{view.history_seconds:.0f} s of history, from routers in {', '.join(view.regions) or 'no region'}"
        )
        print(f"{'source':16} {'declared qps':>12} {'now qps':>9} {'peak qps':>9} {'requests':>9}")
        for source, seen in view.sources.items():
            declared = "-" if seen.declared_qps is None else f"{seen.declared_qps:g}"
            print(
                f"{source:16} {declared:>12} {seen.rate_qps:>9.2f} {seen.peak_qps:>9.2f} {seen.requests:>9}"
            )
    elif args.verb == "list":

        async def both(c: Any) -> tuple[list[Any], list[Any]]:
            return await c.list_models(), await c.list_orphans()

        models, orphans = asyncio.run(_with_client(settings, both))
        for m in models:
            print(f"{m.name:30} {m.state}")
        for m in orphans:
            print(f"{m.name:30} {m.state}: its apps keep serving, unmanaged; `ipnext model adopt {m.name}`")
        if not models and not orphans:
            print("no models")
    elif args.verb == "adopt":
        state = asyncio.run(_with_client(settings, lambda c: c.adopt_model(args.name)))
        print(f"model {args.name} adopted: {state.state}, serving {state.serving_set or 'nothing'}")
    elif args.verb == "delete":
        result = asyncio.run(_with_client(settings, lambda c: c.delete_model(args.name, who="cli")))
        print(f"model {args.name} deleted; removed apps {result.removed_apps}")


def _snapshot(args: argparse.Namespace, settings: Settings) -> None:
    if args.verb == "import-hf":
        import_hf(args, settings)
        return

    async def publish(ipn: Any) -> None:
        # One client and one event loop for both steps: a second asyncio.run with a second
        # Temporal client crashed the interpreter at exit now and then (runtime finalization).
        override = None
        if args.override_freeze:
            from ipnext.rollout import FreezeOverride

            if not args.who:
                raise IpnextError("--override-freeze needs --who: an override records who decided it")
            override = FreezeOverride(reason=args.override_freeze, who=args.who)
        if args.hold and (args.wait or override):
            raise IpnextError(
                "--hold keeps the set from rolling out: it takes neither --wait nor --override-freeze"
            )
        result = await ipn.publish_snapshot(
            args.model, Path(args.folder), who=args.who or "cli", freeze_override=override, hold=args.hold
        )
        print(f"published {result.set_id} ({result.status})", flush=True)
        if args.wait:
            from ipnext.sdk import progress_line

            started = time.monotonic()

            def progress(status: Any) -> None:
                queued = "" if status.set_id == result.set_id else "(queued behind) "
                print(f"  +{time.monotonic() - started:5.1f}s {queued}{progress_line(status)}", flush=True)

            # A pause, a rollback, an abort or a failure ends the wait at once (exit 2, the reason
            # and how to go on in one line): the wait never outlasts a rollout that stopped moving.
            state = await ipn.wait_until_serving(
                args.model, result.set_id, timeout_s=args.timeout, on_progress=progress
            )
            print(f"{result.set_id} serves in {sorted(state.serving_apps)}")

    asyncio.run(_with_client(settings, publish))


def _rollout(args: argparse.Namespace, settings: Settings) -> None:
    who = getattr(args, "who", None) or os.environ.get("USER", "cli")
    reason = getattr(args, "reason", None)

    async def act(ipn: Any) -> None:
        if args.verb == "status":
            status = await ipn.rollout_status(args.model)
            if status is None:
                print("no rollout yet")
                return
            print(render_rollout(status))
            if status.workflow_id:
                print((await ipn.freshness(status.workflow_id, status.updated_at)).describe())
        elif args.verb == "watch":
            await _watch(ipn, args.model, args.interval)
        else:
            if args.verb in ("pause", "abort", "override-freeze") and not reason:
                raise IpnextError(f"rollout {args.verb}: give --reason (it is kept in the rollout's history)")
            if args.verb == "pause":
                status = await ipn.pause_rollout(args.model, reason, who=who)
            elif args.verb == "override-freeze":
                status = await ipn.override_freeze(args.model, reason, who=who)
            elif args.verb == "abort":
                status = await ipn.abort_rollout(args.model, reason, who=who)
            else:
                status = await ipn.resume_rollout(args.model, who=who)
            print(f"sent {args.verb} to {status.workflow_id}")

    asyncio.run(_with_client(settings, act))


async def _watch(ipn: Any, model: str, interval: float) -> None:
    """Redraw the rollout's view every `interval` seconds until it ends (Ctrl-C leaves)."""
    tty = sys.stdout.isatty()
    last = ""
    while True:
        status = await ipn.rollout_status(model)
        view = "no rollout yet" if status is None else render_rollout(status)
        if view != last:
            if tty:
                print("\x1b[2J\x1b[H", end="")
            print(view + ("" if tty else "\n---"), flush=True)
            last = view
        if status is None or status.state.is_terminal:
            return
        await asyncio.sleep(interval)


def render_rollout(status: Any) -> str:
    """The terminal view of a rollout: state, steps, traffic split, gates, pauses."""
    from ipnext.identity import attributed

    marks = [f"[{p}%]" if i < status.steps_done else f" {p}% " for i, p in enumerate(status.steps)]
    outcome = f"  outcome: {status.outcome.value}" if status.outcome is not None else ""
    lines = [
        f"{status.workflow_id}: {status.state.value.upper()}  ({status.step}){outcome}",
        f"steps: {' '.join(marks)}  ({status.steps_done}/{len(status.steps)} done)",
        "traffic: " + ", ".join(f"{k} {v:g}%" for k, v in sorted(status.traffic_percent.items())),
        f"generations: {status.generations or 'none'}",
    ]
    if status.part_traffic:  # sync: independent: each changed part's share on the new set
        moving = f" (moving: {status.part})" if status.part else ""
        shares = ", ".join(f"{k} {v:g}%" for k, v in status.part_traffic.items())
        lines.insert(3, f"parts on the new set: {shares}{moving}")
    for g in status.gates:
        value = "n/a" if g.value is None else f"{g.value:.4g}"
        limit = "n/a" if g.limit is None else f"{g.limit:.4g}"
        verdict = "BREACH" if g.breached else ("ok" if g.judged else "waiting for traffic")
        lines.append(
            f"  gate {g.region} {g.metric}: {value} (limit {limit}, {g.requests} requests) {verdict}"
        )
    for p in status.pauses:
        resumed = f", resumed by {attributed(p.resumed_by, p.resumed_identity)}" if p.resumed_by else ""
        lines.append(f"  paused {p.at:%H:%M:%S} by {attributed(p.who, p.identity)}: {p.reason}{resumed}")
    if status.freeze_override is not None:
        by = attributed(status.freeze_override.who, status.freeze_override_identity)
        lines.append(f"  freeze override by {by}: {status.freeze_override.reason}")
    if status.detail:
        lines.append(status.detail)
    return "\n".join(lines)


def _predict(args: argparse.Namespace, settings: Settings) -> None:
    try:
        inputs = json.loads(args.inputs)
    except json.JSONDecodeError as err:
        raise IpnextError(
            f"--inputs is not JSON: {err}",
            field="--inputs",
            fix='pass e.g. \'{"user": 1, "items": [1, 2]}\'',
        ) from None
    from ipnext.sdk import PredictionClient

    # The data plane only: the routing document and the model's router, no Temporal connection.
    with PredictionClient.from_settings(settings) as serving:
        reply = serving.predict(args.model, inputs, source=args.source, region=args.region, key=args.key)
    _print_json(reply)


def _serve(args: argparse.Namespace, settings: Settings) -> None:
    import ray
    import yaml

    from ipnext.serving.control import connect_for, writer_for

    connect_for(settings)
    config = ray.get(writer_for(settings).export.remote())
    ray.shutdown()
    text = yaml.safe_dump(config, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote the Serve config of {len(config['applications'])} apps to {args.output}")
    else:
        print(text)


def _plan(args: argparse.Namespace, settings: Settings) -> None:
    {"solve": _plan_solve, "show": _plan_show, "schedule": _plan_schedule}[args.verb](args, settings)


def _plan_show(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.replan import PlanStore

    stored = PlanStore(settings.state_dir).load(args.revision)
    if args.json:
        print(stored.model_dump_json(indent=2))
        return
    plan = stored.as_plan()
    print(
        f"fleet plan revision {stored.revision}, made {stored.created_at:%Y-%m-%d %H:%M:%S %Z} by "
        f"{stored.made_by}\nmodels: {', '.join(stored.models)}"
    )
    if stored.down_regions:
        print(f"planned without the down regions: {', '.join(stored.down_regions)}")
        for relaxed in stored.relaxed:
            print(f"  relaxed {relaxed}")
    _print_usage(stored.pools, stored.units, plan)
    _print_demand(stored.demand)
    print(f"moves against the previous plans: {len(stored.moves)} ({plan.moved_units} units newly placed)")
    for move in stored.moves:
        print(f"  {move}")


def _fleet(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.errors import RegionStateError

    if args.verb == "regions":
        status = asyncio.run(_with_client(settings, lambda c: c.fleet_regions()))
        if args.json:
            _print_json(status)
            return
        print(render_regions(status))
        return
    regions = settings.fleet().regions
    if args.region not in regions:
        raise RegionStateError(
            f"region: {args.region!r} is not a region of the fleet file {settings.fleet_file} ({regions}).",
            field="region",
            value=args.region,
            fix=f"name one of {regions}",
        )
    from ipnext.entry.fleet import region_change
    from ipnext.regions import RegionDownInput, RegionUpInput

    if args.change == "down":  # read here: a bad field is refused before anything is asked
        region_change(RegionDownInput, region=args.region, reason=args.reason, who=args.who)
    else:
        region_change(RegionUpInput, region=args.region, who=args.who, reason=args.reason)
    if args.change == "down":
        result = asyncio.run(
            _with_client(settings, lambda c: c.region_down(args.region, reason=args.reason, who=args.who))
        )
    else:
        result = asyncio.run(
            _with_client(settings, lambda c: c.region_up(args.region, who=args.who, reason=args.reason))
        )
    if not result.changed:
        print(f"{result.region} was already {result.health.value}: {result.detail}")
        return
    print(f"{result.region} is {result.health.value} ({result.detail})")
    if result.replan:
        print(
            f"replan {result.replan}: see `ipnext fleet regions`, then `ipnext plan show`; {settings.ui_url}/workflows"
        )


def render_regions(status: Any) -> str:
    """`ipnext fleet regions`: a line per region, then the replans their changes caused."""
    from ipnext.identity import attributed

    lines = []
    for r in status.regions:
        line = f"{r.region:12} {r.health.value:5}"
        if r.since is not None:
            by = "ipnext's node check" if r.detected or r.who == "ipnext" else attributed(r.who, r.identity)
            line += f" since {r.since:%Y-%m-%d %H:%M:%S} by {by}: {r.reason}"
        if r.replan:
            line += f" [{r.replan}]"
        if r.dead_nodes:
            line += f" (dead nodes: {', '.join(n[:12] for n in r.dead_nodes)})"
        lines.append(line)
    if status.replans:
        lines.append("replans:")
        for p in status.replans[-10:]:
            without = f" without {', '.join(p.down_regions)}" if p.down_regions else ""
            lines.append(
                f"  {p.workflow_id}{without}: {p.outcome}, plan revision {p.revision} {p.detail}".rstrip()
            )
            lines.extend(f"    relaxed {x}" for x in p.relaxed)
    if status.replan_due:
        lines.append(f"a {status.replan_due} replan is due")
    if status.last_check_error:
        lines.append(f"last node check: {status.last_check_error}")
    return "\n".join(lines)


def _plan_schedule(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.contracts import REPLAN_SCHEDULE_ID
    from ipnext.entry.schedules import ensure_replan_schedule, trigger_and_wait
    from ipnext.identity import default_identity
    from ipnext.replan import FleetReplanInput, parse_every
    from ipnext.temporal import connect_client

    async def act() -> None:
        from temporalio.service import RPCError, RPCStatusCode

        client = await connect_client(settings, identity=settings.temporal.identity or default_identity())
        handle = client.get_schedule_handle(REPLAN_SCHEDULE_ID)
        try:
            await _schedule_verbs(client, handle)
        except RPCError as err:
            if err.status != RPCStatusCode.NOT_FOUND:
                raise
            raise IpnextError(
                f"there is no replan schedule ({REPLAN_SCHEDULE_ID}) yet.",
                fix="create it with `ipnext plan schedule --every 6h`",
            ) from None

    async def _schedule_verbs(client: Any, handle: Any) -> None:
        if args.every:
            every = parse_every(args.every)
            run_input = FleetReplanInput(time_limit_s=args.time_limit, churn_cost=args.churn_cost)
            await ensure_replan_schedule(client, settings.temporal.task_queue, every, run_input)
            print(f"fleet replan scheduled every {every} ({REPLAN_SCHEDULE_ID}); {settings.ui_url}/schedules")
        if args.pause is not None:
            await handle.pause(note=args.pause or "paused from the ipnext CLI")
            print("replan schedule paused")
        if args.unpause:
            await handle.unpause(note="unpaused from the ipnext CLI")
            print("replan schedule unpaused")
        if args.trigger:
            print("replanning now (the schedule's action)...", flush=True)
            result = await trigger_and_wait(client, args.time_limit + 600)
            gap = f"{100 * result.gap:.3f}%" if result.gap is not None else "n/a"
            print(
                f"plan revision {result.revision}: {len(result.models)} models, cost {result.cost:.2f}, "
                f"gap {gap}, {result.moves_total} moves, applied to {result.applied_to or 'none'}"
            )
            for model, sizing in sorted(result.demand.items()):
                observed = sorted(src for src, v in sizing.sources.items() if v.used == "observed")
                over = sizing.over_budget()
                if observed:
                    print(
                        f"  {model}: planned for observed demand from {', '.join(observed)}"
                        + (f" (over the declared peak_qps: {', '.join(over)})" if over else "")
                    )
        if args.delete:
            await handle.delete()
            print("replan schedule deleted")
        if args.status or not (
            args.every or args.pause is not None or args.unpause or args.trigger or args.delete
        ):
            desc = await handle.describe()
            state = desc.schedule.state
            intervals = ", ".join(str(i.every) for i in desc.schedule.spec.intervals)
            nxt = desc.info.next_action_times[:1]
            print(
                f"{REPLAN_SCHEDULE_ID}: every {intervals}, "
                f"{'paused' if state.paused else 'active'}{f' ({state.note})' if state.note else ''}, "
                f"next run {nxt[0] if nxt and not state.paused else '-'}, "
                f"{desc.info.num_actions} runs so far"
            )

    asyncio.run(act())


def _plan_solve(args: argparse.Namespace, settings: Settings) -> None:
    from pydantic import BaseModel, ConfigDict

    from ipnext.fleet import load_fleet
    from ipnext.plan import DeploymentDemand, Plan, PlanningProblem, SolveOptions
    from ipnext.planner import solve
    from ipnext.specio import load_yaml, parse_spec

    class DemandFile(BaseModel):
        model_config = ConfigDict(extra="forbid")
        deployments: list[DeploymentDemand]

    started = time.monotonic()
    fleet = load_fleet(args.fleet)
    demand = parse_spec(DemandFile, load_yaml(args.demand), source=str(args.demand))
    current = None
    if args.current:
        try:
            current = Plan.from_report(json.loads(Path(args.current).read_text()))
        except (OSError, ValueError, KeyError) as err:
            raise IpnextError(
                f"--current {args.current}: not a plan written by `ipnext plan solve`: {err}"
            ) from None
    problem = PlanningProblem(fleet=fleet, deployments=demand.deployments, current=current)
    # The limit covers the whole command, reading the files and the bound included.
    left = max(1.0, args.time_limit - (time.monotonic() - started))
    options = SolveOptions(time_limit_s=left, churn_cost=args.churn_cost, work_limit=args.work_limit)
    plan = solve(problem, options)
    Path(args.out).write_text(json.dumps(plan.to_report(), indent=2))
    _print_plan_summary(problem, plan)
    print(f"wrote {args.out}")


def _print_usage(pools: list[Any], units: dict[str, dict[str, int]], plan: Any) -> None:
    """Per pool: units used of capacity and their cost; then the plan's figures."""
    used: dict[tuple[str, str], int] = {}
    for name, placement in plan.deployments.items():
        for region, by_hw in placement.replicas.items():
            for hw, n in by_hw.items():
                used[region, hw] = used.get((region, hw), 0) + n * units[name][hw]
    print(f"{'region':12} {'hardware':12} {'units used':>12} {'capacity':>10} {'cost':>12}")
    for pool in pools:
        n = used.get((pool.region, pool.hardware), 0)
        print(f"{pool.region:12} {pool.hardware:12} {n:>12} {pool.units:>10} {n * pool.unit_cost:>12.2f}")
    print(plan.figures())


def _print_demand(demand: dict[str, Any]) -> None:
    """Per model and source: the demand planned, from which figure, and observed peaks above the
    declared peak_qps (the owner's budget) flagged OVER BUDGET."""
    if not demand:
        return
    print("demand planned, per model and source (qps):")
    for model, sizing in sorted(demand.items()):
        how = (
            f"observed weighed in ({sizing.history_seconds:.0f} s of history, peak over "
            f"{sizing.window_seconds:g} s windows, margin {sizing.margin:g})"
            if sizing.observed
            else "declared only"
        )
        note = f"; {sizing.note}" if sizing.note else ""
        print(f"  {model}: {how}{note}")
        for source, s in sorted(sizing.sources.items()):
            peak = f"{s.observed_peak_qps:g}" if s.observed_peak_qps is not None else "-"
            excess = f"  OVER BUDGET: observed {peak} > declared {s.declared_qps:g}" if s.over_budget else ""
            print(
                f"    {source:14} planned {s.planned_qps:>9g} ({s.used}; declared {s.declared_qps:g}, "
                f"observed peak {peak}){excess}"
            )


def _print_plan_summary(problem: Any, plan: Any) -> None:
    units = {d.name: {h: o.units for h, o in d.hardware.items()} for d in problem.deployments}
    _print_usage(problem.fleet.pools, units, plan)
    if problem.current is not None:
        print(f"moves against the current plan: {plan.moved_units} units newly placed")
        for name, placement in sorted(plan.deployments.items()):
            old = problem.current.deployments.get(name)
            for region, by_hw in sorted(placement.replicas.items()):
                for hw, n in sorted(by_hw.items()):
                    before = old.replicas.get(region, {}).get(hw, 0) if old else 0
                    if n != before:
                        print(f"  {name}: {region}/{hw} {before} -> {n}")


def _dev(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.devstack import DevStack

    stack = DevStack(settings, config_path=Path(args.config) if args.config else None)
    if args.verb in ("hold", "release"):
        names = stack.components()
        if args.name not in names:
            raise StackError(
                f"`dev {args.verb}` needs a component name, one of {', '.join(names)}; got {args.name!r}",
                field="name",
            )
        if args.verb == "hold":
            stack.hold(args.name, args.why)
            print(
                f"{args.name} held: the supervisor leaves it as it is until `ipnext dev release {args.name}`"
            )
        else:
            stack.release(args.name)
            print(f"{args.name} released: the supervisor starts it again if it is down")
    elif args.verb == "up":
        stack.up(nodes=args.nodes)
    elif args.verb == "down":
        stack.down()
    else:
        sys.exit(_dev_status(stack, settings))


def _dev_status(stack: Any, settings: Settings) -> int:
    """Each component (up, down, held), the supervisor and what it restarted, and orphaned
    models; 1 when the stack is not up."""
    from ipnext.devstack import SUPERVISOR, process_alive
    from ipnext.entry.supervisor import read_status

    record = stack.read_record()
    if not record:
        print("ipnext dev stack is not up")
        return 1
    holds = stack.holds()
    width = max(10, *(len(name) for name in record["processes"]))  # node-<region> names run long
    for name, proc in record["processes"].items():
        state = "up" if process_alive(proc["pid"]) else "DOWN"
        if name in holds:
            state += f", held since {holds[name]['at']} ({holds[name]['why']})"
        print(f"{name:{width}} {state:6} pid {proc['pid']:<8} log {proc['log']}")
    sv = read_status(stack.state_dir)
    restarts = sv.get("restarts", [])
    if SUPERVISOR in record["processes"]:
        passes = f"{sv.get('passes', 0)} passes, the last at {sv.get('passed_at') or 'never'}"
        print(f"restarts by the supervisor: {len(restarts) or 'none'} ({passes})")
    for entry in restarts[-10:]:
        outcome = f"back in {entry['took_s']}s" if entry.get("ok") else f"FAILED: {entry.get('error', '')}"
        print(f"  {entry['at']} {entry['component']}: {entry['why']}; {outcome}")
    for name, at in sv.get("gave_up", {}).items():
        print(f"  {name}: left down since {at}, too many restarts (see its log; `ipnext dev up` starts it)")
    if stack.is_up():
        try:
            orphans = asyncio.run(asyncio.wait_for(_with_client(settings, lambda c: c.list_orphans()), 30))
        except Exception as err:  # a status command reports, it does not fail on Temporal
            print(f"orphaned models: unknown ({type(err).__name__}: {err})")
        else:
            for m in orphans:
                print(f"orphaned model {m.name}: {m.state}, still serving; `ipnext model adopt {m.name}`")
    return 0 if stack.is_up() else 1


def _demo(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.devstack import DevStack
    from ipnext.examples.demo import run_scenario

    # Ctrl-C and SIGTERM end the demo through the `finally` below, even where SIGINT is ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stack = DevStack(settings)
    started_here = not stack.is_up()
    t0 = time.perf_counter()
    stack.up()
    try:
        asyncio.run(run_scenario(settings))
        print(f"demo scenario done in {time.perf_counter() - t0:.1f}s")
        if not args.once:
            print("the stack stays up; press Ctrl-C to stop it")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print()
    finally:
        if started_here:
            stack.down()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ipnext", description="ipnext: publish, validate, plan, roll out and serve models"
    )
    parser.add_argument("--config", help="ipnext.yaml to use (default: $IPNEXT_CONFIG or config/ipnext.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)

    dev = sub.add_parser("dev", help="the embedded dev stack (Temporal, Ray, worker)")
    dev.add_argument("verb", choices=["up", "down", "status", "hold", "release"])
    dev.add_argument("name", nargs="?", help="hold / release: the component (temporal, ray, worker)")
    dev.add_argument("--why", default="held by hand", help="hold: why, shown by `dev status`")
    dev.add_argument(
        "--nodes",
        choices=["single", "per-region"],
        default=None,
        help="up: one Ray node holding every region (default: setting ray.nodes), or a head and one "
        "Ray node per region of the fleet, with Serve's proxy on each",
    )
    dev.set_defaults(run=_dev)

    model = sub.add_parser("model", help="register, inspect and delete models")
    msub = model.add_subparsers(dest="verb", required=True)
    msub.add_parser("publish", help="register a model from its model.yaml").add_argument("file", type=Path)
    add_update_parser(msub)
    msub.add_parser("get", help="a model's state as JSON").add_argument("name")
    demand = msub.add_parser("demand", help="declared against observed demand, per source region")
    demand.add_argument("name")
    demand.add_argument(
        "--window", type=float, default=None, help="seconds per window (default: demand.window_seconds, 60)"
    )
    msub.add_parser("list", help="registered models")
    msub.add_parser("delete", help="tear down serving and delete the model").add_argument("name")
    msub.add_parser(
        "adopt", help="register again a model whose workflow was terminated (its apps kept serving)"
    ).add_argument("name")
    model.set_defaults(run=_model)

    snap = sub.add_parser("snapshot", help="publish snapshot sets")
    ssub = snap.add_subparsers(dest="verb", required=True)
    pub = ssub.add_parser("publish", help="publish a snapshot folder (with its manifest.json)")
    pub.add_argument("model")
    pub.add_argument("folder")
    pub.add_argument(
        "--wait",
        action="store_true",
        help="wait until the set serves, printing the rollout's progress; exit 2 with the reason "
        "if it pauses, rolls back, is aborted or fails",
    )
    pub.add_argument(
        "--timeout", type=float, default=1800.0, help="--wait: give up after this many seconds (exit 2)"
    )
    pub.add_argument("--override-freeze", metavar="REASON", help="roll out even inside a freeze window")
    pub.add_argument("--who", help="who publishes (required with --override-freeze)")
    pub.add_argument("--hold", action="store_true", help="validate and keep the set, not rolled out")
    add_import_hf_parser(ssub)
    snap.set_defaults(run=_snapshot)
    add_experiment_parser(sub)

    roll = sub.add_parser("rollout", help="watch and steer a model's running rollout (on-call)")
    rsub = roll.add_subparsers(dest="verb", required=True)
    for verb, text in (
        ("status", "the latest rollout's state, steps, split and gates"),
        ("watch", "a live view until the rollout ends"),
        ("pause", "hold the current split (gates still roll back)"),
        ("resume", "go on; the current step's bake starts again"),
        ("abort", "roll back to the previous set"),
        ("override-freeze", "go on through a freeze window (kept in the history)"),
    ):
        verb_parser = rsub.add_parser(verb, help=text)
        verb_parser.add_argument("model")
        if verb in ("pause", "abort", "override-freeze"):
            verb_parser.add_argument("--reason", required=True)
        if verb in ("pause", "resume", "abort", "override-freeze"):
            verb_parser.add_argument("--who", help="default: $USER")
        if verb == "watch":
            verb_parser.add_argument("--interval", type=float, default=1.0, help="seconds between redraws")
    roll.set_defaults(run=_rollout)

    predict = sub.add_parser("predict", help="ask a model for a prediction over HTTP (no Temporal needed)")
    predict.add_argument("model")
    predict.add_argument("--inputs", required=True, help="the request inputs as JSON")
    predict.add_argument(
        "--source", help="the caller's region; the model's routing document picks the serving region"
    )
    predict.add_argument("--region", help="the serving region to ask directly")
    predict.add_argument("--key", help="sticky key: the same key lands on the same region and set")
    predict.set_defaults(run=_predict)

    add_auth_parser(sub)

    serve = sub.add_parser("serve", help="the Serve config")
    serve.add_argument("verb", choices=["export"])
    serve.add_argument("-o", "--output", help="write YAML here instead of stdout")
    serve.set_defaults(run=_serve)

    plan = sub.add_parser("plan", help="placement planning")
    psub = plan.add_subparsers(dest="verb", required=True)
    psolve = psub.add_parser("solve", help="solve a fleet + demand file into a plan (JSON)")
    psolve.add_argument("--fleet", required=True, type=Path)
    psolve.add_argument("--demand", required=True, type=Path)
    psolve.add_argument(
        "--current",
        help="the current plan (JSON from an earlier solve): a replan, the cheapest plan's cost "
        "within 1%% with the fewest units moved (--churn-cost 0: cheapest only)",
    )
    psolve.add_argument(
        "--time-limit", type=float, default=60.0, help="seconds for the whole command: the outer stop"
    )
    psolve.add_argument(
        "--work-limit", type=int, help="the planner's budget in work units, which decides the plan"
    )
    psolve.add_argument("--churn-cost", type=float, default=0.05)
    psolve.add_argument("--out", required=True)
    pshow = psub.add_parser("show", help="the latest fleet plan (or --revision N) from the replan schedule")
    pshow.add_argument("--revision", type=int, help="a stored revision instead of the latest")
    pshow.add_argument("--json", action="store_true", help="the stored plan as JSON")
    psched = psub.add_parser(
        "schedule", help="the Temporal Schedule that replans the fleet (no option: its status)"
    )
    psched.add_argument("--every", help="create or change it: replan every 30m, 6h, 1d, ...")
    psched.add_argument("--time-limit", type=float, default=120.0, help="seconds per solve (with --every)")
    psched.add_argument("--churn-cost", type=float, default=0.05, help="(with --every)")
    psched.add_argument("--pause", nargs="?", const="", metavar="NOTE", help="pause it (with a note)")
    psched.add_argument("--unpause", action="store_true")
    psched.add_argument("--trigger", action="store_true", help="run it now and wait for the plan")
    psched.add_argument("--delete", action="store_true")
    psched.add_argument("--status", action="store_true")
    plan.set_defaults(run=_plan)

    fleet = sub.add_parser("fleet", help="the regions' states (on-call): a lost region, and its end")
    fsub = fleet.add_subparsers(dest="verb", required=True)
    fregion = fsub.add_parser("region", help="take a region out of service, or end its outage")
    frsub = fregion.add_subparsers(dest="change", required=True)
    fdown = frsub.add_parser(
        "down", help="callers go to surviving regions at once; an emergency replan plans without it"
    )
    fdown.add_argument("region")
    fdown.add_argument("--reason", required=True, help="why (kept in the fleet workflow's history)")
    fdown.add_argument("--who", required=True, help="who takes it down")
    fup = frsub.add_parser("up", help="end the outage; a normal replan moves capacity back")
    fup.add_argument("region")
    fup.add_argument("--who", required=True, help="who brings it back")
    fup.add_argument("--reason", default="", help="why (optional)")
    fregions = fsub.add_parser("regions", help="every region's state and the replans they caused")
    fregions.add_argument("--json", action="store_true", help="the whole state as JSON")
    fleet.set_defaults(run=_fleet)

    demo = sub.add_parser("demo", help="bring the stack up and run the demo scenario")
    demo.add_argument("--once", action="store_true", help="run once, stop the stack, exit 0 on success")
    demo.set_defaults(run=_demo)
    return parser


def _one_line(err: BaseException) -> str:
    """An error the CLI did not expect (Temporal or Ray unreachable, an answer it refused), as
    one line that names where it came from."""
    from temporalio.service import RPCError

    if isinstance(err, RPCError):
        return f"Temporal answered {err.status.name}: {err.message}"
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first or repr(err)}"


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    code = 0
    try:
        settings = load_settings(args.config)
        args.run(args, settings)
    except IpnextError as err:
        print(f"ipnext: {type(err).__name__}: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    except Exception as err:  # never a traceback: what failed, in one line
        print(f"ipnext: {_one_line(err)}", file=sys.stderr)
        code = 2
    # Leave without interpreter finalization: the Temporal client's native runtime threads
    # have been seen calling into Python while it finalized (a "PyGILState_Release" abort
    # after a command had done all its work). Everything the command does is done by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
