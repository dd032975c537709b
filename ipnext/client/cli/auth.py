"""`ipnext auth`: the API keys of the serving routes (ipnext/auth.py) from the command line:
`add-key` makes one and shows it once, `list` shows names and models, never keys."""

from __future__ import annotations

import argparse
from typing import Any

from ipnext.errors import IpnextError
from ipnext.spec.settings import Settings
from ipnext.store.keys import add_key, read_keys

__all__ = ["add_parser"]


def run_auth(args: argparse.Namespace, settings: Settings) -> None:
    keys_file = settings.keys_file()
    if keys_file is None:
        raise IpnextError(
            "auth is off (auth.enabled is false): the serving routes take no keys.",
            field="auth.enabled",
            fix="set auth.enabled: true in the config first",
        )
    if args.verb == "list":
        for entry in read_keys(keys_file).keys:
            print(f"{entry.name}: {', '.join(entry.models)}")
        return
    key = add_key(keys_file, args.name, args.models)
    print(f"key {args.name!r} for {', '.join(args.models)} added to {keys_file} (routers read it within 1 s)")
    print("the key (shown this once; only its hash is kept):")
    print(key)


def add_parser(sub: Any) -> None:
    """The `auth` command on the CLI's subcommands (`sub`: argparse's subparsers action)."""
    auth = sub.add_parser("auth", help="API keys of the serving routes")
    asub = auth.add_subparsers(dest="verb", required=True)
    addkey = asub.add_parser(
        "add-key", help="make a key; its hash goes to the keys file, the key is shown once"
    )
    addkey.add_argument("name", help="who holds it (letters, digits and _.@-)")
    addkey.add_argument(
        "--models", nargs="+", required=True, help='model names, prefixes ending in *, or "*" for every model'
    )
    asub.add_parser("list", help="the keys' names and the models each may call (never the keys)")
    auth.set_defaults(run=run_auth)
