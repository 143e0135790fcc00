"""tool_choice (named, required, none) and response_format through the OpenAI route.

Schemas are drawn fresh each run; the demo model's weights are random, so whatever JSON comes
out is the grammar's doing, and it must validate.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from random_schemas import random_name, random_object_schema


def random_tools(rng: random.Random, n: int) -> list[dict]:
    names = set()
    while len(names) < n:
        names.add(random_name(rng))
    return [
        {
            "type": "function",
            "function": {"name": name, "parameters": random_object_schema(rng)},
        }
        for name in sorted(names)
    ]


def _user(rng: random.Random) -> list[dict]:
    text = " ".join(random_name(rng) for _ in range(rng.randint(2, 6)))
    return [{"role": "user", "content": text}]


def test_named_tool_choice_forces_a_valid_call(client, rng_seed):
    rng = random.Random(rng_seed)
    tools = random_tools(rng, rng.randint(1, 3))
    chosen = rng.choice(tools)["function"]
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": _user(rng),
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": chosen["name"]}},
            "max_tokens": 120,
            "temperature": rng.choice([0, 0.8]),
            "seed": rng.randrange(2**31),
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["type"] == "function"
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == chosen["name"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), chosen["parameters"])


def test_required_tool_choice_streams_a_call_of_one_of_the_tools(client, read_sse, rng_seed):
    rng = random.Random(rng_seed)
    tools = random_tools(rng, 2)
    body = {
        "messages": _user(rng),
        "tools": tools,
        "tool_choice": "required",
        "max_tokens": 120,
        "temperature": 0,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = read_sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    pieces = [tc for e in events[:-2] for tc in e["choices"][0]["delta"].get("tool_calls") or []]
    first = pieces[0]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert {p["index"] for p in pieces} == {0}
    assert all("id" not in p for p in pieces[1:])  # the id comes once, on the first delta
    arguments = "".join(p["function"].get("arguments", "") for p in pieces)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    jsonschema.validate(json.loads(arguments), by_name[first["function"]["name"]])


@pytest.mark.parametrize("mode", ["named", "required"])
def test_a_forced_call_cut_by_max_tokens_is_the_model_s_text_alone(
    client, read_sse, rng_seed, mode
):
    """The server writes the call's opener into the prompt and closes the block for the parser;
    a call cut short is content, and that content is only what the model wrote (no markup),
    streamed or not."""
    rng = random.Random(rng_seed)
    tools = random_tools(rng, rng.randint(1, 3))
    names = [t["function"]["name"] for t in tools]
    name = rng.choice(names)
    choice = {"type": "function", "function": {"name": name}} if mode == "named" else "required"
    body = {
        "messages": _user(rng),
        "tools": tools,
        "tool_choice": choice,
        "max_tokens": rng.randint(1, 8),  # far from a whole call
        "temperature": 0,
    }
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]
    assert reply["finish_reason"] == "length" and "tool_calls" not in reply["message"]
    content = reply["message"]["content"]
    openings = [f'{{"name": "{n}", "arguments": {{' for n in names]
    assert any(o.startswith(content) or content.startswith(o) for o in openings), content
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = read_sse(list(r.iter_lines()))
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert not any("tool_calls" in d for d in deltas)


def test_tool_choice_none_parses_no_calls(client, rng_seed):
    rng = random.Random(rng_seed)
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": _user(rng),
            "tools": random_tools(rng, 1),
            "tool_choice": "none",
            "max_tokens": 6,
            "temperature": 0,
        },
    )
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_response_format_gives_valid_json(client, rng_seed, kind):
    rng = random.Random(rng_seed)
    schema = random_object_schema(rng)
    fmt = (
        {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
        if kind == "json_schema"
        else {"type": "json_object"}
    )
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": _user(rng),
            "response_format": fmt,
            "max_tokens": 200,
            "temperature": 0,
            # (the demo's template reasons first: a budget makes the random model answer)
            "thinking_token_budget": rng.randint(0, 8),
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["message"]["content"]
    if kind == "json_object" and choice["finish_reason"] == "length":
        # Any object is allowed, so a random model may go on adding keys until max_tokens.
        assert content.startswith("{")
        return
    assert choice["finish_reason"] == "stop"
    value = json.loads(content)
    if kind == "json_schema":
        jsonschema.validate(value, schema)
    else:
        assert isinstance(value, dict)


def test_forced_call_and_response_format_together_are_refused(client, rng_seed):
    rng = random.Random(rng_seed)
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": _user(rng),
            "tools": random_tools(rng, 1),
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_forced_call_parser_closes_an_open_think_block(rng_seed):
    """A thinking-mode prompt gets `</think>` before the call opener: the parser, fed the same
    suffix, yields the call and no reasoning or content, however the output is chunked."""
    from freetoken_agent.integrations.server.tool_choice import ForcedCallParser
    from freetoken_agent.parsers import OutputParser, ToolCallEnd, coalesce

    rng = random.Random(rng_seed)
    args = {random_name(rng): rng.randint(-9, 99) for _ in range(rng.randint(1, 3))}
    text = json.dumps({"name": "f", "arguments": args})
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 5)))
    parser = ForcedCallParser(OutputParser("hermes", True, None), "</think>\n\n<tool_call>\n")
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += parser.feed(text[a:b])
    events = coalesce(events + parser.finish())
    assert [type(e).__name__ for e in events] == [
        "ToolCallStart",
        "ToolCallArgsDelta",
        "ToolCallEnd",
    ]
    assert isinstance(events[-1], ToolCallEnd) and events[-1].arguments == args
    assert json.loads(events[1].text) == args


def test_a_forced_call_cut_inside_a_string_naming_the_closer_is_the_model_s_text(rng_seed):
    """Cut by max_tokens inside a string argument that mentions `</tool_call>`: the content
    is what the model wrote and nothing more (the server's own closer, fed after the cut,
    closed the block at the string's tag and came out as content), however it is chunked."""
    from freetoken_agent.integrations.server.tool_choice import ForcedCallParser
    from freetoken_agent.parsers import ContentDelta, OutputParser, ToolCallEnd

    rng = random.Random(rng_seed)
    said = random_name(rng) + " </tool_call> " + random_name(rng)
    text = json.dumps({"name": "f", "arguments": {"text": said}})[: -rng.randint(3, 6)]
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 5)))
    parser = ForcedCallParser(OutputParser("hermes", False, None), "<tool_call>\n")
    events = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        events += parser.feed(text[a:b])
    events += parser.finish()
    assert not any(isinstance(e, ToolCallEnd) for e in events)
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)) == text


def test_a_forced_call_holds_only_the_tools_parameters(client, rng_seed):
    """A tool's parameters that do not say whether other keys may come: the forced call's
    schema is closed (as ChatFreeToken's and a call-or-answer's), so the arguments hold the
    declared keys only (the random model would otherwise add keys until max_tokens)."""
    rng = random.Random(rng_seed)
    keys = [f"k{i}" for i in range(rng.randint(1, 3))]
    params = {
        "type": "object",
        "properties": {k: {"type": "integer", "minimum": 0, "maximum": 9} for k in keys},
    }
    tools = [{"type": "function", "function": {"name": "pick", "parameters": params}}]
    for _ in range(3):
        body = {"messages": _user(rng), "tools": tools, "tool_choice": "required",
                "max_tokens": 60, "temperature": 1.0, "seed": rng.randrange(2**31),
                "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
        choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        arguments = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
        assert set(arguments) <= set(keys), arguments
