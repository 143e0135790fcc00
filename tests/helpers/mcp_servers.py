"""MCP test servers and helpers shared by the MCP host's tests (test_mcp_restarts.py,
test_mcp_host_choices.py, test_mcp_host.py)."""

from __future__ import annotations

import socket

# Logs its starts and calls (argv[1]); `crash` ends the process in the call; `quit_soon`
# answers, then exits while the host is idle. Over stdio, or over streamable HTTP on the port
# argv[2].
LOGGING_SERVER = """
import os, sys, threading
from mcp.server import MCPServer

log = sys.argv[1]
def note(line):
    with open(log, "a") as f:
        f.write(line + "\\n")

note("start")
app = MCPServer("logged", log_level="WARNING")

@app.tool(description="echo the text")
def echo(text: str) -> str:
    note("echo " + text)
    return "echo:" + text

@app.tool()
def pid() -> str:
    return str(os.getpid())

@app.tool()
def shout(text: str, times: int) -> str:
    sys.stderr.write(text * times)
    sys.stderr.flush()
    return "ok"

@app.tool()
def quit_soon() -> str:
    threading.Timer(0.2, lambda: os._exit(0)).start()
    return "bye"

@app.tool()
def crash(tail: str = "") -> str:
    note("crash")
    sys.stderr.write(tail)
    sys.stderr.flush()
    os._exit(7)

if len(sys.argv) > 2:
    app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
else:
    app.run("stdio")
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
