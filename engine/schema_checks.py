"""Structural checks of a JSON schema and OpenAI's `response_format`, with no grammar library:
SamplingParams runs them wherever it is built (clients included); the grammar itself is compiled,
and its deeper errors reported, when the engine takes the request (constrained.py)."""

from __future__ import annotations

import json
import re
from typing import Any

JSON_TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# Keywords whose value is a schema, a list of schemas, or a map of name -> schema.
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Regex constructs a grammar cannot hold a token stream to (llguidance refuses them, naming no
# property): look-around and backreferences. Pydantic writes a look-ahead for Decimal fields.
_UNENFORCEABLE_REGEX = re.compile(r"\(\?<?[=!]|\\[1-9]|\\k<")


def schema_of_response_format(fmt: Any) -> dict[str, Any] | None:
    """The JSON schema an OpenAI `response_format` asks for (None for plain text)."""
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise ValueError(f"response_format must be a dict with a 'type', got {fmt!r:.80}")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise ValueError(
                "response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}"
            )
        # OpenAI allows omitting the schema: any JSON object then.
        return spec.get("schema", {"type": "object"})
    raise ValueError(
        f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'"
    )


def schema_problems(schema: Any) -> list[str]:
    """Structural problems of a JSON schema, each naming where it is (a JSON pointer)."""
    if not isinstance(schema, dict):
        return [f"json_schema must be a dict (a JSON object), got {type(schema).__name__}"]
    try:
        json.dumps(schema, allow_nan=False)
    except (TypeError, ValueError) as e:
        return [f"json_schema is not plain JSON: {e}"]
    problems: list[str] = []
    _walk(schema, "", problems)
    return [f"json_schema at {where or '/'}: {what}" for where, what in problems]


def _walk(node: Any, where: str, out: list[tuple[str, str]]) -> None:
    if isinstance(node, bool):  # true / false are schemas too
        return
    if not isinstance(node, dict):
        out.append((where, f"a schema must be an object or a boolean, got {node!r:.60}"))
        return
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in JSON_TYPES:
            out.append((where, f"'type' {k!r} is not one of {sorted(JSON_TYPES)}"))
    required = node.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        out.append((where, "'required' must be a list of property names"))
    if "enum" in node and not (isinstance(node["enum"], list) and node["enum"]):
        out.append((where, "'enum' must be a non-empty list"))
    for key in _COUNTS:
        v = node.get(key)
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            out.append((where, f"'{key}' must be an integer >= 0, got {v!r}"))
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _UNENFORCEABLE_REGEX.search(pattern):
        why = (
            f"'pattern' {pattern!r:.60} uses look-around or a backreference, which constrained "
            "decoding cannot enforce: drop it or rewrite it without them (a pydantic Decimal "
            "field writes one: use float)"
        )
        out.append((where, why))
    for key in _BOUNDS:
        v = node.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            out.append((where, f"'{key}' must be a number, got {v!r}"))
    for key in _SUBSCHEMA:
        sub = node.get(key)
        if key == "items" and isinstance(sub, list):  # the tuple form of older drafts
            for i, item in enumerate(sub):
                _walk(item, f"{where}/items/{i}", out)
        elif key in node:
            _walk(sub, f"{where}/{key}", out)
    for key in _SCHEMA_LISTS:
        if key in node:
            subs = node[key]
            if not isinstance(subs, list) or not subs:
                out.append((where, f"'{key}' must be a non-empty list of schemas"))
                continue
            for i, sub in enumerate(subs):
                _walk(sub, f"{where}/{key}/{i}", out)
    for key in _SCHEMA_MAPS:
        if key in node:
            subs = node[key]
            if not isinstance(subs, dict):
                out.append((where, f"'{key}' must map names to schemas"))
                continue
            for name, sub in subs.items():
                _walk(sub, f"{where}/{key}/{name}", out)
