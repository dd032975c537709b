"""Ray's token authentication settings: the environment every process of the stack gets, the
token file the dev stack makes, and the error a process gets instead of Ray's abort."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ipnext.errors import StackError
from ipnext.spec.settings import Settings
from ipnext.store.ray_token import (
    MODE_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    ensure_ray_token,
    ray_auth_env,
    use_ray_auth,
)


@pytest.fixture(autouse=True)
def no_outside_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """No IPNEXT_* of the run leaks in (the integration tests' conftest names a token file)."""
    for name in list(os.environ):
        if name.startswith("IPNEXT_"):
            monkeypatch.delenv(name)


def settings(tmp_path: Path, **ray: object) -> Settings:
    return Settings(state_dir=tmp_path / "state", ray=ray)


def test_token_mode_and_the_state_folders_token_by_default(tmp_path: Path) -> None:
    env = ray_auth_env(settings(tmp_path))
    assert env == {MODE_ENV: "token", TOKEN_PATH_ENV: str((tmp_path / "state" / "ray-token").resolve())}
    assert ray_auth_env(settings(tmp_path, token_file=tmp_path / "t")) == {
        MODE_ENV: "token",
        TOKEN_PATH_ENV: str((tmp_path / "t").resolve()),
    }
    assert ray_auth_env(settings(tmp_path, auth="disabled")) == {MODE_ENV: "disabled"}


def test_the_dev_stack_makes_a_private_token_once(tmp_path: Path) -> None:
    made = ensure_ray_token(settings(tmp_path))
    assert made is not None and stat.S_IMODE(made.stat().st_mode) == 0o600
    token = made.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert ensure_ray_token(settings(tmp_path)) == made and made.read_text() == token  # kept
    made.chmod(0o644)
    ensure_ray_token(settings(tmp_path))
    assert stat.S_IMODE(made.stat().st_mode) == 0o600  # made private again
    made.write_text("")
    with pytest.raises(StackError, match="is empty"):
        ensure_ray_token(settings(tmp_path))
    assert ensure_ray_token(settings(tmp_path, auth="disabled")) is None


def test_a_process_gets_the_settings_auth_or_an_error_naming_the_setting(tmp_path: Path) -> None:
    env: dict[str, str] = {MODE_ENV: "disabled"}  # e.g. left in a shell: the settings decide
    with pytest.raises(StackError, match=r"no Ray token at .*ray-token") as raised:
        use_ray_auth(settings(tmp_path), env)
    assert raised.value.field == "ray.token_file"
    ensure_ray_token(settings(tmp_path))
    env = {}
    use_ray_auth(settings(tmp_path), env)
    assert env[MODE_ENV] == "token" and env[TOKEN_PATH_ENV].endswith("ray-token")
    # A cluster of RAY_ADDRESS may hand the token itself: no file needed.
    use_ray_auth(settings(tmp_path / "other"), {TOKEN_ENV: "abc"})
    env = {TOKEN_PATH_ENV: "/somewhere"}
    use_ray_auth(settings(tmp_path, auth="disabled"), env)
    assert env == {MODE_ENV: "disabled"}


def test_a_loopback_cluster_keeps_loopback_and_any_other_gets_rays_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`keep_loopback`, before each connection: a driver of a loopback cluster keeps 127.0.0.1 as
    its node address (else it looks for a raylet where the cluster does not listen); attaching to
    another cluster after gives Ray its default back, in the process and for its children."""
    import ray._private.worker
    from ray._private import ray_constants, services

    from ipnext.serving.control import keep_loopback
    from ipnext.store.ray_token import LOOPBACK_ENV, loopback_env

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", ray_constants.ENABLE_RAY_CLUSTER)
    # A unit test run before this one in the same process may have started a local Ray, whose
    # node Ray asks first for the node's address: this test is about the address with none.
    monkeypatch.setattr(ray._private.worker, "_global_node", None)
    monkeypatch.delenv(LOOPBACK_ENV, raising=False)
    assert loopback_env("127.0.0.1:6379") == {LOOPBACK_ENV: "0"} and loopback_env("10.0.0.5:6379") == {}
    keep_loopback("127.0.0.1:6379")
    assert os.environ[LOOPBACK_ENV] == "0" and services.resolve_ip_for_localhost("127.0.0.1") == "127.0.0.1"
    keep_loopback("10.0.0.5:6379")
    assert LOOPBACK_ENV not in os.environ and ray_constants.ENABLE_RAY_CLUSTER is True
