"""How an MCP host's connections come back from their servers' failures
(integrations/mcp_connection.py): an HTTP server that restarted (our session id unknown to
it) gets a new session and the call is sent once; calls that find a crashed server together
restart it once; the restart budget counts restarts in a row, so occasional crashes over a
long session never exhaust it; the tail of a server's stderr is quoted whatever bytes it ends
in. Words, counts and payloads are drawn fresh per run; each server logs what it did, so a
test can tell what the server saw."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import string
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mcp_servers import LOGGING_SERVER, free_port

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations import mcp_stderr
from freetoken_agent.integrations.mcp_connection import MAX_RESTARTS
from freetoken_agent.integrations.mcp_host import MCPHost
from freetoken_agent.messages import ToolCall, ToolResult

# Starts once; every later start exits before it can answer.
ONCE_SERVER = LOGGING_SERVER.replace(
    'note("start")',
    'note("start")\nif open(log).read().count("start") > 1:\n    sys.exit(3)',
)

# Its `freeze` blocks the server's event loop: it answers nothing more.
HUNG_SERVER = LOGGING_SERVER.replace(
    "@app.tool()\ndef pid()",
    "@app.tool()\nasync def freeze() -> str:\n    import time\n    time.sleep(600)\n"
    "    return 'never'\n\n@app.tool()\ndef pid()",
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=2048)


def _word(rng: random.Random) -> str:
    return "w" + "".join(rng.choice(string.ascii_lowercase) for _ in range(8))


def _script(tmp_path: Path, source: str = LOGGING_SERVER) -> Path:
    script = tmp_path / "server.py"
    script.write_text(source)
    return script


def _stdio(script: Path, log: Path) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(script), str(log)]}


async def _call(host: MCPHost, name: str, **arguments: Any) -> ToolResult:
    return (await host.execute(ToolCall("c", name, arguments))).result


def _launch(script: Path, log: Path, port: int) -> subprocess.Popen:
    """The server over HTTP, once it listens."""
    server = subprocess.Popen(
        [sys.executable, str(script), str(log), str(port)], stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, "no HTTP server"
            time.sleep(0.05)


def test_a_restarted_http_server_gets_a_new_session(engine, tmp_path, rng_seed):
    """The restarted server answers 404 to the old session id: the host opens a new session
    and sends the call there, once (before, every later call failed "Session not found")."""
    rng = random.Random(rng_seed)
    words = [_word(rng) for _ in range(rng.randint(2, 4))]
    script, log, port = _script(tmp_path), tmp_path / "calls.log", free_port()
    server = _launch(script, log, port)
    config = {"mcpServers": {"web": {"url": f"http://127.0.0.1:{port}/mcp", "timeout": 20}}}

    async def main() -> list[ToolResult]:
        nonlocal server
        async with MCPHost.from_config(config, engine=engine) as host:
            out = [await _call(host, "echo", text=words[0])]
            server.kill()
            server.wait(timeout=10)
            server = _launch(script, log, port)
            out += [await _call(host, "echo", text=w) for w in words[1:]]
            return out

    try:
        results = asyncio.run(main())
    finally:
        server.kill()
        server.wait(timeout=10)
    for result, word in zip(results, words, strict=True):
        assert result.content == f"echo:{word}" and not result.is_error, result.content
    lines = ["start", f"echo {words[0]}", "start", *(f"echo {w}" for w in words[1:])]
    assert log.read_text().splitlines() == lines


def test_calls_that_find_a_crashed_server_together_restart_it_once(engine, tmp_path, rng_seed):
    n = random.Random(rng_seed).randint(2, 5)
    log = tmp_path / "calls.log"
    config = {"mcpServers": {"s": _stdio(_script(tmp_path), log)}}

    async def main() -> tuple[list[ToolResult], int]:
        async with MCPHost.from_config(config, engine=engine) as host:
            crashed = await _call(host, "crash")
            assert crashed.is_error and "exited while running tool 'crash'" in crashed.content
            results = await asyncio.gather(*(_call(host, "pid") for _ in range(n)))
            return list(results), host.connections["s"].restarts

    results, restarts = asyncio.run(main())
    assert all(not r.is_error for r in results), [r.content for r in results]
    assert len({r.content for r in results}) == 1  # one process answered them all
    assert restarts == 1 and log.read_text().splitlines() == ["start", "crash", "start"]


def test_the_restart_budget_counts_restarts_in_a_row(engine, tmp_path, rng_seed):
    """More crashes than MAX_RESTARTS, each followed by a call that comes back, never exhaust
    the budget; a server that cannot start again is given up after MAX_RESTARTS tries."""
    rng = random.Random(rng_seed)
    crashes = MAX_RESTARTS + rng.randint(1, 2)
    log = tmp_path / "calls.log"
    config = {"mcpServers": {"s": _stdio(_script(tmp_path), log)}}

    async def main() -> list[ToolResult]:
        async with MCPHost.from_config(config, engine=engine) as host:
            out = []
            for _ in range(crashes):
                await _call(host, "crash")
                out.append(await _call(host, "echo", text=_word(rng)))
            return out

    for result in asyncio.run(main()):
        assert not result.is_error and result.content.startswith("echo:"), result.content

    once_log = tmp_path / "once.log"
    once = {"mcpServers": {"s": _stdio(_script(tmp_path, ONCE_SERVER), once_log)}}

    async def given_up() -> list[ToolResult]:
        async with MCPHost.from_config(once, engine=engine) as host:
            await _call(host, "crash")
            return [await _call(host, "pid") for _ in range(MAX_RESTARTS + 1)]

    results = asyncio.run(given_up())
    assert all(r.is_error for r in results)
    assert f"restarted {MAX_RESTARTS}x in a row" in results[-1].content, results[-1].content
    assert once_log.read_text().count("start") == 1 + MAX_RESTARTS


def test_the_stderr_tail_is_quoted_whatever_bytes_it_ends_in(engine, tmp_path, rng_seed):
    """A tail read from a byte offset inside a multi-byte character: quoted, not dropped
    (the text file's read raised UnicodeDecodeError, and the error came without it)."""
    rng = random.Random(rng_seed)
    # 3-byte characters, then 1 or 2 ASCII bytes: the tail's first byte (6000 from the end,
    # a multiple of 3) falls inside a character.
    tail = "€" * rng.randint(2100, 3000) + "\n" + rng.choice(["", _word(rng)[1]])
    config = {"mcpServers": {"s": _stdio(_script(tmp_path), tmp_path / "calls.log")}}

    async def main() -> tuple[ToolResult, str]:
        async with MCPHost.from_config(config, engine=engine) as host:
            result = await _call(host, "crash", tail=tail)
            return result, host.connections["s"].stderr_tail()

    result, quoted = asyncio.run(main())
    # (The host cuts the tool result to its token budget: the connection's tail is whole.)
    assert result.is_error and "its stderr ended with:\n€€€" in result.content, result.content
    assert quoted == tail.strip()[-len(quoted) :] and len(quoted) > 1000


def test_a_chatty_servers_stderr_is_cut_to_its_tail(engine, tmp_path, rng_seed):
    """A server writing to stderr on every call: the captured file stays near its bound
    (cut to its tail before each call) and the tail quoted in errors is still the latest."""
    rng = random.Random(rng_seed)
    config = {"mcpServers": {"s": _stdio(_script(tmp_path), tmp_path / "calls.log")}}
    chunk = mcp_stderr.KEPT // rng.randint(2, 5)  # several calls pass the bound

    async def main() -> tuple[list[int], str, str]:
        sizes = []
        async with MCPHost.from_config(config, engine=engine) as host:
            captured = host.connections["s"]._captured.file
            for i in range(rng.randint(8, 12)):
                text = f"[{i}:{_word(rng)}]"
                result = await _call(host, "shout", text=text, times=chunk // len(text) + 1)
                assert not result.is_error, result.content
                sizes.append(os.fstat(captured.fileno()).st_size)
            last = text
            crashed = await _call(host, "crash", tail=end)
            return sizes, last, host.connections["s"].stderr_tail(), crashed.content

    end = f"the end {_word(rng)}"
    sizes, last, tail, crashed = asyncio.run(main())
    assert max(sizes) <= mcp_stderr.KEPT + 2 * chunk + 4 * mcp_stderr.TAIL, sizes
    assert min(sizes[2:]) < chunk * 2, sizes  # cut
    # The latest text, whole: the last call's shouts, then the crash's words.
    assert tail.endswith(last + end) and "its stderr ended with:" in crashed, (tail, crashed)


def test_a_server_that_stops_answering_is_restarted_by_the_next_call(engine, tmp_path, rng_seed):
    """A tool that blocks its server's loop times out; the probe after it gets no answer, so
    the next call restarts the server (it waited out the whole timeout, as every later call
    did: the restarts covered only servers that exit)."""
    rng = random.Random(rng_seed)
    assert "async def freeze" in HUNG_SERVER
    log = tmp_path / "server.log"
    timeout = rng.choice([1.5, 2.0])
    config = {"mcpServers": {"h": {**_stdio(_script(tmp_path, HUNG_SERVER), log),
                                   "timeout": timeout}}}  # fmt: skip
    text = _word(rng)

    async def main() -> tuple[ToolResult, ToolResult, float]:
        async with MCPHost.from_config(config, engine=engine) as host:
            frozen = await _call(host, "freeze")
            start = time.monotonic()
            echoed = await _call(host, "echo", text=text)
            return frozen, echoed, time.monotonic() - start

    frozen, echoed, seconds = asyncio.run(main())
    assert frozen.is_error and "timed out" in frozen.content, frozen
    assert "the next call restarts it" in frozen.content, frozen
    assert echoed.content == f"echo:{text}" and not echoed.is_error, echoed
    assert seconds < timeout + 20
    assert log.read_text().count("start") == 2
