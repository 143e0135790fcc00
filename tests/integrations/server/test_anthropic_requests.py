"""POST /v1/messages and /v1/messages/count_tokens: what a request is read as, and refused as.

The translation is checked against the chat route: an Anthropic history and its OpenAI
equivalent, written out by hand here, must reach the engine as the same prompt token for
token (the scripted engine records every prompt). Refusals must come in Anthropic's error
shape, naming Anthropic's fields, and so must the middleware's (key, size) and Starlette's.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest
from random_schemas import random_instance, random_name, random_object_schema

URL = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
CHAT = "/v1/chat/completions"


def _text(rng: random.Random, n: int = 3) -> str:
    return " ".join(random_name(rng) for _ in range(n))


def anthropic_error(response: Any, status: int, kind: str) -> str:
    """The response is Anthropic's error object, exactly; returns its message."""
    assert response.status_code == status, (response.status_code, response.text[:300])
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"], body
    return body["error"]["message"]


def histories(rng: random.Random, long: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(an Anthropic body, the OpenAI chat body it means), every block kind in them. Short:
    the history ends with the tool results, so the template renders the calls' reasoning."""
    tools = [{"name": random_name(rng) + str(i), "input_schema": random_object_schema(rng)}
             for i in range(2)]  # fmt: skip
    calls = [(f"toolu_{rng.getrandbits(48):x}", t["name"], random_instance(rng, t["input_schema"]))
             for t in tools]  # fmt: skip
    system = [_text(rng) for _ in range(rng.randint(1, 3))]
    question, thought, said = _text(rng), _text(rng, 5), _text(rng)
    results = [[_text(rng, 2) for _ in range(rng.randint(1, 2))] for _ in calls]
    order = rng.sample(range(2), 2)  # results in any order: both sides put them in call order
    anthropic_results = [
        {"type": "tool_result", "tool_use_id": calls[i][0],
         "content": results[i][0] if len(results[i]) == 1 and rng.random() < 0.5
         else [{"type": "text", "text": t} for t in results[i]]}
        | ({"is_error": True} if rng.random() < 0.3 else {})
        for i in order
    ]  # fmt: skip
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": "c2ln"},
            {"type": "text", "text": said},
            *[{"type": "tool_use", "id": i, "name": n, "input": a} for i, n, a in calls],
        ]},
        {"role": "user", "content": anthropic_results},
    ]  # fmt: skip
    chat: list[dict[str, Any]] = [
        {"role": "system", "content": "\n".join(system)},
        {"role": "user", "content": question},
        {"role": "assistant", "content": said, "reasoning_content": thought, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, n, a in calls
        ]},
        *[{"role": "tool", "tool_call_id": calls[i][0], "content": "\n".join(results[i])}
          for i in order],
    ]  # fmt: skip
    if long:  # text after the results (a user message of its own), then another exchange
        after, answer, parts = _text(rng), _text(rng), [_text(rng) for _ in range(2)]
        messages[-1]["content"].append({"type": "text", "text": after})
        messages += [
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "eA=="},
                                              {"type": "text", "text": answer}]},
            {"role": "user", "content": [{"type": "text", "text": p} for p in parts]},
        ]  # fmt: skip
        chat += [
            {"role": "user", "content": after},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "\n".join(parts)},
        ]
    anthropic = {
        "max_tokens": 8,
        "system": [{"type": "text", "text": s, "cache_control": {"type": "ephemeral"}}
                   for s in system],
        "messages": messages,
        "tools": [{**t, "description": _text(rng)} for t in tools],
    }  # fmt: skip
    openai_tools = [{"type": "function", "function": {"name": t["name"],
                     "description": t["description"], "parameters": t["input_schema"]}}
                    for t in anthropic["tools"]]  # fmt: skip
    return anthropic, {"max_tokens": 8, "messages": chat, "tools": openai_tools}


@pytest.mark.parametrize("long", [False, True])
def test_every_block_kind_gives_the_chat_routes_prompt(scripted_client, rng_seed, long):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    fake.replies = [("ok", "stop")] * 2
    anthropic, chat = histories(rng, long)
    usage = client.post(URL, json=anthropic).json()["usage"]
    prompt_tokens = client.post(CHAT, json=chat).json()["usage"]["prompt_tokens"]
    assert fake.prompts[0] == fake.prompts[1], fake.tokenizer.decode(fake.prompts[0])
    text = fake.tokenizer.decode(fake.prompts[0], skip_special_tokens=False)
    if not long:  # the calls' reasoning is rendered: the thinking block was read
        assert anthropic["messages"][1]["content"][0]["thinking"] in text
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt_tokens
    assert client.post(COUNT, json=anthropic).json() == {"input_tokens": prompt_tokens}
    tokenized = client.post(
        "/tokenize", json={"messages": chat["messages"], "tools": chat["tools"]}
    )
    assert tokenized.json()["count"] == prompt_tokens


def test_system_as_a_string_or_text_blocks(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    parts = [_text(rng) for _ in range(rng.randint(1, 3))]
    user = [{"role": "user", "content": _text(rng)}]
    fake.replies = [("ok", "stop")] * 4
    blocks = [{"type": "text", "text": p} for p in parts]
    for system in ("\n".join(parts), blocks):
        client.post(URL, json={"max_tokens": 4, "system": system, "messages": user})
    client.post(CHAT, json={"messages": [{"role": "system", "content": "\n".join(parts)}, *user]})
    client.post(URL, json={"max_tokens": 4, "messages": user})  # no system prompt
    assert fake.prompts[0] == fake.prompts[1] == fake.prompts[2] != fake.prompts[3]


def test_thinking_switches_the_templates_enable_thinking(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": _text(rng)}]}
    thinking = [None, {"type": "enabled", "budget_tokens": rng.randint(1024, 4096)},
                {"type": "adaptive"}, {"type": "disabled"}]  # fmt: skip
    fake.replies = [("ok", "stop")] * 5
    counts = []
    for value in thinking:
        sent = body if value is None else {**body, "thinking": value}
        assert client.post(URL, json=sent).status_code == 200
        counts.append(client.post(COUNT, json=sent).json()["input_tokens"])
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    client.post(CHAT, json={"messages": body["messages"], **kwargs})
    prompts = [fake.tokenizer.decode(p, skip_special_tokens=False) for p in fake.prompts]
    # The demo template closes an empty think block when thinking is off (Qwen3's way).
    assert prompts[0] == prompts[1] == prompts[2] and not prompts[0].endswith("</think>\n\n")
    assert prompts[3].endswith("<think>\n\n</think>\n\n") and fake.prompts[3] == fake.prompts[4]
    assert counts == [len(p) for p in fake.prompts[:4]]


def test_count_tokens_is_the_prompt_a_message_gets(client, rng_seed):
    rng = random.Random(rng_seed)
    tools = [{"name": random_name(rng), "input_schema": random_object_schema(rng)}]
    body = {"system": _text(rng), "messages": [{"role": "user", "content": _text(rng, 6)}]}
    if rng.random() < 0.5:
        body["tools"] = tools
    counted = client.post(COUNT, json=body)
    assert counted.status_code == 200 and set(counted.json()) == {"input_tokens"}
    usage = client.post(URL, json={**body, "max_tokens": 1}).json()["usage"]
    assert (
        counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"]
    )
    assert usage["cache_read_input_tokens"] == 0  # a fresh engine: all of it computed
    message = anthropic_error(client.post(COUNT, json={**body, "model": "other"}), 404,
                              "not_found_error")  # fmt: skip
    assert "'other'" in message


def _refusals(rng: random.Random) -> list[tuple[dict, int, str, list[str]]]:
    """(body changes, status, error type, what the message must say)."""
    name = random_name(rng)
    tool = {"name": name, "input_schema": {"type": "object"}}
    user = {"role": "user", "content": "hi"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    document = {"type": "document", "source": {"type": "text", "data": "x"}}
    server_tool = rng.choice(["web_search_20250305", "bash_20250124", "text_editor_20250728"])
    return [
        ({"max_tokens": None}, 400, "invalid_request_error", ["max_tokens", "required"]),
        ({"model": "claude-" + name}, 404, "not_found_error", [f"'claude-{name}'"]),
        ({"messages": [user, {"role": "assistant", "content": "ok"},
                       {"role": "user", "content": [{"type": "text", "text": "see"}, image]}]},
         400, "invalid_request_error",
         ["messages[2].content[1]: image blocks are not supported"]),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [document]}]}]},
         400, "invalid_request_error",
         ["messages[0].content[0].content[0]: document blocks are not supported"]),
        ({"tools": [tool, {"type": server_tool, "name": "x"}]}, 400, "invalid_request_error",
         ["tools[1]", server_tool, "runs no tools"]),
        ({"tools": [tool], "tool_choice": {"type": "required"}}, 400, "invalid_request_error",
         ["tool_choice must be"]),
        ({"tools": [tool], "tool_choice": {"type": "tool", "name": name + "x"}}, 400,
         "invalid_request_error", ["tool_choice", repr(name + "x")]),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error",
         ["tool_choice 'any' needs at least one tool"]),
        ({"tools": [{"name": name, "input_schema": {"type": "array"}}]}, 400,
         "invalid_request_error", ["tools[0].input_schema must be an object schema"]),
        ({"stop_sequences": ["ok", ""]}, 400, "invalid_request_error", ["stop_sequences"]),
        ({"temperature": 3}, 400, "invalid_request_error", ["temperature"]),
        ({"thinking": {"type": "on"}}, 400, "invalid_request_error", ["thinking must be"]),
        ({"metadata": "me"}, 400, "invalid_request_error", ["metadata must be an object"]),
        # A prefilled reply is continued, but only from text (not from a call).
        ({"tools": [tool], "messages": [user, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_" + name, "name": name, "input": {}}]}]}, 400,
         "invalid_request_error", ["messages[1] (assistant)", "has tool calls"]),
        ({"tools": [tool], "tool_choice": {"type": "any"},
          "messages": [user, {"role": "assistant", "content": "Sure, "}]}, 400,
         "invalid_request_error", ["forced tool call", "tool_choice"]),
        # The shared check names the translated history's message 3 (after the system
        # prompt and the user's text): the refusal names the Anthropic message it came from.
        ({"system": "s", "messages": [user, {"role": "user", "content": [
            {"type": "text", "text": "and"},
            {"type": "tool_result", "tool_use_id": "toolu_" + name, "content": "r"}]}]}, 400,
         "invalid_request_error", ["messages[1] (tool_result)", f"'toolu_{name}'",
                                   "matches no earlier call"]),
        ({"messages": [{"role": "system", "content": "hi"}]}, 400, "invalid_request_error",
         ["messages[0].role must be 'user' or 'assistant'"]),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, 400,
         "invalid_request_error", ["output_config.format is not supported"]),
        # A strict tool's schema the grammar cannot take: the client's 400 (it was a 500,
        # which SDKs retry), naming Anthropic's field once.
        ({"tools": [tool, {"name": name + "s", "strict": True, "input_schema": {
            "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}]}, 400,
         "invalid_request_error", ["tools[1].input_schema: a strict tool's schema"]),
        ({"thinking": {"type": "enabled", "budget_tokens": -rng.randint(1, 99)}}, 400,
         "invalid_request_error", ["thinking.budget_tokens must be a non-negative integer"]),
    ]  # fmt: skip


def test_refusals_are_anthropic_errors_naming_anthropic_fields(client, rng_seed):
    rng = random.Random(rng_seed)
    base = {"model": "freetoken/qwen3_moe", "max_tokens": 8,
            "messages": [{"role": "user", "content": _text(rng)}]}  # fmt: skip
    for change, status, kind, says in _refusals(rng):
        body = {k: v for k, v in {**base, **change}.items() if v is not None}
        for stream in (False, True):  # refused before a stream starts: the same answer
            message = anthropic_error(client.post(URL, json={**body, "stream": stream}), status,
                                      kind)  # fmt: skip
            assert all(s in message for s in says), (change, message)
            assert "function.parameters" not in message, message  # OpenAI's name, left over
        if "tools" in change and status == 400:  # count_tokens reads the tools alike
            counted = {k: v for k, v in body.items() if k != "max_tokens"}
            message = anthropic_error(client.post(COUNT, json=counted), status, kind)
            assert all(s in message for s in says), (change, message)
    bad_json = client.post(URL, content=b"{", headers={"content-type": "application/json"})
    assert "not valid JSON" in anthropic_error(bad_json, 400, "invalid_request_error")


def test_keys_come_as_x_api_key_or_bearer(make_client, rng_seed):
    rng = random.Random(rng_seed)
    key = f"sk-{rng.getrandbits(64):x}"
    client = make_client(api_key=key)
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({"x-api-key": key}, {"Authorization": f"Bearer {key}"}):
        assert client.post(URL, json=body, headers=headers).status_code == 200, headers
        assert client.post(COUNT, json=body, headers=headers).status_code == 200, headers
        chat = client.post(CHAT, json=body, headers=headers)
        assert chat.status_code == 200, headers
    # The SDK sends both headers when it has both an api_key and an auth_token: either counts.
    for headers in ({"x-api-key": key, "Authorization": "Bearer other"},
                    {"x-api-key": "other", "Authorization": f"Bearer {key}"}):  # fmt: skip
        assert client.post(URL, json=body, headers=headers).status_code == 200, headers
    for headers in ({}, {"x-api-key": key + "x"}, {"Authorization": f"Bearer {key[:-1]}"}):
        message = anthropic_error(client.post(URL, json=body, headers=headers), 401,
                                  "authentication_error")  # fmt: skip
        assert ("x-api-key" in message) == (headers == {}), message
        # The OpenAI routes keep OpenAI's error object.
        assert client.post(CHAT, json=body, headers=headers).json()["error"]["code"] == (
            "invalid_api_key"
        )


def test_the_servers_own_refusals_are_anthropic_errors_there(make_client):
    client = make_client(max_body_bytes=2000)
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": "x" * 3000}]}
    anthropic_error(client.post(URL, json=body), 413, "request_too_large")
    anthropic_error(client.get(URL), 405, "invalid_request_error")
    anthropic_error(client.post(URL + "/batches", json={}), 404, "not_found_error")
    foreign = client.post(URL, json={}, headers={"Origin": "https://evil.example"})
    anthropic_error(foreign, 403, "permission_error")
    assert client.post(CHAT, json=body).json()["error"]["code"] == "request_too_large"


def test_an_x_session_id_keeps_its_session_as_the_chat_route_does(client, rng_seed):
    rng = random.Random(rng_seed)
    hub = client.app.state.server.hub
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": _text(rng)}]}
    client.post(URL, json=body)
    assert len(hub) == 0  # no id: a fresh Session, not kept
    sid = random_name(rng)
    for _ in range(2):
        assert client.post(URL, json=body, headers={"X-Session-Id": sid}).status_code == 200
    assert len(hub) == 1 and hub.get(sid).turns == 2
    bad = client.post(URL, json=body, headers={"X-Session-Id": "no spaces"})
    assert "session id" in anthropic_error(bad, 400, "invalid_request_error")


def test_a_history_over_the_context_is_a_prompt_too_long(client, rng_seed):
    rng = random.Random(rng_seed)
    long = " ".join(random_name(rng) for _ in range(1500))  # past the test engine's 1024
    body = {"max_tokens": 4, "messages": [{"role": "user", "content": long}]}
    for stream in (False, True):
        r = client.post(URL, json={**body, "stream": stream})
        message = anthropic_error(r, 400, "invalid_request_error")
        assert message.startswith("prompt is too long: "), message
        # Anthropic's counts, which agents read to compact: "N tokens > M maximum"
        counts = re.match(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
        assert counts is not None and int(counts[1]) > int(counts[2]) == 1023, message
    assert client.post(COUNT, json=body).json()["input_tokens"] > 1024  # counted, not refused
