"""MCPHost when its servers change under it: a server that announces a new tool list, one that
comes back from a restart with other tools, one that exits while idle.

The model's turns come from a `ScriptedEngine` (tests/helpers/) where a test needs several calls
in one turn; the rest calls tools through `host.execute`. Tool names, descriptions and texts are
drawn fresh per run; each server logs what it did, so a test can tell what the server saw.
"""

from __future__ import annotations

import asyncio
import json
import random
import string
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError
from mcp_servers import LOGGING_SERVER
from scripted_engine import ScriptedEngine

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.mcp_connection import ServerConnection
from freetoken_agent.integrations.mcp_host import MCPHost, RunResult
from freetoken_agent.messages import ToolCall, ToolResult
from freetoken_agent.service import EngineService

# Tools can be added and dropped by calling `add` and `drop`; each tool's description is its
# name reversed (a text the conversation itself never holds, so only the tool list shows it).
CHANGING_SERVER = """
import sys
from mcp.server import MCPServer
from mcp.server.mcpserver import Context

app = MCPServer("changing", log_level="WARNING")

def offer(name):
    app.add_tool(lambda: name + ":ran", name=name, description="the tool " + name[::-1])

async def changed(ctx):
    await ctx.session.send_tool_list_changed()  # to clients of the protocols before 2026-07-28
    await ctx.notify_tools_changed()  # on the 2026-07-28 subscriptions/listen stream

@app.tool()
async def add(name: str, ctx: Context) -> str:
    offer(name)
    await changed(ctx)
    return "added " + name

@app.tool()
async def drop(name: str, ctx: Context) -> str:
    app.remove_tool(name)
    await changed(ctx)
    return "dropped " + name

for name in sys.argv[1:]:
    offer(name)
app.run("stdio")
"""

# Its n-th start (counted in the log) offers `<word>_<n>`, beside `crash`.
PHOENIX_SERVER = """
import os, sys
from mcp.server import MCPServer

log, word = sys.argv[1], sys.argv[2]
with open(log, "a+") as f:
    f.seek(0)
    n = len(f.read().splitlines())
    f.write("start\\n")
app = MCPServer("phoenix", log_level="WARNING")
app.tool(name=f"{word}_{n}")(lambda: f"life {n}")

@app.tool()
def crash() -> str:
    os._exit(5)

app.run("stdio")
"""


@pytest.fixture(scope="module")
def real_engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=2048)


def _word(rng: random.Random) -> str:
    return "t" + "".join(rng.choice(string.ascii_lowercase) for _ in range(9))


def _stdio(tmp_path: Path, source: str, *args: str) -> dict[str, Any]:
    script = tmp_path / "server.py"
    script.write_text(source)
    return {"command": sys.executable, "args": [str(script), *args]}


def _call(tool: str, **arguments: Any) -> str:
    """A call as the demo model's chat format writes it (Hermes)."""
    call = json.dumps({"name": tool, "arguments": arguments})
    return f"<tool_call>\n{call}\n</tool_call>\n"


def _names(tools: list[dict[str, Any]] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or []}


async def _until(condition: Callable[[], bool], seconds: float = 10.0) -> None:
    """Wait (bounded) for `condition`; the caller's assertions say what it meant."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("protocol", ["legacy", "auto", "2026-07-28"])
def test_a_changed_tool_list_reaches_the_next_turn_not_this_one(
    real_engine, tmp_path, rng_seed, protocol
):
    """Under every protocol setting: the 2026-07-28 protocol tells a change only on the
    subscription the host opens (it was never opened: the list stayed stale)."""
    rng = random.Random(rng_seed)
    old, new = _word(rng), _word(rng)
    fake = ScriptedEngine(real_engine)
    fake.replies = [
        (_call("add", name=new) + _call(new), "stop"),  # the turn that adds it cannot call it
        (_call(new) + _call("drop", name=old), "stop"),
        (_call(old), "stop"),
        (f"done {_word(rng)}", "stop"),
    ]
    server = {**_stdio(tmp_path, CHANGING_SERVER, old), "protocol": protocol}
    config = {"mcpServers": {"changing": server}}

    async def main(service: EngineService) -> tuple[RunResult, MCPHost]:
        async with MCPHost.from_config(config, engine=service) as host:
            assert _names(host.tools) == {"add", "drop", old}
            return await host.run("go", max_steps=6), host

    with EngineService(fake) as service:
        result, host = asyncio.run(main(service))
    assert result.stop_reason == "answer" and result.steps == 4, result.error
    added, early, called, dropped, gone = (m for m in result.messages if isinstance(m, ToolResult))
    assert added.content == f"added {new}" and not added.is_error
    # Routed by the names the model saw when it wrote the call: not yet the new one.
    assert early.is_error and f"unknown tool {new!r}" in early.content
    assert called.content == f"{new}:ran" and not called.is_error
    assert dropped.content == f"dropped {old}" and not dropped.is_error
    assert gone.is_error and f"unknown tool {old!r}" in gone.content
    assert new in gone.content  # the available tools it lists are the current ones
    # What each turn's prompt offered: the descriptions appear in the tool list only.
    prompts = [real_engine.tokenizer.decode(ids) for ids in fake.prompts]
    described = [
        {name for name in (old, new) if f"the tool {name[::-1]}" in prompt} for prompt in prompts
    ]
    assert described == [{old}, {old, new}, {new}, {new}]
    assert _names(host.tools) == _names(host.session.tools) == {"add", "drop", new}
    assert set(host.routes) == {"add", "drop", new}


def test_a_restarted_server_is_indexed_anew(real_engine, tmp_path, rng_seed):
    word = _word(random.Random(rng_seed))
    log = tmp_path / "starts.log"
    config = {"mcpServers": {"phoenix": _stdio(tmp_path, PHOENIX_SERVER, str(log), word)}}

    async def main() -> list[ToolResult]:
        async with MCPHost.from_config(config, engine=real_engine) as host:
            assert _names(host.tools) == {"crash", f"{word}_0"}
            out = []
            for name in ("crash", f"{word}_0", f"{word}_1"):
                out.append((await host.execute(ToolCall("c", name, {}))).result)
            assert _names(host.tools) == _names(host.session.tools) == {"crash", f"{word}_1"}
            assert set(host.routes) == {"crash", f"{word}_1"}
            return out

    crashed, stale, fresh = asyncio.run(main())
    assert crashed.is_error and "exited while running tool 'crash'" in crashed.content
    assert stale.is_error and f"{word}_0" in stale.content  # the restarted server's answer
    assert fresh.content == "life 1" and not fresh.is_error
    assert log.read_text() == "start\n" * 2


def test_a_server_that_exits_while_idle_is_restarted_by_the_next_call(
    real_engine, tmp_path, rng_seed
):
    rng = random.Random(rng_seed)
    words = [_word(rng) for _ in range(3)]
    log = tmp_path / "calls.log"
    config = {"mcpServers": {"idler": _stdio(tmp_path, LOGGING_SERVER, str(log))}}

    async def main() -> dict[str, ToolResult]:
        async with MCPHost.from_config(config, engine=real_engine) as host:
            conn = host.connections["idler"]

            async def call(name: str, **arguments: Any) -> ToolResult:
                return (await host.execute(ToolCall("c", name, arguments))).result

            out = {"first": await call("echo", text=words[0]), "crash": await call("crash")}
            out["after_crash"] = await call("echo", text=words[1])
            out["bye"] = await call("quit_soon")
            # The server exits 0.2 s after answering; its connection notices the end.
            await _until(lambda: not conn.running)
            out["after_idle_exit"] = await call("echo", text=words[2])
            out["restarts"] = conn.restarts
            return out

    out = asyncio.run(main())
    assert out["first"].content == f"echo:{words[0]}"
    # Died during the call: said so, and not sent again (the tool may have had effects).
    crash = out["crash"]
    assert crash.is_error and "exited while running tool 'crash'" in crash.content
    assert out["after_crash"].content == f"echo:{words[1]}" and not out["after_crash"].is_error
    assert out["bye"].content == "bye"
    idle = out["after_idle_exit"]
    assert idle.content == f"echo:{words[2]}" and not idle.is_error, idle.content
    assert out["restarts"] == 2
    calls = ["start", f"echo {words[0]}", "crash", "start", f"echo {words[1]}", "start"]
    assert log.read_text().splitlines() == [*calls, f"echo {words[2]}"]


def test_a_call_refused_by_a_closed_connection_is_sent_again(
    real_engine, tmp_path, rng_seed, monkeypatch
):
    """The call path alone, without the owner's watch (as when a call starts in the moment
    between the server's exit and the watch hearing of it): the SDK refuses to write to a
    closed connection, so the server never saw the call, which is sent on a new one."""
    monkeypatch.setattr(ServerConnection, "_transport_closed", lambda *_: None, raising=False)
    words = [_word(random.Random(rng_seed)) for _ in range(2)]
    log = tmp_path / "calls.log"
    config = {"mcpServers": {"idler": _stdio(tmp_path, LOGGING_SERVER, str(log))}}

    async def main() -> tuple[ToolResult, bool]:
        async with MCPHost.from_config(config, engine=real_engine) as host:
            conn = host.connections["idler"]
            await host.execute(ToolCall("c", "echo", {"text": words[0]}))
            await host.execute(ToolCall("c", "quit_soon", {}))
            client, closed = conn._client, False
            deadline = time.monotonic() + 10
            while not closed and time.monotonic() < deadline:  # until the SDK knows it is gone
                try:
                    await client.list_tools()
                    await asyncio.sleep(0.02)
                except MCPError:
                    closed = True
            assert closed and conn.running  # gone, and nothing told the connection
            done = await host.execute(ToolCall("c", "echo", {"text": words[1]}))
            return done.result, conn.restarts

    result, restarts = asyncio.run(main())
    assert result.content == f"echo:{words[1]}" and not result.is_error, result.content
    assert restarts == 1
    calls = ["start", f"echo {words[0]}", "start", f"echo {words[1]}"]
    assert log.read_text().splitlines() == calls
