"""POST /v1/responses (OpenAI's Responses API, responses_*.py): the same turn as the chat route,
written as Responses items and events.

- OpenAI's own SDK against a real server (the demo model): a forced call, its output sent back
  as function_call / function_call_output items, the answer; whole and streamed the same reply
  (greedy), the stream read by the SDK's own event models.
- A scripted engine writes reasoning, text and calls (the demo model writes none of its own):
  the items come in order, and the stream's events, folded back, give the whole response.
- Items give the chat route's prompt: the same history sent both ways renders the same tokens.
- Refusals name the Responses field (input[i], max_output_tokens, tools[i]).
Texts, tools and schemas are drawn fresh each run.
"""

from __future__ import annotations

import json
import random
from typing import Any

import jsonschema
import openai
import pytest
from anthropic_stream import named_events
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from random_schemas import random_instance, random_name, random_object_schema

URL = "/v1/responses"
EVENT = TypeAdapter(ResponseStreamEvent)
MODEL = "freetoken-demo"
KEY = "sk-local-test"
WORDS = ["alpha", "beta", "café", "ka", "lo", "mi", "ru", "line\nbreak", "x,", "{a:", "日本"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(model_dir, model_id=MODEL, api_key=KEY)


def _sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _both(client: openai.OpenAI, **request: Any):
    """(the whole response, the streamed one as the SDK's stream gives it at the end)."""
    whole = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"], kinds
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        # (The SDK rebuilds a completed response only; an incomplete one is the event's.)
        done = kinds[-1] == "response.completed"
        streamed = stream.get_final_response() if done else events[-1].response
    return whole, streamed


def _same(whole, streamed) -> None:
    """One reply both ways, but for the ids drawn per response, item and call."""

    def plain(response) -> dict:
        out = response.model_dump(exclude={"id", "created_at", "usage"})
        for item in out["output"]:
            item.pop("id", None)
            item.pop("call_id", None)
            item.pop("parsed_arguments", None)  # the stream's parsed form only
        return out

    assert plain(whole) == plain(streamed)
    assert whole.usage.output_tokens == streamed.usage.output_tokens


def test_sdk_forced_call_then_its_output_whole_and_streamed(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    client = _sdk(server)
    schema = random_object_schema(rng)
    tool = {"type": "function", "name": random_name(rng), "parameters": schema,
            "description": _words(rng, 4)}  # fmt: skip
    request: dict[str, Any] = {
        "model": MODEL,
        "instructions": random_name(rng),
        "input": [{"role": "user", "content": _words(rng, 5)}],
        "tools": [tool],
        "tool_choice": {"type": "function", "name": tool["name"]},
        "temperature": 0,
        "max_output_tokens": 200,
    }
    whole, streamed = _both(client, **request)
    _same(whole, streamed)
    assert whole.status == "completed", whole
    (call,) = [item for item in whole.output if item.type == "function_call"]
    assert call.name == tool["name"] and call.call_id
    jsonschema.validate(json.loads(call.arguments), schema)

    result = _words(rng, 3)
    request["input"] = [
        *request["input"],
        *[item.model_dump() for item in whole.output],  # the SDK's items, sent back as given
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    request["tool_choice"] = "none"
    request["max_output_tokens"] = n = rng.randint(4, 12)
    answer, streamed_answer = _both(client, **request)
    _same(answer, streamed_answer)
    assert [item.type for item in answer.output] in (["message"], [])
    assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens <= n
    if answer.status == "incomplete":
        assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text == "".join(
        part.text for item in answer.output for part in item.content
    )
    # The second prompt starts with the first's: the prefix cache served it.
    assert answer.usage.input_tokens_details.cached_tokens > 0
    nothing_held(server.state.service)


def test_sdk_input_tokens_count_is_the_responses_input(server, rng_seed):
    """client.responses.input_tokens.count: the input tokens a response to the same body
    takes (its usage: input_tokens), with instructions, tools and a forced call's opener, and
    after a previous response; an unknown previous_response_id is a 400 naming it."""
    rng = random.Random(rng_seed)
    client = _sdk(server)
    tool = {"type": "function", "name": random_name(rng), "description": _words(rng, 3),
            "parameters": random_object_schema(rng)}  # fmt: skip
    previous = None
    for _ in range(3):
        request: dict[str, Any] = {"model": MODEL, "input": _words(rng, rng.randint(1, 30))}
        if rng.random() < 0.7:
            request["instructions"] = _words(rng, rng.randint(1, 9))
        if rng.random() < 0.7:
            choice = rng.choice(["auto", "required", {"type": "function", "name": tool["name"]}])
            request |= {"tools": [tool], "tool_choice": choice}
        if previous is not None:
            request["previous_response_id"] = previous
        counted = client.responses.input_tokens.count(**request)
        assert counted.object == "response.input_tokens"
        response = client.responses.create(**request, max_output_tokens=rng.randint(1, 4),
                                           temperature=0)  # fmt: skip
        assert counted.input_tokens == response.usage.input_tokens, request
        previous = response.id
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.input_tokens.count(model=MODEL, input="x", previous_response_id="r_0")


def test_sdk_text_format_json_schema(server, rng_seed):
    rng = random.Random(rng_seed)
    schema = random_object_schema(rng)
    response = _sdk(server).responses.create(
        model=MODEL,
        input=_words(rng, 4),
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        temperature=0,
        max_output_tokens=300,
        reasoning={"effort": "none"},
    )
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), schema)


def _fold(events: list[tuple[str, dict]]) -> dict:
    """The response a stream describes, rebuilt from its item events alone (the last event's
    response is checked against it), with the event order checked."""
    numbers = [data["sequence_number"] for _, data in events]
    assert numbers == list(range(len(events))), numbers
    assert all(name == data["type"] for name, data in events)
    items: list[dict] = []
    for name, data in events:
        if name == "response.output_item.added":
            assert data["output_index"] == len(items)
            items.append(data["item"])
        elif name in ("response.output_text.delta", "response.reasoning_text.delta"):
            item = items[data["output_index"]]
            assert data["item_id"] == item["id"]
            item["content"][data["content_index"]]["text"] += data["delta"]
        elif name == "response.content_part.added":
            items[data["output_index"]]["content"].append(data["part"])
        elif name == "response.function_call_arguments.delta":
            items[data["output_index"]]["arguments"] += data["delta"]
        elif name == "response.output_item.done":
            assert data["item"]["status"] == "completed"
            items[data["output_index"]]["status"] = "completed"
            assert items[data["output_index"]] == data["item"]
    last = events[-1][1]["response"]
    assert last["output"] == items
    return last


def _without_ids(response: dict) -> dict:
    out = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    drawn = ("id", "call_id")  # per reply
    out["output"] = [{k: v for k, v in item.items() if k not in drawn} for item in out["output"]]
    return out


def test_reasoning_text_and_calls_in_order_whole_and_streamed(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tools = [{"type": "function", "name": random_name(rng),
              "parameters": random_object_schema(rng)} for _ in range(2)]  # fmt: skip
    calls = [rng.choice(tools) for _ in range(rng.randint(0, 3))]
    arguments = [random_instance(rng, t["parameters"]) for t in calls]
    thought, text = _words(rng, rng.randint(1, 6)), _words(rng, rng.randint(1, 6))
    reply = f"<think>\n{thought}\n</think>\n\n{text}"
    for tool, args in zip(calls, arguments, strict=True):
        call = json.dumps({"name": tool["name"], "arguments": args})
        reply += f"\n<tool_call>\n{call}\n</tool_call>"
    fake.replies = [(reply, "stop")] * 2
    body = {"input": _words(rng, 3), "tools": tools, "max_output_tokens": 500}
    whole = client.post(URL, json=body)
    assert whole.status_code == 200, whole.text
    whole = whole.json()
    r = client.post(URL, json={**body, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = named_events(r.text)
    streamed = _fold(events)
    assert _without_ids(whole) == _without_ids(streamed)
    # The SDK's own models take every event and the response, strictly.
    for _, data in events:
        EVENT.validate_python(data, strict=True)
    Response.model_validate(whole, strict=True)
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"] + ["function_call"] * len(calls), kinds
    assert whole["output"][0]["content"][0]["text"].strip() == thought
    assert whole["output"][1]["content"][0]["text"].strip() == text
    for item, tool, args in zip(whole["output"][2:], calls, arguments, strict=True):
        assert (item["name"], json.loads(item["arguments"])) == (tool["name"], args)
        assert item["call_id"]
    assert whole["status"] == "completed" and whole["store"] is True
    assert whole["tools"] == tools  # the request's settings echoed


def test_max_output_tokens_makes_it_incomplete(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    text = _words(rng, rng.randint(2, 8))
    fake.replies = [(text, "length")]
    n = len(fake.tokenizer.encode(text))
    # Settings sent as null are echoed as their defaults (the SDK's types refuse null there).
    nulls = dict.fromkeys(["tools", "tool_choice", "parallel_tool_calls", "temperature"])
    body = {"input": _words(rng, 2), "max_output_tokens": n, **nulls}
    response = client.post(URL, json=body).json()
    Response.model_validate(response, strict=True)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["usage"]["output_tokens"] == n
    assert [item["status"] for item in response["output"]] == ["incomplete"]  # cut there


def test_items_give_the_chat_routes_prompt(scripted_client, rng_seed):
    """A history of every item kind renders the tokens its chat form renders."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tool = {"type": "function", "name": random_name(rng), "parameters": random_object_schema(rng)}
    args = json.dumps(random_instance(rng, tool["parameters"]))
    system, question, thought = random_name(rng), _words(rng, 4), _words(rng, 3)
    said, result, follow = _words(rng, 3), _words(rng, 3), _words(rng, 2)
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": question}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": thought}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": said, "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": tool["name"], "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": result},
        {"role": "user", "content": follow},
    ]  # fmt: skip
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": said, "reasoning_content": thought,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": tool["name"], "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
        {"role": "user", "content": follow},
    ]  # fmt: skip
    # Instructions and the developer message that opens the input are one system message
    # (Codex sends both; Qwen3.5's template refuses a second system message).
    rule = _words(rng, 3)
    items.insert(0, {"type": "message", "role": "developer",
                     "content": [{"type": "input_text", "text": rule}]})  # fmt: skip
    messages[0]["content"] = f"{system}\n\n{rule}"
    fake.replies = [("ok", "stop")] * 2
    chat_tool = {"type": "function", "function": {"name": tool["name"],
                                                  "parameters": tool["parameters"]}}  # fmt: skip
    r = client.post(URL, json={"instructions": system, "input": items, "tools": [tool]})
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": [chat_tool]})
    assert r.status_code == 200, r.text
    assert fake.prompts[0] == fake.prompts[1]


LOGPROBS = "message.output_text.logprobs"


def _refusals(rng: random.Random) -> list[tuple[dict, str, list[str]]]:
    """(body changes, param, what the message must say)."""
    name = random_name(rng)
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    return [
        ({"previous_response_id": "resp_" + name}, "previous_response_id",
         ["is not a response this server keeps"]),
        ({"tools": [{"type": "web_search"}]}, "tools[0]", ["'web_search'", "runs no tools"]),
        ({"input": [{"role": "user", "content": [image]}]}, "input[0]",
         ["'input_image' parts are not supported"]),
        ({"input": [{"type": "item_reference", "id": name}]}, "input[0]",
         ["'item_reference' are not supported"]),
        ({"input": []}, "input", ["non-empty list"]),
        ({"max_output_tokens": 0}, "max_output_tokens", ["max_output_tokens"]),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice", ["tool_choice must be"]),
        ({"text": {"format": {"type": "grammar"}}}, "text", ["text.format"]),
        ({"input": [{"role": "user", "content": "a"},
                    {"type": "function_call_output", "call_id": name, "output": "r"}]},
         "input[1]", [repr(name), "input[1] (function_call_output)"]),
        ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text",
         ["text.format.name is required"]),
        ({"tools": [{"type": "function", "name": name, "parameters": {"type": "object"}}],
          "tool_choice": {"type": "function"}}, "tool_choice", ["{'type': 'function'}"]),
        ({"input": " ".join(random_name(rng) for _ in range(1500))}, "input",
         ["prompt tokens fit"]),  # past the test engine's 1024
        # Fields read or ignored take only their documented type ("false" is not false).
        ({"store": rng.choice(["false", "true", 0, 1])}, "store", ["true or false"]),
        ({"background": "false"}, "background", ["true or false"]),
        ({"metadata": [name]}, "metadata", ["an object"]),
        ({"text": "json"}, "text", ["an object"]),
        ({"include": LOGPROBS}, "include", ["a list of strings"]),
        ({"include": [LOGPROBS, 7]}, "include", ["a list of strings"]),
        ({"user": rng.randint(1, 99)}, "user", ["a string"]),
        ({"truncation": rng.choice([5, name])}, "truncation", ["'auto' or 'disabled'"]),
        ({"prompt_cache_key": {}}, "prompt_cache_key", ["a string"]),
        ({"tools": [{"type": "function", "name": name, "strict": "yes"}]}, "tools[0]",
         ["tools[0].strict must be true or false"]),
        # A Responses tool is flat: its fields are the tool's own, not a `function`'s.
        ({"tools": [{"type": "function", "parameters": {"type": "object"}}]}, "tools[0]",
         ["tools[0].name must be"]),
        ({"tools": [{"type": "function", "name": name, "parameters": {"type": name}}]},
         "tools[0]", ["tools[0].parameters must be an object schema"]),
        ({"text": {"format": {"type": "json_schema", "name": name,
                              "schema": rng.choice([5, name, [], None])}}}, "text",
         ["text.format.schema must be a JSON schema"]),
        # The chat route's fields: refused by name here too, never dropped.
        ({"guided_json": {"type": "object"}}, "guided_json", ["response_format"]),
        ({"use_beam_search": True}, "use_beam_search", ["beam search is not built"]),
        ({"n": rng.randint(2, 4)}, "n", ["one output"]),
        ({"n": rng.choice([True, 1.0, "1"])}, "n", ["n must be an integer"]),
        ({"functions": [{"name": name}]}, "functions", ["legacy form of tools"]),
        ({"function_call": "auto"}, "function_call", ["legacy form of tool_choice"]),
        ({"echo": True}, "echo", ["echo"]),
        ({"reasoning": {"effort": "low"}, "reasoning_effort": "high"}, "reasoning",
         ["not both"]),
        ({"seed": rng.choice(["7", 1.5, 2**64])}, "seed", ["seed must"]),
        ({"presence_penalty": rng.choice([3, -2.5])}, "presence_penalty", ["presence_penalty"]),
        ({"logit_bias": {name: 5}}, "logit_bias", ["token ids"]),
        ({"min_tokens": -1}, "min_tokens", [">= 0"]),
    ]  # fmt: skip


def test_refusals_name_the_responses_fields(client, rng_seed, api_error):
    rng = random.Random(rng_seed)
    base = {"model": "freetoken/qwen3_moe", "input": _words(rng, 3), "max_output_tokens": 8}
    for change, param, says in _refusals(rng):
        body = {**base, **change}
        for stream in (False, True):  # refused before a stream starts: the same answer
            r = client.post(URL, json={**body, "stream": stream})
            error = api_error(r, 400)
            assert error["param"] == param, (change, error)
            assert all(s in error["message"] for s in says), (change, error)
            assert "messages[" not in error["message"], error  # the chat route's name
            assert "'function': {" not in error["message"], error  # the chat form
            assert ".function." not in error["message"] + str(error["param"]), error


def _chat_sampling(rng: random.Random, vocab: int) -> dict:
    """The chat route's sampling fields a client may send in a Responses body, drawn."""
    fields = {
        "top_k": rng.randint(1, 50),
        "min_p": rng.uniform(0, 0.2),
        "presence_penalty": rng.uniform(-1, 1),
        "frequency_penalty": rng.uniform(-1, 1),
        "repetition_penalty": rng.uniform(1, 1.5),
        "logit_bias": {str(rng.randrange(vocab)): rng.choice([100, -100, rng.uniform(-5, 5)])},
        "min_tokens": rng.randint(0, 3),
    }
    drawn = dict(rng.sample(sorted(fields.items()), rng.randint(1, len(fields))))
    if rng.random() < 0.5:  # vLLM's template switch (the prompt's, not the sampling's)
        drawn["chat_template_kwargs"] = {"enable_thinking": rng.random() < 0.5}
    return {"seed": rng.randint(0, 2**31), **drawn}  # a seed: the same draw on both routes


def test_the_chat_routes_sampling_fields_are_honoured(client, engine, rng_seed):
    """seed, the penalties, logit_bias and vLLM's fields sent in a Responses body give the
    chat route's reply with the same fields (they were dropped: a seeded request sampled
    afresh each time, a bias never applied)."""
    rng = random.Random(rng_seed)
    vocab = engine.spec.vocab_size
    text, max_tokens = _words(rng, rng.randint(1, 6)), rng.randint(4, 12)
    for i in range(3):
        fields = {**_chat_sampling(rng, vocab), "temperature": rng.uniform(0.5, 1.5)}
        if i == 0:  # the template's switch off once: it changes the prompt, not the sampling
            fields["chat_template_kwargs"] = {"enable_thinking": False}
        chat = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "ignore_eos": True, **fields}  # fmt: skip
        r = client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        expected = r.json()["choices"][0]["message"]["content"]
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        body = {"input": text, "max_output_tokens": max_tokens, "ignore_eos": True, **fields}
        got = []
        for _ in range(2):
            r = client.post(URL, json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["input_tokens"] == prompt_tokens, (rng_seed, fields)
            output = r.json()["output"]
            got.append("".join(p["text"] for i in output if i["type"] == "message"
                               for p in i["content"]))  # fmt: skip
        assert got == [expected, expected], (rng_seed, fields)


def test_an_engine_error_is_an_error_object_or_response_failed(scripted_client, rng_seed):
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    message = "boom " + random_name(rng)
    fake.replies = [(_words(rng, 3), "error", message)] * 2
    body = {"input": _words(rng, 2), "max_output_tokens": 50}
    r = client.post(URL, json=body)
    assert r.status_code == 500 and r.json()["error"]["message"] == message
    events = named_events(client.post(URL, json={**body, "stream": True}).text)
    assert events[0][0] == "response.created"
    name, data = events[-1]
    assert name == "response.failed" and data["response"]["status"] == "failed"
    assert data["response"]["error"] == {"code": "server_error", "message": message}
    assert "response.completed" not in [n for n, _ in events]


def test_reasoning_items_join_their_own_turn_only(rng_seed):
    """Interleaved reasoning (before each call of one turn) joins that turn's reasoning; a
    reasoning item no assistant item follows (a turn cut short) is left out, not given to a
    later turn."""
    from freetoken_agent.integrations.server.responses_input import chat_history

    rng = random.Random(rng_seed)
    a, b, lost, said = (_words(rng, 2) for _ in range(4))

    def reasoning(text: str) -> dict:
        return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}

    def call(i: int) -> dict:
        return {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}

    items = [
        {"role": "user", "content": _words(rng, 2)},
        reasoning(a), call(1), reasoning(b), call(2),
        {"type": "function_call_output", "call_id": "c1", "output": "x"},
        {"type": "function_call_output", "call_id": "c2", "output": "y"},
        reasoning(lost),
        {"role": "user", "content": _words(rng, 2)},
        {"role": "assistant", "content": said},
    ]  # fmt: skip
    messages = chat_history(None, items).messages
    turns = [m for m in messages if m["role"] == "assistant"]
    assert [len(t.get("tool_calls") or []) for t in turns] == [2, 0]
    assert turns[0]["reasoning_content"] == f"{a}\n\n{b}"
    assert "reasoning_content" not in turns[1] and turns[1]["content"] == said


def test_reasoning_sent_back_in_encrypted_content_alone_keeps_the_prompt(scripted_client, rng_seed):
    """With include ["reasoning.encrypted_content"] (Codex, store false) the reasoning's text
    travels in encrypted_content too; a client that sends the item back with that field alone
    (no content) renders the same history as one that sends the content."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tool = {"type": "function", "name": random_name(rng), "parameters": {"type": "object"}}
    thought = _words(rng, 4)
    call = json.dumps({"name": tool["name"], "arguments": {}})
    fake.replies = [(f"<think>\n{thought}\n</think>\n\n<tool_call>\n{call}\n</tool_call>",
                     "stop")] + [("ok", "stop")] * 2  # fmt: skip
    question = {"role": "user", "content": _words(rng, 3)}
    body = {"input": [question], "tools": [tool], "include": ["reasoning.encrypted_content"]}
    first = client.post(URL, json=body).json()
    reasoning, call_item = first["output"]
    assert reasoning["encrypted_content"].endswith(thought.strip())
    result = {"type": "function_call_output", "call_id": call_item["call_id"], "output": "r"}
    sealed_only = {k: v for k, v in reasoning.items() if k != "content"}
    for sent in (reasoning, sealed_only):
        inputs = [question, sent, call_item, result]
        assert client.post(URL, json={**body, "input": inputs}).status_code == 200
    assert fake.prompts[1] == fake.prompts[2]
    assert thought.strip() in fake.tokenizer.decode(fake.prompts[2])


def test_previous_response_id_continues_the_stored_conversation(scripted_client, rng_seed):
    """A response continued by previous_response_id renders the prompt its whole input would
    (its input, then its output items, then the new input); one asked with store false is
    not kept."""
    rng = random.Random(rng_seed)
    fake, client = scripted_client
    tool = {"type": "function", "name": random_name(rng), "parameters": {"type": "object"}}
    call = json.dumps({"name": tool["name"], "arguments": {}})
    thought = _words(rng, 3)
    fake.replies = [(f"<think>\n{thought}\n</think>\n\n<tool_call>\n{call}\n</tool_call>",
                     "stop")] + [("ok", "stop")] * 3  # fmt: skip
    question = [{"role": "user", "content": _words(rng, 3)}]
    body = {"instructions": random_name(rng), "tools": [tool]}
    first = client.post(URL, json={**body, "input": question}).json()
    assert first["store"] is True
    call_id = next(i["call_id"] for i in first["output"] if i["type"] == "function_call")
    result = [{"type": "function_call_output", "call_id": call_id, "output": _words(rng, 2)}]
    later = {**body, "previous_response_id": first["id"], "input": result}
    r = client.post(URL, json={**later, "stream": rng.random() < 0.5})
    assert r.status_code == 200, r.text
    whole = {**body, "input": [*question, *first["output"], *result]}
    assert client.post(URL, json=whole).status_code == 200
    assert fake.prompts[1] == fake.prompts[2]
    unkept = client.post(URL, json={**body, "input": question, "store": False}).json()
    assert unkept["store"] is False
    again = client.post(URL, json={**later, "previous_response_id": unkept["id"]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "previous_response_id"
