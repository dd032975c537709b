"""Ray's token authentication for every process of the stack: the environment each process gets
(`RAY_AUTH_MODE=token` and `RAY_AUTH_TOKEN_PATH`, never Ray's own guess), and the token file
`ipnext dev up` makes for the cluster it starts.

Ray reads the token once per process, at its first connection, in this order: `RAY_AUTH_TOKEN`,
the file `RAY_AUTH_TOKEN_PATH` names (a file it cannot read aborts the process), then
`~/.ray/auth_token`, which a new local `ray.init` writes itself with the default umask. Naming
the mode and the path explicitly everywhere keeps Ray from ever taking that last path.

Also here, as it too must be in a process's environment before it connects: a cluster at a
loopback address (`127.0.0.1:<port>`, the dev stack's single-node cluster) is one machine's,
and its processes and drivers keep 127.0.0.1 as the node address (`loopback_env`; a driver
already running sets it with `serving.control.keep_loopback`), so every
Ray port of it listens on loopback alone. Ray otherwise swaps 127.0.0.1 for the host's routable
address: its GCS, raylets and agents then listen on every interface, and three metrics servers
(the agent's export port, the autoscaler's and the dashboard's) answer anyone without a token.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import MutableMapping
from pathlib import Path

from ipnext.errors import StackError
from ipnext.spec.settings import Settings

__all__ = [
    "LOOPBACK_ENV",
    "MODE_ENV",
    "TOKEN_ENV",
    "TOKEN_PATH_ENV",
    "ensure_ray_token",
    "is_loopback",
    "loopback_env",
    "ray_auth_env",
    "use_ray_auth",
]

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"  # the token itself (a cluster of RAY_ADDRESS may hand it so); wins over the file
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
# Ray's switch for single-machine platforms: "0" keeps a node address of 127.0.0.1 as it is. Ray
# reads it once, at import (`ray_constants.ENABLE_RAY_CLUSTER`); `ray start --address` (a second
# node) refuses to run with it, so a cluster of several nodes cannot be on loopback alone.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_auth_env(settings: Settings) -> dict[str, str]:
    """What a process of the stack needs in its environment to reach Ray (or to start it)."""
    token_file = settings.ray_token_file()
    if token_file is None:
        return {MODE_ENV: "disabled"}
    return {MODE_ENV: "token", TOKEN_PATH_ENV: str(token_file)}


def ensure_ray_token(settings: Settings) -> Path | None:
    """Make the token file for a cluster the dev stack starts, if it is not there: 256 random
    bits, mode 0600, written so that two processes racing both end with the same token. A file
    that others may read is made owner-only. None when Ray's authentication is off."""
    token_file = settings.ray_token_file()
    if token_file is None:
        return None
    token_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if stat.S_IMODE(token_file.stat().st_mode) & 0o077:
            token_file.chmod(0o600)
    else:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32))
    if not token_file.read_text().strip():
        raise StackError(
            f"ray.token_file: {token_file} is empty.",
            field="ray.token_file",
            value=str(token_file),
            fix="delete it (ipnext dev up makes a new one) or write the cluster's token into it",
        )
    return token_file


def use_ray_auth(settings: Settings, environ: MutableMapping[str, str] | None = None) -> None:
    """Before this process first connects to Ray: the settings' mode and token file (the
    settings decide, as for the stack's own processes; `IPNEXT_RAY__AUTH` and
    `IPNEXT_RAY__TOKEN_FILE` change them, and `RAY_AUTH_TOKEN`, if set, is the token itself).
    A token file that is not there is an error naming the setting, not Ray's abort."""
    env = os.environ if environ is None else environ
    env.update(ray_auth_env(settings))
    if env[MODE_ENV] == "disabled":
        env.pop(TOKEN_PATH_ENV, None)
    path = env.get(TOKEN_PATH_ENV)
    if env.get(MODE_ENV) == "token" and not env.get(TOKEN_ENV) and path and not Path(path).is_file():
        raise StackError(
            f"no Ray token at {path}: Ray's token authentication is on (ray.auth) and nothing made one.",
            field="ray.token_file",
            value=path,
            fix="run `ipnext dev up` (it makes the token of the cluster it starts), or point "
            "ray.token_file (or RAY_AUTH_TOKEN) at the token of the cluster in RAY_ADDRESS",
        )


def is_loopback(address: str) -> bool:
    """Whether a cluster address (`host:port`) is on this machine's loopback."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def loopback_env(address: str) -> dict[str, str]:
    """The environment of a process that starts, joins or connects to the cluster at `address`:
    `{LOOPBACK_ENV: "0"}` for a loopback one, else nothing."""
    return {LOOPBACK_ENV: "0"} if is_loopback(address) else {}
