"""`ipnext model update -f model.yaml [--snapshots FOLDER] [--who W]`: change a registered model's spec.

The worker checks the new spec as at publish and applies it the lightest way it can (see
`ipnext.spec_update`); this prints how, and every changed field. A refused update changes
nothing and exits 1 with the reason (the field and the fix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import Any

from ipnext.config import Settings

__all__ = ["add_update_parser", "update_model_command"]


def add_update_parser(model_verbs: Any) -> None:
    """The `update` verb under `ipnext model`."""
    update = model_verbs.add_parser(
        "update",
        help="change a model's spec: in place, a capacity move, or a new set rolled out (see README)",
    )
    update.add_argument("-f", "--file", type=Path, required=True, help="the whole new model.yaml")
    update.add_argument(
        "--snapshots", type=Path, help="a snapshot folder (with its manifest) for parts the update adds"
    )
    update.add_argument("--who", help="who updates (default: $USER)")


def update_model_command(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.model import load_model_spec
    from ipnext.sdk import Client

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
