"""Anthropic's own Python SDK against a real server (uvicorn, the demo model): what Claude
Code and other Anthropic clients make of our wire, not what our reader of it thinks.

A turn is asked for whole and streamed (`messages.stream`, whose final message is the SDK's
own reassembly of the events) at temperature 0, where both must be the same reply; a tool
call is forced (tool_choice tool), its result sent back as a tool_result, and the answer to
that read both ways too. The key travels as the SDK sends it (`x-api-key`), and as Claude
Code sends an ANTHROPIC_AUTH_TOKEN (`Authorization: Bearer`).
"""

from __future__ import annotations

import random
from typing import Any

import anthropic
import jsonschema
import pytest
from random_schemas import random_name, random_object_schema

MODEL = "freetoken-demo"
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server(model_dir, model_id=MODEL, api_key=KEY)


def _client(server, **auth: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base, max_retries=0, timeout=60, **auth)


def _both(client: anthropic.Anthropic, **request: Any):
    """(the whole message, the streamed one as the SDK reassembles it)."""
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    return whole, streamed


def _same(whole, streamed) -> None:
    """One reply both ways: the ids are drawn per reply, and the second request's prompt was
    mostly a cache read (the first's prompt is its prefix), so only the input's sum agrees."""
    first, second = whole.model_dump(exclude={"id"}), streamed.model_dump(exclude={"id"})
    for message in (first, second):
        for block in message["content"]:
            block.pop("id", None)
        usage = message.pop("usage")
        message["input"] = usage["input_tokens"] + usage["cache_read_input_tokens"]
        message["output_tokens"] = usage["output_tokens"]
    assert first == second


def test_sdk_tool_round_trip_whole_and_streamed(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    client = _client(server, api_key=KEY)
    tool = {
        "name": random_name(rng),
        "description": " ".join(random_name(rng) for _ in range(4)),
        "input_schema": random_object_schema(rng),
    }
    question = " ".join(random_name(rng) for _ in range(5))
    request: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 160,
        # The SDK has no temperature argument any more (Claude's newer models take none);
        # the server still reads the field, and greedy decoding makes both ways one reply.
        "extra_body": {"temperature": 0},
        "system": [{"type": "text", "text": random_name(rng)}],
        "messages": [{"role": "user", "content": question}],
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": tool["name"]},
    }
    whole, streamed = _both(client, **request)
    _same(whole, streamed)
    assert whole.stop_reason == "tool_use", whole
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.name == tool["name"]
    jsonschema.validate(use.input, tool["input_schema"])
    counted = client.messages.count_tokens(
        model=MODEL, system=request["system"], messages=request["messages"], tools=[tool]
    )
    # A forced call's prompt ends with its opener (tool_choice.py), which a count leaves out.
    usage = whole.usage
    assert 0 < usage.input_tokens + usage.cache_read_input_tokens - counted.input_tokens <= 8

    result = " ".join(random_name(rng) for _ in range(3))
    request["messages"] = [
        *request["messages"],
        {"role": "assistant", "content": whole.content},  # the SDK's blocks, sent back as given
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": result},
        ]},
    ]  # fmt: skip
    request["tool_choice"] = {"type": "none"}
    request["max_tokens"] = n = rng.randint(4, 12)
    answer, streamed_answer = _both(client, **request)
    _same(answer, streamed_answer)
    assert [b.type for b in answer.content] in (["text"], [])
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert answer.usage.output_tokens <= n
    # The second turn's prompt starts with the first's: the prefix cache served it. (Read
    # from the whole reply: older SDKs, 0.50 among them, keep message_start's input usage for
    # a stream, where all of the prompt counts as input; the sum, compared above, agrees.)
    assert answer.usage.cache_read_input_tokens > 0
    counted = client.messages.count_tokens(
        model=MODEL, system=request["system"], messages=request["messages"], tools=[tool]
    ).input_tokens
    assert counted == answer.usage.input_tokens + answer.usage.cache_read_input_tokens
    nothing_held(server.state.service)


def test_sdk_keys_and_errors(server, rng_seed):
    rng = random.Random(rng_seed)
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    as_bearer = _client(server, auth_token=KEY)  # Claude Code's ANTHROPIC_AUTH_TOKEN
    assert as_bearer.messages.create(**body).usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as refused:
        _client(server, api_key=KEY + "x").messages.create(**body)
    assert refused.value.body["error"]["type"] == "authentication_error"
    client = _client(server, api_key=KEY)
    other = "claude-" + random_name(rng)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(**{**body, "model": other})
    assert other in missing.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            **{**body, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}
        )
    assert "web_search_20250305" in bad.value.message


def test_sdk_lists_the_served_model(server):
    """`client.models` reads our /v1/models (shared with OpenAI's SDK) with its own fields."""
    client = _client(server, api_key=KEY)
    [model] = list(client.models.list())
    assert (model.id, model.type, model.display_name) == (MODEL, "model", MODEL)
    assert model.created_at.year >= 2025  # a datetime the SDK parsed
    assert client.models.retrieve(MODEL).id == MODEL
