"""Input bounded by its size, refused as a 400 naming the field before the work it would cost:
nesting past Python's recursion limit (a body, a WebSocket frame, tool schemas and tool-call
arguments), more stop strings than the engine should search per token, a history or a prompt
longer than the context."""

from __future__ import annotations

import json
import random

import pytest
from render_count import count_renders

from freetoken_agent.engine.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from freetoken_agent.integrations.server.errors import MAX_NESTING

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
SOCKET = "/v1/sessions/{}/ws"
USER = [{"role": "user", "content": "hi"}]


def _error(r, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def _nest(depth: int, leaf):
    for _ in range(depth):
        leaf = {"a": leaf}
    return leaf


def _until_done(ws, turn) -> list[dict]:
    events = []
    while not events or events[-1] != {**events[-1], "type": "done", "turn": turn}:
        events.append(ws.receive_json())
    return events


def test_a_body_nested_past_the_recursion_limit_is_a_400(client, rng_seed):
    rng = random.Random(rng_seed)
    depth = rng.randint(5_000, 100_000)
    opener, closer = rng.choice([("[", "]"), ('{"a": ', "}")])
    raw = '{"messages": ' + opener * depth + "1" + closer * depth + "}"
    error = _error(client.post(CHAT, content=raw.encode()))
    assert error["code"] == "invalid_json" and "nested deeper" in error["message"]
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 2}).status_code == 200


def test_a_deep_websocket_frame_is_refused_and_the_running_turn_goes_on(client, rng_seed):
    rng = random.Random(rng_seed)
    sid = f"deep-{rng_seed}"
    n = rng.randint(20, 40)
    with client.websocket_connect(SOCKET.format(sid)) as watcher:
        watcher.receive_json(), watcher.receive_json()  # session, memory
        with client.websocket_connect(SOCKET.format(sid)) as ws:
            ws.receive_json(), ws.receive_json()
            ws.send_json({"type": "send", "messages": USER,
                          "sampling": {"max_tokens": n, "ignore_eos": True}})  # fmt: skip
            assert ws.receive_json()["type"] == "start"
            depth = rng.randint(5_000, 50_000)
            ws.send_text('{"type": "cancel", "x": ' + "[" * depth + "]" * depth + "}")
            events = _until_done(ws, 0)
            errors = [e for e in events if e["type"] == "error"]
            assert len(errors) == 1 and errors[0]["code"] == "invalid_json"
            assert "nested deeper" in errors[0]["message"]
            ws.send_json({"type": "send", "messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function", "function": {"name": "f",
                                     "parameters": _nest(MAX_NESTING + 5, {})}}]})  # fmt: skip
            refused = ws.receive_json()
            assert refused["type"] == "error" and refused["param"] == "tools[0]"
        seen = _until_done(watcher, 0)
    usage = next(e for e in events if e["type"] == "usage")
    assert usage["finish_reason"] == "length" and usage["completion_tokens"] == n
    assert [e for e in seen if e["type"] == "done"][-1]["finish_reason"] == "length"


@pytest.mark.parametrize("where", ["tools", "arguments"])
def test_tool_schemas_and_arguments_nested_too_deeply_name_the_field(client, rng_seed, where):
    rng = random.Random(rng_seed)
    depth = rng.randint(MAX_NESTING + 1, 800)
    if where == "tools":
        tool = {"type": "function", "function": {"name": "f", "parameters": _nest(depth, {})}}
        body, param = {"messages": USER, "tools": [tool]}, "tools[0]"
    else:
        call = {"id": "c", "type": "function",
                "function": {"name": "f", "arguments": _nest(depth, 1)}}  # fmt: skip
        body = {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "c", "content": "ok"}]}  # fmt: skip
        param = "messages[1]"
    error = _error(client.post(CHAT, content=json.dumps({**body, "max_tokens": 2}).encode()))
    assert error["param"] == param and f"nested more than {MAX_NESTING}" in error["message"]
    # Real schemas nest a handful of levels: accepted.
    shallow = {"type": "object", "properties": {"p": _nest(rng.randint(1, 20), {})}}
    tool = {"type": "function", "function": {"name": "f", "parameters": shallow}}
    assert client.post(CHAT, json={"messages": USER, "tools": [tool], "max_tokens": 2}).is_success


@pytest.mark.parametrize("route", ["chat", "text", "socket"])
def test_stop_lists_are_capped_naming_stop(client, rng_seed, route):
    rng = random.Random(rng_seed)
    too_many = [f"zq{i}xv" for i in range(rng.randint(MAX_STOP_STRINGS + 1, 5000))]
    too_long = ["ok", "y" * rng.randint(MAX_STOP_CHARS + 1, 50_000)]
    fine = [f"zq{i}xv" for i in range(MAX_STOP_STRINGS)]
    for stop, ok in ((too_many, False), (too_long, False), (fine, True)):
        sampling = {"stop": stop, "max_tokens": 2}
        if route == "socket":
            with client.websocket_connect(SOCKET.format(f"stop-{rng_seed}")) as ws:
                ws.receive_json(), ws.receive_json()
                ws.send_json({"type": "send", "messages": USER, "sampling": sampling})
                first = ws.receive_json()
                if ok:
                    assert first["type"] == "start"
                    _until_done(ws, 0)
                    continue
                assert first["type"] == "error" and first["param"] == "stop", first
                message = first["message"]
        else:
            body = {**sampling, **({"messages": USER} if route == "chat" else {"prompt": "hi"})}
            r = client.post(CHAT if route == "chat" else TEXT, json=body)
            if ok:
                assert r.status_code == 200, r.text
                continue
            error = _error(r)
            assert error["param"] == "stop", error
            message = error["message"]
        if stop is too_many:
            assert f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}" in message
        else:
            assert f"stop[1] has {len(stop[1])} characters" in message


def test_a_history_over_the_context_is_refused_without_locating_anchors(
    client, monkeypatch, rng_seed
):
    rng = random.Random(rng_seed)
    calls = count_renders(monkeypatch)
    n = rng.randint(400, 800) | 1  # tiny messages, well over the 1024-token context
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(n)]
    error = _error(client.post(CHAT, json={"messages": messages, "max_tokens": 2}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert "this engine's context holds 1024 tokens" in error["message"]
    assert len(calls) <= 2  # the rendering itself, not one per message


def test_an_over_long_id_prompt_is_refused_by_its_length(client, engine, rng_seed):
    """Ids outside the vocabulary, far more of them than the context holds: the length is
    judged first (the vocabulary scan runs under the engine's lock)."""
    rng = random.Random(rng_seed)
    vocab = engine.spec.vocab_size
    prompt = [vocab + rng.randrange(1000) for _ in range(rng.randint(1100, 200_000))]
    error = _error(client.post(TEXT, json={"prompt": prompt, "max_tokens": 2}))
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"the prompt has {len(prompt)} tokens" in error["message"]
