"""A process that connected through `connect_client` lets go of Temporal's native runtime at
exit, before the interpreter finalizes (the SIGABRT of temporalio/sdk-python#300 otherwise hits
scripts that did all their work, one run in five on a busy 2-core machine). Deterministic: the
script checks, in the last atexit handler to run, whether the runtime object is gone yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from temporalio.client import Client

SCRIPT = textwrap.dedent(
    """
    import asyncio, atexit, sys, weakref
    import temporalio.runtime
    from temporalio.client import Client
    from ipnext.client.temporal import connect_client
    from ipnext.spec.settings import Settings, TemporalSettings

    refs = []
    # Registered before any connect, so it runs after every handler registered later.
    atexit.register(
        lambda: print("released" if refs[0]() is None else "alive at finalization", flush=True)
    )

    async def main(address, through_ipnext):
        if through_ipnext:
            settings = Settings(temporal=TemporalSettings(address=address, task_queue="exit"))
            client = await connect_client(settings)
        else:
            client = await Client.connect(address)
        refs.append(weakref.ref(temporalio.runtime.Runtime.default()))
        await client.count_workflows()

    asyncio.run(main(sys.argv[1], sys.argv[2] == "ipnext"))
    """
)


def _exit_of(address: str, how: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, address, how], capture_output=True, text=True, timeout=120
    )
    # The control may die of the abort after printing (flushed): its exit code is not read.
    assert "released" in done.stdout or "alive" in done.stdout, done.stderr[-2000:]
    return done.stdout.strip()


async def test_a_connected_process_lets_go_of_the_native_runtime_before_finalization(
    temporal: Client,
) -> None:
    address = temporal.service_client.config.target_host
    assert _exit_of(address, "ipnext") == "released"
    # The control: temporalio alone keeps its runtime into finalization (what this guards).
    assert _exit_of(address, "temporalio") == "alive at finalization"
