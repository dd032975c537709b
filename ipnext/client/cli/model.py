"""`ipnext model publish FILE | update -f FILE [--snapshots FOLDER] [--who W] | get NAME | demand NAME
[--window S] | list | adopt NAME | delete NAME`: register, inspect, change and delete models.

`update` checks the new spec on the worker as at publish and applies it the lightest way it can
(`ipnext.policy.spec_update`), printing how and every changed field; a refused update changes
nothing and exits with the reason (the field and the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

from ipnext.client.cli._common import print_json, with_client
from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `model` command and its verbs, on the CLI's subparsers."""
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


def _model(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.spec.model import load_model_spec

    if args.verb == "publish":
        spec = load_model_spec(args.file)
        state = asyncio.run(with_client(settings, lambda c: c.publish_model(spec)))
        print(f"model {spec.name} registered (workflow model/{spec.name}, state {state.state})")
    elif args.verb == "update":
        update_model_command(args, settings)
    elif args.verb == "get":

        async def get(c: Any) -> tuple[Any, Any]:
            from ipnext.names import model_workflow_id

            state = await c.get_model(args.name)
            return state, await c.freshness(model_workflow_id(args.name), state.updated_at)

        state, fresh = asyncio.run(with_client(settings, get))
        print_json(state)
        print(fresh.describe(), file=sys.stderr)  # stdout stays JSON
    elif args.verb == "demand":
        window = args.window or settings.demand.window_seconds
        view = asyncio.run(with_client(settings, lambda c: c.model_demand(args.name, window)))
        print(
            f"{view.model}: observed over {view.window_seconds:g} s windows, "
            f"{view.history_seconds:.0f} s of history, "
            f"from routers in {', '.join(view.regions) or 'no region'}"
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

        models, orphans = asyncio.run(with_client(settings, both))
        for m in models:
            print(f"{m.name:30} {m.state}")
        for m in orphans:
            print(f"{m.name:30} {m.state}: its apps keep serving, unmanaged; `ipnext model adopt {m.name}`")
        if not models and not orphans:
            print("no models")
    elif args.verb == "adopt":
        state = asyncio.run(with_client(settings, lambda c: c.adopt_model(args.name)))
        print(f"model {args.name} adopted: {state.state}, serving {state.serving_set or 'nothing'}")
    elif args.verb == "delete":
        result = asyncio.run(with_client(settings, lambda c: c.delete_model(args.name, who="cli")))
        print(f"model {args.name} deleted; removed apps {result.removed_apps}")


def add_update_parser(model_verbs: Any) -> None:
    """The `update` verb under `ipnext model`."""
    update = model_verbs.add_parser(
        "update",
        help="change a model's spec: in place, a capacity move, or a new set rolled out "
        "(docs/guides/rollouts.md)",
    )
    update.add_argument("-f", "--file", type=Path, required=True, help="the whole new model.yaml")
    update.add_argument(
        "--snapshots", type=Path, help="a snapshot folder (with its manifest) for parts the update adds"
    )
    update.add_argument("--who", help="who updates (default: $USER)")


def update_model_command(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.client.sdk import Client
    from ipnext.spec.model import load_model_spec

    spec = load_model_spec(args.file)
    who = args.who or os.environ.get("USER", "cli")

    async def update() -> Any:
        async with await Client.connect(settings) as ipn:
            return await ipn.update_model(spec, who=who, snapshots=args.snapshots)

    result = asyncio.run(update())
    if not result.changes:
        print(f"model {spec.name}: the spec is unchanged; nothing to do")
        return
    print(f"model {spec.name} updated by {who} ({result.kind}): {result.outcome}")
    for line in result.changes:
        print(f"  {line}")
