"""`ipnext demo [--once]`: bring the dev stack up and run the demo scenario."""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import Any

from ipnext.spec.settings import Settings

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    """The `demo` command and its verbs, on the CLI's subparsers."""
    demo = sub.add_parser("demo", help="bring the stack up and run the demo scenario")
    demo.add_argument("--once", action="store_true", help="run once, stop the stack, exit 0 on success")
    demo.set_defaults(run=_demo)


def _demo(args: argparse.Namespace, settings: Settings) -> None:
    from ipnext.client.devstack.stack import DevStack
    from ipnext.examples.demo import run_scenario

    # Ctrl-C and SIGTERM end the demo through the `finally` below, even where SIGINT is ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stack = DevStack(settings)
    started_here = not stack.is_up()
    t0 = time.perf_counter()
    stack.up()
    try:
        asyncio.run(run_scenario(settings))
        print(f"demo scenario done in {time.perf_counter() - t0:.1f}s")
        if not args.once:
            print("the stack stays up; press Ctrl-C to stop it")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        print()
    finally:
        if started_here:
            stack.down()
