"""`ipnext.auth`, kept for code written from the README and examples before `ipnext/` was
organised by role: `key_header` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.store.keys import key_header

__all__ = ["key_header"]
