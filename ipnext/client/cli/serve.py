"""`ipnext serve export [-o FILE]`: the Serve config of what is deployed, as YAML."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `serve` command and its verbs, on the CLI's subparsers."""
    serve = sub.add_parser("serve", help="the Serve config")
    serve.add_argument("verb", choices=["export"])
    serve.add_argument("-o", "--output", help="write YAML here instead of stdout")
    serve.set_defaults(run=_serve)


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
