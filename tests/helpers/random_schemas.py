"""Random JSON schemas for tool parameters and response formats: objects of scalar properties
(string, integer, boolean, enum), closed, with a random subset required."""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Collection
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


def random_instance(
    rng: random.Random, schema: dict[str, Any], root: dict[str, Any] | None = None
) -> Any:
    """A random value valid against `schema` (the shapes drawn above, and arrays of them with
    a maxItems, and "#/$defs/..." $refs into `root`, the whole schema)."""
    root = schema if root is None else root
    if "$ref" in schema:
        return random_instance(rng, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        keys = [k for k in props if k in schema["required"] or rng.random() < 0.5]
        return {k: random_instance(rng, props[k], root) for k in keys}
    if kind == "array":  # never past the schema's own cap
        count = rng.randint(0, schema.get("maxItems", 2))
        return [random_instance(rng, schema["items"], root) for _ in range(count)]
    if kind == "string":
        alphabet = string.ascii_letters + ' "\\<>/_'
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, schema["maxLength"])))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    return rng.choice([True, False])


def random_tools(rng: random.Random, parameters: Callable[[random.Random], dict]) -> list[dict]:
    """1-3 OpenAI function tools with distinct random names and `parameters(rng)` each; at least
    one strict, the others strict half the time."""
    names: list[str] = []
    while len(names) < rng.randint(1, 3):
        names.append(random_name(rng, names))
    strict = rng.randrange(len(names))
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": parameters(rng),
                "strict": i == strict or rng.random() < 0.5,
            },
        }
        for i, name in enumerate(names)
    ]
