"""Process-wide context of activities: the worker's settings and its Ray connection."""

from __future__ import annotations

import functools

from ipnext.config import Settings, load_settings

__all__ = ["settings", "writer"]


@functools.cache
def settings() -> Settings:
    return load_settings()


def writer() -> object:
    """The Serve config writer actor, connecting this process to Ray on first use."""
    from ipnext.serving.control import connect_for, writer_for

    current = settings()
    connect_for(current)
    return writer_for(current)
