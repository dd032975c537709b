"""`ipnext snapshot import-hf DIR --model M --part P --version V`: make a Hugging Face checkpoint
folder, left under a snapshot root by a download or training job, a snapshot of one part.

The folder must be `<root>/M/V/` itself or a folder in it (one per part); its config must be of a
served architecture (`ipnext.serving.llm.hf`). Every `.json`, `.jinja` and `.safetensors` file is
hashed (progress per file) into the manifest (`ipnext.snapshots.import_checkpoint`); anything
else, pickled weights included, is left out and said so. Publishing is a separate step
(`ipnext snapshot publish M <folder>`), which validates and pins every file.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ipnext.config import Settings

__all__ = ["add_import_hf_parser", "import_hf"]


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
    from ipnext.snapshots import import_checkpoint, resolve_in_roots

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
        f"wrote {where / 'manifest.json'}: part {args.part} = {len(entry.files or {})} files, sha256 {entry.sha256}"
    )
    if left_out:
        print(f"left out (never read): {', '.join(left_out)}")
    print(f"publish it with: ipnext snapshot publish {args.model} {where}")
