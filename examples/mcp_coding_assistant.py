"""A coding assistant: the local model drives the example file server through MCPHost.

    python examples/mcp_coding_assistant.py                      # the demo model (random weights)
    python examples/mcp_coding_assistant.py --model PATH --max-tokens 256 --task "..."

It makes a temporary project directory, starts the servers of `examples/mcp_servers.json` with
`MCP_FILE_ROOT` pointing there, and runs the agent loop with the first turn forced to call
`list_files(".")` (tool_choice, with the path pinned by the grammar). The demo model's weights
are random, so after that forced call its text is gibberish and it may call nothing: the forced
turn is what makes the loop (tool call -> server -> result -> next turn) run all the same.
A real checkpoint (`--model`) lists, reads and answers on its own.

The config is Cursor's format; two adjustments happen here, not in the file: the command
"python" becomes this interpreter (the one with `mcp` installed) and relative script paths are
resolved from the repository root, so the example runs from any directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from freetoken_agent import Engine
from freetoken_agent.demo_model import DEMO_NOTICE, ensure_demo_model
from freetoken_agent.integrations.mcp_config import MCPConfigError
from freetoken_agent.integrations.mcp_host import MCPHost, RunResult
from freetoken_agent.messages import AssistantMessage, Message, ToolResult

HERE = Path(__file__).resolve().parent
PROJECT = {
    "README.md": "# calc\nA tiny calculator package.\n",
    "calc.py": "def add(a, b):\n    return a + b\n",
}
SYSTEM = "You are a coding assistant. Use the file tools to inspect the project before answering."


def load_servers(path: Path) -> dict:
    try:
        config = json.loads(path.read_text())
    except OSError as e:  # said as the host says it (main prints one line)
        raise MCPConfigError(f"cannot read MCP config {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise MCPConfigError(f"MCP config {path} is not JSON: {e}") from e
    servers = config.get("mcpServers") if isinstance(config, dict) else None
    for entry in servers.values() if isinstance(servers, dict) else ():  # (else the host says)
        if isinstance(entry, dict) and entry.get("command") == "python":
            entry["command"] = sys.executable
        if isinstance(entry, dict):
            entry.setdefault("cwd", str(HERE.parent))
    return config


def format_transcript(messages: list[Message]) -> str:
    """One line or block per message, for people reading the run."""
    lines = []
    for msg in messages:
        if isinstance(msg, AssistantMessage):
            if msg.reasoning:
                lines.append(f"[assistant thinking] {msg.reasoning!r}")
            if msg.content:
                lines.append(f"[assistant] {msg.content!r}")
            lines += [f"[tool call] {c.name}({json.dumps(c.arguments)})" for c in msg.tool_calls]
        elif isinstance(msg, ToolResult):
            label = "tool error" if msg.is_error else "tool result"
            lines.append(f"[{label}] {msg.name}: {msg.content!r}")
        else:
            lines.append(f"[{msg.role}] {msg.content!r}")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> RunResult:
    model = Path(args.model) if args.model else ensure_demo_model()
    engine = Engine.load(model, device=args.device, progress=False, max_model_len=args.context)
    with tempfile.TemporaryDirectory(prefix="freetoken-mcp-") as root:
        for name, text in PROJECT.items():
            Path(root, name).write_text(text)
        os.environ["MCP_FILE_ROOT"] = root  # read by the config's ${env:MCP_FILE_ROOT}
        host = MCPHost.from_config(
            load_servers(Path(args.config)),
            engine=engine,
            system=SYSTEM,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
        )
        async with host:
            for name, why in host.failures.items():
                print(f"server {name} did not start: {why}", file=sys.stderr)
            if not any(t["function"]["name"] == "list_files" for t in host.tools):
                raise SystemExit(f"no server of {args.config} offers list_files: nothing to do")
            print("tools:", ", ".join(t["function"]["name"] for t in host.tools))
            choice = {"type": "function", "function": {"name": "list_files"}}
            choice["function"]["arguments"] = {"path": "."}
            result = await host.run(args.task, max_steps=args.max_steps, tool_choice=choice)
    print(format_transcript(result.messages))
    print(f"-- {result.steps} model turn(s), stopped: {result.stop_reason}")
    if not args.model:
        print(DEMO_NOTICE)
    return result


def main(argv: list[str] | None = None) -> RunResult:
    """Runs the example; a config the host refuses ends it with its reason (exit status 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the demo model)")
    parser.add_argument("--config", default=str(HERE / "mcp_servers.json"))
    parser.add_argument("--task", default="What does this project do? Look at its files.")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--context", type=int, default=4096, help="max_model_len")
    try:
        return asyncio.run(run(parser.parse_args(argv)))
    except MCPConfigError as e:
        raise SystemExit(f"{parser.prog}: {e}") from None


if __name__ == "__main__":
    main()
