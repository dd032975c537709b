"""API keys on the serving routes: the keys file (each key hashed, with a name and the models
it may call), the check every HTTP door makes (`KeyCheck`: 401 without a known key, 403 for a
model the key may not call), and the key the SDK and CLI send (`client_key`).

The keys file is YAML, written by `ipnext dev up` (its first key) and `ipnext auth add-key`:

    keys:
      - name: ranking-team
        sha256: 3f1c...           # of the key; the key itself is shown once, when made
        models: [feed-ranker, "ranking-*"]   # a name, a prefix ending in *, or "*" for every model

Keys are 256-bit random tokens, so an unsalted SHA-256 is enough to keep the keys useless to
whoever reads the file (a password would need a slow, salted hash; a random key does not). The
file also holds `request_signing_secret`, the HMAC key of experiments' request ids, so it is
written readable by its owner only.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from ipnext.errors import SpecError
from ipnext.spec.reading import format_validation_error

if TYPE_CHECKING:
    from ipnext.spec.settings import Settings

__all__ = [
    "API_KEY_ENV",
    "ApiKeyEntry",
    "KeyCheck",
    "KeysFile",
    "add_key",
    "bearer",
    "client_key",
    "hash_key",
    "key_header",
    "new_key",
    "read_keys",
]

API_KEY_ENV = "IPNEXT_API_KEY"  # the key the SDK and CLI send, over any file
KEY_PREFIX = "ipn_"  # so a leaked key is recognisable (secret scanners, logs)

ModelPattern = Annotated[str, StringConstraints(pattern=r"^(\*|[a-z][a-z0-9-]*\*?)$")]


class ApiKeyEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}$")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    models: list[ModelPattern] = Field(min_length=1)

    def may_call(self, model: str) -> bool:
        return any(
            pattern == "*" or pattern == model or (pattern.endswith("*") and model.startswith(pattern[:-1]))
            for pattern in self.models
        )


class KeysFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: list[ApiKeyEntry] = Field(default_factory=list)
    # The routers' HMAC key for experiments' request ids (`ipnext.policy.experiments`), 256 random bits
    # in hex: the one secret in this file, which is why it is the owner's alone (0600). Written
    # with the first key; None in files from before experiments (no request ids are signed).
    request_signing_secret: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")

    @model_validator(mode="after")
    def _unique(self) -> KeysFile:
        names = [k.name for k in self.keys]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"keys: the name {repeated[0]!r} is given twice; give each key its own name")
        hashes = [k.sha256 for k in self.keys]
        if len(set(hashes)) != len(hashes):
            raise ValueError("keys: one key hash is listed twice; remove the copy")
        return self


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def bearer(key: str | None) -> dict[str, str]:
    """The header that carries `key` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def key_header(settings: Settings) -> dict[str, str]:
    """The header with the key the settings give the SDK and CLI (none without one): for code
    that calls the serving routes with its own HTTP client (benches, tests, the demo)."""
    return bearer(client_key(settings.api_key_file()))


def read_keys(path: Path) -> KeysFile:
    """The keys file at `path`; a SpecError naming the file and the field when it is not one."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise SpecError(
            f"auth.keys_file: cannot read {path}: {err.strerror or err}.",
            field="auth.keys_file",
            value=str(path),
            fix="run `ipnext dev up` (it writes the dev stack's keys file) or `ipnext auth add-key`",
        ) from None
    except yaml.YAMLError as err:
        raise SpecError(f"{path} is not YAML: {err}", field="auth.keys_file", value=str(path)) from None
    try:
        return KeysFile.model_validate(data if data is not None else {})
    except ValidationError as err:
        raise SpecError(
            f"{path} is invalid: {format_validation_error(err)}",
            field="auth.keys_file",
            value=str(path),
            fix="each key needs name, sha256 (64 hex digits) and models; `ipnext auth add-key` writes one",
        ) from None


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path`, readable by its owner only, replacing it in one step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(partial, path)


def add_key(path: Path, name: str, models: list[str]) -> str:
    """Make a key named `name` for `models`, add its hash to the keys file at `path` (created
    if missing) and return the key: the only time it is seen."""
    current = read_keys(path) if path.exists() else KeysFile()
    key = new_key()
    try:
        entry = ApiKeyEntry(name=name, sha256=hash_key(key), models=models)
        secret = current.request_signing_secret or secrets.token_hex(32)
        updated = KeysFile(keys=[*current.keys, entry], request_signing_secret=secret)
    except ValidationError as err:
        raise SpecError(
            f"the key is invalid: {format_validation_error(err)}",
            field="auth",
            fix="a name not yet in the keys file (`ipnext auth list`), of letters, digits and _.@-; "
            "models as names, prefixes ending in *, or *",
        ) from None
    _write_private(path, yaml.safe_dump(updated.model_dump(mode="json"), sort_keys=False))
    return key


def client_key(key_file: Path | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The key the SDK and CLI send: IPNEXT_API_KEY, else the first line of `key_file` if it
    exists (the dev stack writes its key there), else none."""
    env = os.environ if environ is None else environ
    key = env.get(API_KEY_ENV, "").strip()
    if key:
        return key
    if key_file is None:
        return None
    try:
        return key_file.read_text().strip() or None
    except FileNotFoundError:
        return None


class KeyCheck:
    """What every HTTP door asks before anything else: may this `Authorization` header call this
    model? It reads the keys file, and reads it again when it changed (checked at most every
    `recheck_s`), so adding or removing a key needs no restart. While the file cannot be read
    (gone, unreadable, invalid) every request is refused with 503: the door is closed, not open,
    when its keys are missing."""

    def __init__(self, path: Path, recheck_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self._path = path
        self._recheck_s = recheck_s
        self._clock = clock
        self._checked_at = -float("inf")
        self._stamp: tuple[int, int] | None = None  # (mtime_ns, size) of the file last read
        self._by_hash: dict[str, ApiKeyEntry] | None = None
        self._secret: bytes | None = None
        self.last_error: str | None = None

    def signing_secret(self) -> bytes | None:
        """The file's request-signing secret (None: the file has none, or cannot be read)."""
        return self._secret if self._keys() is not None else None

    def refuse(self, authorization: str | None, model: str) -> tuple[int, str] | None:
        """None when the header's key may call `model`; else the status and the message."""
        entry = self._entry(authorization)
        if isinstance(entry, tuple):
            return entry
        if not entry.may_call(model):
            return 403, f"the API key {entry.name!r} may not call model {model!r}"
        return None

    def refuse_unknown(self, authorization: str | None) -> tuple[int, str] | None:
        """None when the header carries a known key, whatever it may call; else 401 (or 503 while
        the file cannot be read). What a door asks before it reads a body or looks a path up:
        a caller without a key learns nothing, not even which routes or models exist."""
        entry = self._entry(authorization)
        return entry if isinstance(entry, tuple) else None

    def _entry(self, authorization: str | None) -> ApiKeyEntry | tuple[int, str]:
        keys = self._keys()
        if keys is None:
            return 503, "the serving keys cannot be read; ask the operator (see the router's log)"
        scheme, _, key = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return 401, "an API key is required: send Authorization: Bearer <key>"
        entry = keys.get(hash_key(key.strip()))
        if entry is None:
            return 401, "the API key is not known (revoked, or mistyped)"
        return entry

    def _keys(self) -> dict[str, ApiKeyEntry] | None:
        now = self._clock()
        if now - self._checked_at < self._recheck_s:
            return self._by_hash
        self._checked_at = now
        try:
            stat = self._path.stat()
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                read = read_keys(self._path)
                # A dict keyed by hash: the lookup compares hashes, which reveal nothing of a key.
                self._by_hash = {entry.sha256: entry for entry in read.keys}
                secret = read.request_signing_secret
                self._secret = bytes.fromhex(secret) if secret is not None else None
                self._stamp = stamp
                self.last_error = None
        except (OSError, SpecError) as err:  # closed, not open: no keys, every request refused
            self.last_error = str(err)
            self._by_hash, self._stamp, self._secret = None, None, None
        return self._by_hash
