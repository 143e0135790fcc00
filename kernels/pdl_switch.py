"""FREETOKEN_PDL, the switch for programmatic dependent launch (kernels/triton/pdl.py: what
each word does). Plain Python, no Triton: an engine checks the variable when it loads, so a
misspelt value fails there and not at the first CUDA step."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

# PDL's constexpr in a kernel: bit flags.
WAIT, RELEASE, PREFETCH = 1, 2, 4
LIGHT = 8  # not a kernel's: `launch` leaves the heavy kernels out
_WORDS = {"0": 0, "off": 0, "1": WAIT | RELEASE, "on": WAIT | RELEASE, "exit": WAIT,
          "prefetch": PREFETCH, "light": WAIT | RELEASE | LIGHT}  # fmt: skip

_override: str | None = None


def flags(value: str) -> int:
    """FREETOKEN_PDL's value as the kernels' PDL flags: 0 (off), or WAIT with RELEASE and/or
    PREFETCH. `prefetch` alone means `on,prefetch`."""
    words = [w.strip() for w in value.lower().replace("+", ",").split(",") if w.strip()]
    unknown = [w for w in words if w not in _WORDS]
    if unknown:
        raise ValueError(f"FREETOKEN_PDL: unknown {unknown}; say a list of {sorted(_WORDS)}")
    bits = 0
    for w in words:
        bits |= _WORDS[w]
    if bits & PREFETCH and not bits & WAIT:
        bits |= WAIT | RELEASE
    return bits


DEFAULT = "light"  # the twenty-third session, 48 layers: all resident b=1 296.1 -> 299.5 and
# b=4 664.2 -> 675.2 tok/s (`on`: 283.9 / 685.4); gpu-fill native 258.4 -> 265.3 and
# 511.9 -> 516.1 (bench/results/NOTES.md). FREETOKEN_PDL=off launches without PDL.


def _env_word() -> str:
    return os.environ.get("FREETOKEN_PDL", DEFAULT)


def requested() -> int:
    """The switch's flags: `override`'s value inside it, else FREETOKEN_PDL's."""
    return flags(_override if _override is not None else _env_word())


@contextmanager
def override(value: bool | str | None) -> Iterator[None]:
    """The switch inside the block, whatever the env says: True / False (`on` / off), or a
    FREETOKEN_PDL value; None: the environment's value."""
    global _override
    word = {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value
    flags(word if word is not None else _env_word())  # a bad value fails here, not at a launch
    before, _override = _override, word
    try:
        yield
    finally:
        _override = before
