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

`main` imports only the module of the command it runs (a prediction loads no Temporal client),
reads the settings, runs the command, and turns every error into one line on stderr (exit 2),
`ipnext: <what went wrong>`, an IpnextError with its fix; `ipnext --debug ...` adds the type and
traceback. A reader that closes the pipe (`ipnext ... | head`) ends the command quietly, exit 141.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import sys
import traceback
from types import ModuleType

from ipnext.errors import IpnextError
from ipnext.spec.settings import load_settings

__all__ = ["main", "parser"]

# Each command and the module that adds it, in the order `ipnext --help` lists them.
COMMANDS = {
    "dev": "dev",
    "model": "model",
    "snapshot": "snapshot",
    "experiment": "experiment",
    "shadow": "experiment",
    "rollout": "rollout",
    "predict": "predict",
    "auth": "auth",
    "serve": "serve",
    "plan": "plan",
    "fleet": "fleet",
    "demo": "demo",
}

# A shell reports a process that SIGPIPE ended as 128 + 13: what `cat` or `grep` exit with under
# `head`, and what `set -o pipefail` scripts already expect of a filter whose reader left early.
# (Python's docs exit 1 in their recipe; 0 would hide from a pipeline that the output was cut.)
CLOSED_PIPE_EXIT = 141


def _noun(module: str) -> ModuleType:
    return importlib.import_module(f"ipnext.client.cli.{module}")


def parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `ipnext` parser. With no `command`, every noun and verb (the docs generate the CLI
    reference from it); with one, only that command's module is imported and every other command
    is a stand-in that takes any words (`main` parses again with everything if one is chosen)."""
    parser = argparse.ArgumentParser(
        prog="ipnext", description="ipnext: publish, validate, plan, roll out and serve models"
    )
    parser.add_argument("--config", help="ipnext.yaml to use (default: $IPNEXT_CONFIG or config/ipnext.yaml)")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, print its type and traceback as well"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = COMMANDS.get(command or "")
    for name, module in COMMANDS.items():
        if chosen is None or module == chosen:
            if name == module:  # a module adds all of its commands at once
                _noun(module).add_parser(sub)
        else:
            stand_in = sub.add_parser(name, add_help=False)
            stand_in.add_argument("words", nargs=argparse.REMAINDER)
            stand_in.set_defaults(run=None)
    return parser


def _command_in(argv: list[str]) -> str | None:
    """The command argparse will pick, read ahead so that only its module is imported: the first
    word that is neither an option nor --config's value. None (every module) for a help of the
    whole CLI or no command."""
    words = iter(argv)
    for word in words:
        if word in ("-h", "--help"):
            return None
        if word == "--config":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def _parse(argv: list[str]) -> argparse.Namespace:
    args = parser(_command_in(argv)).parse_args(argv)
    if args.run is None:  # the read-ahead guessed another command (an abbreviated --config)
        args = parser().parse_args(argv)
    return args


def _stdout_reader_gone() -> bool:
    """stdout is a pipe whose reader has closed it (`| head`), rather than a socket or a child's
    pipe that broke inside a command, which is an error like any other."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll, or no real stdout: say it is not
        return False


def _one_line(err: BaseException) -> str:
    """What went wrong, in one line without Python's class names: an IpnextError's message and
    fix; Temporal's status; else the first line of the message (`--debug` shows the rest)."""
    if isinstance(err, IpnextError):
        return str(err)
    service = sys.modules.get("temporalio.service")  # not loaded: no RPCError can have come
    if service is not None and isinstance(err, service.RPCError):
        return f"Temporal answered {err.status.name}: {err.message}"
    lines = str(err).strip().splitlines()
    what = lines[0] if lines else "an unexpected error without a message"
    return f"{what} (`ipnext --debug ...` shows where it came from)"


def _run(argv: list[str]) -> int:
    """Parse, run, and give the exit code: 0; 2 for an error, said in one line; 130 on Ctrl-C;
    argparse's own or a command's `sys.exit` code."""
    debug = False
    try:
        args = _parse(argv)
        debug = args.debug
        args.run(args, load_settings(args.config))
        return 0
    except SystemExit as done:  # argparse's --help (0) or usage error (2, said); `dev status`'s code
        if done.code is None or isinstance(done.code, int):
            return done.code or 0
        print(f"ipnext: {done.code}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        return 130
    except Exception as err:
        if isinstance(err, BrokenPipeError) and _stdout_reader_gone():
            raise  # not an error: `main` ends quietly
        if debug:
            traceback.print_exception(err)
        print(f"ipnext: {_one_line(err)}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> None:
    try:
        code = _run(sys.argv[1:] if argv is None else argv)
        sys.stdout.flush()  # output still buffered meets a closed pipe here, not at exit
    except BrokenPipeError:
        # The reader left (`ipnext model get X | head -3`): nothing more is wanted, so no message.
        # stdout goes to /dev/null so that nothing flushed later raises again, after one last try
        # in case it was stderr's reader that left (`2> >(head -1)`) and stdout is a file.
        try:
            sys.stdout.flush()
        except OSError:
            pass
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = CLOSED_PIPE_EXIT
    # Leave without interpreter finalization: the Temporal client's native runtime threads
    # have been seen calling into Python while it finalized (a "PyGILState_Release" abort
    # after a command had done all its work). Everything the command does is done by now.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # stderr's reader gone too (`2>&1 | head`)
            pass
    os._exit(code)
