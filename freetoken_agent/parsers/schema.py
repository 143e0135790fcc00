"""Typed parameter values from an OpenAI-style tool schema.

Formats that write parameter values as bare text (Qwen3-Coder's XML) lose the JSON type; the
tool's schema says what the value was meant to be. A value that does not fit its declared type
stays the string the model wrote: the tool can then complain with a useful message, where a
guess would hide the mistake.
"""

from __future__ import annotations

import math
from typing import Any

from freetoken_agent.parsers.json_scan import loads_strict


def parameter_schemas(tools: list[dict] | None) -> dict[str, dict[str, dict]]:
    """Function name -> parameter name -> that parameter's JSON schema.

    Accepts `{"type": "function", "function": {...}}` entries and bare function dicts.
    """
    schemas: dict[str, dict[str, dict]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if isinstance(props, dict):
            schemas[fn["name"]] = {
                k: resolved(v, params) for k, v in props.items() if isinstance(v, dict)
            }
        else:
            schemas[fn["name"]] = {}
    return schemas


MAX_REF_DEPTH = 16  # $refs followed in a row (a recursive schema stops typing there)


def resolved(schema: dict, root: dict, depth: int = 0) -> dict:
    """`schema` with a local `$ref` ("#/$defs/X", "#/definitions/X") at its top, and in its
    anyOf/oneOf/allOf options, followed into `root` (the tool's parameters), sibling keys
    kept: a value's type is read from the top (pydantic writes nested models, enums and
    optional models as refs)."""
    if depth >= MAX_REF_DEPTH:
        return schema
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part) if isinstance(target, dict) else None
        if isinstance(target, dict):
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**resolved(target, root, depth + 1), **rest}
    for key in ("anyOf", "oneOf", "allOf"):
        options = schema.get(key)
        if isinstance(options, list):
            schema = {**schema, key: [
                resolved(o, root, depth + 1) if isinstance(o, dict) else o for o in options
            ]}  # fmt: skip
    return schema


_JSON_TYPE = {bool: "boolean", int: "integer", float: "number", str: "string",
              type(None): "null", dict: "object", list: "array"}  # fmt: skip


def declared_types(schema: dict) -> list[str]:
    """The JSON types `schema` declares: its `type`, else its anyOf/oneOf options' types, its
    allOf parts' (each part must hold), or its enum / const members' types."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf", "allOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                types += declared_types(option)
    members = _members(schema)
    for member in members or []:
        kind = _JSON_TYPE.get(type(member))
        if kind is not None and kind not in types:
            types.append(kind)
    return types


def _members(schema: dict) -> list | None:
    """The values `schema` allows by enum or const, None when it does not list them."""
    if "const" in schema:
        return [schema["const"]]
    members = schema.get("enum")
    return members if isinstance(members, list) else None


def convert_value(text: str, schema: dict | None) -> Any:
    """The value of a parameter written as `text`, typed by its schema (a string without one).
    A schema listing its values (enum, const) takes the member the text writes, bare for a
    string, JSON for the others, before reading types (a mixed enum's 2 is the number)."""
    types = declared_types(schema) if schema else []
    stripped = text.strip()
    members = _members(schema) if schema else None
    if members:
        if any(isinstance(m, str) and m == text for m in members):
            return text
        try:
            value = loads_strict(stripped)
        except ValueError:
            value = _NO_VALUE
        for member in members:
            if not isinstance(member, str) and _same_json(value, member):
                return member
    if "null" in types and stripped == "null":
        return None
    if not types or "string" in types:
        return text
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    try:
        value = loads_strict(stripped)  # strict: NaN or deep nesting stays text
    except ValueError:
        return text
    for kind in types:
        if kind == "integer" and isinstance(value, float) and value.is_integer():
            return int(value)
        if _fits(value, kind):
            return value
    return text


def _fits(value: Any, kind: str) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if kind == "integer":
        return isinstance(value, int)
    if kind == "number":
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if kind == "object":
        return isinstance(value, dict)
    if kind == "array":
        return isinstance(value, list)
    return False


_NO_VALUE = object()  # text that is no JSON value


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: true and 1 differ, 1 and 1.0 do not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    return type(a) is type(b) and a == b
