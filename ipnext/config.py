"""`ipnext.config`, kept for code written from the README and examples before `ipnext/` was
organised by role: `Settings` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.spec.settings import Settings

__all__ = ["Settings"]
