"""The one Serve config writer: the body of the detached actor `ipnext-serve-writer`.

Serve replaces the whole multi-app config on every apply, so two writers would erase each
other's apps: every change goes through this actor (`control.get_writer` makes or finds it). It
keeps the desired state of every app, renders the whole declarative config and applies it, once
for every change that arrived while the last apply ran (`group_commit.py`): a burst of changes
costs a few applies, not one each. Holding every model's set apps, it is also where each
autoscaled deployment's burst bound is computed (`layout.burst_bounds`), and where pooled models'
placeholders are folded into their pools (`pool_layout.fold_pools`).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import ray

from ipnext.contracts.routing import RoutingDocument, succeed
from ipnext.errors import ServingError
from ipnext.serving.config_store import ConfigStore
from ipnext.serving.group_commit import Change, GroupCommit
from ipnext.serving.layout import (
    PROXY_TIMEOUT_S,
    RAY_NAMESPACE,
    ROUTING_APP,
    DeployedRouter,
    PoolEnvelope,
    burst_bounds,
    deployed_router,
    deployed_routing,
    plan_bounds,
    render_routing_app,
    render_serve_config,
    with_keys_file,
    without_keys_file,
)
from ipnext.serving.pool_layout import (
    PoolFold,
    fold_pools,
    is_placeholder,
    is_pool_app,
    is_pool_router_app,
    serving_apps,
    unfold_pools,
)
from ipnext.serving.pool_ledger import ledger_actor_name

__all__ = ["ServeConfigWriter"]

logger = logging.getLogger(__name__)


class _WriterChange(Change):
    """A change the writer commits with whatever else is queued (`GroupCommit`): `payload` edits
    the desired apps in place and returns the caller's answer (None: the count of applies)."""

    def __init__(
        self,
        edit: Callable[[dict[str, dict[str, Any]]], Any],
        envelope: PoolEnvelope | None = None,
        fold: PoolFold | None = None,
        force: bool = False,
    ) -> None:
        super().__init__(payload=edit)
        self.envelope, self.fold = envelope, fold
        self.force = force  # apply even when nothing changed: Serve lost apps the writer holds


class ServeConfigWriter:
    """Body of the detached writer actor. Its methods run on threads of their own
    (`WRITER_CONCURRENCY`); every change goes through one group commit, so the changes that
    arrive while an apply runs are applied together by the next one, and a batch that Serve
    refuses is applied again change by change, so a bad change fails alone."""

    def __init__(
        self, host: str, port: int, proxy_location: str = "HeadOnly", keys_file: str | None = None
    ) -> None:
        self._host = host
        self._port = port
        self._proxy_location = proxy_location
        # The API keys file every HTTP door checks (None: open); added to the doors' args when the
        # whole config is rendered (`layout.with_keys_file`), never to the apps held here.
        self._keys_file = keys_file
        # As rendered from the records (the plans' bounds); replaced whole by each commit, never
        # edited in place, so a read on another thread sees one commit's apps or the next one's.
        self._apps: dict[str, dict[str, Any]] = {}
        self._applies = 0
        # The fleet's pools and burst setting, as the last activity that applied passed them; a
        # restarted writer has none until then and bounds every deployment at its floor.
        self._envelope: PoolEnvelope | None = None
        self._deployed: dict[str, Any] | None = None  # the whole config last applied
        # How pools render (the settings' pool, replica and router sections), as the last activity
        # that applied passed it; a restarted writer renders with the defaults until then.
        self._fold = PoolFold()
        self._commits: GroupCommit[_WriterChange] = GroupCommit(self._commit)
        # The fleet-sized user_configs (pools, pool routers, the routing table) live in Ray's KV
        # store, Serve holds references to them (config_store.py); each deployment's key now.
        self._store = self._config_store()
        self._stored: dict[str, str] = {}
        self._adopt_running_apps()

    def _config_store(self) -> ConfigStore:
        return ConfigStore()

    def _client(self) -> Any:
        from ray import serve
        from ray.serve.context import _get_global_client

        serve.start(
            proxy_location=self._proxy_location,
            http_options={"host": self._host, "port": self._port, "request_timeout_s": PROXY_TIMEOUT_S},
            logging_config={"enable_access_log": False},
        )
        return _get_global_client()

    def _adopt_running_apps(self) -> None:
        # A restarted writer must not erase apps it did not know about.
        details = self._client().get_serve_details()
        running: dict[str, dict[str, Any]] = {}
        for name, app in (details.get("applications") or {}).items():
            config = app.get("deployed_app_config")
            if not config:
                continue
            try:
                config = self._store.adopt(config)
            except ServingError as err:  # its models' serving checks apply it again
                logger.warning("config writer: not adopting %s: %s", name, err)
                continue
            # Serve holds them with their burst and their keys file: back to the records' form.
            running[name] = without_keys_file(plan_bounds(config))
        # A pool router's config holds its pooled models' placeholders: held again as they were.
        self._apps.update(unfold_pools(running))

    def _render(
        self, apps: dict[str, dict[str, Any]], envelope: PoolEnvelope | None, fold: PoolFold
    ) -> dict[str, Any]:
        # Pooled models' placeholders become their pools and pool routers (pool_layout.py).
        real = fold_pools(apps, fold)
        return render_serve_config(
            with_keys_file(burst_bounds(real, envelope), self._keys_file),
            self._host,
            self._port,
            self._proxy_location,
        )

    def _commit(self, batch: list[_WriterChange]) -> None:
        """Apply a batch in one config change; if that fails and the batch holds more than one
        change, apply them one at a time, so each caller gets its own change's outcome."""
        try:
            self._apply_changes(batch)
        except Exception as err:
            if len(batch) == 1:
                batch[0].fail(err)
                return
            for change in batch:
                try:
                    self._apply_changes([change])
                except Exception as alone:
                    change.fail(alone)

    def _apply_changes(self, changes: list[_WriterChange]) -> None:
        from ray.serve.schema import ServeDeploySchema

        desired = copy.deepcopy(self._apps)
        envelope, fold, force = self._envelope, self._fold, False
        answers = []
        for change in changes:  # in the order they were asked for
            envelope = change.envelope or envelope
            fold = change.fold or fold
            force = force or change.force
            answers.append(change.payload(desired))
        config = self._render(desired, envelope, fold)
        if force or desired != self._apps or config != self._deployed or not self._applies:
            served, stored = self._store.externalize(config, _stored_app)
            self._client().deploy_apps(ServeDeploySchema.model_validate(served))
            gone = _pool_apps(self._deployed) - _pool_apps(config)
            self._apps, self._deployed, self._applies = desired, config, self._applies + 1
            try:  # what no deployment serves any more; a failure leaves keys for the next apply
                self._store.prune(stored, self._stored)
            except Exception as err:
                logger.warning("config writer: pruning stored configs failed: %r", err)
            self._stored = stored
            after = _pool_apps(config)
            for pool in sorted(gone):  # its last pooled model left: its loads and quarantines go too
                _forget_pool(pool, keep_ledger=any(p.split(".")[1] == pool.split(".")[1] for p in after))
        self._envelope, self._fold = envelope, fold
        for change, answer in zip(changes, answers, strict=True):
            change.finish(self._applies if answer is None else answer)

    def use_keys_file(self, keys_file: str | None) -> bool:
        """Check every HTTP door against `keys_file` from now on (None: open); applied at once
        when it differs from the file the doors check now. Whether anything changed."""
        if keys_file == self._keys_file:
            return False
        self._keys_file = keys_file
        if self._applies or self._apps:
            self.redeploy()
        return True

    def apply(
        self,
        upserts: list[dict[str, Any]],
        removals: list[str],
        envelope: dict[str, Any] | None = None,
        fold: dict[str, Any] | None = None,
    ) -> int:
        """Upsert and remove apps, and apply the whole config when it changed; returns the count
        of applies once it is applied. `envelope` (a PoolEnvelope) replaces the pools the burst
        bounds are computed from: one model's apps change what every other deployment of their
        pools may burst into. `fold` (a PoolFold) replaces how shared pools render."""

        def edit(desired: dict[str, dict[str, Any]]) -> None:
            for name in removals:
                desired.pop(name, None)
            for app in upserts:
                desired[app["name"]] = app

        answer: int = self._commits.submit(
            _WriterChange(
                edit,
                envelope=PoolEnvelope.model_validate(envelope) if envelope is not None else None,
                fold=PoolFold.model_validate(fold) if fold is not None else None,
            )
        )
        return answer

    def redeploy(self, envelope: dict[str, Any] | None = None) -> int:
        """Apply the whole desired config again, unchanged: Serve lost apps the writer holds."""
        answer: int = self._commits.submit(
            _WriterChange(
                lambda desired: None,
                envelope=PoolEnvelope.model_validate(envelope) if envelope is not None else None,
                force=True,
            )
        )
        return answer

    def commit_stats(self) -> dict[str, int]:
        """How many commits (applies asked of Serve, or found unchanged) carried how many changes."""
        return {**self._commits.stats(), "applies": self._applies}

    def app_configs(self, names: list[str]) -> dict[str, dict[str, Any] | None]:
        """The named apps' configs as last applied (None for an app the writer does not hold)."""
        return {name: self._apps.get(name) for name in names}

    def routing_generation(self, model: str) -> int | None:
        """The generation of the model's published routing document (None: none published)."""
        document = deployed_routing(self._apps.get(ROUTING_APP)).documents.get(model)
        return document.generation if document is not None else None

    def deployed_router(self, name: str) -> DeployedRouter | None:
        """The routing and cap of router app `name` as last applied (None if it has none)."""
        app = self._apps.get(name)
        return deployed_router(app) if app is not None else None

    def publish_routing(self, draft: dict[str, Any]) -> int:
        """Make `draft` (a RoutingDocument) its model's routing document, at the next generation
        if it says something new (read and written inside the commit, so two models never race);
        returns the generation now published."""
        document = RoutingDocument.model_validate(draft)

        def edit(desired: dict[str, dict[str, Any]]) -> int:
            table = deployed_routing(desired.get(ROUTING_APP))
            previous = table.documents.get(document.model)
            published = succeed(previous, document)
            if published is not previous:
                routing = render_routing_app(table.with_document(published))
                desired[routing["name"]] = routing
            return published.generation

        answer: int = self._commits.submit(_WriterChange(edit))
        return answer

    def withdraw_routing(self, model: str) -> bool:
        """Drop the model's routing document (the app stays, answering 404 for it)."""

        def edit(desired: dict[str, dict[str, Any]]) -> bool:
            table = deployed_routing(desired.get(ROUTING_APP))
            if model not in table.documents:
                return False
            routing = render_routing_app(table.without(model))
            desired[routing["name"]] = routing
            return True

        answer: bool = self._commits.submit(_WriterChange(edit))
        return answer

    def app_names(self) -> list[str]:
        return sorted(self._apps)

    def pooled(self, names: list[str]) -> dict[str, list[str]]:
        """Which of the named apps the writer holds as pooled placeholders, and the Serve apps
        each is folded into (`pool_layout.serving_apps`: its region's pool router first)."""
        found: dict[str, list[str]] = {}
        for name in names:
            app = self._apps.get(name)
            if app is not None and is_placeholder(app):
                found[name] = serving_apps(app)
        return found

    def pool_members(self) -> dict[str, list[str]]:
        """Every pooled model the writer holds a placeholder of, with the Serve apps its
        placeholders are folded into: the whole input of the fleet's pool check, in one read."""
        members: dict[str, set[str]] = {}
        for name, app in self._apps.items():  # replaced whole by each apply, never edited in place
            if is_placeholder(app):
                members.setdefault(name.split(".", 1)[0], set()).update(serving_apps(app))
        return {model: sorted(apps) for model, apps in sorted(members.items())}

    def export(self) -> dict[str, Any]:
        """The whole config as Serve gets it: every deployment with its burst bound."""
        return self._render(self._apps, self._envelope, self._fold)


def _stored_app(name: str) -> bool:
    """The apps whose user_configs grow with the fleet: kept in the config store."""
    return name == ROUTING_APP or is_pool_app(name) or is_pool_router_app(name)


def _pool_apps(config: dict[str, Any] | None) -> set[str]:
    return {app["name"] for app in (config or {}).get("applications", []) if is_pool_app(app["name"])}


def _forget_pool(pool: str, keep_ledger: bool) -> None:
    """A pool app that is gone: its region's ledger forgets it, or goes, when the region has no
    pool left (no pooled model there)."""
    region = pool.split(".")[1]
    try:
        ledger = ray.get_actor(ledger_actor_name(region), namespace=RAY_NAMESPACE)
    except ValueError:
        return  # none was made: no load ever ran in that region's pools
    if keep_ledger:
        ray.get(ledger.forget.remote(pool), timeout=60)
    else:
        ray.kill(ledger)
