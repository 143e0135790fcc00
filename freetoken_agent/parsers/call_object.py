"""A tool call written as a JSON object: `{"name": ..., "arguments": {...}}`.

Shared by the JSON formats (Hermes, Mistral's list form). Lenient where models commonly drift
and the meaning is still clear: `"parameters"` for `"arguments"`, arguments given as a JSON
string holding an object, arguments left out for a tool without parameters.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.parsers.json_scan import loads_strict

ARGS_KEYS = ("arguments", "parameters")


def call_from_object(item: Any) -> tuple[str, str, dict[str, Any]] | str:
    """(name, arguments key or "", arguments) of a call object, or why it is not a call.

    When both argument keys appear, the first one written wins.
    """
    if not isinstance(item, dict):
        return "tool call is not a JSON object"
    name = item.get("name")
    if not isinstance(name, str) or not name:
        return "tool call has no name"
    keys = [k for k in item if k in ARGS_KEYS]
    key = keys[0] if keys else ""
    args = item[key] if key else {}
    if isinstance(args, str):
        try:
            args = loads_strict(args)
        except ValueError:
            return "tool call arguments are not a JSON object"
    if not isinstance(args, dict):
        return "tool call arguments are not a JSON object"
    return name, key, args
