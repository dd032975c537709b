"""`ipnext.registry`, kept for code written from the README and examples before `ipnext/` was
organised by role: `ModelState` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.contracts.model import ModelState

__all__ = ["ModelState"]
