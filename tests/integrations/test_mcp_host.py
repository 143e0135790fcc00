"""MCPHost against real stdio MCP servers (the example file server and tiny scripts written here),
driven by the demo model (random weights) on the CPU.

A random model cannot be asked to pick a file, so every tool call that matters is forced: the
first turn runs under tool_choice with the arguments pinned by the grammar (constrained
decoding), and what the test checks is everything after the model: routing, the server's work,
hooks, the result fed back into the next prompt, and the failures the host must survive. File
names, contents and sampling prompts are drawn fresh per run.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import string
import subprocess
import sys
import time
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from mcp_servers import free_port

from freetoken_agent import Engine, Session, ToolHooks, UserMessage
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.mcp_config import MCPConfigError, load_config
from freetoken_agent.integrations.mcp_host import MCPHost, RunResult, StepStart, ToolExecuted
from freetoken_agent.messages import AssistantMessage, ToolCall, ToolResult
from freetoken_agent.parsers import ContentDelta, ToolCallEnd, parser_factory_for
from freetoken_agent.service import EngineService
from freetoken_agent.session import Usage

REPO = Path(__file__).resolve().parents[2]
FILE_SERVER = REPO / "examples" / "mcp_file_server.py"
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

# A server whose tools misbehave on purpose; the file server sits beside it in the same host.
FAULTY_SERVER = """
import os, sys, anyio
from mcp.server import MCPServer

app = MCPServer("faulty", log_level="WARNING")

@app.tool()
def crash(note: str) -> str:
    print("faulty: dying on purpose", file=sys.stderr, flush=True)
    os._exit(7)

@app.tool()
async def sleepy(seconds: float) -> str:
    await anyio.sleep(seconds)
    return "woke up"

@app.tool()
def echo(text: str) -> str:
    return "echo:" + text

app.run("stdio")
"""

# A server that asks the client's model, once the deprecated way (a mid-call request on the
# session) and once through the 2026 resolver (`Sample`).
SAMPLING_SERVER = """
import json
from typing import Annotated
import mcp_types as types
from mcp.server import MCPServer
from mcp.server.mcpserver import Context, Resolve, Sample

app = MCPServer("asker", log_level="WARNING")

def _message(text):
    return types.SamplingMessage(role="user", content=types.TextContent(type="text", text=text))

@app.tool()
async def ask(question: str, system: str, stop: str, max_tokens: int, ctx: Context) -> str:
    r = await ctx.session.create_message(
        [_message(question)], max_tokens=max_tokens, system_prompt=system, temperature=0.0,
        stop_sequences=[stop],
    )
    return json.dumps({"text": r.content.text, "model": r.model, "stop": r.stop_reason})

def _sample(question: str):
    return Sample([_message(question)], max_tokens=5, temperature=0.0)

@app.tool()
async def ask_resolved(
    question: str, answer: Annotated[types.CreateMessageResult, Resolve(_sample)]
) -> str:
    return json.dumps({"text": answer.content.text, "stop": answer.stop_reason})

app.run("stdio")
"""


# The same over streamable HTTP, which also shows the configured headers arrive.
HTTP_SERVER = """
import sys
import mcp_types as types
from mcp.server import MCPServer
from mcp.server.mcpserver import Context

app = MCPServer("web", log_level="WARNING")

@app.tool()
def whoami(ctx: Context) -> str:
    return (ctx.headers or {}).get("x-token", "<no header>")

@app.tool()
async def ask(question: str, ctx: Context) -> str:
    content = types.TextContent(type="text", text=question)
    r = await ctx.session.create_message(
        [types.SamplingMessage(role="user", content=content)], max_tokens=6, temperature=0.0
    )
    return r.content.text

app.run(sys.argv[2], host="127.0.0.1", port=int(sys.argv[1]))
"""


# A bare JSON-RPC server whose `lookup` answers with the error code and message it is given,
# the codes the SDK also uses for its own timeout and lost connection. It logs each start.
RAW_ERROR_SERVER = """
import json, sys
code, message, log = int(sys.argv[1]), sys.argv[2], sys.argv[3]
open(log, "a").write("start\\n")
schema = {"type": "object", "properties": {}}
tools = [{"name": n, "inputSchema": schema} for n in ("lookup", "ping")]
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
              "serverInfo": {"name": "raw", "version": "0"}}})
    elif method == "tools/list":
        send({"jsonrpc": "2.0", "id": mid, "result": {"tools": tools}})
    elif method == "tools/call" and msg["params"]["name"] == "lookup":
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": code, "message": message}})
    elif method == "tools/call":
        pong = {"content": [{"type": "text", "text": "pong"}]}
        send({"jsonrpc": "2.0", "id": mid, "result": pong})
    else:
        send({"jsonrpc": "2.0", "id": mid, "result": {}})
"""

# `dump` returns n random characters drawn from `seed` (the test draws the same).
DUMP_SERVER = """
import random, string
from mcp.server import MCPServer

app = MCPServer("dump", log_level="WARNING")

@app.tool()
def dump(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_letters + " ") for _ in range(n))

app.run("stdio")
"""

# A tool taking a pydantic model: its input schema holds the model under "$defs" and refers to it
# by "$ref", as FastMCP writes every structured parameter.
BOX_SERVER = """
from typing import Literal
from pydantic import BaseModel
from mcp.server import MCPServer

app = MCPServer("boxes", log_level="WARNING")

class Box(BaseModel):
    color: Literal["red", "green", "blue"]
    big: bool

@app.tool()
def paint(box: Box, label: str) -> str:
    return f"{label}:{box.color}:{box.big}"

app.run("stdio")
"""

# Offers the tools named on its command line; each answers with its server's and its own name.
NAMED_TOOLS_SERVER = """
import sys
from mcp.server import MCPServer

server, names = sys.argv[1], sys.argv[2:]
app = MCPServer(server, log_level="WARNING")
for name in names:
    app.tool(name=name)(lambda name=name: f"{server}:{name}")
app.run("stdio")
"""


# --- fixtures and helpers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    # float64: a greedy reference run and the host's run cannot differ by a near-tied argmax.
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(
        path, device="cpu", dtype="float64", progress=False, kv_tokens=8192, max_model_len=2048
    )


def _word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(string.ascii_lowercase + string.digits) for _ in range(n))


def _text(rng: random.Random) -> str:
    alphabet = string.ascii_letters + string.digits + " .,:;-_/é€\n"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(20, 120)))


def _project(root: Path, rng: random.Random) -> dict[str, str]:
    files = {f"{_word(rng, rng.randint(3, 10))}.{rng.choice(['txt', 'py', 'md'])}": _text(rng)}
    while len(files) < rng.randint(2, 5):
        files[f"{_word(rng, rng.randint(3, 10))}.txt"] = _text(rng)
    for name, text in files.items():
        (root / name).write_text(text, encoding="utf-8")
    return files


def _stdio(script: Path, *args: str, **extra: Any) -> dict[str, Any]:
    return {"command": sys.executable, "args": [str(script), *args], **extra}


def _forced(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _results(result: RunResult) -> list[ToolResult]:
    return [m for m in result.messages if isinstance(m, ToolResult)]


def _local_answer(
    engine: Engine, question: str, system: str | None, max_tokens: int, stop: list[str]
) -> str:
    """What the local model answers a one-message sampling request, computed directly."""
    session = Session(engine, system=system, parser_factory=parser_factory_for(engine))
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "stop": stop}
    events = session.send([UserMessage(question)], sampling)
    return "".join(e.text for e in events if isinstance(e, ContentDelta))


def _host(config: dict, engine: Engine, **options: Any) -> MCPHost:
    # Enough for a forced call with pinned arguments: a call cut by max_tokens is void.
    options.setdefault("max_tokens", 48)
    options.setdefault("temperature", 0.0)
    return MCPHost.from_config({"mcpServers": config}, engine=engine, **options)


# --- tests ---------------------------------------------------------------------------------
def test_tools_are_listed_and_namespaced_when_names_collide(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    roots = {}
    for name in ("alpha", "beta"):
        roots[name] = tmp_path / name
        roots[name].mkdir()
    files = {name: _project(root, rng) for name, root in roots.items()}

    async def main() -> None:
        async with _host({"only": _stdio(FILE_SERVER, str(roots["alpha"]))}, engine) as host:
            names = [t["function"]["name"] for t in host.tools]
            assert sorted(names) == ["list_files", "read_file", "write_file"]
            read = next(t for t in host.tools if t["function"]["name"] == "read_file")
            assert read["type"] == "function"
            assert read["function"]["parameters"]["required"] == ["path"]
            assert host.session.tools == host.tools and not host.failures
        config = {name: _stdio(FILE_SERVER, str(root)) for name, root in roots.items()}
        async with _host(config, engine) as host:
            names = {t["function"]["name"] for t in host.tools}
            tools = ("list_files", "read_file", "write_file")
            assert names == {f"{server}__{tool}" for server in roots for tool in tools}
            name, text = next(iter(files["beta"].items()))
            done = await host.execute(ToolCall("c1", "beta__read_file", {"path": name}))
            assert done.server == "beta" and not done.result.is_error
            assert done.result.content == text

    asyncio.run(main())


def test_forced_read_file_result_reaches_the_next_prompt(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    files = _project(tmp_path, rng)
    name = rng.choice(sorted(files))
    seen: list[tuple[str, str]] = []
    hooks = ToolHooks()
    hooks.after.append(
        lambda call, result, session: seen.append((call.name, result.content)) or result
    )

    async def main() -> tuple[list[Any], Session]:
        config = {"files": _stdio(FILE_SERVER, str(tmp_path))}
        async with _host(config, engine, hooks=hooks) as host:
            question = f"What is in {_word(rng, 6)}?"
            events = [
                e
                async for e in host.stream(
                    question, max_steps=2, tool_choice=_forced("read_file", path=name)
                )
            ]
            return events, host.session

    events, session = asyncio.run(main())
    result = events[-1]
    assert isinstance(result, RunResult) and result.steps == 2
    call_msg = result.messages[1]
    assert isinstance(call_msg, AssistantMessage) and len(call_msg.tool_calls) == 1
    call = call_msg.tool_calls[0]
    assert (call.name, call.arguments) == ("read_file", {"path": name})
    tool_result = result.messages[2]
    assert isinstance(tool_result, ToolResult) and tool_result.tool_call_id == call.id
    assert tool_result.content == files[name] and not tool_result.is_error
    assert seen == [("read_file", files[name])]  # the session's hooks ran
    # The second turn's prompt, as the session rendered and sent it, carries the file.
    prompt = session.last_prompt
    assert files[name] in prompt.text and tool_result in prompt.messages
    assert session.anchor_for(call.id) is not None
    kinds = [type(e) for e in events]
    assert kinds[0] is StepStart and events[0].forced == "read_file"
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [(e.id, e.name) for e in ends[:1]] == [(call.id, "read_file")]
    assert kinds.index(ToolCallEnd) < kinds.index(Usage) < kinds.index(ToolExecuted)
    assert sum(isinstance(e, StepStart) for e in events) == 2


def test_a_forced_call_of_a_tool_with_defs_keeps_to_them(engine, tmp_path, rng_seed):
    """A tool whose parameter is a pydantic model (its schema under $defs, referred to by
    $ref): the forced call's grammar holds the model's fields, and the server takes the call.
    Nested under the call's "arguments", the refs resolved nowhere and the turn failed."""
    rng = random.Random(rng_seed)
    script = tmp_path / "boxes.py"
    script.write_text(BOX_SERVER)
    label = _word(rng, rng.randint(1, 8))

    async def main() -> RunResult:
        async with _host({"boxes": _stdio(script)}, engine, max_tokens=96) as host:
            choice = _forced("paint", label=label)
            return await host.run(_word(rng, 6), max_steps=1, tool_choice=choice)

    result = asyncio.run(main())
    assert result.stop_reason == "max_steps", result.error  # the grammar compiled
    call_msg = result.messages[1]
    assert isinstance(call_msg, AssistantMessage) and len(call_msg.tool_calls) == 1, result
    box = call_msg.tool_calls[0].arguments["box"]
    assert set(box) == {"color", "big"} and box["color"] in ("red", "green", "blue")
    assert isinstance(box["big"], bool)
    [tool_result] = _results(result)
    assert not tool_result.is_error, tool_result.content
    assert tool_result.content == f"{label}:{box['color']}:{box['big']}"


def test_paths_escaping_the_root_are_refused(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    root = tmp_path / "root"
    root.mkdir()
    _project(root, rng)
    secret = tmp_path / f"{_word(rng, 8)}.txt"
    secret.write_text(_text(rng))
    outside = tmp_path / f"{_word(rng, 8)}.txt"
    attempts = [
        ("read_file", {"path": f"../{secret.name}"}),
        ("read_file", {"path": str(secret)}),
        ("write_file", {"path": f"../{outside.name}", "content": _text(rng)}),
        ("list_files", {"path": ".."}),
    ]

    async def main() -> list[ToolResult]:
        out = []
        async with _host({"files": _stdio(FILE_SERVER, str(root))}, engine) as host:
            for tool, arguments in attempts:
                choice = _forced(tool, **arguments)
                # Long pinned paths and contents: room for the whole call (512 tokens).
                sampling = {"max_tokens": 512}
                result = await host.run("go", max_steps=1, tool_choice=choice, sampling=sampling)
                assert result.stop_reason == "max_steps", result.messages
                out += _results(result)
        return out

    for result in asyncio.run(main()):
        assert result.is_error and "outside the server's root" in result.content
        assert secret.read_text() not in result.content
    assert not outside.exists()


def test_crash_timeout_and_unknown_tool_are_error_results(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    files = _project(tmp_path, rng)
    faulty = tmp_path / "faulty_server.py"
    faulty.write_text(FAULTY_SERVER)
    broken = tmp_path / "broken_server.py"
    broken.write_text("import sys\nprint('broken: no config', file=sys.stderr)\nsys.exit(3)\n")
    config = {
        "files": _stdio(FILE_SERVER, str(tmp_path)),
        "faulty": _stdio(faulty, timeout=1),
        "broken": _stdio(broken),
    }
    name = rng.choice(sorted(files))
    word = _word(rng, 10)

    async def main() -> dict[str, Any]:
        async with _host(config, engine) as host:
            out: dict[str, Any] = {"failures": dict(host.failures)}
            for label, choice in [
                ("crash", _forced("crash", note=word)),
                ("after_crash", _forced("read_file", path=name)),
                ("restarted", _forced("echo", text=word)),
                ("timeout", _forced("sleepy", seconds=30)),
                ("after_timeout", _forced("echo", text=word[::-1])),
            ]:
                out[label] = _results(await host.run("go", max_steps=1, tool_choice=choice))[0]
            out["unknown"] = (await host.execute(ToolCall("x1", f"no_{word}", {}))).result
        return out

    out = asyncio.run(main())
    assert list(out["failures"]) == ["broken"] and "broken: no config" in out["failures"]["broken"]
    assert out["crash"].is_error and "exited while running tool 'crash'" in out["crash"].content
    assert "dying on purpose" in out["crash"].content  # the server's stderr tail
    assert out["after_crash"].content == files[name] and not out["after_crash"].is_error
    assert out["restarted"].content == "echo:" + word and not out["restarted"].is_error
    assert out["timeout"].is_error and "timed out after 1 s" in out["timeout"].content
    assert out["after_timeout"].content == "echo:" + word[::-1]
    unknown = out["unknown"]
    assert unknown.is_error and f"no_{word}" in unknown.content
    for tool in ("read_file", "crash", "sleepy", "echo"):
        assert tool in unknown.content


def test_names_made_for_collisions_never_meet_real_ones(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    script = tmp_path / "named.py"
    script.write_text(NAMED_TOOLS_SERVER)
    a, b, x = (f"s{i}{_word(rng, 4)}" for i in range(3))
    tool = _word(rng, 5)
    # a's real names are exactly what b's `tool` would be renamed to, and its first suffix.
    offers = {a: [f"{b}__{tool}", f"{b}__{tool}_2"], b: [tool], x: [tool]}
    config = {server: _stdio(script, server, *names) for server, names in offers.items()}

    async def main() -> tuple[list[str], dict[str, str]]:
        async with _host(config, engine) as host:
            names = [t["function"]["name"] for t in host.tools]
            answers = {}
            for name in names:
                done = await host.execute(ToolCall("c", name, {}))
                assert not done.result.is_error, done.result.content
                answers[name] = done.result.content
            return names, answers

    names, answers = asyncio.run(main())
    assert len(names) == len(set(names)) == 4
    # Every tool of every server is reachable, each under a name of its own.
    expected = {f"{server}:{name}" for server, names in offers.items() for name in names}
    assert set(answers.values()) == expected
    assert answers[f"{b}__{tool}"] == f"{a}:{b}__{tool}"  # real names keep theirs
    assert answers[f"{x}__{tool}"] == f"{x}:{tool}"


def test_server_errors_with_the_sdks_own_codes_are_tool_errors(engine, tmp_path, rng_seed):
    """-32000 (JSON-RPC's "server error", the SDK's CONNECTION_CLOSED) and -32001 (the SDK's
    REQUEST_TIMEOUT) answered by a healthy server: its message, no restart, no timeout."""
    rng = random.Random(rng_seed)
    script = tmp_path / "raw.py"
    script.write_text(RAW_ERROR_SERVER)
    codes = {"closed": -32000, "late": -32001}
    messages = {name: f"record {rng.randrange(10**6)} {_word(rng, 8)}" for name in codes}
    logs = {name: tmp_path / f"{name}.log" for name in codes}
    config = {
        name: _stdio(script, str(code), messages[name], str(logs[name]), timeout=30)
        for name, code in codes.items()
    }

    async def main() -> dict[str, list[ToolExecuted]]:
        out: dict[str, list[ToolExecuted]] = {name: [] for name in codes}
        async with _host(config, engine) as host:
            for name in codes:  # more errors than MAX_RESTARTS, then a good call
                for tool in ["lookup"] * 5 + ["ping"]:
                    out[name].append(await host.execute(ToolCall("c", f"{name}__{tool}", {})))
        return out

    for name, calls in asyncio.run(main()).items():
        for done in calls[:-1]:
            assert done.result.is_error and done.seconds < 10
            assert done.result.content == f"tool 'lookup' failed: {messages[name]}"
        assert not calls[-1].result.is_error and calls[-1].result.content == "pong"
        assert logs[name].read_text() == "start\n"  # never restarted


# A server of resources only: it declares no tools capability and answers tools/list with
# "method not found", as a server that does not implement it must.
NO_TOOLS_SERVER = """
import json, sys
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
for line in sys.stdin:
    msg = json.loads(line)
    mid, method = msg.get("id"), msg.get("method")
    if mid is None:
        continue
    if method == "initialize":
        send({"jsonrpc": "2.0", "id": mid, "result": {"capabilities": {"resources": {}},
              "protocolVersion": msg["params"]["protocolVersion"],
              "serverInfo": {"name": "docs", "version": "0"}}})
    else:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "no " + method}})
"""


def test_a_server_without_tools_starts_with_none(engine, tmp_path, rng_seed):
    """A resources-only server (no tools capability) starts, with no tools, beside a server
    with tools (it was reported as failed to start: "Method not found")."""
    rng = random.Random(rng_seed)
    script = tmp_path / "docs.py"
    script.write_text(NO_TOOLS_SERVER)
    raw = tmp_path / "raw.py"
    raw.write_text(RAW_ERROR_SERVER)
    docs, tools = _word(rng, 6), _word(rng, 6)
    config = {docs: _stdio(script), tools: _stdio(raw, "-32000", "x", str(tmp_path / "l.log"))}

    async def main() -> tuple[dict, list[str], ToolExecuted, list[str]]:
        async with _host(config, engine) as host:
            names = [t["function"]["name"] for t in host.tools]
            pong = await host.execute(ToolCall("c", "ping", {}))
            return dict(host.failures), names, pong, sorted(host.connections)

    failures, names, pong, connected = asyncio.run(main())
    assert failures == {} and connected == sorted([docs, tools])
    assert sorted(names) == ["lookup", "ping"]  # the docs server's: none
    assert pong.result.content == "pong" and not pong.result.is_error


def test_long_tool_results_are_cut_to_fit_the_context(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    script = tmp_path / "dump.py"
    script.write_text(DUMP_SERVER)
    n, seed = rng.randint(20_000, 80_000), rng.randrange(2**31)
    pick = random.Random(seed).choice
    full = "".join(pick(string.ascii_letters + " ") for _ in range(n))
    choice = _forced("dump", n=n, seed=seed)

    async def main(**options: Any) -> RunResult:
        async with _host({"dump": _stdio(script)}, engine, **options) as host:
            return await host.run("go", max_steps=2, tool_choice=choice)

    cut = asyncio.run(main())
    assert cut.stop_reason in ("answer", "max_steps") and cut.steps == 2, cut.error
    (result,) = _results(cut)
    text, marker = result.content.rsplit("\n", 1)
    limit = engine.max_model_len // 4  # the default
    assert full.startswith(text) and limit // 2 < len(engine.tokenizer.encode(text)) <= limit
    assert marker.startswith(f"[... {n - len(text)} characters cut")
    # Past the cap's protection: a result the context cannot hold ends the run, said so.
    whole = asyncio.run(main(max_result_tokens=10**6))
    assert whole.stop_reason == "error" and whole.steps == 1
    assert "no longer fits the model's context" in whole.error
    assert _results(whole)[0].content == full  # the history as it stands


def test_server_sampling_is_answered_by_the_local_model(engine, tmp_path, rng_seed):
    rng = random.Random(rng_seed)
    script = tmp_path / "asker.py"
    script.write_text(SAMPLING_SERVER)
    question, system = _text(rng), _text(rng)
    max_tokens = rng.randint(6, 14)

    def local(system: str | None, max_tokens: int, stop: list[str]) -> str:
        return _local_answer(engine, question, system, max_tokens, stop)

    free = local(system, max_tokens, [])
    # Random weights may write bytes that are no UTF-8: the stream holds them back and its end
    # flushes them as U+FFFD, which no stop string can meet (seed 2531560096: '-tocol' then four
    # of them, and the stop cut among them), so the stop comes from the text before them.
    text = free.split("\ufffd")[0]
    if len(text) >= 4:  # a stop string from inside the free answer must cut the answer there
        cut = rng.randrange(1, len(text) - 2)
        stop, reason = text[cut : cut + 2], "stopSequence"
    else:  # the model ended at once: a stop string it never writes
        stop, reason = "\u2603\u2603", None
    expected = local(system, max_tokens, [stop])
    assert reason is None or len(expected) < len(free)

    async def main() -> tuple[dict, dict, Any]:
        async with _host({"asker": _stdio(script)}, engine) as host:
            args = {"question": question, "system": system, "stop": stop, "max_tokens": max_tokens}
            room = {"max_tokens": 512}  # the pinned texts are long
            first = await host.run(
                "go", max_steps=1, tool_choice=_forced("ask", **args), sampling=room
            )
            choice = _forced("ask_resolved", question=question)
            second = await host.run("go", max_steps=1, tool_choice=choice, sampling=room)
            replies = [_results(r)[0] for r in (first, second)]
            assert not any(r.is_error for r in replies), replies
            return json.loads(replies[0].content), json.loads(replies[1].content), host

    answer, resolved, host = asyncio.run(main())
    assert answer["text"] == expected and answer["model"] == host.model_name
    assert answer["stop"] == reason or (reason is None and answer["stop"] != "stopSequence")
    assert resolved["text"] == local(None, 5, [])
    assert [r.server for r in host.sampler.log] == ["asker", "asker"]
    assert host.sampler.log[0].system == system and host.sampler.log[0].max_tokens == max_tokens


@pytest.mark.parametrize("status", [401, 403, 500])
def test_an_http_server_refusing_the_start_is_named_with_its_status(engine, rng_seed, status):
    """Streamable HTTP: the SDK says only "Server returned an error response"; the failure
    now names the status (and, for 401/403, the headers to check)."""
    import http.server
    import threading

    class Refusing(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _refuse(self) -> None:
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_POST = do_GET = do_DELETE = _refuse

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    name = _word(random.Random(rng_seed), 6)
    url = f"http://127.0.0.1:{server.server_address[1]}/mcp"

    async def main() -> dict[str, str]:
        entry = {"url": url, "headers": {"Authorization": "Bearer x"}, "startup_timeout": 20}
        async with _host({name: entry}, engine) as host:
            return dict(host.failures)

    try:
        failures = asyncio.run(main())
    finally:
        server.shutdown()
    said = failures[name]
    assert f"HTTP {status} " in said, said
    assert ("check the credentials" in said) == (status in (401, 403)), said


@pytest.mark.parametrize("transport", ["streamable-http", "sse"])
def test_http_server_with_headers_and_sampling(engine, tmp_path, rng_seed, transport):
    """Streamable HTTP, and the older HTTP+SSE transport (Claude Code's `"type": "sse"`, or a
    url ending in /sse as Cursor reads it; the config refused it)."""
    rng = random.Random(rng_seed)
    script = tmp_path / "web.py"
    script.write_text(HTTP_SERVER)
    port, token, question = free_port(), _word(rng, 16), _word(rng, 12)
    server = subprocess.Popen(
        [sys.executable, str(script), str(port), transport],
        stderr=subprocess.DEVNULL,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 20
        while True:  # uvicorn listening?
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, "no HTTP server"
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}"
        config = {"web": {"url": url, "headers": {"X-Token": token}, "timeout": 20}}
        if transport == "sse" and rng.random() < 0.5:
            config["web"]["type"] = "sse"  # else read from the path

        async def main() -> list[ToolResult]:
            async with _host(config, engine) as host:
                assert sorted(host.routes) == ["ask", "whoami"]
                out = []
                for choice in (_forced("whoami"), _forced("ask", question=question)):
                    out += _results(await host.run("go", max_steps=1, tool_choice=choice))
                return out

        whoami, asked = asyncio.run(main())
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert whoami.content == token and not whoami.is_error
    assert asked.content == _local_answer(engine, question, None, 6, []) and not asked.is_error


def test_leaving_a_stream_early_aborts_the_turn(engine, rng_seed):
    """No servers at all (a host may have none); the consumer walks away mid-answer."""
    question = _text(random.Random(rng_seed))

    async def main(service: EngineService) -> int:
        seen = 0
        async with _host({}, service) as host:
            assert host.tools == [] and host.session.tools is None
            room = {"max_tokens": 2000, "ignore_eos": True}
            async with aclosing(host.stream(question, sampling=room)) as events:
                async for event in events:
                    seen += isinstance(event, ContentDelta)
                    if seen == 3:
                        break
            for _ in range(200):  # the turn's thread aborts at its next token
                with service.lock:
                    if not service.engine.has_unfinished():
                        return seen
                await asyncio.sleep(0.01)
        return -1

    with EngineService(engine) as service:
        assert asyncio.run(main(service)) == 3
        stats = service.stats()["requests"]
        assert stats["running"] == stats["waiting"] == 0


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"args": ["x"]}, "exactly one of 'command'"),
        ({"command": "x", "url": "http://h/mcp"}, "it has both"),
        ({"command": "x", "args": "a b"}, "'args' must be a list of strings"),
        ({"command": "x", "env": {"A": 1}}, "'env' must map strings to strings"),
        ({"url": "ftp://h/mcp"}, "'url' must start with http"),
        ({"url": "http://h/mcp", "headers": ["x"]}, "'headers' must map"),
        ({"command": "x", "timeout": -1}, "'timeout' must be a positive number"),
        ({"command": "x", "type": "sse"}, "does not match"),
        ({"url": "http://h/mcp", "type": "websocket"}, "type 'websocket' is not supported"),
        ({"url": "http://h/mcp", "type": "stdio"}, "does not match"),
        ({"command": "x", "args": ["${env:FREETOKEN_TEST_UNSET_VAR}"]}, "is not set"),
        ({"url": "http://h/mcp", "headers": {"A": "${FREETOKEN_TEST_UNSET_VAR}"}}, "is not set"),
        ("python", "the entry must be an object"),
    ],
)
def test_config_errors_name_the_server(entry, message, rng_seed):
    name = f"srv_{rng_seed}"
    with pytest.raises(MCPConfigError) as info:
        load_config({"mcpServers": {"fine": {"command": "ok"}, name: entry}})
    assert name in str(info.value) and message in str(info.value)


def test_config_file_forms(tmp_path, monkeypatch, rng_seed):
    value = _word(random.Random(rng_seed), 12)
    monkeypatch.setenv("FREETOKEN_TEST_TOKEN", value)
    path = tmp_path / "servers.json"
    monkeypatch.delenv("FREETOKEN_TEST_UNSET_VAR", raising=False)
    fallback = _word(random.Random(rng_seed + 1), 8)
    servers = {
        "a": {"command": "run", "args": ["--k", "${env:FREETOKEN_TEST_TOKEN}"], "alwaysAllow": []},
        "b": {"url": "http://127.0.0.1:1/mcp", "headers": {"X": "t ${env:FREETOKEN_TEST_TOKEN}"}},
        "c": {"command": "off", "disabled": True},
        # Claude Code's forms: ${NAME}, ${NAME:-default}, and "type": "sse"
        "d": {"type": "sse", "url": "http://127.0.0.1:1/events",
              "headers": {"A": "${FREETOKEN_TEST_TOKEN}",
                          "B": f"${{FREETOKEN_TEST_UNSET_VAR:-{fallback}}}"}},
        "e": {"url": "http://127.0.0.1:1/sse/"},  # an SSE endpoint by its path, as Cursor
        "f": {"type": "http", "url": "http://127.0.0.1:1/sse"},  # said otherwise: as said
        # Cursor's own variables (they are no environment variables)
        "g": {"command": "run", "args": ["${userHome}${/}x", "${workspaceFolder}",
                                         "${workspaceFolderBasename}${pathSeparator}"]},
    }  # fmt: skip
    path.write_text(json.dumps({"mcpServers": servers}))
    monkeypatch.chdir(tmp_path)
    a, b, d, e, f, g = load_config(path)
    home, here = str(Path.home()), str(tmp_path)
    assert g.args == [f"{home}{os.sep}x", here, f"{tmp_path.name}{os.sep}"]
    assert (a.name, a.transport, a.args) == ("a", "stdio", ["--k", value])
    assert (b.name, b.transport, b.headers) == ("b", "http", {"X": f"t {value}"})
    assert (d.transport, d.headers) == ("sse", {"A": value, "B": fallback})
    assert (e.transport, f.transport) == ("sse", "http")
    path.write_text("{not json")
    with pytest.raises(MCPConfigError, match="is not JSON"):
        load_config(path)
    with pytest.raises(MCPConfigError, match="mcpServers"):
        load_config({"servers": {}})


def test_coding_assistant_example_runs(monkeypatch, capsys):
    sys.path.insert(0, str(REPO / "examples"))
    monkeypatch.setenv("MCP_FILE_ROOT", "")  # restored after the test; the example sets it
    try:
        import mcp_coding_assistant as example
    finally:
        sys.path.remove(str(REPO / "examples"))
    args = ["--max-tokens", "32", "--max-steps", "2", "--device", "cpu", "--context", "2048"]
    result = example.main(args)
    calls = [c for m in result.messages if isinstance(m, AssistantMessage) for c in m.tool_calls]
    assert (calls[0].name, calls[0].arguments) == ("list_files", {"path": "."})
    listing = _results(result)[0]
    assert not listing.is_error and listing.content.split("\n") == sorted(example.PROJECT)
    out = capsys.readouterr().out
    assert "[tool call] list_files" in out and "model turn(s), stopped:" in out


@pytest.mark.parametrize(
    "config, said",
    [
        ({"servers": {}}, "mcpServers"),
        ({"mcpServers": {"ghost": {"command": "/nonexistent/freetoken-mcp"}}}, "list_files"),
        ('{"mcpServers": {"files": {"command": "x"},}}', "is not JSON"),  # a trailing comma
        (None, "cannot read MCP config"),  # no such file
    ],
)
def test_coding_assistant_example_says_why_it_cannot_run(config, said, tmp_path, monkeypatch):
    """A config the host refuses, one whose server does not start, one that is no JSON or no
    file: the example exits with one line saying so (it ended in a KeyError, ValueError,
    JSONDecodeError or FileNotFoundError traceback)."""
    sys.path.insert(0, str(REPO / "examples"))
    monkeypatch.setenv("MCP_FILE_ROOT", "")
    try:
        import mcp_coding_assistant as example
    finally:
        sys.path.remove(str(REPO / "examples"))
    path = tmp_path / "servers.json"
    if config is not None:
        path.write_text(config if isinstance(config, str) else json.dumps(config))
    with pytest.raises(SystemExit) as done:
        example.main(["--config", str(path), "--device", "cpu", "--context", "1024"])
    assert said in str(done.value.code)


def test_a_forced_call_cut_by_max_tokens_ends_the_run_as_an_error(engine, tmp_path, rng_seed):
    """A forced call's JSON cut short is no answer: the run ends with stop_reason "error" and
    says max_tokens cut it (it was reported as the model's answer, its half-written JSON as
    the text); no tool ran."""
    rng = random.Random(rng_seed)
    root = tmp_path / "project"
    root.mkdir()
    name = next(iter(_project(root, rng)))
    max_tokens = rng.randint(4, 10)  # the pinned path alone is longer

    async def main() -> RunResult:
        async with _host({"files": _stdio(FILE_SERVER, str(root))}, engine) as host:
            choice = _forced("read_file", path=name + "/" + _word(rng, 40))
            return await host.run("go", max_steps=2, tool_choice=choice,
                                  sampling={"max_tokens": max_tokens})  # fmt: skip

    result = asyncio.run(main())
    assert result.stop_reason == "error", (result.stop_reason, result.answer)
    assert f"max_tokens ({max_tokens}) cut it" in result.error
    assert not _results(result)
