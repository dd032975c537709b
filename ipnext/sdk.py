"""`ipnext.sdk`, kept for code written from the README and examples before `ipnext/` was
organised by role: `Client`, `Prediction`, `PredictionClient` now come from `ipnext` itself.
Nothing else of the old module is here."""

from __future__ import annotations

from ipnext.client.prediction import Prediction, PredictionClient
from ipnext.client.sdk import Client

__all__ = ["Client", "Prediction", "PredictionClient"]
