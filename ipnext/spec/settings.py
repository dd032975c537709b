"""Settings: ipnext.yaml (pydantic-settings) plus the Temporal dev server's temporal-dev.yaml.

Where the file is: `--config` (the `path` of `load_settings`), else `IPNEXT_CONFIG`, else
`config/ipnext.yaml` under the current folder, else the defaults below. Relative paths in a
file (`state_dir`, `snapshot_roots`, `fleet_file`, ...) are relative to that file's folder,
never to the current one; `Settings.source` is the file, absolute, which the dev stack hands
to every process it starts (as `IPNEXT_CONFIG`).
Environment wins over the file: `IPNEXT_<FIELD>` (nested with `__`, e.g.
`IPNEXT_SERVE__PORT=8001`), and the conventional `TEMPORAL_ADDRESS` / `RAY_ADDRESS`,
which make ipnext use existing clusters instead of starting its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ipnext.errors import SpecError, StackError
from ipnext.spec.fleet import Fleet, load_fleet
from ipnext.spec.reading import format_validation_error, load_yaml, parse_spec

__all__ = [
    "DEFAULT_FACTORY_PREFIXES",
    "AuthSettings",
    "AutoscalingSettings",
    "DemandSettings",
    "FeedbackSettings",
    "ModelCodeSettings",
    "PartHealthCheckSettings",
    "PinnedSettings",
    "PoolSettings",
    "RaySettings",
    "RegionSettings",
    "ServeSettings",
    "Settings",
    "TemporalDevSettings",
    "TemporalSettings",
    "TemporalTLSSettings",
    "load_settings",
]

DEFAULT_CONFIG = Path("config/ipnext.yaml")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TemporalTLSSettings(_Section):
    """How the worker, SDK, CLI and tests reach a Temporal server over TLS (its presence turns
    TLS on). Files are PEM, read at connect; a relative path is relative to the config file."""

    ca_file: Path | None = None  # the CA the server's certificate must chain to; None: the system's roots
    cert_file: Path | None = None  # the client certificate (mTLS), with key_file
    key_file: Path | None = None
    # The name the server's certificate must carry (and the TLS SNI), when the address differs.
    server_name: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _cert_and_key_together(self) -> TemporalTLSSettings:
        if (self.cert_file is None) != (self.key_file is None):
            given, missing = ("cert_file", "key_file") if self.key_file is None else ("key_file", "cert_file")
            raise ValueError(
                f"temporal.tls.{given} is set but temporal.tls.{missing} is not: a client certificate "
                f"needs its private key. Fix: set temporal.tls.{missing} too, or remove temporal.tls.{given}"
            )
        return self


class TemporalSettings(_Section):
    address: str | None = None  # None: the dev server that temporal-dev.yaml describes
    namespace: str = "default"
    task_queue: str = "ipnext"
    tls: TemporalTLSSettings | None = None  # None: plaintext (the dev server's loopback default)
    # A file holding the API key (Temporal Cloud's, or a gateway's), sent as a bearer token on
    # every call. Never the key itself in this file; IPNEXT_TEMPORAL_API_KEY overrides the file.
    api_key_file: Path | None = None
    # What the SDK and CLI claim to be, in the `ipnext-identity` header and as the Temporal
    # client identity (None: <OS user>@<host>). A claim, not authentication: see docs/operations/security.md.
    identity: str | None = Field(default=None, min_length=1, max_length=200)


class PartHealthCheckSettings(_Section):
    """How Serve checks each part replica (the part's `check_health`): every `period_s`, each
    check allowed `timeout_s`; Serve replaces a replica after 3 failed checks in a row."""

    period_s: float = Field(default=5.0, gt=0, allow_inf_nan=False)
    timeout_s: float = Field(default=20.0, gt=0, allow_inf_nan=False)


class AutoscalingSettings(_Section):
    """How each deployment of a serving set scales between replans, inside the plan's envelope
    (Serve's `autoscaling_config`): from the plan's replicas up to the plan's replicas plus its
    share of `burst` x its pool's unallocated units. Serve's own defaults are 30 s up, 600 s
    down, a 30 s look-back and a 10 s metrics push; tests shorten them."""

    target_ongoing_requests: float = Field(default=2.0, gt=0, allow_inf_nan=False)  # per replica
    # Share (0-1) of each pool's units no plan takes that its deployments may burst into.
    burst: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False)
    upscale_delay_s: float = Field(default=30.0, ge=0, allow_inf_nan=False)
    downscale_delay_s: float = Field(default=600.0, ge=0, allow_inf_nan=False)
    look_back_period_s: float = Field(default=30.0, gt=0, allow_inf_nan=False)
    metrics_interval_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    # A model's router replicas in a region: 1 to this many, scaling on their own requests.
    router_max_replicas: int = Field(default=4, ge=1, le=64)


class PoolSettings(_Section):
    """Shared pools (a model with `serving: pooled`): what one pool replica may hold and how it
    treats a part that fails. `budget_bytes` is counted by the pool itself (each part's pinned
    file size while it loads, then the bytes of its tensors), not read from RSS: freed torch
    memory does not shrink RSS. A part that fails to load `max_load_failures` times in a row, or
    whose load outlasts `load_timeout_s`, is refused for `quarantine_s`, doubled at each repeat
    up to `max_quarantine_s`, while the pool serves the rest. A part's first `probation_calls`
    calls after each load are written down in the pool's ledger, as its loads are: a part whose
    calls kill `max_load_failures` replicas in a row is quarantined as one whose loads do (0: only
    loads are watched); one whose calls grow the replica's resident memory by `leak_bytes` is
    quarantined across the pool as leaking."""

    budget_bytes: int = Field(default=2 * 1024**3, ge=1024**2)
    max_load_failures: int = Field(default=2, ge=1, le=100)
    probation_calls: int = Field(default=3, ge=0, le=1000)
    quarantine_s: float = Field(default=60.0, gt=0, allow_inf_nan=False)
    max_quarantine_s: float = Field(default=3600.0, gt=0, allow_inf_nan=False)
    load_timeout_s: float = Field(default=60.0, gt=0, le=3600, allow_inf_nan=False)
    # Requests one pool replica takes at once (many models' parts share it; Serve's default is 5).
    max_ongoing_requests: int = Field(default=64, ge=1, le=10_000)
    # A part whose calls grow a pool replica's resident memory by more than this (net, over its
    # calls that ran alone, after its first three: policy/leak_watch.py) is quarantined across
    # the pool as leaking (0: not watched).
    leak_bytes: int = Field(default=256 * 1024**2, ge=0)
    # How often a pooled model checks its own serving against its record. The fleet's pool check
    # (activities/pool_check.py) watches the apps pooled models share at every tick of `fleet`
    # and asks a model to check at once when they lose anything, so this is a safety net.
    model_check_seconds: float = Field(default=600.0, ge=1, allow_inf_nan=False)


class ServeSettings(_Section):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, gt=0, lt=65536)
    # How long a prediction client may use a model's routing document before fetching it again.
    routing_ttl_seconds: float = Field(default=5.0, gt=0)
    # How often a serving model checks that Serve serves what its record says (and repairs it).
    reconcile_seconds: float = Field(default=30.0, ge=1)
    part_health_check: PartHealthCheckSettings = Field(default_factory=PartHealthCheckSettings)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)
    pools: PoolSettings = Field(default_factory=PoolSettings)
    # How long a serving set's replica, told to stop, waits for requests already on their way
    # before it counts the ones it holds (and then stops once none are left, or after Serve's
    # 20 s). ipnext moves a set's traffic away before it removes the set, so the wait covers only
    # requests sent just before that; None keeps Serve's own (2 s), which every removal of a set,
    # and every scale-down, waits through.
    shutdown_wait_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class RaySettings(_Section):
    address: str | None = None  # None: the dev stack starts a local cluster
    num_cpus: int | None = Field(default=None, gt=0)
    replica_num_cpus: float = Field(default=0, ge=0)  # 1 CPU per replica starves 2-core machines
    # What `ipnext dev up` starts: one node with every region's resources, or a head (no region)
    # and one worker node per region of the fleet (`--nodes per-region`), so a region can be lost.
    nodes: Literal["single", "per-region"] = "single"
    # How the per-region stack's GCS checks its nodes (Ray's defaults, 3 s x 5 failures, declare
    # a killed node dead after about 15 s): every period, each check given the period; after
    # `failure_threshold` failed checks in a row the node is dead.
    health_check_period_ms: int = Field(default=1000, ge=100)
    health_check_failure_threshold: int = Field(default=4, ge=1)
    node_object_store_bytes: int = Field(default=200 * 1024 * 1024, ge=80 * 1024 * 1024)  # per region node
    # Ray's token authentication: every process of the stack (the head, each `ray start` node,
    # the worker, Serve's replicas, the CLI and tests) runs with RAY_AUTH_MODE=token and the token
    # file RAY_AUTH_TOKEN_PATH names (ipnext/store/ray_token.py). `disabled` lets anyone who reaches
    # Ray's ports run code on the cluster.
    auth: Literal["token", "disabled"] = "token"
    # The token's file; None: `<state_dir>/ray-token`, which `ipnext dev up` makes (0600) for
    # the cluster it starts. A cluster of RAY_ADDRESS: its token's file, or RAY_AUTH_TOKEN.
    token_file: Path | None = None


class RegionSettings(_Section):
    """The `fleet` workflow (lost regions): how often it reads Ray's node table, whether it marks
    a region down by itself when every node of it is dead, and its replans' time limit."""

    check_seconds: float = Field(default=5.0, gt=0)
    detect: bool = True
    replan_time_limit_s: float = Field(default=60.0, gt=0)


class DemandSettings(_Section):
    """Observed demand (`ipnext.policy.demand`): the window rates and peaks are read over, and how the
    fleet replan plans from it: each source for max(declared, observed peak x (1 + margin)),
    once a model's history is at least `min_history_seconds` long (declared alone before)."""

    window_seconds: float = Field(default=60.0, gt=0, le=86_400)  # whole 5 s slots
    margin: float = Field(default=0.2, ge=0, le=10)
    min_history_seconds: float = Field(default=3600.0, ge=0)
    # How often a metrics actor saves its history to `<demand_dir>/<model>/<region>.json`.
    save_seconds: float = Field(default=5.0, gt=0)


class FeedbackSettings(_Section):
    """Experiments' feedback (`POST .../feedback`): each (request id, outcome) counts once, as
    the feedback ledger of the experiment records (`ipnext.store.feedback_ledger`: one per
    experiment, on the head node, its log in `<state_dir>/feedback/<model>/<experiment>.log`).
    Feedback on an answer older than `window_seconds` is refused (its id is forgotten then), and
    a ledger holding `max_entries` ids refuses more (503) rather than forget one early."""

    window_seconds: float = Field(default=86_400.0, gt=0, le=30 * 86_400)
    # About 120 bytes of memory each (a 16-byte digest, its expiry, a dict slot).
    max_entries: int = Field(default=1_000_000, ge=1)


# A module path, or a package's with a trailing dot: `ipnext.` covers every module under ipnext,
# `acme.parts` covers acme.parts and its submodules. Never empty (that would allow everything).
FactoryPrefix = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.?$")]
GIB = 1024**3
# The model code a worker imports unless its operator says otherwise: the example packages and the
# platform's own LLM part, nothing else of the platform (its CLI, dev stack and key handling are
# callables too, and a spec must not reach them).
DEFAULT_FACTORY_PREFIXES = ("ipnext.examples.", "ipnext.serving.llm.part")


class ModelCodeSettings(_Section):
    """Which model code the worker may import, and the limits of the child process it runs in.

    A part's factory module must fall under one of `factory_prefixes` (`DEFAULT_FACTORY_PREFIXES`
    unless set), checked before anything imports it, by validation and again by every replica;
    validation imports the factories, and builds each part with its weights, in a process forked
    for it that may run `validation_timeout_s` and use `validation_memory_bytes` of private memory
    (its RLIMIT_DATA), so owner code that hangs, exits or allocates without bound fails that
    validation, not the worker (activities/spec_check.py)."""

    factory_prefixes: list[FactoryPrefix] = Field(
        default_factory=lambda: list(DEFAULT_FACTORY_PREFIXES), min_length=1
    )
    # Bounded by the 2 min the activities that wait on a validation are given
    # (activities.VALIDATE_TIMEOUT), answers included.
    validation_timeout_s: float = Field(default=60.0, gt=0, le=100, allow_inf_nan=False)
    # Measured (CPU torch, 2 cores): the warm checker holds 215 MiB of private data after
    # importing torch; a check that builds an example's parts with their weights (click ranker,
    # request ranker, tiny LLM) 234-252 MiB, its RSS about 200 MiB, its virtual size up to
    # 830 MiB (why the limit is on data, not address space, which torch's thread arenas and
    # stacks reserve without using, and more so with more cores). 4 GiB leaves room for larger
    # weights; raise it for parts whose weights are bigger.
    validation_memory_bytes: int = Field(default=4 * GIB, ge=512 * 1024**2)


class AuthSettings(_Section):
    """API keys on every serving HTTP route (predict, streams, a model's description and demand,
    the routing documents): `Authorization: Bearer <key>`, 401 without a known key, 403 for a
    model the key may not call (ipnext/auth.py). On by default."""

    enabled: bool = True
    # The keys the routes accept, hashed (ipnext/auth.py says the format); None:
    # `<state_dir>/api-keys.yaml`, which `ipnext dev up` writes with a first key. On a multi-node
    # cluster: a path every node reads (the routers read it where they run).
    keys_file: Path | None = None
    # The key the SDK and CLI send; None: `<state_dir>/api-key` (the dev stack's own key).
    # IPNEXT_API_KEY overrides it. Never the key itself in this file.
    api_key_file: Path | None = None


class TemporalDevSettings(_Section):
    """temporal-dev.yaml: how `ipnext dev up` runs `temporal server start-dev`."""

    ip: str = "127.0.0.1"
    port: int = Field(default=7233, gt=0, lt=65536)
    ui_port: int = Field(default=8233, gt=0, lt=65536)
    namespace: str = "default"
    db_filename: str = "temporal.db"
    log_level: str = "warn"
    search_attributes: dict[str, str] = Field(
        default_factory=lambda: {
            "IpnextModel": "Keyword",
            "IpnextState": "Keyword",
            "IpnextTrafficPercent": "Int",
            "IpnextRegionsDown": "KeywordList",
            "IpnextArms": "KeywordList",
        }
    )


class PinnedSettings(_Section):
    """The pinned store's collection (ipnext/store/pinned_store.py): after a model's set list
    changes, pinned files no model's kept sets name are deleted once older than
    `gc_grace_seconds`. A set being validated pins its files before its model names them: the
    grace must outlast a validation (the activity's 2 min) by a wide margin."""

    gc_enabled: bool = True  # false: models still write their references; nothing is deleted
    gc_grace_seconds: float = Field(default=3600.0, ge=300, allow_inf_nan=False)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="IPNEXT_", env_nested_delimiter="__", extra="forbid")

    fleet_file: Path = Path("config/fleet.dev.yaml")
    snapshot_roots: list[Path] = Field(default_factory=lambda: [Path(".ipnext/snapshots")])
    freeze_calendar: Path | None = None
    state_dir: Path = Path(".ipnext")
    # Validated snapshot files, copied out of training's reach (ipnext/store/pinned.py); by default
    # `<state_dir>/pinned`. On a multi-node cluster: a folder every node reads.
    pinned_dir: Path | None = None
    pinned: PinnedSettings = Field(default_factory=PinnedSettings)
    # Observed demand histories, saved by the metrics actors; by default `<state_dir>/demand`.
    # On a multi-node cluster: a folder the head node (where those actors run) writes.
    demand_dir: Path | None = None
    temporal_dev_file: Path | None = None
    temporal: TemporalSettings = Field(default_factory=TemporalSettings)
    serve: ServeSettings = Field(default_factory=ServeSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    regions: RegionSettings = Field(default_factory=RegionSettings)
    demand: DemandSettings = Field(default_factory=DemandSettings)
    feedback: FeedbackSettings = Field(default_factory=FeedbackSettings)
    model_code: ModelCodeSettings = Field(default_factory=ModelCodeSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    # The file these settings were read from (absolute), None for defaults and the environment.
    _source: Path | None = PrivateAttr(default=None)

    @property
    def source(self) -> Path | None:
        return self._source

    def describe_source(self) -> str:
        """Which config a process read, for the first line of its log."""
        where = str(self._source) if self._source else "no config file (defaults and the environment)"
        return f"config {where}; state in {self.state_dir.resolve()}"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file's values come in as init arguments; the environment overrides them.
        return (env_settings, init_settings)

    def temporal_dev(self) -> TemporalDevSettings:
        if self.temporal_dev_file is None:
            return TemporalDevSettings()
        return parse_spec(
            TemporalDevSettings,
            load_yaml(self.temporal_dev_file),
            source=str(self.temporal_dev_file),
        )

    @property
    def temporal_address(self) -> str:
        if self.temporal.address:
            return self.temporal.address
        dev = self.temporal_dev()
        return f"{dev.ip}:{dev.port}"

    @property
    def temporal_namespace(self) -> str:
        return self.temporal.namespace

    @property
    def serve_url(self) -> str:
        return f"http://{self.serve.host}:{self.serve.port}"

    @property
    def proxy_location(self) -> str:
        """Where Serve runs its HTTP proxies: on every node of a per-region stack (so each region
        answers through a proxy of its own), on the head alone otherwise."""
        return "EveryNode" if self.ray.nodes == "per-region" else "HeadOnly"

    @property
    def ui_url(self) -> str:
        dev = self.temporal_dev()
        return f"http://{dev.ip}:{dev.ui_port}/namespaces/{self.temporal.namespace}"

    def fleet(self) -> Fleet:
        return load_fleet(self.fleet_file)

    def pinned_store(self) -> Path:
        """The pinned store's folder, absolute (replicas run in other folders)."""
        return (self.pinned_dir or self.state_dir / "pinned").resolve()

    def demand_store(self) -> Path:
        """The folder of saved demand histories, absolute (the actors run in other folders)."""
        return (self.demand_dir or self.state_dir / "demand").resolve()

    def feedback_store(self) -> Path:
        """The folder of experiments' feedback ledgers, absolute (the ledgers run elsewhere)."""
        return (self.state_dir / "feedback").resolve()

    def keys_file(self) -> Path | None:
        """The keys file the serving routes check, absolute; None when auth is off."""
        if not self.auth.enabled:
            return None
        return (self.auth.keys_file or self.state_dir / "api-keys.yaml").resolve()

    def api_key_file(self) -> Path:
        """Where the SDK and CLI read their key when IPNEXT_API_KEY is not set."""
        return (self.auth.api_key_file or self.state_dir / "api-key").resolve()

    def ray_token_file(self) -> Path | None:
        """The Ray token's file, absolute; None when Ray's token authentication is off."""
        if self.ray.auth == "disabled":
            return None
        return (self.ray.token_file or self.state_dir / "ray-token").resolve()

    @property
    def ray_address_file(self) -> Path:
        return self.state_dir / "ray-address"

    def ray_address(self) -> str:
        """The configured Ray cluster, else the one the dev stack started."""
        if self.ray.address:
            return self.ray.address
        try:
            return self.ray_address_file.read_text().strip()
        except FileNotFoundError:
            raise StackError(
                "no Ray cluster: RAY_ADDRESS is not set and the dev stack is not up.",
                field="ray.address",
                fix="run `ipnext dev up`, or set RAY_ADDRESS to an existing cluster",
            ) from None


_PATH_FIELDS = ("fleet_file", "freeze_calendar", "state_dir", "temporal_dev_file", "pinned_dir", "demand_dir")
_TEMPORAL_TLS_FILES = ("ca_file", "cert_file", "key_file")


def _resolve_temporal_paths(temporal: Any, base: Path) -> Any:
    """The `temporal` section with its file paths made absolute against the config's folder."""
    if not isinstance(temporal, dict):
        return temporal  # validation says what is wrong with it
    temporal = dict(temporal)
    if temporal.get("api_key_file") is not None:
        temporal["api_key_file"] = (base / temporal["api_key_file"]).resolve()
    tls = temporal.get("tls")
    if isinstance(tls, dict):
        temporal["tls"] = {
            k: (base / v).resolve() if k in _TEMPORAL_TLS_FILES and v is not None else v
            for k, v in tls.items()
        }
    return temporal


def load_settings(path: str | Path | None = None) -> Settings:
    """Load settings from `path`, `IPNEXT_CONFIG` or config/ipnext.yaml, then the environment."""
    chosen = path or os.environ.get("IPNEXT_CONFIG")
    file = Path(chosen) if chosen else (DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None)
    data: dict[str, Any] = {}
    if file is not None:
        loaded = load_yaml(file) or {}
        base = file.resolve().parent
        data = dict(loaded)
        for key in _PATH_FIELDS:
            if data.get(key) is not None:
                data[key] = (base / data[key]).resolve()
        if "temporal" in data:
            data["temporal"] = _resolve_temporal_paths(data["temporal"], base)
        ray_section = data.get("ray")
        if isinstance(ray_section, dict) and ray_section.get("token_file") is not None:
            data["ray"] = {**ray_section, "token_file": (base / ray_section["token_file"]).resolve()}
        auth = data.get("auth")
        if isinstance(auth, dict):
            data["auth"] = {
                k: (base / v).resolve() if k in ("keys_file", "api_key_file") and v is not None else v
                for k, v in auth.items()
            }
        if "snapshot_roots" in data:
            data["snapshot_roots"] = [(base / p).resolve() for p in data["snapshot_roots"]]
    try:
        settings = Settings(**data)
    except ValidationError as err:
        raise SpecError(
            f"{file or 'settings'} is invalid: {format_validation_error(err)}",
            field=".".join(str(p) for p in err.errors()[0]["loc"]),
            fix="see config/ipnext.yaml for the fields and their meaning",
        ) from None
    if os.environ.get("TEMPORAL_ADDRESS"):
        settings.temporal.address = os.environ["TEMPORAL_ADDRESS"]
    if os.environ.get("RAY_ADDRESS"):
        settings.ray.address = os.environ["RAY_ADDRESS"]
    settings._source = file.resolve() if file is not None else None
    return settings
