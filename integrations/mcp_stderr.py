"""A stdio MCP server's stderr, captured to quote its last lines in error messages (a server
that fails to start or dies mid-call usually says why there). One file for a connection's
life: restarts append to it. It is cut to its tail once it grows past KEPT bytes, since a
server that logs every request would otherwise fill the disk over a long session."""

from __future__ import annotations

import os
import tempfile
from typing import TextIO

TAIL = 1500  # characters quoted in error messages
KEPT = 256 * 1024  # bytes past which the file is cut to its tail


class CapturedStderr:
    def __init__(self) -> None:
        self.file: TextIO = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in close())

    def bound(self) -> None:
        """Cut the file to its tail once it is past KEPT. The server's stderr is the same open
        file (the offset shared with ours): setting the offset after the kept tail makes the
        server's next write land there, not past a hole."""
        if self.file.closed:
            return
        try:
            fd = self.file.fileno()
            end = os.fstat(fd).st_size
            if end <= KEPT:
                return
            tail = os.pread(fd, 4 * TAIL, end - 4 * TAIL)
            os.ftruncate(fd, 0)
            os.pwrite(fd, tail, 0)
            os.lseek(fd, len(tail), os.SEEK_SET)
        except (OSError, ValueError):
            pass  # a diagnostic only: never a reason for a call to fail

    def tail(self) -> str:
        """The last TAIL characters the server wrote."""
        if self.file.closed:
            return ""
        try:
            fd = self.file.fileno()
            end = os.fstat(fd).st_size
            # Bytes, decoded leniently: the offset may fall inside a multi-byte character.
            start = max(0, end - 4 * TAIL)
            data = os.pread(fd, end - start, start)
        except (OSError, ValueError):
            return ""
        return data.decode("utf-8", "replace")[-TAIL:].strip()

    def close(self) -> None:
        self.file.close()
