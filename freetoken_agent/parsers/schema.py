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
            schemas[fn["name"]] = {k: v for k, v in props.items() if isinstance(v, dict)}
        else:
            schemas[fn["name"]] = {}
    return schemas


def declared_types(schema: dict) -> list[str]:
    """The JSON types `schema` declares: its `type`, else its anyOf/oneOf options' types."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    types: list[str] = []
    for key in ("anyOf", "oneOf"):
        for option in schema.get(key) or []:
            if isinstance(option, dict):
                types += declared_types(option)
    return types


def convert_value(text: str, schema: dict | None) -> Any:
    """The value of a parameter written as `text`, typed by its schema (a string without one)."""
    types = declared_types(schema) if schema else []
    stripped = text.strip()
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
