"""Fixtures for the server tests: the demo model on the CPU behind `create_app`.

Each test gets a fresh Engine (loading the tiny demo folder takes milliseconds), so one test's
cached pages or unfinished requests can never leak into another's checks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.server import create_app


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
