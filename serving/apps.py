"""The Serve builders under their import paths from before the split into `set_app` and
`router`: Serve configs rendered then (`ipnext.serving.apps:set_app`, `...:router_app`) are
still rebuilt by a restarted controller, so those paths must keep importing."""

from __future__ import annotations

from ipnext.serving.router import router_app
from ipnext.serving.set_app import set_app

__all__ = ["router_app", "set_app"]
