"""`ipnext snapshot publish MODEL FOLDER [--wait [--timeout S]] [--override-freeze REASON --who NAME]
[--hold]` and `ipnext snapshot import-hf DIR --model M --part P --version V`: publish snapshot sets.

`import-hf` makes a Hugging Face checkpoint folder, left under a snapshot root by a download or
training job, a snapshot of one part: its config must be of a served architecture
(`ipnext.serving.llm.hf`); every `.json`, `.jinja` and `.safetensors` file is hashed (progress per
file) into the manifest (`ipnext.store.snapshots.import_checkpoint`), anything else (pickled weights
included) is left out and said so. Publishing is the separate `snapshot publish`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from ipnext.client.cli._common import with_client
from ipnext.errors import IpnextError
from ipnext.spec.settings import Settings

__all__ = ["PROGRESS_EVERY_S", "add_parser"]

PROGRESS_EVERY_S = 10.0  # --wait prints a progress line at least this often


def add_parser(sub: Any) -> None:
    """The `snapshot` command and its verbs, on the CLI's subparsers."""
    snap = sub.add_parser("snapshot", help="publish snapshot sets")
    ssub = snap.add_subparsers(dest="verb", required=True)
    pub = ssub.add_parser("publish", help="publish a snapshot folder (with its manifest.json)")
    pub.add_argument("model")
    pub.add_argument("folder")
    pub.add_argument(
        "--wait",
        action="store_true",
        help="wait until the set serves (exit 0), printing the rollout's progress at each change "
        f"and at least every {PROGRESS_EVERY_S:g} s; waits through pauses that end by themselves "
        "(too little traffic, a freeze window); exit 2 with the outcome in one line if it rolls "
        "back, is aborted, fails or is paused by a person",
    )
    pub.add_argument(
        "--timeout", type=float, default=1800.0, help="--wait: give up after this many seconds (exit 2)"
    )
    pub.add_argument("--override-freeze", metavar="REASON", help="roll out even inside a freeze window")
    pub.add_argument("--who", help="who publishes (required with --override-freeze)")
    pub.add_argument("--hold", action="store_true", help="validate and keep the set, not rolled out")
    add_import_hf_parser(ssub)
    snap.set_defaults(run=_snapshot)


def _snapshot(args: argparse.Namespace, settings: Settings) -> None:
    if args.verb == "import-hf":
        import_hf(args, settings)
        return

    async def publish(ipn: Any) -> None:
        # One client and one event loop for both steps: a second asyncio.run with a second
        # Temporal client crashed the interpreter at exit now and then (runtime finalization).
        override = None
        if args.override_freeze:
            from ipnext.contracts.freeze import FreezeOverride

            if not args.who:
                raise IpnextError("--override-freeze needs --who: an override records who decided it")
            override = FreezeOverride(reason=args.override_freeze, who=args.who)
        if args.hold and (args.wait or override):
            raise IpnextError(
                "--hold keeps the set from rolling out: it takes neither --wait nor --override-freeze"
            )
        result = await ipn.publish_snapshot(
            args.model, Path(args.folder), who=args.who or "cli", freeze_override=override, hold=args.hold
        )
        print(f"published {result.set_id} ({result.status})", flush=True)
        if args.wait:
            from ipnext.client.rollout_wait import progress_line

            started = time.monotonic()

            def progress(status: Any) -> None:
                queued = "" if status.set_id == result.set_id else "(queued behind) "
                print(f"  +{time.monotonic() - started:5.1f}s {queued}{progress_line(status)}", flush=True)

            # A CI step asks "does my set serve?": a pause that ends by itself (ipnext's own, for
            # traffic or a freeze window) is waited through; one that needs a person, a rollback,
            # an abort or a failure ends the wait at once (exit 2, the outcome and how to go on in
            # one line): the wait never outlasts a rollout that stopped moving.
            state = await ipn.wait_until_serving(
                args.model,
                result.set_id,
                timeout_s=args.timeout,
                on_progress=progress,
                through_traffic_pause=True,
                heartbeat_s=PROGRESS_EVERY_S,
            )
            print(f"{result.set_id} serves in {sorted(state.serving_apps)}")

    asyncio.run(with_client(settings, publish))


def add_import_hf_parser(snapshot_verbs: Any) -> None:
    """The `import-hf` verb under `ipnext snapshot`."""
    imp = snapshot_verbs.add_parser(
        "import-hf",
        help="write the manifest for a Hugging Face checkpoint folder under a snapshot root "
        "(<root>/MODEL/VERSION/, or a folder in it per part)",
    )
    imp.add_argument("dir")
    imp.add_argument("--model", required=True)
    imp.add_argument("--part", required=True)
    imp.add_argument("--version", required=True)


def import_hf(args: argparse.Namespace, settings: Settings) -> None:
    """Write the manifest that makes a Hugging Face checkpoint folder a snapshot (snapshots.
    import_checkpoint), after checking it lies in a snapshot root and its config is served."""
    from ipnext.serving.llm.hf import CONFIG_FILE, decoder_config, read_json
    from ipnext.store.snapshots import import_checkpoint, resolve_in_roots

    folder = resolve_in_roots(str(Path(args.dir).resolve()), settings.snapshot_roots)
    family, config = decoder_config(read_json(folder / CONFIG_FILE))  # refuses what is not served
    print(
        f"{folder.name}: {family}, {config.n_layers} layers, hidden {config.dim}, vocabulary "
        f"{config.vocab_size}, context {config.max_seq_len}; hashing its files:",
        flush=True,
    )
    where, manifest, left_out = import_checkpoint(
        folder, args.model, args.part, args.version, log=lambda line: print(line, flush=True)
    )
    entry = manifest.parts[args.part]
    print(
        f"wrote {where / 'manifest.json'}: part {args.part} = {len(entry.files or {})} files, "
        f"sha256 {entry.sha256}"
    )
    if left_out:
        print(f"left out (never read): {', '.join(left_out)}")
    print(f"publish it with: ipnext snapshot publish {args.model} {where}")
