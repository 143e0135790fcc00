"""POST /v1/chat/completions, streamed and not, plus /v1/models and /health."""

from __future__ import annotations

import json
import random
import string


def _words(rng: random.Random, n: int) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(n)
    )


def _stream(client, body: dict, read_sse) -> list:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return read_sse(list(r.iter_lines()))


def test_non_streamed_completion_has_the_openai_shape(client, rng_seed):
    rng = random.Random(rng_seed)
    max_tokens = rng.randint(3, 9)
    messages = [
        {"role": "system", "content": _words(rng, 4)},
        {"role": "user", "content": _words(rng, 6)},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"model": "freetoken/qwen3_moe", "messages": messages, "max_tokens": max_tokens,
              "temperature": 0},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == client.get("/v1/models").json()["data"][0]["id"]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == max_tokens


def test_streamed_equals_non_streamed_and_ends_with_usage_and_done(client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    body = {
        "messages": [{"role": "user", "content": _words(rng, rng.randint(3, 12))}],
        "max_completion_tokens": rng.randint(4, 12),
        "temperature": 0,
    }
    whole = client.post("/v1/chat/completions", json=body).json()
    events = _stream(client, {**body, "stream_options": {"include_usage": True}}, read_sse)

    assert events[-1] == "[DONE]"
    usage_chunk, final = events[-2], events[-3]
    chunks = events[:-3]
    assert (
        usage_chunk["choices"] == []
        and usage_chunk["usage"]["completion_tokens"] == (whole["usage"]["completion_tokens"])
    )
    assert usage_chunk["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    # The repeat reuses the first request's KV (same prompt): reported as cached tokens.
    assert usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert final["choices"][0]["delta"] == {}
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    ids = {c["id"] for c in events[:-1]}
    assert len(ids) == 1 and all(c["object"] == "chat.completion.chunk" for c in events[:-1])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    content = "".join(d.get("content") or "" for d in deltas)
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    message = whole["choices"][0]["message"]
    assert content == (message["content"] or "")
    assert reasoning == (message.get("reasoning_content") or "")


def test_without_include_usage_there_is_no_usage_chunk(client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    body = {"messages": [{"role": "user", "content": _words(rng, 3)}], "max_tokens": 3}
    events = _stream(client, body, read_sse)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def _block(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>\n'


def test_streamed_tool_calls_are_the_reply_s_and_voided_ones_stream_as_content(
    scripted_client, read_sse, rng_seed
):
    """Call blocks the parser voids (bad JSON; at the end cut by max_tokens) are content in
    the non-streamed reply, so the stream must not announce them as calls (an agent would run
    them); the calls it does stream are the reply's, numbered as it lists them. A whole call
    whose close tag never came is a call (as vLLM reads it)."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    names = sorted({_words(rng, 1) for _ in range(3)})
    tools = [{"type": "function", "function": {"name": n}} for n in names]

    def bad_json() -> str:  # a bare word where a JSON value must be
        return _block(rng.choice(names), f'{{"{_words(rng, 1)}": {_words(rng, 1)}}}')

    blocks, calls = [], []
    for _ in range(rng.randint(0, 3)):
        name, args = rng.choice(names), {_words(rng, 1): rng.randint(-99, 99)}
        if rng.random() < 0.3:
            blocks.append(bad_json())
        else:
            blocks.append(_block(name, json.dumps(args)))
            calls.append((name, args))
    last = (rng.choice(names), {_words(rng, 1): _words(rng, 2)})
    whole = _block(last[0], json.dumps(last[1]))
    start = whole.index('"arguments": {') + len('"arguments": {')
    ending, reason, called = rng.choice(
        [
            (whole[: -len("\n</tool_call>\n")], "stop", True),  # the close tag never came
            (whole[: rng.randint(start, len(whole) - len("}\n</tool_call>\n"))], "length", False),
            (bad_json(), "stop", False),
        ]
    )
    calls += [last] if called else []
    text = _words(rng, rng.randint(0, 4)) + "\n" + "".join(blocks) + ending
    fake.replies = [(text, reason)] * 2
    body = {"messages": [{"role": "user", "content": _words(rng, 3)}], "tools": tools}

    reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    message = reply["message"]
    listed = [c["function"] for c in message.get("tool_calls") or []]
    assert [(c["name"], json.loads(c["arguments"])) for c in listed] == calls
    events = _stream(client, body, read_sse)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == reply["finish_reason"]
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    streamed: dict[int, dict] = {}  # as OpenAI clients accumulate: by index
    for piece in (p for d in deltas for p in d.get("tool_calls") or []):
        call = streamed.setdefault(piece["index"], {"name": "", "arguments": ""})
        call["name"] += piece.get("function", {}).get("name") or ""
        call["arguments"] += piece.get("function", {}).get("arguments") or ""
    assert sorted(streamed) == list(range(len(calls)))
    assert [(streamed[i]["name"], json.loads(streamed[i]["arguments"])) for i in streamed] == calls
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")


def test_history_with_tool_calls_and_reasoning_is_accepted(client, rng_seed):
    """An agent's full history: reasoning sent back, an assistant tool call (arguments as a
    JSON string), the tool's result, and the next turn."""
    rng = random.Random(rng_seed)
    call_id = "call_" + "".join(rng.choice("abcdef0123456789") for _ in range(12))
    args = {"city": _words(rng, 1), "days": rng.randint(1, 9)}
    tools = [
        {
            "type": "function",
            "function": {
                "name": "forecast",
                "description": _words(rng, 5),
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    messages = [
        {"role": "user", "content": _words(rng, 5)},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": _words(rng, 6),
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "forecast", "arguments": json.dumps(args)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": _words(rng, 4)},
    ]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 30


def test_models_and_health(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and len(models["data"]) == 1
    card = models["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 1024
    assert client.get(f"/v1/models/{card['id']}").json()["id"] == card["id"]
    assert client.get("/v1/models/not-this-one").status_code == 404
    health = client.get("/health").json()
    assert health["status"] == "ok" and health["model"] == card["id"]
    memory = health["memory"]
    assert memory["kv_pages"] >= memory["kv_pages_free"] > 0
    assert health["requests"]["running"] == 0


def test_model_id_is_configurable(make_client, rng_seed):
    name = f"my-model-{rng_seed}"
    client = make_client(model_id=name)
    assert client.get("/v1/models").json()["data"][0]["id"] == name
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.json()["model"] == name


def test_web_page_is_served(client):
    for path in ("/", "/ui"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/v1/sessions/" in r.text and "WebSocket" in r.text
        assert "default-src 'none'" in r.headers["content-security-policy"]
