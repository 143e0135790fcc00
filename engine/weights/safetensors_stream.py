"""A safetensors file written tensor by tensor from other safetensors files' bytes.

    pieces = [Piece.of(path, name) ...]            # where each tensor lies in its source file
    write(dst, pieces, {"format": "pt"})            # dst: header, then each piece's bytes

`convert` moves a checkpoint's dense tensors (every tensor but the routed experts) into one file.
safetensors' own writers take the tensors in memory, all at once: 15-40 GB for the dense part of
the largest MoE checkpoints, more than the machines this runs on may have. The format is a
little-endian u64 header length, a JSON header (dtype, shape and [begin, end) byte offsets into
the data that follows, which the offsets must cover without a hole) and the data; the bytes of
a tensor are the same in any safetensors file, so they are copied through a small buffer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

_CHUNK = 16 << 20  # bytes copied at a time
# Bytes an element takes, by safetensors' dtype names (the rest take one).
# The float dtypes by safetensors' names, as torch names them.
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
_ELEMENT_SIZES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4,
                  "F16": 2, "BF16": 2, "I16": 2, "U16": 2}  # fmt: skip


def read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data begins (the file was opened by
    safetensors already, so it is well formed)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


@dataclass(frozen=True, slots=True)
class Piece:
    """One tensor's bytes in a source file."""

    path: Path
    name: str
    dtype: str  # safetensors' name: "BF16", "F32", ...
    shape: tuple[int, ...]
    start: int  # in the file
    size: int  # bytes

    @classmethod
    def of(cls, path: Path, name: str, header: dict, data_start: int) -> Piece:
        entry = header[name]
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        return cls(path, name, entry["dtype"], shape, data_start + begin, end - begin)


def write(
    dst: Path,
    pieces: Sequence[Piece],
    metadata: dict[str, str],
    done: Callable[[int], object] = lambda n: None,
) -> None:
    """`dst` holding `pieces`, the widest dtypes first (as safetensors orders them: the data
    starts 8-byte aligned, so each tensor then starts at a multiple of its element size, which
    a zero-copy reader may need); `done(bytes)` after each copy (a progress bar)."""
    pieces = sorted(pieces, key=lambda p: -_ELEMENT_SIZES.get(p.dtype, 1))  # stable
    header: dict = {"__metadata__": metadata}
    at = 0
    for p in pieces:
        offsets = [at, at + p.size]
        header[p.name] = {"dtype": p.dtype, "shape": list(p.shape), "data_offsets": offsets}
        at += p.size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data 8-byte aligned
    with open(dst, "wb") as out:
        out.write(len(blob).to_bytes(8, "little"))
        out.write(blob)
        for p in pieces:
            with open(p.path, "rb") as src:
                src.seek(p.start)
                left = p.size
                while left:
                    chunk = src.read(min(left, _CHUNK))
                    if not chunk:
                        raise OSError(f"{p.path} ends inside tensor {p.name}")
                    out.write(chunk)
                    left -= len(chunk)
            done(p.size)
