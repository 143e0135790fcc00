"""Strict tools under tool_choice "auto" for Mistral-format models (Mixtral, Mistral; read by
parsers/mistral.py): the free text of strict_tools.py (TEXT never holds `[TOOL_CALLS]`), then
the calls in the form the model's chat template writes, which its tokenizer tells:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{"q": "x"}

- The list (v3 tokenizers: Mixtral-8x22B-Instruct, Mistral-7B-Instruct-v0.3), the form unless
  told otherwise: one JSON array of calls, each `anyOf` the tools' call schemas (call_schema:
  a strict tool's closed schema, else its name and any object). Templates write a space after
  the opener (Mixtral's `[TOOL_CALLS] [`) or none (Ministral's `[TOOL_CALLS][`), so the space
  is optional; each item may end with the 9-character `"id"` the templates write (the parser
  ignores it, ids are ours). The output ends after the list (templates write eos there; the
  parser would read more text, and more calls, but nothing else is what the model was taught):

    start: free call?
    call: <[opener id]> " "? %json {type: array, minItems: 1, items: {anyOf: one schema a tool}}

- Name first (v11 and later tokenizers, which have `[ARGS]` as a control token; or a template
  that writes `[ARGS]`): one rule per tool, so the name selects its arguments' schema (a strict
  tool's, closed; else any object), an optional `[CALL_ID]` id where the tokenizer has that
  token (the parser skips it), calls back to back as the templates write them, then the end:

    start: free call*
    call: <[opener id]> (t0 | t1)
    t0: "get_weather" (<[CALL_ID id]> CALL_ID)? <[ARGS id]> %json {its arguments' schema}

  A tool whose name the parser cannot read back (outside `[\\w.\\-:/]`, or too long) is left
  out of this form.
- Not held: text after the list or the last call (the grammar ends; the parser would take it
  as content), a single call object in place of the list (the parser reads one; templates do
  not write it), `"parameters"` for `"arguments"`, or arguments as a JSON string (the parser's
  leniencies: the grammar holds the form the templates write).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken_agent.engine.constrained import JSON_OPTIONS
from freetoken_agent.integrations.strict_tools import call_frame, call_schema
from freetoken_agent.parsers.mistral import ARGS, CALL_ID, MAX_NAME, NAME, OPEN

CALL_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}  # Mistral's ids


def mistral_calls_grammar(tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> str:
    """The Lark grammar of free text with Mistral calls of `tools` (OpenAI tools, names
    checked), in the form `tokenizer` (the engine's, engine/text/tokenizer.py) tells."""
    if writes_named_calls(tokenizer):
        return named_calls_grammar(tools, tokenizer)
    return list_calls_grammar(tools, tokenizer)


def writes_named_calls(tokenizer: Any) -> bool:
    """Whether the model writes `[TOOL_CALLS]name[ARGS]{...}` rather than the list: its
    tokenizer has `[ARGS]` as an added token (v11 and later), or its chat template (the one
    the tool format is read from, parsers/for_engine.py) writes it."""
    if _added_id(tokenizer, ARGS) is not None:
        return True
    sources = getattr(tokenizer, "chat_template_sources", None) or {}
    return ARGS in (sources.get("tool_use") or sources.get("default") or "")


def list_calls_grammar(tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> str:
    """Free text, then at most one `[TOOL_CALLS] [...]` list of calls of `tools`."""
    items, defs = [], {}
    for i, tool in enumerate(tools):
        schema = call_schema(tool, defs, f"tool{i}.")
        items.append({**schema, "properties": {**schema["properties"], "id": CALL_ID_SCHEMA}})
    calls = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,  # the parser refuses an empty list
        "x-guidance": JSON_OPTIONS,  # the separators the templates' tojson writes
        **({"$defs": defs} if defs else {}),  # the root, where the calls' $refs resolve
    }
    head, open_mark, _ = call_frame(tokenizer, OPEN, None, calls="call?")
    return "\n".join([*head, f'call: {open_mark} " "? %json {json.dumps(calls)}'])


def named_calls_grammar(tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> str:
    """Free text, then `[TOOL_CALLS]name[ARGS]{...}` calls of `tools`, back to back."""
    readable = [t for t in tools if _readable(t["function"]["name"])]
    head, open_mark, _ = call_frame(tokenizer, OPEN, None, calls="call*" if readable else "")
    if not readable:  # no call the parser could read: free text only
        return "\n".join(head)
    args_mark = _mark(tokenizer, ARGS)
    call_id = _added_id(tokenizer, CALL_ID)
    id_part = f"(<[{call_id}]> CALL_ID)? " if call_id is not None else ""
    rules = []
    for i, tool in enumerate(readable):
        defs: dict[str, Any] = {}
        arguments = dict(call_schema(tool, defs)["properties"]["arguments"])
        arguments["x-guidance"] = JSON_OPTIONS
        if defs:  # this %json's own root, where the arguments' $refs resolve
            arguments["$defs"] = defs
        name = json.dumps(tool["function"]["name"])
        rules.append(f"t{i}: {name} {id_part}{args_mark} %json {json.dumps(arguments)}")
    call = f"call: {open_mark} ({' | '.join(f't{i}' for i in range(len(readable)))})"
    ids = ["CALL_ID: /[A-Za-z0-9]{9}/"] if call_id is not None else []
    return "\n".join([*head, call, *rules, *ids])


def _readable(name: str) -> bool:
    """Whether the parser reads `name` whole before `[ARGS]`."""
    return bool(name) and len(name) <= MAX_NAME and NAME.fullmatch(name) is not None


def _added_id(tokenizer: Any, text: str) -> int | None:
    token = tokenizer.token_to_id(text)
    return token if token in tokenizer.backend.get_added_tokens_decoder() else None


def _mark(tokenizer: Any, text: str) -> str:
    """`text` in the grammar: its token by id when it is an added token, else the string."""
    token = _added_id(tokenizer, text)
    return f"<[{token}]>" if token is not None else json.dumps(text)
