"""An FTW folder's files beside the banks: the dense weights (dense.safetensors) and the files
copied from the HF folder (config.json, generation_config.json, the tokenizer and its chat
templates). Their CRC32s, recorded in the manifest by convert ("dense_crc32", "files"), and
the check `verify` makes of them, beside the banks' rows: a damaged or cut-short file is found
by `freetoken verify`, not at the next load (or never, for a flipped bit in a weight or a
rope_theta in config.json). Manifests written before a field existed are checked for a
readable dense file only."""

from __future__ import annotations

import zlib
from pathlib import Path

from freetoken_agent.engine.weights.loader import CheckpointError, opened

FIELD = "dense_crc32"
FILES = "files"  # {path inside the folder: CRC32} of the copied files
_CHUNK = 16 << 20  # bytes read at a time


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def copied_crc32s(folder: Path, names: list[str]) -> dict[str, int]:
    """{name: CRC32} of the files `names` (paths inside `folder`), for the manifest."""
    return {name: file_crc32(folder / name) for name in names}


def file_problem(folder: Path, manifest: dict) -> str | None:
    """What is wrong with the folder's dense file or a copied file (None: nothing found)."""
    copied = manifest.get(FILES)
    for name, want in copied.items() if isinstance(copied, dict) else ():
        path = folder / name
        try:
            if file_crc32(path) != want:
                return f"{path} fails its checksum (the manifest's {FILES}): the file is damaged"
        except OSError as e:
            return f"{path} cannot be read: {e.strerror or e}"
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
