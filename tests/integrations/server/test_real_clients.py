"""Real clients against a real server: uvicorn on a loopback port, the demo model behind it.

The `openai` SDK, LangChain's `ChatOpenAI` and the `websockets` library talk to the server as
they would to any OpenAI-compatible endpoint, so what is checked here is what those clients
make of our wire format (SSE deltas, tool-call pieces, usage), not what our own parser thinks.
Prompts and tool schemas are drawn fresh each run; outputs are compared across paths (streamed
vs whole, SDK vs LangChain) at temperature 0, where the engine's results are exact.
"""

from __future__ import annotations

import json
import random
import socket
import string
from typing import Any

import jsonschema
import openai
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from websockets.sync.client import connect

MODEL = "freetoken-demo"  # what `freetoken serve` calls the demo model
ALIAS = "demo"  # an alias this server also answers to


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))


def _text(rng: random.Random, n: int) -> str:
    return " ".join(_word(rng) for _ in range(n))


def random_tool(rng: random.Random) -> dict[str, Any]:
    """A function tool with 1-3 short scalar arguments (short: a forced call fits max_tokens)."""
    props: dict[str, Any] = {}
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(["string", "integer", "enum", "boolean"])
        if kind == "string":
            props[_word(rng)] = {"type": "string", "maxLength": rng.randint(1, 5)}
        elif kind == "integer":
            lo = rng.randint(-20, 20)
            props[_word(rng)] = {"type": "integer", "minimum": lo, "maximum": lo + 50}
        elif kind == "enum":
            props[_word(rng)] = {"enum": rng.sample(["red", "green", "blue", "amber"], 2)}
        else:
            props[_word(rng)] = {"type": "boolean"}
    schema = {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }
    name = "fn_" + _word(rng)
    return {
        "type": "function",
        "function": {"name": name, "description": _text(rng, 4), "parameters": schema},
    }


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(model_dir, model_id=MODEL, model_aliases=[ALIAS])


@pytest.fixture
def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_openai(server, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(
        model=MODEL,
        base_url=server.base + "/v1",
        api_key="unused",  # a keyless local server ignores it; the client insists on one
        temperature=0,
        max_retries=0,
        timeout=60,
        **options,
    )


def rebuild_calls(chunks: list) -> dict[int, dict[str, str]]:
    """Tool calls from streamed SDK chunks, as a client must rebuild them: keyed by `index`,
    id and name from the first piece, argument text concatenated."""
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += piece.id or ""
            if piece.function is not None:
                call["name"] += piece.function.name or ""
                call["arguments"] += piece.function.arguments or ""
    return calls


def test_openai_sdk_streams_a_forced_tool_call_and_usage(server, sdk, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    tool = random_tool(rng)
    name = tool["function"]["name"]
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _text(rng, rng.randint(3, 9))}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": name}},
        "max_tokens": 120,
        "temperature": 0,
    }
    chunks = list(
        sdk.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    calls = rebuild_calls(chunks)
    assert list(calls) == [0]
    call = calls[0]
    assert call["name"] == name and call["id"].startswith("call_")
    arguments = json.loads(call["arguments"])  # the pieces concatenate to one JSON object
    jsonschema.validate(arguments, tool["function"]["parameters"])
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["tool_calls"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert {c.model for c in chunks} == {MODEL}

    whole = sdk.chat.completions.create(**request)  # the same call, not streamed
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and whole.model == MODEL
    assert [c.function.name for c in message.tool_calls] == [name]
    assert json.loads(message.tool_calls[0].function.arguments) == arguments
    assert whole.usage.completion_tokens == usage.completion_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    nothing_held(server.state.service)


def test_openai_sdk_gets_404_for_a_model_not_served(server, sdk, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    other = rng.choice(["gpt-4o", "deepseek-chat", "freetoken/other"]) + "-" + _word(rng)
    body = {"messages": [{"role": "user", "content": _text(rng, 3)}], "max_tokens": 2}
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.chat.completions.create(model=other, **body)
    assert missing.value.code == "model_not_found" and other in missing.value.message
    assert MODEL in missing.value.message  # says what is served
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve(other)
    with pytest.raises(openai.NotFoundError):  # streamed: refused before the stream starts
        sdk.chat.completions.create(model=other, stream=True, **body)
    assert [m.id for m in sdk.models.list().data] == [MODEL]
    for name in (MODEL, ALIAS, "freetoken/qwen3_moe"):  # the id, an alias, the default id
        assert sdk.models.retrieve(name).id == MODEL
        assert sdk.chat.completions.create(model=name, **body).model == MODEL
    nothing_held(server.state.service)


def test_chat_openai_invoke_and_stream_agree_with_usage(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    n = rng.randint(3, 8)
    llm = chat_openai(server, max_tokens=n, stream_usage=True, extra_body={"ignore_eos": True})
    prompt = [HumanMessage(_text(rng, rng.randint(3, 10)))]
    reply = llm.invoke(prompt)
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.response_metadata["model_name"] == MODEL
    usage = reply.usage_metadata
    assert usage["output_tokens"] == n and usage["input_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + n

    chunks = list(llm.stream(prompt))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.content == reply.content  # greedy: the same tokens either way
    assert merged.usage_metadata["output_tokens"] == n
    assert merged.usage_metadata["input_tokens"] == usage["input_tokens"]
    # The repeated prompt's KV was reused, and LangChain reports it as a cache read.
    assert merged.usage_metadata["input_token_details"]["cache_read"] > 0
    nothing_held(server.state.service)


def test_chat_openai_tool_calling_round_trip(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    tool = random_tool(rng)
    name = tool["function"]["name"]
    llm = chat_openai(server, max_tokens=120).bind_tools([tool], tool_choice=name)
    history: list = [HumanMessage(_text(rng, rng.randint(3, 8)))]
    called = llm.invoke(history)
    assert [c["name"] for c in called.tool_calls] == [name]
    call = called.tool_calls[0]
    jsonschema.validate(call["args"], tool["function"]["parameters"])
    assert call["id"].startswith("call_") and not called.invalid_tool_calls
    assert called.response_metadata["finish_reason"] == "tool_calls"

    merged = None
    for chunk in llm.stream(history):
        merged = chunk if merged is None else merged + chunk
    assert [c["name"] for c in merged.tool_calls] == [name]
    assert merged.tool_calls[0]["args"] == call["args"]  # rebuilt from the streamed pieces

    # The agent loop: the call and its result go back; the server takes the history.
    history += [called, ToolMessage(json.dumps({"ok": _word(rng)}), tool_call_id=call["id"])]
    answer = chat_openai(server, max_tokens=4).bind_tools([tool]).invoke(history)
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert answer.usage_metadata["input_tokens"] > called.usage_metadata["input_tokens"]
    nothing_held(server.state.service)


# --- the WebSocket session stream, through the `websockets` library ----------------------

_FIELDS: dict[str, dict[str, Any]] = {
    "session": {"id": str, "turns": int, "running": bool, "history": list},
    "start": {"turn": int, "prompt_tokens": int, "user": (str, type(None))},
    "reasoning": {"text": str},
    "content": {"text": str},
    "warning": {"message": str},
    "usage": {
        "prompt_tokens": int,
        "completion_tokens": int,
        "reused_tokens": int,
        "prefilled_tokens": int,
        "finish_reason": str,
        "exact": bool,
        "first_divergence": int,
        "anchor": (dict, type(None)),
    },
    "memory": {"kv_pages": int, "kv_pages_free": int, "page_size": int, "experts": dict},
    "done": {"turn": (int, type(None)), "finish_reason": (str, type(None))},
    "error": {"message": str},
    "tool_call": {"phase": str, "index": int},
}


def well_formed(event: Any) -> dict[str, Any]:
    """One event, checked against the documented shape of its type."""
    assert isinstance(event, dict) and event.get("type") in _FIELDS, event
    for key, kind in _FIELDS[event["type"]].items():
        assert isinstance(event.get(key), kind), (key, event)
        assert not (kind is int and isinstance(event[key], bool)), (key, event)
    if event["type"] == "memory":
        assert 0 <= event["kv_pages_free"] <= event["kv_pages"]
    return event


def _receive(ws) -> dict[str, Any]:
    return well_formed(json.loads(ws.recv(timeout=60)))


def _until_done(ws) -> list[dict[str, Any]]:
    events = [_receive(ws)]
    while events[-1]["type"] != "done":
        events.append(_receive(ws))
    return events


def _ws_url(server, sid: str) -> str:
    return f"ws://127.0.0.1:{server.port}/v1/sessions/{sid}/ws"


def test_websockets_client_two_turns_reuse_the_first(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    sid = f"ws-{rng_seed:x}"
    questions = [_text(rng, rng.randint(2, 6)) for _ in range(2)]
    turns = []
    with connect(_ws_url(server, sid), subprotocols=["freetoken"], open_timeout=30) as ws:
        assert ws.subprotocol == "freetoken"
        hello = [_receive(ws), _receive(ws)]
        assert hello[0] == {"type": "session", "id": sid, "turns": 0, "running": False,
                            "history": []}  # fmt: skip
        assert hello[1]["type"] == "memory"
        for question in questions:
            sampling = {"max_tokens": rng.randint(3, 8), "temperature": 0}
            ws.send(json.dumps({"type": "send", "append": True, "model": ALIAS,
                                "messages": [{"role": "user", "content": question}],
                                "sampling": sampling}))  # fmt: skip
            events = _until_done(ws)
            kinds = [e["type"] for e in events]
            assert kinds[0] == "start" and kinds[-3:] == ["usage", "memory", "done"], kinds
            assert set(kinds[1:-3]) <= {"reasoning", "content", "tool_call", "warning"}
            assert events[0]["user"] == question and events[0]["turn"] == len(turns)
            usage, done = events[-3], events[-1]
            assert 0 < usage["completion_tokens"] <= sampling["max_tokens"]
            assert usage["reused_tokens"] + usage["prefilled_tokens"] == usage["prompt_tokens"]
            assert usage["prompt_tokens"] == events[0]["prompt_tokens"] and usage["exact"]
            text = "".join(e["text"] for e in events if e["type"] == "content")
            assert done["turn"] == len(turns) and done["finish_reason"] == usage["finish_reason"]
            assert done["message"]["role"] == "assistant"
            assert (done["message"]["content"] or "") == text
            turns.append(events)
        first, second = turns[0][-3], turns[1][-3]
        # Turn 2's prompt is turn 1's history plus the new question: its KV is reused.
        assert second["prompt_tokens"] > first["prompt_tokens"]
        assert 0 < second["reused_tokens"] <= second["first_divergence"]
        assert second["anchor"]["offset"] <= second["first_divergence"]

        ws.send("{not json")  # a bad message: an error and a done; the socket stays open
        error, done = _receive(ws), _receive(ws)
        assert error["type"] == "error" and error["code"] == "invalid_json"
        assert done == {"type": "done", "turn": None, "finish_reason": "error"}
        ws.send(json.dumps({"type": "send", "model": "gpt-x", "messages": []}))
        error, done = _receive(ws), _receive(ws)
        assert error["code"] == "model_not_found" and error["param"] == "model"

    with connect(_ws_url(server, sid), subprotocols=["freetoken"]) as late:
        session = _receive(late)
        roles = [m["role"] for m in session["history"]]
        assert session["turns"] == 2 and roles == ["user", "assistant"] * 2
        assert [m["content"] for m in session["history"][::2]] == questions
    nothing_held(server.state.service)


def test_websockets_client_that_drops_the_connection_aborts_its_turn(
    server, rng_seed, nothing_held
):
    """The TCP connection dies mid-turn, with no close frame: the turn is aborted."""
    rng = random.Random(rng_seed)
    service = server.state.service
    with connect(_ws_url(server, f"drop-{rng_seed:x}"), open_timeout=30) as ws:
        _receive(ws), _receive(ws)
        sampling = {"max_tokens": 900, "ignore_eos": True, "temperature": 0.7, "seed": rng_seed}
        ws.send(json.dumps({"type": "send", "sampling": sampling,
                            "messages": [{"role": "user", "content": _text(rng, 4)}]}))  # fmt: skip
        while _receive(ws)["type"] not in ("content", "reasoning"):
            pass
        generated = service.stats()["tokens"]["generated"]
        ws.socket.shutdown(socket.SHUT_RDWR)  # abrupt: no closing handshake
        nothing_held(service)
    assert service.stats()["tokens"]["generated"] - generated < 900 - 1
