"""A small MCP file server (stdio) confined to one root directory.

    python examples/mcp_file_server.py /path/to/root        # or MCP_FILE_ROOT=/path/to/root

Tools: `list_files(path)`, `read_file(path)`, `write_file(path, content)`. Paths are relative to
the root; any path that resolves outside it (`..`, an absolute path, a symlink pointing out) is
refused with an error the model can read. Written with the SDK's `MCPServer`; anticipated
failures raise `ToolError`, whose message reaches the client (any other exception is reported
by the SDK as a bare "Error executing tool", which would tell the model nothing).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

MAX_READ_BYTES = 64 * 1024  # a model's context is small: refuse to dump huge files into it
ROOT_ENV = "MCP_FILE_ROOT"


def build_server(root: Path) -> MCPServer:
    root = root.resolve()
    if not root.is_dir():
        raise SystemExit(f"mcp_file_server: root {root} is not a directory")
    server = MCPServer(
        "files",
        instructions=f"Files under one root directory ({root.name}); paths are relative to it.",
        log_level="WARNING",  # stderr is for trouble: hosts quote its tail when we fail
    )

    def inside(path: str) -> Path:
        """The root-confined absolute path for `path`; ToolError if it escapes the root."""
        target = (root / path).resolve()  # resolves `..` and symlinks before the check
        if target != root and root not in target.parents:
            raise ToolError(f"path {path!r} is outside the server's root directory; refused")
        return target

    @server.tool()
    def list_files(path: str = ".") -> str:
        """List the files and directories under `path` (relative to the root), one per line;
        directories end with '/'."""
        target = inside(path)
        if not target.is_dir():
            raise ToolError(f"{path!r} is not a directory")
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
        return "\n".join(names) if names else "(empty directory)"

    @server.tool()
    def read_file(path: str) -> str:
        """Read a UTF-8 text file (relative to the root)."""
        target = inside(path)
        if not target.is_file():
            raise ToolError(f"{path!r} is not a file")
        if target.stat().st_size > MAX_READ_BYTES:
            raise ToolError(f"{path!r} is larger than {MAX_READ_BYTES} bytes")
        try:
            return target.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ToolError(f"{path!r} is not UTF-8 text") from e

    @server.tool()
    def write_file(path: str, content: str) -> str:
        """Write `content` to a text file (relative to the root), creating directories."""
        target = inside(path)
        if target == root or target.is_dir():
            raise ToolError(f"{path!r} is a directory")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
        return f"wrote {len(content.encode('utf-8'))} bytes to {path}"

    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=os.environ.get(ROOT_ENV))
    args = parser.parse_args(argv)
    if not args.root:
        parser.error(f"give the root directory as an argument or in ${ROOT_ENV}")
    build_server(Path(args.root)).run("stdio")


if __name__ == "__main__":
    main()
