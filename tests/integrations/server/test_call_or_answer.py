"""Tools with tool_choice "auto" and a JSON response_format (what the OpenAI Agents SDK sends on
every turn): the output is one call of a tool or the answer, and the reply says which.

The scripted engine answers with chosen texts (a valid call, or a valid answer), so the reading
of each is checked exactly; the demo model (random weights, greedy) shows that whatever the
grammar lets out reads as one of the two. Tools and schemas are drawn fresh each run.
"""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from held_schema import held_schema
from random_schemas import random_instance, random_name, random_object_schema

from freetoken_agent.integrations.server.tool_choice import ToolChoice, parser_factory
from freetoken_agent.parsers import ContentDelta, ReasoningDelta, ToolCallEnd

URL = "/v1/chat/completions"
CALL_KEYS = ("name", "arguments")  # an answer with a call's keys is a call


def _name(rng: random.Random) -> str:
    return random_name(rng, CALL_KEYS)


def _object_schema(rng: random.Random) -> dict[str, Any]:
    return random_object_schema(rng, CALL_KEYS)


def _answer_schema(rng: random.Random) -> dict[str, Any]:
    """An object schema; at times with a nested one behind a $ref, as pydantic writes them."""
    schema = _object_schema(rng)
    if rng.random() < 0.5:
        key, item = _name(rng), _name(rng).capitalize()
        while key in schema["properties"]:
            key = _name(rng)
        ref = {"$ref": f"#/$defs/{item}"}
        nested = rng.choice([ref, {"type": "array", "items": ref, "maxItems": rng.randint(1, 2)}])
        schema["properties"][key] = nested
        schema["required"].append(key)
        schema["$defs"] = {item: _object_schema(rng)}
    return schema


def _tools(rng: random.Random) -> list[dict]:
    names: set[str] = set()
    count = rng.randint(1, 3)
    while len(names) < count:
        names.add(_name(rng))
    tools = []
    for name in sorted(names):
        fn: dict[str, Any] = {"name": name, "description": " ".join(_name(rng) for _ in "ab")}
        if rng.random() < 0.8:  # else a tool without parameters: it takes {}
            fn["parameters"] = _object_schema(rng)
        tools.append({"type": "function", "function": fn})
    return tools


def _call(rng: random.Random, tools: list[dict]) -> dict[str, Any]:
    fn = rng.choice(tools)["function"]
    params = fn.get("parameters")
    return {"name": fn["name"], "arguments": random_instance(rng, params, params) if params else {}}


def _format(rng: random.Random, kind: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the answer's schema, the response_format asking for it)."""
    if kind == "json_object":
        return {"type": "object"}, {"type": "json_object"}
    schema = _answer_schema(rng)
    return schema, {"type": "json_schema", "json_schema": {"name": _name(rng), "schema": schema}}


def _answer(rng: random.Random, schema: dict[str, Any]) -> Any:
    """A random answer valid against `schema` (json_object's: some object of scalars)."""
    return random_instance(rng, schema if "properties" in schema else _object_schema(rng), schema)


def _body(
    rng: random.Random, tools: list[dict], fmt: dict[str, Any], thinking: bool = False
) -> dict[str, Any]:
    """A request for a call or the answer; `thinking`: in the demo template's thinking mode,
    where the JSON follows the reasoning (integrations/reasoned_json.py), else with it off."""
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": " ".join(_name(rng) for _ in range(4))}],
        "tools": tools,
        "response_format": fmt,
        "max_tokens": 300,
        "temperature": 0,
    }
    if rng.random() < 0.5:
        body["tool_choice"] = "auto"  # the default with tools
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    return body


def _outcome(finish: str, content: str | None, calls: list[dict]) -> tuple:
    """(finish_reason, content, [(name, arguments)]): what a reply says, ids aside."""
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls), calls
    pairs = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
    return finish, content or None, pairs


def _ask(client, read_sse, body: dict[str, Any], reasoning: str | None = None) -> tuple:
    """The outcome of `body` non-streamed, checked equal to the streamed one's; the reasoning,
    streamed or not, checked equal to `reasoning` where given."""
    r = client.post(URL, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    whole = _outcome(choice["finish_reason"], message["content"], message.get("tool_calls", []))
    assert whole[2] or message["content"] is not None, message
    with client.stream("POST", URL, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = read_sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-2]]
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    # A call goes out whole, in one delta: id, name and all of its arguments.
    assert [c["index"] for c in calls] == list(range(len(calls)))
    content = "".join(d.get("content") or "" for d in deltas)
    streamed = _outcome(events[-2]["choices"][0]["finish_reason"], content, calls)
    assert streamed == whole
    if reasoning is not None:
        assert (message.get("reasoning_content") or "") == reasoning, message
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == reasoning
    return whole


def _is_call_of(value: Any, tools: list[dict]) -> bool:
    names = {t["function"]["name"] for t in tools}
    return (
        isinstance(value, dict)
        and set(value) == {"name", "arguments"}
        and value["name"] in names
        and isinstance(value["arguments"], dict)
    )


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_a_call_or_the_answer_comes_back_as_such(scripted_client, read_sse, rng_seed, kind):
    """The engine is asked for "a call of a tool or the answer", and what it writes is read as
    what it is: the call as tool_calls (finish "tool_calls"), the answer as content ("stop").
    With thinking on, the JSON follows the reasoning, which comes back as reasoning_content."""
    fake, client = scripted_client
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    schema, fmt = _format(rng, kind)
    call = _call(rng, tools)
    answer = _answer(rng, schema)
    thinking = rng.random() < 0.5
    body = _body(rng, tools, fmt, thinking)
    thought = " ".join(_name(rng) for _ in range(3)) if thinking else ""
    for value in rng.sample([call, answer], 2):
        text = json.dumps(value, ensure_ascii=False)
        written = thought + "\n</think>\n\n" + text if thinking else text
        fake.replies = [(written, "stop"), (written, "stop")]
        finish, content, calls = _ask(client, read_sse, body, reasoning=thought)
        if value is call:
            assert (finish, content, calls) == ("tool_calls", None, [tuple(call.values())])
        else:
            assert (finish, content, calls) == ("stop", text, [])
    assert len(fake.samplings) == 4
    for sampling in fake.samplings:
        assert sampling.response_format is None
        assert (sampling.grammar is not None) == thinking  # the schema after the reasoning
        jsonschema.validate(call, held_schema(sampling))
        jsonschema.validate(answer, held_schema(sampling))


def test_the_grammar_lets_out_a_call_or_the_answer(engine, client, read_sse, rng_seed, monkeypatch):
    """Greedy, on the demo model, with each kind of response_format, thinking on (a budget
    ends the random model's reasoning) or off: whatever the output, it reads as a valid call
    of one of the tools or a valid answer, the same streamed or not."""
    rng = random.Random(rng_seed)
    samplings = []
    submit = engine.submit

    def recording(prompt, sampling, **options):
        samplings.append(sampling)
        return submit(prompt, sampling, **options)

    monkeypatch.setattr(engine, "submit", recording)
    for kind in rng.sample(["json_schema", "json_object"], 2):
        samplings.clear()
        tools = _tools(rng)
        schema, fmt = _format(rng, kind)
        thinking = rng.random() < 0.5
        body = _body(rng, tools, fmt, thinking)
        if thinking:
            body["thinking_token_budget"] = rng.randint(0, 8)
        finish, content, calls = _ask(client, read_sse, body)
        if finish == "tool_calls":
            assert content is None and len(calls) == 1
            name, arguments = calls[0]
            fn = next(t["function"] for t in tools if t["function"]["name"] == name)
            jsonschema.validate(arguments, fn.get("parameters") or {"maxProperties": 0})
        elif finish == "length":  # any object is an answer: a random model may add keys forever
            assert kind == "json_object" and content.startswith("{") and not calls
        else:
            assert finish == "stop" and not calls
            value = json.loads(content)
            jsonschema.validate(value, schema)
            assert not _is_call_of(value, tools), "a call of a tool came back as the answer"
        # The grammar was given both: each tool's calls and the answer are among what it
        # allows. (json_object's answer allows every object, calls too: there only the
        # reading tells them apart, which the scripted test above checks.)
        assert len(samplings) == 2
        for sampling in samplings:
            for tool in tools:
                jsonschema.validate(_call(rng, [tool]), held_schema(sampling))
            jsonschema.validate(_answer(rng, schema), held_schema(sampling))


def test_tool_choice_none_leaves_the_answer_schema_alone(scripted_client, read_sse, rng_seed):
    """With tool_choice "none" the response_format's schema is the only constraint, and a
    call-shaped answer is the answer (thinking off: the schema alone, from the first token;
    with thinking on it follows the reasoning, test_reasoning_clients.py)."""
    fake, client = scripted_client
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    schema, fmt = _format(rng, "json_schema")
    text = json.dumps(_call(rng, tools))
    fake.replies = [(text, "stop"), (text, "stop")]
    body = {**_body(rng, tools, fmt), "tool_choice": "none"}  # (thinking off)
    assert _ask(client, read_sse, body) == ("stop", text, [])
    assert [s.json_schema for s in fake.samplings] == [schema, schema]


@pytest.mark.parametrize("kind", ["json_schema", "json_object"])
def test_a_forced_call_with_a_response_format_is_still_refused(client, api_error, rng_seed, kind):
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    forced = rng.choice(
        ["required", {"type": "function", "function": {"name": _call(rng, tools)["name"]}}]
    )
    body = {**_body(rng, tools, _format(rng, kind)[1]), "tool_choice": forced}
    body["stream"] = rng.choice([True, False])
    error = api_error(client.post(URL, json=body), 400)
    assert error["param"] == "response_format", error


def test_an_unresolvable_ref_names_its_field(client, api_error, rng_seed):
    """The answer and the tools' parameters are nested in one schema, so each one's $refs are
    inlined first; one that points nowhere is a 400 naming where it is."""
    rng = random.Random(rng_seed)
    for field in rng.sample(["response_format", "tools"], 2):
        tools = _tools(rng)
        schema, fmt = _format(rng, "json_schema")
        broken = {"type": "object", "properties": {"x": {"$ref": f"#/$defs/{_name(rng)}"}}}
        at = rng.randrange(len(tools))
        if field == "tools":
            tools[at]["function"]["parameters"] = broken
        else:
            fmt["json_schema"]["schema"] = broken
        error = api_error(client.post(URL, json=_body(rng, tools, fmt)), 400)
        assert error["param"] == (f"tools[{at}]" if field == "tools" else field), error


def test_a_call_or_answer_turn_closes_an_open_think_block(engine, rng_seed):
    """The grammar starts at the first token: a prompt that leaves `<think>` open gets its
    closer as a suffix, and the parser, starting past it, reads a call or the answer (never
    reasoning), however the output is chunked."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    call = _call(rng, tools)
    schema = _answer_schema(rng)
    answer = _answer(rng, schema)
    for value, thinking in [(call, True), (answer, True), (call, False)]:
        turn = SimpleNamespace(suffix_ids=None)
        factory = parser_factory(ToolChoice("auto"), tools, engine, turn, True)
        end = "<|im_start|>assistant\n" + ("<think>\n" if thinking else "")
        rendered = "<|im_start|>user\nhi<|im_end|>\n" + end  # its `<think>`: the token
        ids = engine.tokenizer.encode(rendered)
        parser = factory(SimpleNamespace(text=rendered, token_ids=ids))
        closer = engine.tokenizer.encode("</think>\n\n") if thinking else []
        assert turn.suffix_ids == closer
        text = json.dumps(value)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 5))))
        events = []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            events += parser.feed(text[a:b])
        events += parser.finish()
        assert not any(isinstance(e, ReasoningDelta) and e.text for e in events)
        ends = [e for e in events if isinstance(e, ToolCallEnd)]
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        if value is call:
            assert [(e.name, dict(e.arguments)) for e in ends] == [tuple(call.values())]
            assert content == ""
        else:
            assert not ends and content == text
