"""Runs cut short by someone other than their client, as the Anthropic and Responses APIs say it
(named_stream.cut_short): a WebSocket watcher of the session cancels an HTTP turn sent with
X-Session-Id, or the engine service closes under it. Before, both APIs reported a natural,
complete end (Responses "completed", Anthropic "end_turn") with a cut reply.

- Responses: a cancel is status "cancelled" (streamed: the response.incomplete event, no
  cancelled event exists), never stored; the close fails the response.
- Anthropic: an error (streamed: an `error` event; whole: 499 for a cancel, which the SDKs do
  not send again, 500 for the close).
- /health answers 503 naming why once the service is closed.
- Later runs on every route are refused with 503 naming why, as /health is.
The slow scripted engine writes a drawn reply one token per pause."""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from anthropic_stream import named_events
from openai.types.responses import Response

URL_WS = "/v1/sessions/{}/ws"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["alpha", "beta", "ka", "lo", "mi", "ru"]) for _ in range(n))


@pytest.fixture
def slow(paced_client):
    fake, client = paced_client
    fake.slow_after, fake.delay = 0, 0.02
    return paced_client


def _request(route: str, stream: bool, text: str) -> tuple[str, dict]:
    if route == "responses":
        return "/v1/responses", {"input": text, "max_output_tokens": 400, "stream": stream}
    return "/v1/messages", {"messages": [{"role": "user", "content": text}], "max_tokens": 400,
                            "stream": stream}  # fmt: skip


def _post_in_thread(client, path: str, body: dict, sid: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def post() -> None:
        r = client.post(path, json=body, headers={"X-Session-Id": sid})
        out["status"], out["text"] = r.status_code, r.text

    thread = threading.Thread(target=post)
    thread.start()
    return thread, out


def _wait_running(client, sid: str) -> None:
    live = client.app.state.server.hub.lookup(sid)
    deadline = time.monotonic() + 30
    while live.running is None or not live.running.reply.text:
        assert time.monotonic() < deadline, "the turn never ran"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_cancel_by_another_client_of_the_session_is_not_a_complete_reply(
    slow, rng_seed, route, stream
):
    rng = random.Random(rng_seed)
    fake, client = slow
    fake.replies = [(_words(rng, rng.randint(60, 120)), "stop")]
    sid = f"cut-{rng.randrange(10**9)}"
    path, body = _request(route, stream, _words(rng, 3))
    with client.websocket_connect(URL_WS.format(sid)) as watcher:
        watcher.receive_json(), watcher.receive_json()  # its hello: session, memory
        thread, out = _post_in_thread(client, path, body, sid)
        _wait_running(client, sid)
        watcher.send_json({"type": "cancel"})
        thread.join(30)
    assert not thread.is_alive() and fake.running == {}
    if route == "responses":
        if stream:
            assert out["status"] == 200, out
            name, data = named_events(out["text"])[-1]
            assert name == "response.incomplete", name
            response = data["response"]
        else:
            assert out["status"] == 200, out
            response = json.loads(out["text"])
        Response.model_validate(response, strict=True)
        assert response["status"] == "cancelled" and response["incomplete_details"] is None
        assert response["store"] is False  # it is not kept (store true would promise it)
        assert all(item["status"] != "completed" for item in response["output"][-1:])
        assert client.get(f"/v1/responses/{response['id']}").status_code == 404  # not kept
    else:
        if stream:
            assert out["status"] == 200, out
            events = named_events(out["text"])
            assert events[-1][0] == "error" and "cancelled" in events[-1][1]["error"]["message"]
            assert "message_stop" not in [name for name, _ in events]
        else:
            assert out["status"] == 499, out
            error = json.loads(out["text"])
            assert error["type"] == "error" and "cancelled" in error["error"]["message"]


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_the_engine_closing_under_a_turn_fails_it_and_health_says_closed(slow, rng_seed, route):
    rng = random.Random(rng_seed)
    fake, client = slow
    fake.replies = [(_words(rng, rng.randint(60, 120)), "stop")]
    sid = f"close-{rng.randrange(10**9)}"
    assert client.get("/health").json()["status"] == "ok"
    path, body = _request(route, False, _words(rng, 3))
    thread, out = _post_in_thread(client, path, body, sid)
    _wait_running(client, sid)
    client.app.state.server.service.close()
    thread.join(30)
    assert not thread.is_alive()
    assert out["status"] == 500, out
    assert "closed" in out["text"], out
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "closed"
    assert "closed" in health.json()["reason"]


_AFTER_CLOSE = {  # route -> (body, the error's type on that wire)
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "hi"}]}, "server_error"),
    "/v1/completions": ({"prompt": "hi"}, "server_error"),
    "/v1/responses": ({"input": "hi"}, "server_error"),
    "/v1/messages": ({"messages": [{"role": "user", "content": "hi"}]}, "overloaded_error"),
}


@pytest.mark.parametrize("stream", [False, True])
def test_requests_after_the_service_closed_are_503_naming_why(slow, rng_seed, stream, caplog):
    """Once the service stopped (closed, or MAX_FAILURES failed steps in a row), every new
    run is refused before anything is sent: 503, as /health answers, with the reason, and no
    traceback logged per request (before: a 500 carrying "RuntimeError: ...")."""
    rng = random.Random(rng_seed)
    _, client = slow
    service = client.app.state.server.service
    service.close()
    why = service.why_closed
    assert why
    for path, (body, kind) in _AFTER_CLOSE.items():
        body = {**body, "max_tokens": rng.randint(4, 40), "stream": stream}
        caplog.clear()
        r = client.post(path, json=body)
        assert r.status_code == 503, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == kind and error["message"] == why, (path, error)
        assert not any(rec.exc_info for rec in caplog.records), path  # no traceback
