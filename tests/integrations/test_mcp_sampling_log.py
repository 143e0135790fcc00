"""The MCP host's record of sampling requests (mcp_sampling.SamplingResponder.log) keeps the
most recent LOG_KEPT: a server that samples in a loop must not grow the host for ever.
Requests here are refused before any generation (tool use inside sampling), which records
them all the same; their servers' names are drawn fresh."""

from __future__ import annotations

import asyncio
import random

import mcp_types as types

from freetoken_agent.integrations import mcp_sampling


def _params(rng: random.Random) -> types.CreateMessageRequestParams:
    text = types.TextContent(type="text", text=f"q{rng.randrange(10**6)}")
    return types.CreateMessageRequestParams(
        messages=[types.SamplingMessage(role="user", content=text)],
        max_tokens=rng.randint(1, 50),
        tools=[types.Tool(name="t", input_schema={"type": "object"})],
    )


def test_the_sampling_log_keeps_the_most_recent_requests(monkeypatch, rng_seed):
    rng = random.Random(rng_seed)
    kept = rng.randint(2, 6)
    monkeypatch.setattr(mcp_sampling, "LOG_KEPT", kept)
    responder = mcp_sampling.SamplingResponder(None, None, model_name="m", max_tokens_cap=64)
    servers = [f"server{i}" for i in range(kept + rng.randint(1, 10))]

    async def ask_all() -> list:
        return [await responder.answer(name, _params(rng)) for name in servers]

    answers = asyncio.run(ask_all())
    assert all(isinstance(a, types.ErrorData) for a in answers)
    assert [r.server for r in responder.log] == servers[-kept:]
    assert all(r.error for r in responder.log)
