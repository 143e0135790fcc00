"""Strict tools under tool_choice "auto": free text, and calls that keep to the tools' schemas.

OpenAI's `strict: true` on a function promises arguments valid against its parameters' schema,
whether the model is forced to call or decides to (the OpenAI Agents SDK makes its function
tools strict by default, and the SDK's `parse()` validates the arguments). A forced call is
constrained already (tool_choice.py); under "auto" the model may write text, so the grammar
here lets text through and constrains only what follows a call's opener: text, then any number
of `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks with text between, as
llguidance's Lark syntax writes it (vLLM and SGLang do the same with xgrammar's structural tags,
llama.cpp with its lazy grammars):

    start: free (call free)*
    free: TEXT? (<[other added tokens]> TEXT?)*
    TEXT: /(?s:.+)/ & ~/(?s:.*)<tool_call>(?s:.*)/
    call: <[opener id]> "\\n" %json {anyOf: one schema a tool} "\\n" <[closer id]>

- llguidance reads a tokenizer's added tokens (Qwen's <tool_call>, <think>, <|im_end|>, even
  those not marked special) as special tokens, which a regex cannot match: the opener and the
  closer are named by id, and free text may hold every other added token (the think tags
  above all). A tokenizer without them as tokens gets the same grammar with string literals.
- TEXT is one lexeme that never holds the opener's text: a model could otherwise spell
  `<tool_call>` out of plain tokens, which the Hermes parser reads as a call all the same, and
  write an unconstrained call. Two TEXTs are never adjacent, or the lexer could split the
  opener across them.
- Strict tools' calls keep to their schemas (closed, as in strict mode); other tools' calls
  must still name the tool and give an object (OpenAI does not check them either).

Hermes-format models (Qwen2.5/Qwen3 and the templates that write these blocks) get this
grammar; models that write the XML calls of Qwen3-Coder/Qwen3.5 get the same free text around
calls written as their template writes them (strict_tools_xml.py), and so do Mistral-format
models (Mixtral, Mistral; strict_tools_mistral.py): one `[TOOL_CALLS] [...]` list of calls
(v3 tokenizers), or `[TOOL_CALLS]name[ARGS]{...}` calls where the tokenizer has `[ARGS]` or
the template writes it (v11 and later).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken_agent.engine.constrained import JSON_OPTIONS
from freetoken_agent.integrations.constrained_output import call_part, closed_with, rooted
from freetoken_agent.parsers import engine_tool_format

OPENER, CLOSER = "<tool_call>", "</tool_call>"


def is_strict(tool: Mapping[str, Any]) -> bool:
    fn = tool.get("function", tool)
    return isinstance(fn, Mapping) and fn.get("strict") is True


def any_strict(tools: Sequence[Mapping[str, Any]] | None) -> bool:
    return bool(tools) and any(is_strict(t) for t in tools)


def call_schema(tool: Mapping[str, Any], defs: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """What one call of `tool` must be: its schema when strict (closed, its parameters' $defs
    added to `defs` closed and renamed with `prefix`: constrained_output.call_part), else its
    name and an object. Each `%json` of a grammar is its own root: `defs` go to the root of
    the schema this call sits in."""
    if is_strict(tool):
        own: dict[str, Any] = {}
        call, own = closed_with(call_part(tool, prefix, own), own)
        defs.update(own)
        return call
    name = tool["function"]["name"]
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def strict_grammar(engine: Any, tools: Sequence[Mapping[str, Any]]) -> str | None:
    """The grammar of `tools` for `engine` (an Engine, EngineService or the server's bridge:
    its tokenizer, spec and chat template), or None when its model writes none of the Hermes,
    XML and Mistral calls (or has no tokenizer): its calls stay unconstrained."""
    # Imported here: strict_tools_xml and strict_tools_mistral build on this module.
    from freetoken_agent.integrations.strict_tools_mistral import mistral_calls_grammar
    from freetoken_agent.integrations.strict_tools_xml import xml_calls_grammar

    tool_format = engine_tool_format(engine) if engine.tokenizer is not None else None
    if tool_format == "hermes":
        return strict_calls_grammar(tools, engine.tokenizer)
    if tool_format == "qwen3_coder":
        return xml_calls_grammar(tools, engine.tokenizer)
    if tool_format == "mistral":
        return mistral_calls_grammar(tools, engine.tokenizer)
    return None


def strict_calls_grammar(tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> str:
    """The Lark grammar of free text with calls of `tools` (OpenAI tools, names checked);
    `tokenizer`: the engine's (engine/text/tokenizer.py)."""
    defs: dict[str, Any] = {}
    calls = rooted([call_schema(t, defs, f"tool{i}.") for i, t in enumerate(tools)], defs)
    calls["x-guidance"] = JSON_OPTIONS  # the separators json.dumps writes, as elsewhere
    head, open_mark, close_mark = call_frame(tokenizer)
    call = f'call: {open_mark} "\\n" %json {json.dumps(calls)} "\\n" {close_mark}'
    return "\n".join([*head, call])


def call_frame(
    tokenizer: Any, opener: str = OPENER, closer: str | None = CLOSER, calls: str = "(call free)*"
) -> tuple[list[str], str, str]:
    """What every call format shares: the grammar's first rules (`start`, `free`, `TEXT`; a
    `call` rule must follow where `calls` names it) and the marks of the opener and the closer
    ("" where a format has none). `calls`: what follows the first free text (by default, any
    number of calls, each followed by free text)."""
    added = sorted(tokenizer.backend.get_added_tokens_decoder())  # ids of the added tokens
    open_id = tokenizer.token_to_id(opener)
    open_mark, close_mark = call_marks(tokenizer, opener, closer)
    others = [i for i in added if i != open_id]
    free = f"TEXT? (<[{','.join(map(str, others))}]> TEXT?)*" if others else "TEXT?"
    head = [
        "start: free" + (f" {calls}" if calls else ""),
        f"free: {free}",
        f"TEXT: /(?s:.+)/ & ~/(?s:.*){regex_literal(opener)}(?s:.*)/",
    ]
    return head, open_mark, close_mark


def call_marks(
    tokenizer: Any, opener: str = OPENER, closer: str | None = CLOSER
) -> tuple[str, str]:
    """The Lark marks of a call's opener and closer: by id where the tokenizer has them as added
    tokens (which a grammar's string cannot match), else as string literals; "" for no closer."""
    added = set(tokenizer.backend.get_added_tokens_decoder())
    open_id = tokenizer.token_to_id(opener)
    close_id = tokenizer.token_to_id(closer) if closer else None
    if open_id is not None and open_id in added and (close_id is not None or not closer):
        return f"<[{open_id}]>", f"<[{close_id}]>" if closer else ""
    return json.dumps(opener), json.dumps(closer) if closer else ""


REGEX_META = set("\\.+*?()|[]{}^$#&-~/")  # escaped in a /.../ regex (the slash ends it)


def regex_literal(text: str) -> str:
    """`text` as a regex matching itself, inside /.../. Only metacharacters are escaped:
    Rust's regex (llguidance's) reads some escaped signs as assertions (\\< is a word start)."""
    return "".join("\\" + c if c in REGEX_META else c for c in text)
