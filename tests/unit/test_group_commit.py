"""The writer's group commit: changes that arrive while an apply runs are applied together by the
next one; a batch Serve refuses is applied change by change, so only the bad change fails; routing
documents of models published at once all land. The writer runs in threads as its actor does,
with Serve's client replaced at its seam (`_client`)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ipnext.contracts.routing import RoutingDocument
from ipnext.names import wait_until
from ipnext.serving.config_store import REF_KEY, ConfigStore, DictKV, resolve
from ipnext.serving.config_writer import ServeConfigWriter
from ipnext.serving.group_commit import Change, GroupCommit
from ipnext.serving.layout import ROUTING_APP, deployed_routing


class FakeServe:
    """Serve's client: records each whole config applied (`applied`, the apps' names; `configs`,
    the configs); refuses any config holding an app named in `refuse`; holds each apply until
    `gate` is set (cleared: the apply waits); `running` is what `get_serve_details` reports."""

    def __init__(self) -> None:
        self.applied: list[list[str]] = []
        self.configs: list[dict[str, Any]] = []
        self.running: dict[str, Any] = {}
        self.refuse: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def get_serve_details(self) -> dict[str, Any]:
        return {"applications": self.running}

    def deploy_apps(self, config: Any) -> None:
        names = [app.name for app in config.applications]
        self.entered.set()
        assert self.gate.wait(30), "the test never opened the gate"
        if self.refuse & set(names):
            raise ValueError(f"Serve refused {sorted(self.refuse & set(names))}")
        self.applied.append(names)
        self.configs.append(config.model_dump(mode="json", exclude_unset=True))


class Writer(ServeConfigWriter):
    def __init__(self, serve: FakeServe, kv: DictKV | None = None) -> None:
        self.serve = serve
        self.kv = kv or DictKV()
        super().__init__("127.0.0.1", 8000)

    def _client(self) -> Any:
        return self.serve

    def _config_store(self) -> ConfigStore:
        return ConfigStore(self.kv)


def app(name: str) -> dict[str, Any]:
    return {"name": name, "route_prefix": f"/{name}", "import_path": "m:app", "deployments": []}


def document(model: str) -> dict[str, Any]:
    routes = {"us-east": {"us-east": 1.0}}
    return RoutingDocument(model=model, generation=1, ttl_seconds=5, routes=routes).model_dump(mode="json")


def held_first_apply(writer: Writer, callers: list[Any]) -> list[Any]:
    """Run the first caller until its apply is in Serve, start the rest (they queue behind it),
    then let Serve answer; the callers' answers in order."""
    serve = writer.serve
    serve.gate.clear()
    serve.entered.clear()
    with ThreadPoolExecutor(max_workers=len(callers)) as pool:
        first = pool.submit(callers[0])
        assert serve.entered.wait(30)
        rest = [pool.submit(c) for c in callers[1:]]
        # Every other caller queued behind the running commit before Serve answers it.
        wait_until(
            lambda: len(writer._commits._queue), lambda n: n == len(rest), timeout_s=30, interval_s=0.01
        )
        serve.gate.set()
        futures = [first, *rest]
        return [f.exception() or f.result() for f in futures]


def test_changes_that_arrive_during_an_apply_are_applied_together_by_the_next() -> None:
    serve = FakeServe()
    writer = Writer(serve)
    callers = [lambda i=i: writer.apply([app(f"a{i}")], []) for i in range(12)]
    answers = held_first_apply(writer, callers)
    assert serve.applied == [["a0"], sorted(f"a{i}" for i in range(12))]
    assert answers == [1] + [2] * 11
    assert writer.commit_stats() == {"commits": 2, "changes": 12, "largest_batch": 11, "applies": 2}
    assert writer.app_names() == sorted(f"a{i}" for i in range(12))


def test_a_batch_serve_refuses_is_applied_change_by_change_and_only_the_bad_change_fails() -> None:
    serve = FakeServe()
    writer = Writer(serve)
    serve.refuse = {"bad"}
    callers = [
        lambda: writer.apply([app("a0")], []),
        lambda: writer.apply([app("a1")], []),
        lambda: writer.apply([app("bad")], []),
        lambda: writer.apply([app("a2")], []),
    ]
    answers = held_first_apply(writer, callers)
    assert isinstance(answers[2], ValueError) and "bad" in str(answers[2])
    assert [a for i, a in enumerate(answers) if i != 2] == [1, 2, 3]
    # The batch of three was refused whole, then a1 and a2 were applied alone.
    assert serve.applied == [["a0"], ["a0", "a1"], ["a0", "a1", "a2"]]
    assert writer.app_names() == ["a0", "a1", "a2"]


def test_routing_documents_published_at_once_all_land_and_unchanged_ones_apply_nothing() -> None:
    serve = FakeServe()
    writer = Writer(serve)
    models = [f"m{i}" for i in range(6)]
    answers = held_first_apply(writer, [lambda m=m: writer.publish_routing(document(m)) for m in models])
    assert answers == [1] * 6
    table = deployed_routing(writer.app_configs([ROUTING_APP])[ROUTING_APP])
    assert sorted(table.documents) == models
    applies = len(serve.applied)
    assert applies == 2
    assert writer.publish_routing(document("m0")) == 1 and len(serve.applied) == applies  # nothing new
    assert writer.withdraw_routing("m3") is True and writer.withdraw_routing("m3") is False
    assert "m3" not in deployed_routing(writer.app_configs([ROUTING_APP])[ROUTING_APP]).documents
    assert writer.redeploy() == len(serve.applied) == applies + 2  # applied even though unchanged


def test_an_error_in_the_commit_reaches_every_caller_of_its_batch_and_the_next_commit_runs() -> None:
    calls: list[int] = []

    def commit(batch: list[Change]) -> None:
        calls.append(len(batch))
        if len(calls) == 1:
            raise RuntimeError("down")
        for change in batch:
            change.finish(change.payload * 2)

    group: GroupCommit[Change] = GroupCommit(commit)
    with pytest.raises(RuntimeError, match="down"):
        group.submit(Change(payload=1))
    assert group.submit(Change(payload=4)) == 8
    forgetful: GroupCommit[Change] = GroupCommit(lambda batch: None)
    with pytest.raises(RuntimeError, match="did not answer"):
        forgetful.submit(Change(payload=1))


def test_the_routing_table_reaches_serve_as_a_reference_to_the_store_and_a_new_writer_adopts_it() -> None:
    """The fleet-sized user_configs (here the routing app's table) are stored, content-addressed,
    and Serve gets a reference its replica resolves; an unchanged table is the same key; keys no
    deployment serves are pruned down to the one before; a restarted writer reads the table
    back from the store, and one whose reference is gone is not adopted."""
    serve, kv = FakeServe(), DictKV()
    writer = Writer(serve, kv)
    writer.apply([app("a0")], [])
    for model in ("m0", "m1", "m2"):
        writer.publish_routing(document(model))
    served = {a["name"]: a for a in serve.configs[-1]["applications"]}
    reference = served[ROUTING_APP]["deployments"][0]["user_config"]
    assert set(reference) == {REF_KEY} and reference[REF_KEY] in kv.values
    assert served["a0"]["deployments"] == []  # a model's own apps stay inline
    assert sorted(resolve(reference, kv)["documents"]) == ["m0", "m1", "m2"]
    assert len(kv.keys(f"{ROUTING_APP}/")) == 2  # the table now and the one before
    writer.redeploy()
    assert serve.configs[-1]["applications"] == serve.configs[-2]["applications"]  # same key
    # A writer that restarts adopts what Serve runs, the table read back through its reference.
    serve.running = {a["name"]: {"deployed_app_config": a} for a in serve.configs[-1]["applications"]}
    again = Writer(serve, kv)
    table = deployed_routing(again.app_configs([ROUTING_APP])[ROUTING_APP])
    assert sorted(table.documents) == ["m0", "m1", "m2"] and again.app_names() == sorted([ROUTING_APP, "a0"])
    kv.values.clear()  # the store lost it: not adopted (the models' checks apply it again)
    assert Writer(serve, kv).app_names() == ["a0"]
