"""`ipnext.sdk`, kept for code written from the README and examples before `ipnext/` was
organised by role: `Client`, `Prediction`, `PredictionClient` now come from `ipnext` itself.
Nothing else of the old module is here, and each name loads on first use (PEP 562), so that
`from ipnext.sdk import PredictionClient` does not load the Temporal client `Client` needs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ipnext

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time `__getattr__` loads them
    from ipnext.client.prediction import Prediction, PredictionClient
    from ipnext.client.sdk import Client

__all__ = ["Client", "Prediction", "PredictionClient"]


def __getattr__(name: str) -> Any:
    """The names of `__all__`, loaded on first use by `ipnext`'s own lazy loader (PEP 562)."""
    if name not in __all__:
        raise AttributeError(f"module 'ipnext.sdk' has no attribute {name!r}")
    value = getattr(ipnext, name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
