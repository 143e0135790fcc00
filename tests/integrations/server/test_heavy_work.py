"""A request's parsing and a count's render run on the heavy-work pool (heavy_work.py), not on
the event loop, which every other client's stream needs: a 3.7 MB history parsed on the loop
held the other streams for 0.4-3.6 s. Each route's parser is spied on for the thread it runs
in; a parser on the loop thread would say so."""

from __future__ import annotations

import random
import threading

import pytest

from freetoken_agent.integrations.server import (
    anthropic_routes,
    input_count,
    openai_routes,
    responses_routes,
    sessions_ws,
    tokenize_routes,
)

URL_WS = "/v1/sessions/{}/ws"


def _spy(monkeypatch, module, name: str) -> list[str]:
    """The names of the threads `module.name` runs in, from now on."""
    threads: list[str] = []
    real = getattr(module, name)

    def spied(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spied)
    return threads


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(["ka", "lo", "mi", "ru", "beta"]) for _ in range(n))


def test_every_route_parses_off_the_event_loop(client, rng_seed, monkeypatch):
    rng = random.Random(rng_seed)
    spied = {
        "chat": _spy(monkeypatch, openai_routes, "parse_chat_request"),
        "text": _spy(monkeypatch, openai_routes, "parse_text_request"),
        "messages": _spy(monkeypatch, anthropic_routes, "parse_messages_request"),
        "responses": _spy(monkeypatch, responses_routes, "parse_responses_request"),
        "count": _spy(monkeypatch, input_count, "turn_plan"),
        "tokenize": _spy(monkeypatch, tokenize_routes, "parse_messages"),
        "socket": _spy(monkeypatch, sessions_ws, "turn_request"),
    }
    user = [{"role": "user", "content": _words(rng, rng.randint(1, 9))}]
    small = {"max_tokens": 2}
    posts = [
        ("/v1/chat/completions", {"messages": user, **small}),
        ("/v1/completions", {"prompt": _words(rng, 5), **small}),
        ("/v1/messages", {"messages": user, **small}),
        ("/v1/messages/count_tokens", {"messages": user}),
        ("/v1/responses", {"input": user, "max_output_tokens": 2}),
        ("/v1/responses/input_tokens", {"input": user}),
        ("/tokenize", {"messages": user}),
    ]
    for path, body in rng.sample(posts, len(posts)):
        assert client.post(path, json=body).status_code == 200, path
    with client.websocket_connect(URL_WS.format(f"heavy-{rng_seed}")) as ws:
        ws.receive_json(), ws.receive_json()  # the hello: session, memory
        ws.send_json({"type": "send", "messages": user, "sampling": small})
        while ws.receive_json()["type"] != "done":
            pass
    for route, threads in spied.items():  # (the event loop runs in the client's own thread)
        assert threads, route
        assert all(t.startswith("freetoken-heavy") for t in threads), (route, threads)


@pytest.mark.parametrize("frame_kb", [1, 100])
def test_a_socket_refuses_a_busy_send_after_its_checks(client, rng_seed, frame_kb):
    """A send checked off the loop is refused as busy if a turn started meanwhile (another
    socket's): the check is made again once its checks are done."""
    rng = random.Random(rng_seed)
    sid = f"busy-{rng_seed}-{frame_kb}"
    live = client.app.state.server.hub.get(sid)
    pad = "x" * (frame_kb * 1024)
    with client.websocket_connect(URL_WS.format(sid)) as ws:
        ws.receive_json(), ws.receive_json()
        real = sessions_ws.turn_request

        def starts_another(msg, live_, state):
            request = real(msg, live_, state)
            live.running = object()  # as another socket's send would, while this one checked
            return request

        sessions_ws.turn_request = starts_another
        try:
            ws.send_json({"type": "send", "messages": [{"role": "user", "content": pad}]})
            error = ws.receive_json()
        finally:
            sessions_ws.turn_request = real
            live.running = None
        assert error["type"] == "error" and "already running a turn" in error["message"]
        assert ws.receive_json() == {"type": "done", "turn": None, "finish_reason": "error"}
        ws.send_json({"type": "send", "messages": [{"role": "user", "content": _words(rng, 3)}],
                      "sampling": {"max_tokens": 2}})  # fmt: skip
        while (event := ws.receive_json())["type"] != "done":
            pass
        assert event["finish_reason"] in ("stop", "length")
