"""The `ipnext` command line, one module per noun; each adds its command and verbs to the parser
(`add_parser`) and runs them through the SDK, the dev stack or the planner.

| command | module | what it does |
|---|---|---|
| `ipnext dev` | `dev.py` | the embedded dev stack: up, down, status, hold and release a component |
| `ipnext model` | `model.py` | publish, update, get, demand, list, adopt and delete models |
| `ipnext snapshot` | `snapshot.py` | publish snapshot sets; import a Hugging Face checkpoint folder |
| `ipnext experiment`, `ipnext shadow` | `experiment.py` | A/B experiments and shadow traffic on a model |
| `ipnext rollout` | `rollout.py` | watch and steer a running rollout (on-call) |
| `ipnext predict` | `predict.py` | one prediction over HTTP, no Temporal needed |
| `ipnext auth` | `auth.py` | the serving routes' API keys |
| `ipnext serve` | `serve.py` | the Serve config, exported |
| `ipnext plan` | `plan.py` | solve placements by hand; the replan Schedule |
| `ipnext fleet` | `fleet.py` | regions down and up (on-call) |
| `ipnext demo` | `demo.py` | the stack and the demo scenario |

`main` reads the settings, runs the command, and turns every error into one line on stderr
(exit 2): an IpnextError with its fix, anything else with where it came from; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from ipnext.client.cli import (
    auth,
    demo,
    dev,
    experiment,
    fleet,
    model,
    plan,
    predict,
    rollout,
    serve,
    snapshot,
)
from ipnext.errors import IpnextError
from ipnext.spec.settings import load_settings

__all__ = ["main", "parser"]

# In the order `ipnext --help` lists them.
NOUNS = (dev, model, snapshot, experiment, rollout, predict, auth, serve, plan, fleet, demo)


def parser() -> argparse.ArgumentParser:
    """The whole `ipnext` parser: every noun and verb (the docs generate the CLI reference from it)."""
    parser = argparse.ArgumentParser(
        prog="ipnext", description="ipnext: publish, validate, plan, roll out and serve models"
    )
    parser.add_argument("--config", help="ipnext.yaml to use (default: $IPNEXT_CONFIG or config/ipnext.yaml)")
    sub = parser.add_subparsers(dest="command", required=True)
    for noun in NOUNS:
        noun.add_parser(sub)
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
    args = parser().parse_args(argv)
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
