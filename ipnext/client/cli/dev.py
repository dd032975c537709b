"""`ipnext dev up [--nodes single|per-region] | down | status | hold|release NAME [--why W]`: the
embedded dev stack (Temporal, Ray, the worker, the supervisor)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from ipnext.client.cli._common import with_client
from ipnext.errors import StackError
from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `dev` command and its verbs, on the CLI's subparsers."""
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


def _dev(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.client.devstack.stack import DevStack

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
    """Each component (up, down, held), the supervisor and what it restarted, the pinned store's
    use and what its collections reclaimed, and orphaned models; 1 when the stack is not up."""
    from ipnext.client.devstack.stack import SUPERVISOR, process_alive
    from ipnext.client.devstack.status_file import pinned_store_lines, read_status
    from ipnext.store.pinned_store import read_gc_report

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
    store = settings.pinned_store()
    for line in pinned_store_lines(store, read_gc_report(store)):
        print(line)
    if stack.is_up():
        try:
            orphans = asyncio.run(asyncio.wait_for(with_client(settings, lambda c: c.list_orphans()), 30))
        except Exception as err:  # a status command reports, it does not fail on Temporal
            print(f"orphaned models: unknown ({type(err).__name__}: {err})")
        else:
            for m in orphans:
                print(f"orphaned model {m.name}: {m.state}, still serving; `ipnext model adopt {m.name}`")
    return 0 if stack.is_up() else 1
