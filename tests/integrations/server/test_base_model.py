"""A base model (no chat template) behind the server: the chat routes refuse a history with a
400 naming the missing template and the route that serves plain text, never a 500; plain text
completions still run."""

from __future__ import annotations

import json
import random
import shutil
import string
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.integrations.server import create_app


@pytest.fixture
def base_client(model_dir: Path, tmp_path: Path):
    folder = tmp_path / "base"
    shutil.copytree(model_dir, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert config.pop("chat_template", None) is not None  # the demo has one to take away
    config_path.write_text(json.dumps(config))
    engine = Engine.load(folder, device="cpu", progress=False, kv_tokens=2048, max_model_len=512)
    with TestClient(create_app(engine)) as client:
        yield client


def _words(rng: random.Random) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7)))
        for _ in range(rng.randint(1, 6))
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_chat_routes_refuse_a_history_naming_the_missing_template(
    base_client: TestClient, route: str, stream: bool, rng_seed: int
) -> None:
    rng = random.Random(rng_seed)
    text = _words(rng)
    body = {"max_tokens": rng.randint(1, 8), "stream": stream}
    if route == "/v1/responses":
        body = {"input": text, "stream": stream}
    else:
        body["messages"] = [{"role": "user", "content": text}]
    r = base_client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert "no chat template" in r.text and "/v1/completions" in r.text
    # Plain text still runs on the same server.
    r = base_client.post("/v1/completions", json={"prompt": text, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_websocket_turn_is_refused_naming_the_missing_template(
    base_client: TestClient, rng_seed: int
) -> None:
    rng = random.Random(rng_seed)
    with base_client.websocket_connect(f"/v1/sessions/s{rng_seed}/ws") as ws:
        assert [ws.receive_json()["type"] for _ in range(2)] == ["session", "memory"]
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _words(rng)}]})
        event = ws.receive_json()
        while event["type"] not in ("error", "done"):
            event = ws.receive_json()
        assert event["type"] == "error" and "no chat template" in event["message"], event
