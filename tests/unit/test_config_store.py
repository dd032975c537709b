"""Fleet-sized user_configs kept in a KV store and referenced from Serve's config: the same
content is the same key, other apps stay inline, a reference that is missing or does not match
its bytes is refused by name, and pruning keeps each deployment's current and previous config."""

from __future__ import annotations

from typing import Any

import pytest

from ipnext.errors import ServingError
from ipnext.serving.config_store import REF_KEY, ConfigStore, DictKV, is_reference, resolve


def config(table: dict[str, Any]) -> dict[str, Any]:
    return {
        "applications": [
            {"name": "big", "deployments": [{"name": "d", "user_config": table}, {"name": "plain"}]},
            {"name": "small", "deployments": [{"name": "d", "user_config": {"x": 1}}]},
        ]
    }


def stored(name: str) -> bool:
    return name == "big"


def test_a_stored_config_is_referenced_by_its_content_and_resolves_to_itself() -> None:
    store = ConfigStore(DictKV())
    served, keys = store.externalize(config({"models": [1, 2, 3]}), stored)
    big, small = served["applications"]
    reference = big["deployments"][0]["user_config"]
    assert is_reference(reference) and keys == {"big/d": reference[REF_KEY]}
    assert "user_config" not in big["deployments"][1]  # none to store
    assert small["deployments"][0]["user_config"] == {"x": 1}  # not a stored app: inline
    assert resolve(reference, store.kv) == {"models": [1, 2, 3]}
    assert resolve({"x": 1}, store.kv) == {"x": 1} and resolve(None, store.kv) == {}
    again, _ = store.externalize(config({"models": [1, 2, 3]}), stored)
    assert again == served  # the same content: the same reference, so Serve changes nothing
    changed, _ = store.externalize(config({"models": [1, 2]}), stored)
    assert changed["applications"][0] != big
    assert store.adopt(changed["applications"][0])["deployments"][0]["user_config"] == {"models": [1, 2]}


def test_a_missing_or_altered_config_is_refused_by_its_key() -> None:
    kv = DictKV()
    store = ConfigStore(kv)
    served, keys = store.externalize(config({"models": [1]}), stored)
    reference = served["applications"][0]["deployments"][0]["user_config"]
    kv.values[keys["big/d"]] = b'{"models":[2]}'
    with pytest.raises(ServingError, match="do not hash to its key"):
        resolve(reference, kv)
    kv.values.clear()
    with pytest.raises(ServingError, match=r"big/d/[0-9a-f]{64} is not in Ray's KV store"):
        store.adopt(served["applications"][0])


def test_pruning_keeps_the_config_served_and_the_one_before_and_drops_a_gone_deployments() -> None:
    kv = DictKV()
    store = ConfigStore(kv)
    before: dict[str, str] = {}
    for n in range(4):
        _, now = store.externalize(config({"models": list(range(n))}), stored)
        store.prune(now, before)
        assert set(kv.keys("big/d/")) == {now["big/d"], *([before["big/d"]] if before else [])}
        before = now
    assert store.prune({}, before) == 2  # the app went: its keys with it
    assert kv.values == {}
