"""The one Temporal client factory: worker, SDK, CLI and tests all get the pydantic data converter."""

from __future__ import annotations

from temporalio.client import Client
from temporalio.common import SearchAttributeKey
from temporalio.contrib.pydantic import pydantic_data_converter

from ipnext.config import Settings

__all__ = ["MODEL_KEY", "STATE_KEY", "TRAFFIC_KEY", "connect_client"]

MODEL_KEY = SearchAttributeKey.for_keyword("IpnextModel")
STATE_KEY = SearchAttributeKey.for_keyword("IpnextState")
TRAFFIC_KEY = SearchAttributeKey.for_int("IpnextTrafficPercent")


async def connect_client(settings: Settings) -> Client:
    return await Client.connect(
        settings.temporal_address,
        namespace=settings.temporal_namespace,
        data_converter=pydantic_data_converter,
    )
