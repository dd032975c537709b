"""What every CLI noun shares: JSON output and an SDK client for one command."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from ipnext.spec.settings import Settings

__all__ = ["print_json", "with_client"]


def print_json(value: Any) -> None:
    if hasattr(value, "model_dump"):
        value = value.model_dump(mode="json")
    print(json.dumps(value, indent=2, default=str))


async def with_client(settings: Settings, action: Callable[[Any], Awaitable[Any]]) -> Any:
    from ipnext.client.sdk import Client

    async with await Client.connect(settings) as ipn:
        return await action(ipn)
