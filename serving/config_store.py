"""Fleet-sized `user_config`s kept out of Serve's config, in Ray's KV store.

Serve's controller deep-copies every deployment's info, its `user_config` included, at every
step of its control loop (`ApplicationState._reconcile_target_deployments`), changed or not. A
pool's catalogue, a pool router's config and the routing app's table each hold every model of
their scope, so with them inline the controller's CPU grew with the fleet while nothing changed
(py-spy at 200 pooled models: 52% of its samples there, 47% of a core). The writer stores
each such config here, content-addressed, and gives Serve a reference,
`{"config_ref": "<app>/<deployment>/<sha256>"}`; the replica resolves it in `reconfigure`. The
same content is the same key, so Serve sees no change and reconfigures nothing; a new catalogue
is a new key, and Serve reconfigures the replicas in place as before.

Ray's KV store lives in the GCS with Serve's own state (Serve keeps its checkpoints there too),
so the two are lost together or kept together. What happens when things go wrong:

- A reference whose value is missing or whose bytes do not hash to its key: `resolve` raises
  `ServingError` naming the key; the replica's reconfigure fails, Serve reports the app's update
  failed, and the model's serving check applies its record again (a new put of the value).
- A writer that restarts adopts the apps Serve runs by resolving their references; an app whose
  reference cannot be resolved is not adopted (logged), and its models' serving checks apply it
  again.
- Keys pile up with every catalogue change: after each apply the writer prunes each app's keys
  down to the one it now serves and the one before (a replica may still be reconfiguring from
  it), and an app's keys go with the app.

The KV calls are behind `KV` (`RayKV` by default), so the writer's logic is tested without Ray.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any, Protocol

from ipnext.errors import ServingError

__all__ = ["KV_NAMESPACE", "REF_KEY", "ConfigStore", "DictKV", "RayKV", "is_reference", "resolve"]

KV_NAMESPACE = "ipnext-configs"
REF_KEY = "config_ref"


class KV(Protocol):
    def put(self, key: str, value: bytes) -> None: ...

    def get(self, key: str) -> bytes | None: ...

    def delete(self, key: str) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...


class RayKV:
    """Ray's internal KV store (the GCS), in the namespace `KV_NAMESPACE`; the calling process
    must be connected to the cluster (every Serve replica and the writer are)."""

    def put(self, key: str, value: bytes) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        _internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)

    def get(self, key: str) -> bytes | None:
        from ray.experimental.internal_kv import _internal_kv_get

        value: bytes | None = _internal_kv_get(key, namespace=KV_NAMESPACE)
        return value

    def delete(self, key: str) -> None:
        from ray.experimental.internal_kv import _internal_kv_del

        _internal_kv_del(key, namespace=KV_NAMESPACE)

    def keys(self, prefix: str) -> list[str]:
        from ray.experimental.internal_kv import _internal_kv_list

        return [k.decode() for k in _internal_kv_list(prefix, namespace=KV_NAMESPACE)]


class DictKV:
    """An in-memory KV (unit tests, and a writer's logic outside Ray)."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def put(self, key: str, value: bytes) -> None:
        self.values[key] = value

    def get(self, key: str) -> bytes | None:
        return self.values.get(key)

    def delete(self, key: str) -> None:
        self.values.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        return sorted(k for k in self.values if k.startswith(prefix))


def is_reference(config: Any) -> bool:
    return isinstance(config, dict) and set(config) == {REF_KEY}


def resolve(config: dict[str, Any] | None, kv: KV | None = None) -> dict[str, Any]:
    """A deployment's `user_config` as its replica should read it: the stored config a
    reference names, checked against its hash, or the config itself when it is inline."""
    if not is_reference(config):
        return config or {}
    assert config is not None
    key = config[REF_KEY]
    data = (kv or RayKV()).get(key)
    if data is None:
        raise ServingError(f"config {key} is not in Ray's KV store; the next serving check applies it again")
    if not key.endswith("/" + hashlib.sha256(data).hexdigest()):
        raise ServingError(f"config {key}: its stored bytes do not hash to its key")
    loaded: dict[str, Any] = json.loads(data)
    return loaded


class ConfigStore:
    """The writer's side: `externalize` a whole Serve config before it is applied, `adopt` an
    app Serve runs back to its inline form, `prune` what no app serves any more."""

    def __init__(self, kv: KV | None = None) -> None:
        self.kv: KV = kv or RayKV()

    def externalize(
        self, config: dict[str, Any], stored: Callable[[str], bool]
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The config with the `user_config` of every deployment of the apps `stored` names put
        in the store and replaced by its reference; and each such app's key now."""
        out = copy.copy(config)
        keys: dict[str, str] = {}
        apps = []
        for app in config.get("applications", []):
            if not stored(app["name"]):
                apps.append(app)
                continue
            deployments = []
            for deployment in app.get("deployments", []):
                user_config = deployment.get("user_config")
                if user_config is None or is_reference(user_config):
                    deployments.append(deployment)
                    continue
                data = json.dumps(user_config, sort_keys=True, separators=(",", ":")).encode()
                key = f"{app['name']}/{deployment['name']}/{hashlib.sha256(data).hexdigest()}"
                if self.kv.get(key) is None:
                    self.kv.put(key, data)
                keys[f"{app['name']}/{deployment['name']}"] = key
                deployments.append({**deployment, "user_config": {REF_KEY: key}})
            apps.append({**app, "deployments": deployments})
        out["applications"] = apps
        return out, keys

    def adopt(self, app: dict[str, Any]) -> dict[str, Any]:
        """An app as Serve runs it, each referenced `user_config` read back (raises
        `ServingError` when one cannot be)."""
        deployments = [
            {**d, "user_config": resolve(d["user_config"], self.kv)}
            if is_reference(d.get("user_config"))
            else d
            for d in app.get("deployments", [])
        ]
        return {**app, "deployments": deployments}

    def prune(self, now: dict[str, str], before: dict[str, str]) -> int:
        """Delete every stored config of a deployment but the one it serves now and the one
        before; a deployment gone, all of its. Returns how many keys went."""
        deleted = 0
        for deployment in sorted(set(now) | set(before)):
            keep = {now.get(deployment), before.get(deployment) if deployment in now else None}
            for key in self.kv.keys(deployment + "/"):
                if key not in keep:
                    self.kv.delete(key)
                    deleted += 1
        return deleted
