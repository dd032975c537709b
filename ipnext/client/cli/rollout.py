"""`ipnext rollout status|watch MODEL | pause|abort|override-freeze MODEL --reason R [--who W] |
resume MODEL`: watch and steer a model's running rollout (on-call)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from ipnext.client.cli._common import with_client
from ipnext.errors import IpnextError
from ipnext.spec.settings import Settings

__all__ = ["add_parser", "render_rollout"]


def add_parser(sub: Any) -> None:
    """The `rollout` command and its verbs, on the CLI's subparsers."""
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
            verb_parser.add_argument(
                "--timeout", type=float, default=None, help="give up after this many seconds (exit 2)"
            )
    roll.set_defaults(run=_rollout)


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
            await _watch(ipn, args.model, args.interval, args.timeout)
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

    asyncio.run(with_client(settings, act))


async def _watch(ipn: Any, model: str, interval: float, timeout_s: float | None = None) -> None:
    """Redraw the rollout's view every `interval` seconds until it ends (Ctrl-C leaves). Exits
    as `snapshot publish --wait` does: 0 only when it completed; rolled back, aborted, cancelled,
    failed or refused raise `RolloutStoppedError` (exit 2, the outcome in one line), and so does
    `timeout_s` running out. It watches through pauses: on-call watches a paused rollout too."""
    from ipnext.client.rollout_wait import stopped_line
    from ipnext.errors import RolloutStoppedError, ServingError
    from ipnext.names import RolloutState

    tty = sys.stdout.isatty()
    last = ""
    until = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = await ipn.rollout_status(model)
        view = "no rollout yet" if status is None else render_rollout(status)
        if view != last:
            if tty:
                print("\x1b[2J\x1b[H", end="")
            print(view + ("" if tty else "\n---"), flush=True)
            last = view
        if status is None or status.state == RolloutState.COMPLETED:
            return
        if status.state.is_terminal:
            raise RolloutStoppedError(stopped_line(status.set_id, status), status=status)
        if until is not None and time.monotonic() >= until:
            raise ServingError(
                f"{status.set_id}'s rollout still {status.state.value} at {status.step or 'start'} "
                f"after {timeout_s:g} s",
                fix=f"`ipnext rollout watch {model}` goes on watching",
            )
        await asyncio.sleep(interval)


def render_rollout(status: Any) -> str:
    """The terminal view of a rollout: state, steps, traffic split, gates, pauses."""
    from ipnext.contracts.identity import attributed

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
