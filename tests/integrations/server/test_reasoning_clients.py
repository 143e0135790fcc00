"""Reasoning through a real client: LangChain's ChatDeepSeek against a real uvicorn server.

The demo template closes no think block and opens none, so this module serves a copy of the
demo model whose template ends the generation prompt with `<think>\\n`, as reasoning models'
templates do (Qwen3 thinking mode, DeepSeek-R1). The output then starts inside the reasoning:
whatever the random weights write before a `</think>` is reasoning, sent as
`reasoning_content` deltas, which ChatDeepSeek keeps in `additional_kwargs`.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_deepseek import ChatDeepSeek
from thinking_model import thinking_demo

from freetoken_agent.engine.thinking_budget import MAX_WAIT

MODEL = "demo-thinking"


@pytest.fixture(scope="module")
def thinking_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return thinking_demo(model_dir, tmp_path_factory.mktemp("thinking") / MODEL)


@pytest.fixture(scope="module")
def server(start_server, thinking_dir):
    return start_server(thinking_dir, model_id=MODEL)


def _text(rng: random.Random) -> str:
    return " ".join(
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 7)))
        for _ in range(rng.randint(3, 9))
    )


def deepseek(server, **options: Any) -> ChatDeepSeek:
    return ChatDeepSeek(
        model=MODEL,
        api_base=server.base + "/v1",
        api_key="unused",
        temperature=0,
        max_retries=0,
        timeout=60,
        **options,
    )


def test_chat_deepseek_keeps_reasoning_invoked_and_streamed(server, rng_seed, nothing_held):
    rng = random.Random(rng_seed)
    n = rng.randint(6, 12)
    # ignore_eos: a random model may end at once; a fixed length makes the reasoning non-empty.
    llm = deepseek(server, max_tokens=n, stream_usage=True, extra_body={"ignore_eos": True})
    prompt = [HumanMessage(_text(rng))]
    reply = llm.invoke(prompt)
    reasoning = reply.additional_kwargs.get("reasoning_content")
    assert isinstance(reasoning, str) and reasoning.strip(), reply
    assert "</think>" not in reasoning  # the marker ends it; it is not reasoning text
    assert reply.usage_metadata["output_tokens"] == n
    assert reply.response_metadata["finish_reason"] == "length"

    raw = httpx.post(
        server.base + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": prompt[0].content}],
              "max_tokens": n, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).json()["choices"][0]["message"]  # fmt: skip
    assert raw["reasoning_content"] == reasoning  # passed through as the server sent it
    assert (raw["content"] or "") == reply.content

    chunks = list(llm.stream(prompt))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.additional_kwargs["reasoning_content"] == reasoning
    assert merged.content == reply.content
    assert merged.usage_metadata["output_tokens"] == n
    # Live: the text came in pieces, reasoning first (a random model may write one reasoning
    # token before `</think>`, so the pieces are counted over reasoning and content together).
    pieces = [i for i, c in enumerate(chunks) if c.additional_kwargs.get("reasoning_content")]
    said = [i for i, c in enumerate(chunks) if c.content]
    assert pieces and len(pieces) + len(said) > 1
    assert not said or pieces[0] < said[0]
    nothing_held(server.state.service)


def test_chat_deepseek_forced_tool_call_under_thinking(server, rng_seed, nothing_held):
    """A forced call closes the open think block first (server-side), so the call parses."""
    rng = random.Random(rng_seed)
    name = "lookup_" + "".join(rng.choice(string.ascii_lowercase) for _ in range(5))
    schema = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": rng.randint(1, 6)},
            "limit": {"type": "integer", "minimum": 1, "maximum": rng.randint(2, 99)},
        },
        "required": ["query", "limit"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": name, "parameters": schema}}
    llm = deepseek(server, max_tokens=100).bind_tools([tool], tool_choice=name)
    prompt = [HumanMessage(_text(rng))]
    called = llm.invoke(prompt)
    assert [c["name"] for c in called.tool_calls] == [name], called
    jsonschema.validate(called.tool_calls[0]["args"], schema)
    assert called.response_metadata["finish_reason"] == "tool_calls"

    merged = None
    for chunk in llm.stream(prompt):
        merged = chunk if merged is None else merged + chunk
    assert merged.tool_calls[0]["args"] == called.tool_calls[0]["args"]
    nothing_held(server.state.service)


def test_a_json_answer_under_thinking_follows_the_reasoning(server, rng_seed):
    """A response_format on a model whose template opens a think block: the model reasons (a
    thinking budget caps it: the random weights never close the block themselves), then the
    grammar holds the answer to the schema, and the JSON is the answer's content, streamed or
    not; with tool_choice "none" too. With thinking off the block is closed in the prompt and
    the JSON comes from the first token."""
    rng = random.Random(rng_seed)
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": rng.randint(1, 99)}},
        "required": ["n"],
        "additionalProperties": False,
    }
    thinking = rng.random() < 0.7
    budget = rng.randint(3, 8)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": _text(rng)}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        "max_tokens": 64 + budget + MAX_WAIT,
        "temperature": 1.0,
        "seed": rng_seed,
        "thinking_token_budget": budget,
    }
    if not thinking:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if rng.random() < 0.5:
        body["tools"] = [{"type": "function", "function": {"name": "noop"}}]
        body["tool_choice"] = "none"
    with httpx.Client(base_url=server.base, timeout=60) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
        lines = []
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert whole["finish_reason"] == "stop", whole
    assert bool(whole["message"].get("reasoning_content")) == thinking, whole
    jsonschema.validate(json.loads(whole["message"]["content"]), schema)
    deltas = [json.loads(x)["choices"][0]["delta"] for x in lines[:-1] if json.loads(x)["choices"]]
    assert "".join(d.get("content") or "" for d in deltas) == whole["message"]["content"]
