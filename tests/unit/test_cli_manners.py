"""The CLI's manners (issue 42): a reader that closes the pipe ends a command quietly (exit 141),
an error is one line that says what went wrong without Python's class names (`--debug` adds the
type and traceback), and a prediction from the command line loads nothing of the Temporal client.
Every command here runs without a server: they read local files, or find no one at the port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ipnext.client import cli
from ipnext.client.cli import CLOSED_PIPE_EXIT
from ipnext.store.keys import hash_key

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path, **fields: object) -> Path:
    config = tmp_path / "ipnext.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), **fields}))
    return config


def _many_keys(tmp_path: Path, count: int) -> Path:
    """A config whose keys file lists `count` keys with long model lists: `auth list` prints
    about 600 bytes a key, far more than a pipe holds (64 KiB) or stdout buffers (8 KiB)."""
    config = _config(tmp_path)
    models = [f"model-{'x' * 40}-{n}" for n in range(10)]
    keys = [{"name": f"key-{i}", "sha256": hash_key(f"key-{i}"), "models": models} for i in range(count)]
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "api-keys.yaml").write_text(yaml.safe_dump({"keys": keys}))
    return config


def _ipnext(*args: str, stdout: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "ipnext", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )


# -- a closed pipe ---------------------------------------------------------------------------


def test_a_reader_that_stops_reading_ends_the_command_quietly(tmp_path: Path) -> None:
    """`ipnext auth list | head -1`. The output is several times what the pipe holds, so the
    command is still writing when the reader closes, however fast either side runs."""
    config = _many_keys(tmp_path, 2000)
    read_end, write_end = os.pipe()
    proc = _ipnext("--config", str(config), "auth", "list", stdout=write_end)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        first = reader.readline()
    assert first.startswith(b"key-0: model-"), first
    _, stderr = proc.communicate(timeout=90)
    assert (proc.returncode, stderr.decode()) == (CLOSED_PIPE_EXIT, "")


@pytest.mark.parametrize("unbuffered", ["1", ""])
def test_a_reader_gone_before_the_command_starts_ends_it_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, unbuffered: str
) -> None:
    """Two keys: a line or two that fit stdout's buffer. Buffered, the closed pipe shows only
    when `main` flushes at the end; unbuffered (PYTHONUNBUFFERED), at the command's first print."""
    monkeypatch.setenv("PYTHONUNBUFFERED", unbuffered)
    config = _many_keys(tmp_path, 2)
    read_end, write_end = os.pipe()
    os.close(read_end)
    proc = _ipnext("--config", str(config), "auth", "list", stdout=write_end)
    os.close(write_end)
    _, stderr = proc.communicate(timeout=90)
    assert (proc.returncode, stderr.decode()) == (CLOSED_PIPE_EXIT, "")


def test_the_whole_output_still_arrives_when_the_reader_reads_it_all(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ipnext", "--config", str(_many_keys(tmp_path, 300)), "auth", "list"],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 300 and lines[-1].startswith("key-299: "), lines[-1]


# -- errors: one line, no class names; --debug shows where --------------------------------------


def _auth_off(tmp_path: Path, *before: str) -> subprocess.CompletedProcess[str]:
    config = _config(tmp_path, auth={"enabled": False})
    return subprocess.run(
        [sys.executable, "-m", "ipnext", *before, "--config", str(config), "auth", "list"],
        capture_output=True,
        text=True,
        timeout=90,
    )


AUTH_OFF = (
    "ipnext: auth is off (auth.enabled is false): the serving routes take no keys. "
    "Fix: set auth.enabled: true in the config first\n"
)


def test_an_error_is_one_line_with_its_fix_and_no_class_name(tmp_path: Path) -> None:
    done = _auth_off(tmp_path)
    assert (done.returncode, done.stderr, done.stdout) == (2, AUTH_OFF, "")


def test_debug_adds_the_type_and_the_traceback_before_the_same_line(tmp_path: Path) -> None:
    done = _auth_off(tmp_path, "--debug")
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("Traceback (most recent call last):\n"), done.stderr
    assert 'auth.py", line' in done.stderr and "in run_auth" in done.stderr, done.stderr
    assert "\nipnext.errors.IpnextError: auth is off" in done.stderr, done.stderr
    assert done.stderr.endswith(AUTH_OFF), done.stderr


@pytest.fixture
def failing_auth(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[tuple[list[str], list[BaseException]]]:
    """`ipnext auth list` (run in this process through `_run`, which returns the exit code
    `main` exits with) made to raise what a test puts in the list it yields."""
    raised: list[BaseException] = []

    def run_auth(*_: object) -> None:
        raise raised[0]

    monkeypatch.setattr("ipnext.client.cli.auth.run_auth", run_auth)
    yield ["--config", str(_config(tmp_path)), "auth", "list"], raised


def test_an_unexpected_error_is_its_message_and_a_pointer_to_debug(
    failing_auth: tuple[list[str], list[BaseException]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, raised = failing_auth
    raised.append(OSError(28, "No space left on device"))
    assert cli._run(argv) == 2
    err = capsys.readouterr().err
    assert (
        err == "ipnext: [Errno 28] No space left on device (`ipnext --debug ...` shows where it came from)\n"
    )
    raised[0] = KeyError()
    assert cli._run(argv) == 2
    assert "KeyError" not in capsys.readouterr().err
    assert cli._run(["--debug", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and "\nKeyError\n" in err, err


def test_a_broken_pipe_that_is_not_stdouts_is_an_error_like_any_other(
    failing_auth: tuple[list[str], list[BaseException]], capsys: pytest.CaptureFixture[str]
) -> None:
    """A command whose own socket or child broke: stdout is fine, so it is said, exit 2."""
    argv, raised = failing_auth
    raised.append(BrokenPipeError(32, "Broken pipe"))
    assert cli._run(argv) == 2
    assert capsys.readouterr().err.startswith("ipnext: [Errno 32] Broken pipe (")


def test_ctrl_c_exits_130_without_a_word_unless_debugging(
    failing_auth: tuple[list[str], list[BaseException]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv, raised = failing_auth
    raised.append(KeyboardInterrupt())
    assert cli._run(argv) == 130
    assert capsys.readouterr().err == ""
    assert cli._run(["--debug", *argv]) == 130
    assert "KeyboardInterrupt" in capsys.readouterr().err


def test_argparse_keeps_its_own_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._run(["predict", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: ipnext predict")
    assert cli._run(["predict"]) == 2
    assert "the following arguments are required: model, --inputs" in capsys.readouterr().err
    assert cli._run(["no-such-command"]) == 2
    assert "invalid choice: 'no-such-command'" in capsys.readouterr().err


# -- what the data plane loads ------------------------------------------------------------------


def _loaded_after(code: str) -> tuple[str, set[str]]:
    """Run `code` in a fresh interpreter; what it printed before the module list, and the list."""
    script = f"import sys\n{code}\nprint('--modules--')\nprint('\\n'.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90, check=True
    )
    said, _, modules = done.stdout.partition("--modules--\n")
    return said, set(modules.split())


@pytest.fixture
def nobody_at_the_serving_port(tmp_path: Path) -> Iterator[Path]:
    """A config whose serving port is bound and never listened on: every connection is refused
    at once, and nothing else can take the port while the test runs."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield _config(tmp_path, serve={"host": "127.0.0.1", "port": held.getsockname()[1]})


def _predict_from_the_cli(config: Path) -> tuple[str, set[str]]:
    """`ipnext predict` through the CLI's own path (read ahead, parse, settings, the command),
    ending at the refused connection; `_run` gives its exit code instead of leaving."""
    argv = ["--config", str(config), "predict", "m", "--inputs", '{"user": 1}']
    return _loaded_after(f"from ipnext.client.cli import _run\nprint(_run({argv!r}))")


def test_a_prediction_from_the_cli_loads_only_its_command_and_not_the_temporal_client(
    nobody_at_the_serving_port: Path,
) -> None:
    said, loaded = _predict_from_the_cli(nobody_at_the_serving_port)
    assert said.strip() == "2"  # the refused connection, said in one line
    assert "ipnext.client.prediction" in loaded
    assert sorted(m for m in loaded if m.startswith("ipnext.client.cli.")) == [
        "ipnext.client.cli._common",
        "ipnext.client.cli.predict",
    ]
    heavy = {"temporalio.client", "temporalio.worker", "ipnext.client.sdk", "ray", "torch", "numpy"}
    assert not heavy & loaded, sorted(heavy & loaded)


def test_a_prediction_from_the_cli_loads_nothing_of_temporal(nobody_at_the_serving_port: Path) -> None:
    _, loaded = _predict_from_the_cli(nobody_at_the_serving_port)
    assert not [m for m in loaded if m.split(".")[0] in ("temporalio", "grpc")]


def test_the_old_sdk_module_loads_the_temporal_client_only_when_client_is_asked_for() -> None:
    _, loaded = _loaded_after("import ipnext.sdk")
    assert not [m for m in loaded if m.startswith(("ipnext.client", "temporalio", "httpx", "pydantic"))]
    _, loaded = _loaded_after("from ipnext.sdk import Prediction, PredictionClient")
    assert "ipnext.client.prediction" in loaded and not {"temporalio.client", "ipnext.client.sdk"} & loaded
    said, loaded = _loaded_after(
        "from ipnext.sdk import Client\nimport ipnext.client.sdk as home\nprint(Client is home.Client)"
    )
    assert said.strip() == "True" and "temporalio.client" in loaded


def test_reading_ahead_picks_the_command_argparse_picks() -> None:
    assert cli._command_in(["--config", "predict", "model", "get", "x"]) == "model"
    assert cli._command_in(["--debug", "predict", "m", "--inputs", "{}"]) == "predict"
    assert cli._command_in(["--help", "predict"]) is None
    assert cli._command_in(["--config"]) is None
    # A guess argparse does not share lands on a stand-in, and `_parse` parses with everything.
    args = cli._parse(["--conf", "predict", "model", "get", "x"])
    assert (args.config, args.command, args.verb, args.name) == ("predict", "model", "get", "x")
    assert args.run is not None
