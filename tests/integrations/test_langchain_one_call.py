"""ChatFreeToken.bind_tools(..., parallel_tool_calls=False): one call at most, and the engine
stops there (FirstCallOnly, shared with the server), in all four LangChain entry points.

A scripted engine writes two good calls and a long tail, the tail slowly (`PacedEngine`): a
generation stopped at its first call ends long before its reply would have.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from langchain_core.messages import AIMessageChunk
from scripted_engine import PacedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.service import EngineService

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "ta", "pe", "xi", "qu"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=8192, max_model_len=2048)


@pytest.fixture
def paced(engine):
    fake = PacedEngine(engine)
    service = EngineService(fake)
    yield fake, service
    service.close()


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def _block(name: str, args: dict) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n</tool_call>\n'


def _calls(message) -> list[tuple[str, dict]]:
    return [(c["name"], c["args"]) for c in message.tool_calls]


def test_parallel_tool_calls_false_stops_at_the_first_call(paced, rng_seed):
    rng = random.Random(rng_seed)
    fake, service = paced
    names = [f"{_name(rng)}_{i}" for i in range(rng.randint(1, 3))]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in names
    ]
    calls = [(rng.choice(names), {f"k{i}": rng.randint(-99, 99)}) for i in range(2)]
    first = " ".join(_name(rng) for _ in range(rng.randint(0, 3))) + "\n" + _block(*calls[0])
    text = first + _block(*calls[1]) + "zo " * 150
    fake.replies = [(text, "stop")] * 5
    question = _name(rng)

    # The control, unpaced: by default both calls come back.
    llm = ChatFreeToken(engine=service, max_tokens=1024)
    assert _calls(llm.bind_tools(tools).invoke(question)) == calls
    done = fake.finished
    fake.slow_after = len(fake.tokenizer.encode(first)) - 2  # the boundary may go either way
    total = len(fake.tokenizer.encode(text))

    one = llm.bind_tools(tools, parallel_tool_calls=False)

    def streamed(chunks: list) -> AIMessageChunk:
        out = chunks[0]
        for chunk in chunks[1:]:
            out = out + chunk
        return out

    async def both_async():
        message = await one.ainvoke(question)
        return message, streamed([c async for c in one.astream(question)])

    messages = [one.invoke(question), streamed(list(one.stream(question)))]
    messages += list(asyncio.run(both_async()))
    for message in messages:
        assert _calls(message) == [calls[0]]
        assert message.response_metadata["finish_reason"] == "tool_calls"
        assert "zo zo" not in message.content
        assert message.usage_metadata["output_tokens"] < total
    assert fake.finished == done  # none of the four ran to the end of its reply

    with pytest.raises(ValueError, match="parallel_tool_calls"):
        llm.bind_tools(tools, parallel_tool_calls="no").invoke(question)
