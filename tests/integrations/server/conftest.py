"""Fixtures for the server tests: the demo model on the CPU behind `create_app`.

Each test gets a fresh Engine (loading the tiny demo folder takes milliseconds), so one test's
cached pages or unfinished requests can never leak into another's checks. Tests of real clients
(SDKs, a browser, raw sockets) run a real uvicorn server on a free loopback port instead, one
per module (`start_server`), and check after each test that nothing was left behind
(`assert_nothing_held`). The demo model never writes a free-form or malformed tool call, so
`scripted_client` serves a `ScriptedEngine` (tests/helpers/) that answers with chosen texts
instead.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from scripted_engine import PacedEngine, ScriptedEngine
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.server import create_app, make_server
from freetoken_agent.service import EngineService


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def engine(model_dir: Path) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


@pytest.fixture
def make_client(engine: Engine) -> Iterator[Callable[..., TestClient]]:
    """make_client(**create_app options) -> a started TestClient (lifespan run: one event loop
    for all its requests and sockets, as under uvicorn). Closed after the test."""
    clients: list[TestClient] = []

    def make(**options: Any) -> TestClient:
        client = TestClient(create_app(engine, **options))
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client) -> TestClient:
    return make_client()


def _served(fake: ScriptedEngine) -> Iterator[tuple[ScriptedEngine, TestClient]]:
    """(fake, a started TestClient serving it), closed after."""
    service = EngineService(fake)
    client = TestClient(create_app(service))
    client.__enter__()
    yield fake, client
    client.__exit__(None, None, None)
    service.close()


@pytest.fixture
def scripted_client(engine: Engine) -> Iterator[tuple[ScriptedEngine, TestClient]]:
    """(fake, client): a started TestClient whose engine answers with `fake.replies`."""
    yield from _served(ScriptedEngine(engine))


@pytest.fixture
def paced_client(engine: Engine) -> Iterator[tuple[PacedEngine, TestClient]]:
    """(fake, client) as scripted_client's, the engine a PacedEngine: it sleeps `fake.delay`
    before each step once a request has written `fake.slow_after` tokens (set them)."""
    yield from _served(PacedEngine(engine))


def sse_payloads(lines: list[str]) -> list[Any]:
    """The data of each server-sent event, JSON-decoded ('[DONE]' kept as the string)."""
    events = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture
def read_sse() -> Callable[[list[str]], list[Any]]:
    return sse_payloads


def load_engine(model_dir: Path) -> Engine:
    return Engine.load(model_dir, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(slots=True)
class LiveServer:
    """A uvicorn server running the app in a thread on 127.0.0.1."""

    base: str  # http://127.0.0.1:PORT
    port: int
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def state(self) -> Any:
        """The app's ServerState (service, hub, model id)."""
        return self.server.config.app.state.server

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        assert not self.thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="module")
def start_server() -> Iterator[Callable[..., LiveServer]]:
    """start_server(model folder or Engine, **make_server options) -> a started LiveServer,
    stopped when the module's tests are done. The app owns an EngineService, closed at
    uvicorn's shutdown."""
    servers: list[LiveServer] = []

    def start(model: Path | Engine, **options: Any) -> LiveServer:
        engine = load_engine(model) if isinstance(model, Path) else model
        port = free_port()
        options.setdefault("log_level", "warning")
        server = make_server(engine, "127.0.0.1", port, **options)
        thread = threading.Thread(target=server.run, daemon=True, name=f"uvicorn-{port}")
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        live = LiveServer(f"http://127.0.0.1:{port}", port, server, thread)
        servers.append(live)
        return live

    yield start
    for live in servers:
        live.stop()


def assert_nothing_held(service: Any, timeout: float = 10.0) -> None:
    """No request runs (aborts land at the engine's next step: wait for them), the engine's
    managers are consistent, and once the radix tree lets go of what it caches every KV page
    is free: nothing is held by a request that should have ended."""
    engine = service.engine
    deadline = time.monotonic() + timeout
    while True:
        with service.lock:
            busy = engine.has_unfinished()
        if not busy or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    stacks = _server_stacks() if busy else ""
    with service.lock:
        assert not engine.has_unfinished(), _unfinished(service) + stacks
        engine.check_integrity()
        engine.radix.reset()
        assert engine.kv.allocator.n_free == engine.kv.allocator.capacity


def _unfinished(service: Any) -> str:
    """What a failure needs to tell a missed disconnect (the service still delivers to the
    request, its output near max_tokens) from an abort the engine did not honour (no sink)."""
    engine, now = service.engine, time.perf_counter()
    sched = engine.scheduler
    rows = [
        f"{r.id}: {r.status.name}, {len(r.output_ids)} of {r.sampling.max_tokens} tokens, "
        f"{now - r.arrival_time:.1f} s old, sink {'held' if r.id in service._sinks else 'gone'}"
        for r in [*sched.running, *sched.waiting]
    ]
    return f"{service.stats()['requests']}; " + "; ".join(rows)


def _server_stacks() -> str:
    """Where the server's threads are, innermost call first (taken while the test does not
    hold the engine's lock): a uvicorn loop blocked in `service.abort` is an abort that could
    not get the lock; one idle in `select` beside a held sink is a reset nobody saw."""
    frames = sys._current_frames()
    lines = []
    for thread in threading.enumerate():
        frame = frames.get(thread.ident)
        if frame is None or not thread.name.startswith(("uvicorn-", "freetoken-")):
            continue
        calls = [
            f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)
        ]
        lines.append(f"\n  {thread.name}: " + " < ".join(reversed(calls[-6:])))
    return "".join(lines)


def assert_api_error(response: Any, *statuses: int) -> dict[str, Any]:
    """An httpx response is a 4xx (one of `statuses` if given) carrying an OpenAI error object
    with a message; returns the error."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if statuses:
        assert response.status_code in statuses, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    return error


# Test modules cannot import conftest (importlib mode): the helpers come as fixtures.
@pytest.fixture(scope="session")
def nothing_held() -> Callable[..., None]:
    return assert_nothing_held


@pytest.fixture(scope="session")
def api_error() -> Callable[..., dict[str, Any]]:
    return assert_api_error
