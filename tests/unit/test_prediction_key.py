"""The prediction clients keep the stack's API key whatever they are given (issue 42): every
constructor, with a URL or without, and `from_settings`, sends `api_key=` when given, else
IPNEXT_API_KEY, else the settings' key file (`client_api_key`). A client built with an explicit
URL once dropped the dev stack's key, and the README's example answered 401.

The serving layer is a fake that refuses like the doors do (401 without a known key): over
httpx.MockTransport, and once over a real local HTTP server for the prediction module's
docstring example, run as it is written but for the server's address."""

from __future__ import annotations

import inspect
import itertools
import json
import textwrap
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

import ipnext.client.prediction as prediction
from ipnext.client.prediction import AsyncPredictionClient, Prediction, PredictionClient, client_api_key
from ipnext.contracts.routing import RoutingDocument, predict_path, routing_path
from ipnext.errors import PredictionError, SpecError
from ipnext.spec.settings import Settings, load_settings
from ipnext.store.keys import API_KEY_ENV

pytestmark = pytest.mark.timeout(60)

MODEL = "feed-ranker"
URL = "http://serving.test"
FILE_KEY, ENV_KEY, GIVEN_KEY = "ipn_fromfile", "ipn_fromenv", "ipn_given"
DOCUMENT = RoutingDocument(model=MODEL, generation=1, ttl_seconds=5, routes={"us-east": {"us-east": 1.0}})
ENVELOPE: dict[str, Any] = {
    "outputs": [0.5, 0.25],
    "set": f"{MODEL}@1",
    "parts": {"dense": f"{MODEL}/dense@v1"},
}


def _write_config(folder: Path, key: str | None) -> Path:
    """A config whose state folder holds the dev stack's key file (`<state_dir>/api-key`) when
    `key` is given, as `ipnext dev up` leaves it."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "ipnext.yaml"
    config.write_text(yaml.safe_dump({"state_dir": "state"}))
    key_file = folder / "state" / "api-key"
    key_file.unlink(missing_ok=True)
    if key is not None:
        key_file.parent.mkdir(exist_ok=True)
        key_file.write_text(key + "\n")
    return config


@pytest.fixture
def ambient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str | None, str | None], Settings]:
    """Set the ambient settings (IPNEXT_CONFIG, whose key file holds `file_key`) and the
    IPNEXT_API_KEY environment variable (`env_key`; unset when None); the settings they give."""

    def set_up(file_key: str | None, env_key: str | None) -> Settings:
        config = _write_config(tmp_path / "ambient", file_key)
        monkeypatch.setenv("IPNEXT_CONFIG", str(config))
        if env_key is None:
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        else:
            monkeypatch.setenv(API_KEY_ENV, env_key)
        return load_settings()

    return set_up


class Doors:
    """The routing app and one router, behind a key check: 401 without `key`, as every door."""

    def __init__(self, key: str | None) -> None:
        self.key = key
        self.sent: list[str | None] = []  # each request's Authorization header

    def handle(self, request: httpx.Request) -> httpx.Response:
        authorization = request.headers.get("authorization")
        self.sent.append(authorization)
        if self.key is not None and authorization != f"Bearer {self.key}":
            return httpx.Response(
                401, json={"message": "an API key is required: send Authorization: Bearer <key>"}
            )
        if request.url.path == routing_path(MODEL):
            return httpx.Response(200, json=DOCUMENT.model_dump(mode="json"))
        if request.url.path == predict_path(MODEL, "us-east"):
            return httpx.Response(200, json=ENVELOPE)
        return httpx.Response(404, json={"message": f"no route {request.url.path}"})

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def test_a_client_given_only_a_url_sends_the_dev_stacks_key(ambient: Any) -> None:
    """The README's line, `PredictionClient(url)`: the key `ipnext dev up` wrote is sent, and the
    doors answer instead of refusing with 401 (what the client did before it kept the key)."""
    ambient(FILE_KEY, None)
    doors = Doors(key=FILE_KEY)
    with PredictionClient(URL, transport=doors.transport()) as serving:
        reply = serving.predict(MODEL, {"user": 3, "items": [1, 2]}, source="us-east")
    assert reply == Prediction(**ENVELOPE, region="us-east")
    assert doors.sent == [f"Bearer {FILE_KEY}"] * 2, doors.sent  # the routing document, the prediction


def test_the_fake_doors_refuse_a_client_without_the_key(ambient: Any) -> None:
    """The test above can fail: a client that sends no key gets the doors' 401."""
    ambient(None, None)
    doors = Doors(key=FILE_KEY)
    with (
        PredictionClient(URL, transport=doors.transport()) as serving,
        pytest.raises(PredictionError, match="HTTP 401") as refused,
    ):
        serving.predict(MODEL, {"user": 3, "items": [1, 2]}, source="us-east")
    assert refused.value.status_code == 401 and doors.sent == [None]


# Every way to build a client: sync and async, with a URL, without one, and from the settings.
Build = Callable[[httpx.MockTransport, dict[str, Any]], Any]
BUILDS: dict[str, Build] = {
    "PredictionClient(url)": lambda t, kw: PredictionClient(URL, transport=t, **kw),
    "PredictionClient()": lambda t, kw: PredictionClient(transport=t, **kw),
    "PredictionClient.from_settings()": lambda t, kw: PredictionClient.from_settings(transport=t, **kw),
    "AsyncPredictionClient(url)": lambda t, kw: AsyncPredictionClient(URL, transport=t, **kw),
    "AsyncPredictionClient()": lambda t, kw: AsyncPredictionClient(transport=t, **kw),
    "AsyncPredictionClient.from_settings()": lambda t, kw: AsyncPredictionClient.from_settings(
        transport=t, **kw
    ),
}


async def _sent_header(build: Build, options: dict[str, Any]) -> str | None:
    """The Authorization header the client built by `build` sends with its first request."""
    doors = Doors(key=None)
    client = build(doors.transport(), options)
    try:
        if isinstance(client, PredictionClient):
            client.routing(MODEL)
        else:
            await client.routing(MODEL)
    finally:
        if isinstance(client, PredictionClient):
            client.close()
        else:
            await client.aclose()
    assert len(doors.sent) == 1, doors.sent
    return doors.sent[0]


@pytest.mark.parametrize("built", list(BUILDS))
async def test_every_constructor_finds_the_key_in_one_order(built: str, ambient: Any) -> None:
    """Every combination of the three places a key can come from: the first one that has a key
    wins, in the order `api_key=`, IPNEXT_API_KEY, the settings' key file; none sends no header."""
    for given, env, in_file in itertools.product((GIVEN_KEY, None), (ENV_KEY, None), (FILE_KEY, None)):
        ambient(in_file, env)
        options = {} if given is None else {"api_key": given}
        expected = next((key for key in (given, env, in_file) if key is not None), None)
        sent = await _sent_header(BUILDS[built], options)
        assert sent == (None if expected is None else f"Bearer {expected}"), (built, given, env, in_file)


async def test_an_empty_api_key_sends_none(ambient: Any) -> None:
    """`api_key=""` is an explicit "no key", over the environment and the file: a caller can
    see what a keyless request is answered."""
    ambient(FILE_KEY, ENV_KEY)
    for built, build in BUILDS.items():
        assert await _sent_header(build, {"api_key": ""}) is None, built


async def test_from_settings_reads_the_key_file_of_the_settings_it_is_given(
    tmp_path: Path, ambient: Any
) -> None:
    """`from_settings(settings)` reads those settings' key file, never the ambient config's:
    with none there it sends no key, though IPNEXT_CONFIG's stack has one."""
    ambient(FILE_KEY, None)
    elsewhere = load_settings(_write_config(tmp_path / "elsewhere", "ipn_elsewhere"))
    keyless = load_settings(_write_config(tmp_path / "keyless", None))
    for cls in (PredictionClient, AsyncPredictionClient):
        assert await _sent_header(_from_settings(cls, elsewhere), {}) == "Bearer ipn_elsewhere", cls
        assert await _sent_header(_from_settings(cls, keyless), {}) is None, cls


def _from_settings(cls: type[PredictionClient] | type[AsyncPredictionClient], settings: Settings) -> Build:
    return lambda transport, options: cls.from_settings(settings, transport=transport, **options)


def test_settings_are_read_only_when_no_key_is_given_or_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller with a URL and a key (given, or in IPNEXT_API_KEY) needs no config: a broken one
    is not read. Without either, the settings are the last place to look, and a broken config
    is an error naming its file, not a request sent without a key to be refused."""
    broken = tmp_path / "ipnext.yaml"
    broken.write_text(yaml.safe_dump({"serve": {"port": "not a port"}}))
    monkeypatch.setenv("IPNEXT_CONFIG", str(broken))
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert client_api_key(GIVEN_KEY) == GIVEN_KEY
    monkeypatch.setenv(API_KEY_ENV, ENV_KEY)
    assert client_api_key() == ENV_KEY
    PredictionClient(URL).close()
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(SpecError, match=str(broken)):
        PredictionClient(URL)


def test_the_order_is_written_where_users_read_it() -> None:
    """The docstrings a user reads (help(), the SDK reference) say the order the code keeps."""
    for documented in (client_api_key, AsyncPredictionClient.__init__, PredictionClient.__init__):
        doc = " ".join((inspect.getdoc(documented) or "").split())
        assert doc.index("api_key") < doc.index("IPNEXT_API_KEY") < doc.index("key file"), documented


# ---- the module docstring's example, over a real socket ----------------------------------


def _docstring_example(module: Any, opening: str) -> str:
    """The indented example in `module`'s docstring that starts with `opening`, dedented."""
    lines = (module.__doc__ or "").splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(opening))
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and len(lines[end]) - len(lines[end].lstrip()) > indent:
        end += 1
    return textwrap.dedent("\n".join(lines[start:end])) + "\n"


@pytest.fixture
def local_doors() -> Iterator[tuple[str, list[str | None]]]:
    """The fake doors on a real local port (the example builds its own httpx client, so no
    MockTransport can reach it): its URL, and each request's Authorization header."""
    doors = Doors(key=FILE_KEY)

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            request = httpx.Request(
                self.command, f"{URL}{self.path}", headers=dict(self.headers), content=body
            )
            answer = doors.handle(request)
            self.send_response(answer.status_code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the test reads `sent`
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", doors.sent
    finally:
        server.shutdown()
        server.server_close()


def test_the_modules_docstring_example_runs_with_the_stacks_key(
    ambient: Any, local_doors: tuple[str, list[str | None]]
) -> None:
    """`ipnext.client.prediction`'s own example, `PredictionClient("http://127.0.0.1:8000")`
    as written but for the port: it predicts with the key from the settings' key file."""
    url, sent = local_doors
    ambient(FILE_KEY, None)
    code = _docstring_example(prediction, "with PredictionClient(")
    assert '"http://127.0.0.1:8000"' in code, code
    scope: dict[str, Any] = {"PredictionClient": PredictionClient}
    exec(
        compile(code.replace('"http://127.0.0.1:8000"', json.dumps(url)), "prediction.py docstring", "exec"),
        scope,
    )
    assert scope["reply"] == Prediction(**ENVELOPE, region="us-east")
    assert sent == [f"Bearer {FILE_KEY}"] * 2, sent
