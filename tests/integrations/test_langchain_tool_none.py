"""ChatFreeToken with tool_choice="none": the tools stay in the prompt, as the server keeps
them (integrations/server/tool_choice.py), and nothing is read as a call.

Why it matters: an agent's turns render the tools in the system prompt; a last turn under
"none" that dropped them changed the prompt's first tokens, so the whole history was
prefilled again, and the same request answered differently through LangChain and through the
OpenAI route. Here one EngineService serves both; its submissions are tapped, and the same
history (random tools, a call and its result) goes through the chat route under "none",
ChatFreeToken under "auto" and under "none": the three prompts must be the same token ids,
and the greedy replies of the two "none" runs the same text. Names and texts are drawn fresh.
"""

from __future__ import annotations

import json
import random
import string

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from prompt_tap import tap_prompts
from scripted_engine import ScriptedEngine
from starlette.testclient import TestClient

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.integrations.server import create_app
from freetoken_agent.service import EngineService


@pytest.fixture
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return Engine.load(ensure_demo_model(tmp_path_factory.mktemp("cache")), device="cpu",
                       progress=False, kv_tokens=4096, max_model_len=1024)  # fmt: skip


@pytest.fixture
def service(engine):
    service = EngineService(engine)
    yield service
    service.close()


def _word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))


def _tools(rng: random.Random) -> list[dict]:
    return [
        {"type": "function", "function": {
            "name": f"{_word(rng)}_{i}", "description": " ".join(_word(rng) for _ in range(3)),
            "parameters": {"type": "object", "properties": {_word(rng): {"type": "string"}}}}}
        for i in range(rng.randint(1, 3))
    ]  # fmt: skip


def test_none_keeps_the_tools_in_the_prompt_as_the_server_does(service, monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    prompts = tap_prompts(service, monkeypatch)
    tools = _tools(rng)
    tool = rng.choice(tools)["function"]
    args = {next(iter(tool["parameters"]["properties"])): _word(rng)}
    system, question, result = _word(rng), " ".join(_word(rng) for _ in range(4)), _word(rng)
    call_id = "call_" + _word(rng)
    max_tokens = rng.randint(2, 10)

    chat = [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
         "function": {"name": tool["name"], "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]  # fmt: skip
    with TestClient(create_app(service)) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": chat, "tools": tools, "tool_choice": "none", "temperature": 0,
            "max_tokens": max_tokens})  # fmt: skip
    assert r.status_code == 200, r.text
    served = r.json()["choices"][0]["message"]

    messages = [
        SystemMessage(system),
        HumanMessage(question),
        AIMessage("", tool_calls=[{"name": tool["name"], "args": args, "id": call_id}]),
        ToolMessage(result, tool_call_id=call_id),
    ]
    llm = ChatFreeToken(engine=service, temperature=0, max_tokens=max_tokens)
    llm.bind_tools(tools).invoke(messages)
    reply = llm.bind_tools(tools, tool_choice="none").invoke(messages)

    assert len(prompts) == 3, len(prompts)
    assert prompts[1] == prompts[0], rng_seed  # "auto" renders what the server's "none" did
    assert prompts[2] == prompts[0], rng_seed  # and so does "none": the history's KV reused
    assert reply.tool_calls == [] and served.get("tool_calls") in (None, []), rng_seed
    assert reply.content == served["content"], rng_seed
    assert reply.usage_metadata["input_token_details"]["cache_read"] >= len(prompts[0]) - 16


def test_none_reads_a_written_call_as_content_as_the_server_does(engine, rng_seed):
    """A scripted model writes text and a call block anyway: under "none" no call comes back,
    and the block is content, word for word the server's."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    name = rng.choice(tools)["function"]["name"]
    block = json.dumps({"name": name, "arguments": {_word(rng): _word(rng)}})
    reply = f"{_word(rng)} {_word(rng)}\n<tool_call>\n{block}\n</tool_call>"
    fake = ScriptedEngine(engine)
    fake.replies = [(reply, "stop")] * 2
    service = EngineService(fake)
    try:
        question = " ".join(_word(rng) for _ in range(3))
        with TestClient(create_app(service)) as client:
            r = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": question}], "tools": tools,
                "tool_choice": "none", "max_tokens": 200})  # fmt: skip
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["message"]
        llm = ChatFreeToken(engine=service, max_tokens=200)
        got = llm.bind_tools(tools, tool_choice="none").invoke(question)
    finally:
        service.close()
    assert served.get("tool_calls") in (None, []) and served["content"] == reply, served
    assert got.tool_calls == [] and got.content == reply, (rng_seed, got)
    assert fake.prompts[1] == fake.prompts[0], rng_seed
