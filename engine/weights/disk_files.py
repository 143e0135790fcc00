"""Files convert writes: their disk blocks reserved before a mapped write fills them (a full
disk is then an OSError naming the file, not a SIGBUS in the write), and synced to the disk
before the checkpoint is read back and renamed into place."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def allocate(path: Path, nbytes: int) -> None:
    """Create `path` with `nbytes` of disk blocks reserved (posix_fallocate; elsewhere the
    file is only sized, and a full disk shows up in the mapped write)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    why = f"{path}: no room for {nbytes} bytes ({e.strerror})"
                    raise OSError(e.errno, why) from e
                os.ftruncate(fd, nbytes)  # a file system without fallocate
        else:
            os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def synced(path: Path) -> None:
    """Write a file to the disk and drop it from the page cache (where the OS allows), so a
    read-back reads the disk rather than the pages just written."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
