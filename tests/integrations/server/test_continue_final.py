"""Continuing the last assistant message (a "prefill"): vLLM's `continue_final_message` on the
chat route and the WebSocket, Anthropic's last assistant message on /v1/messages, and the
/tokenize count of such a prompt. The prompt must be the finished history's rendering cut right
after the prefill (the non-continued rendering is the oracle), the reply the continuation
alone; what cannot be continued is refused naming the field."""

from __future__ import annotations

import random

from anthropic_stream import named_events, reassemble

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.messages import messages_from_openai

CHAT = "/v1/chat/completions"
WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "ru", "x,", "{a:", "日本"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _history(rng: random.Random) -> tuple[list[dict], str]:
    prefill = _words(rng, rng.randint(1, 4)) + rng.choice(["", " ", ": {", "\n"])
    return [
        {"role": "user", "content": _words(rng, 3)},
        {"role": "assistant", "content": prefill},
    ], prefill


def _prompt_text(fake, i: int) -> str:
    return fake.tokenizer.decode(fake.prompts[i], skip_special_tokens=False)


def _check_cut(fake, i: int, messages: list[dict], prefill: str) -> None:
    """Request i's prompt is the finished rendering up to the prefill's end."""
    closed = ChatFormat(fake.tokenizer).render(
        messages_from_openai(messages), add_generation_prompt=False
    )
    text = _prompt_text(fake, i)
    assert text.endswith(prefill) and closed.text.startswith(text)
    assert closed.text[len(text) :] == "<|im_end|>\n"


def test_the_chat_route_continues_the_last_message(scripted_client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    messages, prefill = _history(rng)
    reply = _words(rng, rng.randint(1, 5))
    fake.replies = [(reply, "stop")] * 3
    flags = rng.choice([{}, {"add_generation_prompt": False}])
    body = {"messages": messages, "continue_final_message": True, **flags}
    r = client.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == reply and choice["finish_reason"] == "stop"
    _check_cut(fake, 0, messages, prefill)
    counted = client.post("/tokenize", json=body).json()
    assert counted["tokens"] == fake.prompts[0]
    assert r.json()["usage"]["prompt_tokens"] == counted["count"]

    # Without the flag the same history is a finished turn, and a new one opens after it.
    assert client.post(CHAT, json={"messages": messages}).status_code == 200
    assert _prompt_text(fake, 1).startswith(_prompt_text(fake, 0) + "<|im_end|>\n")

    # Streamed: the same continuation, delta by delta.
    r = client.post(CHAT, json={**body, "stream": True})
    chunks = [c for c in read_sse(r.text.splitlines()) if isinstance(c, dict)]
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert "".join(d for d in deltas if d) == reply
    assert fake.prompts[2] == fake.prompts[0]


def test_anthropic_continues_a_last_assistant_message(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    messages, prefill = _history(rng)
    reply = _words(rng, rng.randint(1, 5))
    fake.replies = [(reply, "stop")] * 3
    blocks = [{"role": "user", "content": [{"type": "text", "text": messages[0]["content"]}]},
              {"role": "assistant", "content": [{"type": "text", "text": prefill}]}]  # fmt: skip
    body = {"model": "freetoken/qwen3_moe", "max_tokens": 64, "messages": blocks}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["content"] == [{"type": "text", "text": reply}]
    assert whole["stop_reason"] == "end_turn"
    _check_cut(fake, 0, messages, prefill)
    counted = client.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    assert counted == whole["usage"]["input_tokens"] == len(fake.prompts[0])
    events = named_events(client.post("/v1/messages", json={**body, "stream": True}).text)
    streamed = reassemble(events)
    assert streamed["content"] == whole["content"]
    assert fake.prompts[1] == fake.prompts[0]
    # With thinking on it is refused, as Anthropic refuses it: the template would close the
    # prefilled turn's (empty) think block before the prefill, and no thinking would happen.
    thinking = rng.choice([{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}])
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        r = client.post(route, json={**body, "thinking": thinking})
        assert r.status_code == 400, r.text
        assert "prefilled" in r.json()["error"]["message"], r.json()
    r = client.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text


def test_what_cannot_be_continued_is_refused(client, api_error, rng_seed):
    rng = random.Random(rng_seed)
    messages, _ = _history(rng)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    cases = [
        ({"continue_final_message": True, "add_generation_prompt": True},
         "add_generation_prompt", "cannot both be true"),
        ({"add_generation_prompt": False}, "add_generation_prompt", "only with"),
        ({"continue_final_message": "yes"}, "continue_final_message", "true or false"),
        ({"continue_final_message": True, "messages": messages[:1]}, "messages[0]",
         "not the assistant's"),
        ({"continue_final_message": True, "response_format": schema}, "response_format",
         "cannot be constrained"),
    ]  # fmt: skip
    for change, param, says in cases:
        error = api_error(client.post(CHAT, json={"messages": messages, **change}), 400)
        assert error["param"] == param and says in error["message"], (change, error)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    called = [*messages[:1], {"role": "assistant", "content": None, "tool_calls": [call]}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": called, "tools": tools, "continue_final_message": True}
    error = api_error(client.post(CHAT, json=body), 400)
    assert error["param"] == "messages[1]" and "has tool calls" in error["message"]


def test_the_websocket_keeps_the_continued_message_whole(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    messages, prefill = _history(rng)
    reply = _words(rng, rng.randint(1, 5))
    fake.replies = [(reply, "stop")]
    with client.websocket_connect("/v1/sessions/s1/ws") as ws:
        ws.receive_json(), ws.receive_json()  # the session, the memory split
        ws.send_json({"type": "send", "messages": messages, "continue_final_message": True})
        while (event := ws.receive_json())["type"] != "done":
            pass
        assert event["finish_reason"] == "stop"
    _check_cut(fake, 0, messages, prefill)
    with client.websocket_connect("/v1/sessions/s1/ws") as ws:
        session = ws.receive_json()
    assert [(m["role"], m["content"]) for m in session["history"]] == [
        ("user", messages[0]["content"]),
        ("assistant", prefill + reply),
    ]


def test_a_prefill_ending_in_think_text_opens_no_block(client, engine, rng_seed):
    """A prefill whose text ends with `<think>` is content, encoded as characters (never the
    model's think token): the reply is content, as the thinking budget (by ids) reads it, not
    reasoning the budget never counts. The model's own `<think>` token is banned: a random
    model may write it first, which would open a block of its own."""
    rng = random.Random(rng_seed)
    prefill = _words(rng, 2) + " <think>" + rng.choice(["", "\n"])
    messages = [{"role": "user", "content": _words(rng, 3)},
                {"role": "assistant", "content": prefill}]  # fmt: skip
    body = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 12, "temperature": 0.8, "seed": rng.randrange(1 << 30),
            "thinking_token_budget": rng.randint(0, 3)}  # fmt: skip
    think_id = engine.tokenizer.token_to_id("<think>")
    body["logit_bias"] = {str(think_id): -100}
    out = client.post(CHAT, json=body).json()
    message = out["choices"][0]["message"]
    assert not message.get("reasoning_content") and message["content"], message
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0, out["usage"]
