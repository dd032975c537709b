"""`ipnext.model`, kept for code written from the README and examples before `ipnext/` was
organised by role: `load_model_spec` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.spec.model import load_model_spec

__all__ = ["load_model_spec"]
