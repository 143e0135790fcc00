"""MCP server configuration in the Cursor / Claude Desktop form, checked before anything starts.

    {"mcpServers": {
        "files": {"command": "python", "args": ["server.py", "/tmp/root"], "env": {"K": "v"}},
        "remote": {"url": "http://127.0.0.1:8000/mcp", "headers": {"Authorization": "Bearer x"}}
    }}

A server entry is stdio (`command`, optional `args`, `env`, `cwd`), streamable HTTP (`url`,
optional `headers`) or the older HTTP+SSE transport (`url` with `"type": "sse"`, or, as Cursor
reads it, a url whose path ends in `/sse`); `type` may say which ("stdio", "http",
"streamable-http", "sse"). In any of those strings `${env:NAME}` (Cursor's form) and `${NAME}`
or `${NAME:-default}` (Claude Code's) are replaced by the host's environment variable (an unset
one without a default is an error), so secrets and paths stay out of the file; Cursor's
`${userHome}`, `${workspaceFolder}` (the directory the host runs in), `${workspaceFolderBasename}`,
`${pathSeparator}` and `${/}` are what Cursor makes them. FreeToken's own
optional keys: `timeout` (seconds per tool call, default 60; it covers any sampling the server
asks of the local model during the call, so a slow model needs more), `startup_timeout` (seconds
to connect and list tools, default 30), `protocol` ("legacy", the default, "auto" or a protocol
version; see `ServerConfig.protocol`) and `disabled` (true: skip the entry). Keys other tools
put in these files (`autoApprove`, `description`, ...) are ignored with a log line, not refused:
one shared config file serves several hosts. Every error names the server and the key.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("freetoken.mcp")

DEFAULT_TIMEOUT = 60.0
DEFAULT_STARTUP_TIMEOUT = 30.0
_KNOWN = {
    "command",
    "args",
    "env",
    "cwd",
    "url",
    "headers",
    "type",
    "timeout",
    "startup_timeout",
    "protocol",
    "disabled",
}
# ${env:NAME} (Cursor), ${NAME} and ${NAME:-default} (Claude Code), ${/} (Cursor)
_ENV_REF = re.compile(r"\$\{(env:)?([A-Za-z_][A-Za-z0-9_]*|/)(?::-([^}]*))?\}")
# Cursor's own variables (its docs' "config interpolation"): the workspace is the directory the
# host runs in, as a project's tools are started from it.
_CURSOR_VARIABLES = {
    "userHome": lambda: str(Path.home()),
    "workspaceFolder": os.getcwd,
    "workspaceFolderBasename": lambda: Path.cwd().name,
    "pathSeparator": lambda: os.sep,
    "/": lambda: os.sep,
}
_TYPES = {
    "stdio": "stdio",
    "http": "http",
    "streamable-http": "http",
    "streamableHttp": "http",
    "sse": "sse",
}


class MCPConfigError(ValueError):
    """The MCP configuration is malformed; the message names the server and the key."""


@dataclass(slots=True)
class ServerConfig:
    """One server of the config. Owned by the MCPHost that parsed it."""

    name: str
    command: str | None = None  # stdio
    args: list[str] = field(default_factory=list)
    env: dict[str, str] | None = None  # merged over the SDK's safe default environment
    cwd: str | None = None
    url: str | None = None  # streamable HTTP, or HTTP+SSE where `sse`
    sse: bool = False  # the 2024-11-05 HTTP+SSE transport (Claude Code's "type": "sse")
    headers: dict[str, str] = field(default_factory=dict)
    timeout: float = DEFAULT_TIMEOUT
    startup_timeout: float = DEFAULT_STARTUP_TIMEOUT
    # "legacy" (the initialize handshake) by default: it is the only mode in which a server may
    # call `ctx.session.create_message` mid-call (sampling as every pre-2026 server does it); on
    # a 2026-07-28 connection that call fails for want of a back-channel. The 2026 resolver form
    # (`Sample`) works in both modes, so legacy costs servers nothing we use.
    protocol: str = "legacy"

    @property
    def transport(self) -> str:
        """stdio, http (streamable HTTP) or sse."""
        if self.command is not None:
            return "stdio"
        return "sse" if self.sse else "http"


def load_config(source: str | Path | Mapping[str, Any]) -> list[ServerConfig]:
    """The enabled servers of a config file (path) or an already-parsed dict, in file order."""
    if isinstance(source, Mapping):
        data: Any = source
    else:
        path = Path(source)
        try:
            data = json.loads(path.read_text())
        except OSError as e:
            raise MCPConfigError(f"cannot read MCP config {path}: {e}") from e
        except json.JSONDecodeError as e:
            raise MCPConfigError(f"MCP config {path} is not JSON: {e}") from e
    if not isinstance(data, Mapping) or not isinstance(data.get("mcpServers"), Mapping):
        raise MCPConfigError(
            'an MCP config is a JSON object with an "mcpServers" object mapping server names '
            "to entries"
        )
    servers = []
    for name, entry in data["mcpServers"].items():
        config = parse_server(name, entry)
        if config is not None:
            servers.append(config)
    return servers


def parse_server(name: Any, entry: Any) -> ServerConfig | None:
    """One entry checked field by field; None when it is disabled."""
    if not isinstance(name, str) or not name:
        raise MCPConfigError(f"MCP server names must be non-empty strings, got {name!r}")
    where = f"MCP server {name!r}"
    if not isinstance(entry, Mapping):
        raise MCPConfigError(f"{where}: the entry must be an object, got {type(entry).__name__}")
    if entry.get("disabled") is True:
        return None
    unknown = sorted(set(entry) - _KNOWN)
    if unknown:
        log.info("%s: ignoring keys this host does not use: %s", where, ", ".join(unknown))
    kind = entry.get("type")
    if kind is not None and kind not in _TYPES:
        supported = ", ".join(sorted(_TYPES))
        raise MCPConfigError(f"{where}: type {kind!r} is not supported (use one of {supported})")
    has_command, has_url = "command" in entry, "url" in entry
    if has_command == has_url:
        what = "both" if has_command else "neither"
        raise MCPConfigError(
            f"{where}: an entry needs exactly one of 'command' (a stdio server) or 'url' "
            f"(a streamable HTTP server); it has {what}"
        )
    if kind is not None and (_TYPES[kind] == "stdio") != has_command:
        raise MCPConfigError(f"{where}: type {kind!r} does not match the entry's command/url")
    config = ServerConfig(name=name)
    config.timeout = _seconds(entry, "timeout", DEFAULT_TIMEOUT, where)
    config.startup_timeout = _seconds(entry, "startup_timeout", DEFAULT_STARTUP_TIMEOUT, where)
    protocol = entry.get("protocol", "legacy")
    if not isinstance(protocol, str) or not protocol:
        raise MCPConfigError(f"{where}: 'protocol' must be a string such as 'legacy' or 'auto'")
    config.protocol = protocol
    if has_command:
        config.command = _text(entry, "command", where)
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise MCPConfigError(f"{where}: 'args' must be a list of strings")
        config.args = [expand_env(a, f"{where}, 'args'") for a in args]
        config.env = _strings(entry, "env", where) if "env" in entry else None
        config.cwd = _text(entry, "cwd", where) if entry.get("cwd") is not None else None
    else:
        config.url = _text(entry, "url", where)
        if not config.url.startswith(("http://", "https://")):
            raise MCPConfigError(f"{where}: 'url' must start with http:// or https://")
        config.headers = _strings(entry, "headers", where) if "headers" in entry else {}
        path = urlsplit(config.url).path.rstrip("/")
        config.sse = _TYPES.get(kind) == "sse" or (kind is None and path.endswith("/sse"))
    return config


def expand_env(text: str, where: str) -> str:
    """`text` with each `${env:NAME}`, `${NAME}` or `${NAME:-default}` replaced by that
    environment variable (the default where it is unset or empty, as the shell's `:-`), and
    Cursor's `${userHome}`, `${workspaceFolder}`, `${workspaceFolderBasename}`,
    `${pathSeparator}` and `${/}` by what Cursor puts there (the workspace: the current
    directory)."""

    def value(match: re.Match[str]) -> str:
        env, name, default = match.group(1), match.group(2), match.group(3)
        if not env and name in _CURSOR_VARIABLES:
            return _CURSOR_VARIABLES[name]()
        if name == "/":
            raise MCPConfigError(f"{where}: ${{env:/}} names no environment variable")
        if default is not None:
            return os.environ.get(name) or default
        if name not in os.environ:
            raise MCPConfigError(f"{where}: environment variable {name} is not set")
        return os.environ[name]

    return _ENV_REF.sub(value, text)


def _text(entry: Mapping[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise MCPConfigError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return expand_env(value, f"{where}, {key!r}")


def _strings(entry: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    value = entry.get(key)
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise MCPConfigError(f"{where}: {key!r} must map strings to strings")
    return {k: expand_env(v, f"{where}, {key!r}") for k, v in value.items()}


def _seconds(entry: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = entry.get(key, default)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise MCPConfigError(f"{where}: {key!r} must be a positive number of seconds")
    return float(value)
