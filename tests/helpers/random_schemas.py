"""Random JSON schemas for tool parameters and response formats: objects of scalar properties
(string, integer, boolean, enum), closed, with a random subset required."""

from __future__ import annotations

import random
import string
from collections.abc import Collection
from typing import Any


def random_name(rng: random.Random, avoid: Collection[str] = ()) -> str:
    """A lowercase identifier (tool, property or word), drawn again while it is in `avoid`."""
    while True:
        name = rng.choice(string.ascii_lowercase) + "".join(
            rng.choice(string.ascii_lowercase + "_") for _ in range(rng.randint(2, 8))
        )
        if name not in avoid:
            return name


def random_scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "boolean", "enum"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 99)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "amber"], rng.randint(1, 4))}
    return {"type": "boolean"}


def random_object_schema(rng: random.Random, avoid: Collection[str] = ()) -> dict[str, Any]:
    """One to four scalar properties, none named in `avoid`."""
    names = list(dict.fromkeys(random_name(rng, avoid) for _ in range(rng.randint(1, 4))))
    return {
        "type": "object",
        "properties": {n: random_scalar(rng) for n in names},
        "required": rng.sample(names, rng.randint(1, len(names))),
        "additionalProperties": False,
    }
