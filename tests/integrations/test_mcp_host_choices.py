"""MCPHost's tool_choice and life cycle beyond the forced calls of test_mcp_host.py:
"none" keeps the tools in the prompt but reads no call (a call the model writes anyway is text,
never run); a forced call of a tool whose parameters are combined with allOf (its properties in
the branches) keeps to them, pins included; a host entered again indexes its new connections,
and one that has exited refuses to call. Words and values are drawn fresh per run; servers log
what they ran."""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
from pathlib import Path
from typing import Any

import pytest
from mcp_servers import LOGGING_SERVER
from scripted_engine import ScriptedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.mcp_host import MCPHost, RunResult
from freetoken_agent.messages import AssistantMessage, ToolCall, ToolResult
from freetoken_agent.service import EngineService

# A bare JSON-RPC server offering `both`, its parameters in allOf branches as zod's
# intersections write them; a call answers with its arguments.
COMBINED_SERVER = """
import json, sys
schema = {"type": "object", "allOf": [
    {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]},
    {"type": "object", "properties": {"b": {"enum": ["x", "y", "z"]}}, "required": ["b"]}]}
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if mid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"capabilities": {"tools": {}},
              "protocolVersion": msg["params"]["protocolVersion"],
              "serverInfo": {"name": "combined", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": [
            {"name": "both", "inputSchema": schema}]}})
    elif method == "tools/call":
        text = json.dumps(msg["params"]["arguments"], sort_keys=True)
        send({"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": text}]}})
    else:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
"""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(
        path, device="cpu", dtype="float32", progress=False, kv_tokens=4096, max_model_len=2048
    )


def _word(rng: random.Random) -> str:
    return "w" + "".join(rng.choice(string.ascii_lowercase) for _ in range(8))


def _config(tmp_path: Path, log: Path, source: str = LOGGING_SERVER) -> dict[str, Any]:
    script = tmp_path / "server.py"
    script.write_text(source)
    return {"mcpServers": {"s": {"command": sys.executable, "args": [str(script), str(log)]}}}


def _call(tool: str, **arguments: Any) -> str:
    """A call as the demo model's chat format writes it (Hermes)."""
    return f"<tool_call>\n{json.dumps({'name': tool, 'arguments': arguments})}\n</tool_call>"


def test_tool_choice_none_keeps_the_tools_and_runs_no_call(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    word = _word(rng)
    fake = ScriptedEngine(engine)
    written = _call("echo", text=word)
    fake.replies = [(written, "stop"), (written, "stop")]
    log = tmp_path / "calls.log"
    log.touch()

    async def main(service: EngineService) -> tuple[RunResult, RunResult]:
        async with MCPHost.from_config(_config(tmp_path, log), engine=service) as host:
            plain = await host.run(_word(rng), max_steps=3, tool_choice="none")
            auto = await host.run(_word(rng), max_steps=1)
            return plain, auto

    with EngineService(fake) as service:
        plain, auto = asyncio.run(main(service))
    assert plain.stop_reason == "answer" and plain.steps == 1, plain.error
    assert not any(isinstance(m, ToolResult) for m in plain.messages)
    assert word in plain.answer and not plain.messages[-1].tool_calls
    # The tools stayed in the prompt (the history renders as it will under "auto").
    prompt = engine.tokenizer.decode(fake.prompts[0])
    assert "echo the text" in prompt
    # "auto" (the next run) reads the same text as a call and runs it: once, in all.
    assert [m.content for m in auto.messages if isinstance(m, ToolResult)] == [f"echo:{word}"]
    assert log.read_text().splitlines() == ["start", f"echo {word}"]


def test_a_forced_call_of_a_combined_schema_keeps_to_its_branches(engine, tmp_path, rng_seed):
    """Parameters whose properties sit in allOf branches: closing the object beside them
    forbade every key the branches require (the grammar admitted nothing), and the pin check
    refused their names."""
    rng = random.Random(rng_seed)
    pinned = rng.choice(["x", "y", "z"])
    tool = {"type": "function", "function": {"name": "both", "arguments": {"b": pinned}}}
    config = _config(tmp_path, tmp_path / "unused.log", COMBINED_SERVER)

    async def main() -> RunResult:
        async with MCPHost.from_config(config, engine=engine, max_tokens=48) as host:
            return await host.run(_word(rng), max_steps=1, tool_choice=tool)

    result = asyncio.run(main())
    assert result.stop_reason == "max_steps", result.error
    call = result.messages[1]
    assert isinstance(call, AssistantMessage) and len(call.tool_calls) == 1
    arguments = call.tool_calls[0].arguments
    assert set(arguments) == {"a", "b"} and isinstance(arguments["a"], bool)
    assert arguments["b"] == pinned
    [answer] = [m for m in result.messages if isinstance(m, ToolResult)]
    assert json.loads(answer.content) == arguments  # what the server got


def test_a_host_entered_again_routes_to_its_new_connections(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    log = tmp_path / "calls.log"
    host = MCPHost.from_config(_config(tmp_path, log), engine=engine)
    words = [_word(rng) for _ in range(2)]

    async def main() -> tuple[list[ToolResult], int]:
        pids = []
        for word in words:
            async with host:
                done = await host.execute(ToolCall("c", "pid", {}))
                pids.append(int(done.result.content))
                await host.execute(ToolCall("c", "echo", {"text": word}))
                restarts = host.connections["s"].restarts
        with pytest.raises(RuntimeError, match="enter the host first"):
            await host.execute(ToolCall("c", "echo", {"text": "late"}))
        return pids, restarts

    pids, restarts = asyncio.run(main())
    assert len(set(pids)) == 2 and restarts == 0  # each entry's own server, none restarted
    assert log.read_text().splitlines() == [x for w in words for x in ("start", f"echo {w}")]
