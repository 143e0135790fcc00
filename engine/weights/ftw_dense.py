"""An FTW folder's dense weights (dense.safetensors): its CRC32, recorded in the manifest by
convert ("dense_crc32"), and the check `verify` makes of it, beside the banks' rows: a damaged
or cut-short dense file is found by `freetoken verify`, not at the next load (or never, for a
flipped bit in a weight). Manifests written before the field existed are checked for a
readable file only."""

from __future__ import annotations

import zlib
from pathlib import Path

from freetoken_agent.engine.weights.loader import CheckpointError, opened

FIELD = "dense_crc32"
_CHUNK = 16 << 20  # bytes read at a time


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def dense_problem(folder: Path, manifest: dict) -> str | None:
    """What is wrong with the folder's dense file (None: nothing found)."""
    path = folder / manifest["dense"]
    want = manifest.get(FIELD)
    try:
        if want is not None and file_crc32(path) != want:
            return f"{path} fails its checksum (the manifest's {FIELD}): the file is damaged"
    except OSError as e:  # gone, or unreadable: said as the damage it is
        return f"{path} cannot be read: {e.strerror or e}"
    try:
        with opened(path) as f:
            f.keys()
    except CheckpointError as e:
        return str(e)
    return None
