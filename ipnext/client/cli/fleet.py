"""`ipnext fleet region down REGION --reason R --who W | region up REGION --who W [--reason R] |
regions [--json]`: the regions' states (on-call): a lost region, and its end."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from ipnext.client.cli._common import print_json, with_client
from ipnext.spec.settings import Settings

__all__ = ["add_parser", "render_regions"]


def add_parser(sub: Any) -> None:
    """The `fleet` command and its verbs, on the CLI's subparsers."""
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


def _fleet(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.errors import RegionStateError

    if args.verb == "regions":
        status = asyncio.run(with_client(settings, lambda c: c.fleet_regions()))
        if args.json:
            print_json(status)
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
    from ipnext.client.fleet import region_change
    from ipnext.contracts.fleet import RegionDownInput, RegionUpInput

    if args.change == "down":  # read here: a bad field is refused before anything is asked
        region_change(RegionDownInput, region=args.region, reason=args.reason, who=args.who)
    else:
        region_change(RegionUpInput, region=args.region, who=args.who, reason=args.reason)
    if args.change == "down":
        result = asyncio.run(
            with_client(settings, lambda c: c.region_down(args.region, reason=args.reason, who=args.who))
        )
    else:
        result = asyncio.run(
            with_client(settings, lambda c: c.region_up(args.region, who=args.who, reason=args.reason))
        )
    if not result.changed:
        print(f"{result.region} was already {result.health.value}: {result.detail}")
        return
    print(f"{result.region} is {result.health.value} ({result.detail})")
    if result.replan:
        print(
            f"replan {result.replan}: see `ipnext fleet regions`, then `ipnext plan show`; "
            f"{settings.ui_url}/workflows"
        )


def render_regions(status: Any) -> str:
    """`ipnext fleet regions`: a line per region, then the replans their changes caused."""
    from ipnext.contracts.identity import attributed

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
