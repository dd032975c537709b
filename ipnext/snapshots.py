"""`ipnext.snapshots`, kept for code written from the README and examples before `ipnext/` was
organised by role: `Manifest`, `import_checkpoint`, `write_snapshot` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.store.snapshots import Manifest, import_checkpoint, write_snapshot

__all__ = ["Manifest", "import_checkpoint", "write_snapshot"]
