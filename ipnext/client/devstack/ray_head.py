"""The dev stack's Ray head process (`python -m ipnext.client.devstack.ray_head`, started by
`DevStack`): a local cluster with the fleet as custom resources, and Serve, until it is told to
stop; its GCS address is written to the settings' `ray_address_file` for the rest of the stack.

Ray's own metrics export port (Prometheus text, no token) is left to Ray: a random port, which
Ray binds to loopback when the node address is loopback, as the single-node stack's is
(`store/ray_token.py`); per-region nodes (`--nodes per-region`) have a routable address, and Ray
then binds it to every interface, with no setting to do otherwise. ipnext needs it no more: its
series are served on the keyed `GET /metrics` of the Serve port (`serving/prometheus_text.py`)."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from ipnext.client.devstack.stack import free_port
from ipnext.spec.settings import load_settings

__all__ = ["ray_head"]


def _agent_port_of_its_own() -> None:
    """Give this head's dashboard agent a free port, as `_start_nodes` gives every region node's.
    `ray.init` starts it on Ray's fixed 52365, which `ray.init` does not let a caller change: a
    second stack on the machine (the other test worker's, a unit test's local Ray) then leaves
    this agent without its HTTP server (its job API, which the token guards, gone: port -1)."""
    from ray._private import parameter

    if getattr(parameter.RayParams, "_ipnext_agent_port", False):
        return
    base = parameter.RayParams

    class RayParams(base):  # type: ignore[misc, valid-type]
        _ipnext_agent_port = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("dashboard_agent_listen_port", free_port())
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParams  # type: ignore[misc]


def ray_head() -> None:
    """The dev stack's Ray head: a local cluster with the fleet as custom resources, and Serve."""
    import ray
    from ray import serve

    from ipnext.serving.layout import PROXY_TIMEOUT_S

    settings = load_settings()
    print(f"ipnext ray head: {settings.describe_source()}, {settings.ray.nodes} nodes", flush=True)
    fleet = settings.fleet()
    resources: dict[str, float] = {}
    if settings.ray.nodes == "single":  # else each region's node holds its own (DevStack._start_nodes)
        resources = {f"region:{r}": 1000.0 for r in fleet.regions}
        for pool in fleet.pools:
            key = f"hw:{pool.hardware}"
            resources[key] = resources.get(key, 0.0) + pool.units
    ray_dir = settings.state_dir / "ray"
    ray_dir.mkdir(parents=True, exist_ok=True)
    _agent_port_of_its_own()
    ray.init(
        # Always a new cluster: with no address, Ray joins the one named in its folder's
        # `ray_current_cluster`, which a region node's `ray start` wrote for the head now gone.
        address="local",
        num_cpus=settings.ray.num_cpus or os.cpu_count(),
        resources=resources,
        include_dashboard=False,
        # No `_metrics_export_port`: Ray's random one, loopback-only on a single node (docstring).
        _node_ip_address="127.0.0.1",
        _temp_dir=str(ray_dir),
        namespace="ipnext",
        log_to_driver=False,
    )
    serve.start(
        proxy_location=settings.proxy_location,
        http_options={
            "host": settings.serve.host,
            "port": settings.serve.port,
            "request_timeout_s": PROXY_TIMEOUT_S,  # a backstop above every router deadline
        },
        logging_config={"enable_access_log": False},
    )
    address = ray.get_runtime_context().gcs_address
    tmp = settings.ray_address_file.with_suffix(".tmp")
    tmp.write_text(address + "\n")
    tmp.replace(settings.ray_address_file)
    print(f"ray head at {address}, resources {resources}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    settings.ray_address_file.unlink(missing_ok=True)
    ray.shutdown()


if __name__ == "__main__":
    ray_head()
