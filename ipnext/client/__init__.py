"""The client tier: the SDK (`sdk`), predictions with only the serving URL (`prediction`), the
Temporal client factory (`temporal`), the fleet workflow and replan Schedule from the client side
(`fleet`, `schedules`), the worker process (`worker`), the command line (`cli`, one module per
noun) and the dev stack (`devstack`, with its supervisor).

Modules here may import every layer; nothing below imports them (the layering test)."""

__all__ = ["cli", "devstack", "fleet", "prediction", "schedules", "sdk", "temporal", "worker"]
