"""`ipnext plan solve --fleet F --demand D [--current P] --out P | show [--revision N] [--json]`
and `ipnext plan schedule --every 6h | --pause [NOTE] | --unpause | --trigger | --delete |
--status`: placement planning by hand, and the Schedule that replans the fleet."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from ipnext.errors import IpnextError
from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `plan` command and its verbs, on the CLI's subparsers."""
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


def _plan(args: argparse.Namespace, settings: Settings) -> None:
    {"solve": _plan_solve, "show": _plan_show, "schedule": _plan_schedule}[args.verb](args, settings)


def _plan_show(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.store.plans import PlanStore

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


def _plan_schedule(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.client.schedules import ensure_replan_schedule, trigger_and_wait
    from ipnext.client.temporal import connect_client
    from ipnext.contracts.fleet import FleetReplanInput
    from ipnext.contracts.identity import default_identity
    from ipnext.names import REPLAN_SCHEDULE_ID
    from ipnext.store.plans import parse_every

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
    from ipnext.contracts.plan import Plan, PlanningProblem, SolveOptions
    from ipnext.planner import solve
    from ipnext.spec.demand_file import load_demand_file
    from ipnext.spec.fleet import load_fleet

    started = time.monotonic()
    fleet = load_fleet(args.fleet)
    demand = load_demand_file(args.demand)
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
