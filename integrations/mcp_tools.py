"""The host's tool index: which name the model sees for each server's tool, and where a call
by that name goes.

Each tool is offered under its own name, or as `server__tool` where two servers offer the same
name (`server__tool_2`, ... where that name is taken too), so every tool has a name of its own.

Servers' tool lists change while the host runs: a server announces a change
(notifications/tools/list_changed) and its connection lists the tools again, or a server that
exited is restarted and listed anew. Each connection counts its listings (`tools_generation`);
the index remembers the counts it was built from, so `stale` says whether a rebuild is due.
The host rebuilds only between model turns (`MCPHost._reindex`): the calls of one turn are
routed by the names the model saw when it wrote them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from freetoken_agent.integrations.mcp_connection import ServerConnection
from freetoken_agent.integrations.mcp_turn import openai_tool

SEPARATOR = "__"  # server__tool for names offered by more than one server


@dataclass(slots=True)
class Route:
    connection: ServerConnection
    tool: str  # the server's own name for it


class ToolIndex:
    def __init__(self) -> None:
        self.tools: list[dict[str, Any]] = []  # OpenAI-style, as the prompt shows them
        self.routes: dict[str, Route] = {}
        self._built_from: dict[str, int] = {}  # server name -> tools_generation indexed

    def stale(self, connections: Mapping[str, ServerConnection]) -> bool:
        """Whether a server was added, removed, or listed its tools since the last build."""
        return self._built_from != {n: c.tools_generation for n, c in connections.items()}

    def build(self, connections: Iterable[ServerConnection]) -> None:
        """Expose each tool under its own name, or `server__tool` when names collide. A
        renamed tool may meet a real one (server "b"'s "c" and another server's "b__c"), or a
        server may list a name twice: a numeric suffix then makes the name free, so every tool
        stays reachable. Names offered once keep theirs."""
        connections = list(connections)
        offers: dict[str, int] = {}
        for conn in connections:
            for tool in conn.tools:
                offers[tool.name] = offers.get(tool.name, 0) + 1
        taken = {name for name, n in offers.items() if n == 1}
        self.tools, self.routes = [], {}
        for conn in connections:
            for tool in conn.tools:
                name = tool.name
                if offers[name] > 1:
                    base = name = conn.name + SEPARATOR + tool.name
                    suffix = 1
                    while name in taken:
                        suffix += 1
                        name = f"{base}_{suffix}"
                    taken.add(name)
                self.routes[name] = Route(conn, tool.name)
                self.tools.append(openai_tool(name, tool))
        self._built_from = {conn.name: conn.tools_generation for conn in connections}
