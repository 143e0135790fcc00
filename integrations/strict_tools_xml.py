"""Strict tools under tool_choice "auto" for models that write XML calls (Qwen3-Coder, Qwen3.5
and 3.6; parsers/qwen3_coder.py reads them): the free text of strict_tools.py, and each call
written exactly as the chat template writes one:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

    call: <[opener id]> (t0 | t1) <[closer id]>
    t0: "\\n<function=get_weather>\\n" t0_0 t0_1? "</function>\\n"
    t0_0: "<parameter=city>" VALUE
    t0_1: "<parameter=days>" "\\n" %json {"type": "integer"} "\\n</parameter>\\n"
    t1: "\\n<function=search>\\n" any_parameter* "</function>\\n"    (a tool that is not strict)
    any_parameter: "<parameter=" KEY ">" VALUE
    VALUE: /\\n(?s:.*)\\n<\\/parameter>\\n/ & ~/(?s:.*)(<\\/parameter>|\\n<parameter=|...).../

- Values are bare text: a string as it is, anything else as JSON (the template's `tojson`),
  which the parser types back by the parameter's schema (parsers/schema.py). So a value whose
  schema allows a string is bare text (VALUE: a newline, the text, its close tag; the parser
  drops both newlines), a JSON-typed one is `%json` of its subschema (closed, as in strict
  mode), and an enum (or const) is one of its members as the template writes them.
- VALUE holds its close tag, and no earlier end the parser would see (qwen3_coder.VALUE_ENDS:
  `</parameter>` anywhere, `<parameter=`, `</function>` or `</tool_call>` at a line start):
  a lexeme ends only where nothing can extend it, and text stopping short of its close tag
  could always go on (a value may hold `\\n</paramete`).
- A strict tool's parameters come in its schema's `properties` order, each optional one
  skippable. A fixed order is what keeps the grammar small (any order would take a rule per
  permutation, or per subset already written), and it costs nothing: arguments are a map,
  the prompt lists the properties in that order, models write them so, and OpenAI's strict
  mode writes them in schema order too.
- Not held, though read as the parser reads them: a string's length, pattern or format; a
  value whose schema declares no type, or a string among other types (any bare text: the
  schema's string branch, or the parser's fallback to a string, takes it); strings nested in
  a JSON value that hold `</parameter>` (the parser cuts the value there). A strict tool whose
  parameters are not one closed object of properties (additional properties allowed, a
  top-level anyOf, a required name the parser cannot read back) is held as a non-strict one:
  a known name, any parameters.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from freetoken_agent.engine.constrained import JSON_OPTIONS
from freetoken_agent.integrations.constrained_output import call_part, closed_with, refers
from freetoken_agent.integrations.strict_tools import call_frame, is_strict, regex_literal
from freetoken_agent.parsers.qwen3_coder import (
    FUNCTION,
    FUNCTION_END,
    MAX_NAME,
    PARAMETER,
    PARAMETER_END,
    VALUE_ENDS,
)
from freetoken_agent.parsers.schema import convert_value, declared_types, resolved

CLOSE_VALUE = "\n" + PARAMETER_END + "\n"
# Keywords that constrain an object beyond its listed properties, which a fixed list of
# parameters cannot hold (any other key, an annotation such as $id or x-order, says nothing
# about which values are valid).
UNHELD_OBJECT_KEYS = {
    "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref", "patternProperties",
    "propertyNames", "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "unevaluatedProperties",
}  # fmt: skip


def xml_calls_grammar(tools: Sequence[Mapping[str, Any]], tokenizer: Any) -> str:
    """The Lark grammar of free text with XML calls of `tools` (OpenAI tools, names checked);
    `tokenizer`: the engine's (engine/text/tokenizer.py)."""
    head, open_mark, close_mark = call_frame(tokenizer)
    rules, loose = [], False
    for i, tool in enumerate(tools):
        parameters = strict_parameters(tool) if is_strict(tool) else None
        loose = loose or parameters is None
        rules += _function_rules(f"t{i}", tool["function"]["name"], parameters)
    functions = " | ".join(f"t{i}" for i in range(len(tools)))
    call = f"call: {open_mark} ({functions}) {close_mark}"
    return "\n".join([*head, call, *rules, *(ANY_PARAMETER if loose else []), VALUE_LEXEME])


def _function_rules(
    rule: str, name: str, parameters: list[tuple[str, bool, Any]] | None
) -> list[str]:
    """`rule`: one call of the tool `name`, from the newline after the opener to the closer;
    `parameters` as strict_parameters gives them (None: any parameters)."""
    opening, closing = _literal(f"\n{FUNCTION}{name}>\n"), _literal(FUNCTION_END + "\n")
    if parameters is None:
        return [f"{rule}: {opening} any_parameter* {closing}"]
    body, rules = [], []
    for j, (key, required, schema) in enumerate(parameters):
        body.append(f"{rule}_{j}" + ("" if required else "?"))
        rules.append(f"{rule}_{j}: {_literal(f'{PARAMETER}{key}>')} {_value(schema)}")
    return [f"{rule}: {opening} {' '.join([*body, closing])}", *rules]


def strict_parameters(tool: Mapping[str, Any]) -> list[tuple[str, bool, Any]] | None:
    """A strict tool's parameters in schema order, as (name, required, schema), its objects
    closed; None when its parameters are not one closed object of properties the parser can
    name (the tool is then held as a non-strict one). Each value is its own `%json` root: a
    parameter's schema that refers to the tool's $defs carries them (`_rooted`)."""
    defs: dict[str, Any] = {}
    params, defs = closed_with(call_part(tool, "", defs)["properties"]["arguments"], defs)
    props, required = params.get("properties"), params.get("required", [])
    if (
        set(params) & UNHELD_OBJECT_KEYS
        or params.get("type", "object") != "object"
        or params.get("additionalProperties") is not False
        or not isinstance(props, dict)
        or not isinstance(required, list)
        or not all(r in props and _nameable(r) for r in required)
    ):
        return None
    return [(k, k in required, _rooted(s, defs)) for k, s in props.items() if _nameable(k)]


def _rooted(schema: Any, defs: dict[str, Any]) -> Any:
    """A parameter's schema as its value's own root: its $refs at the top (and in its
    anyOf/oneOf/allOf options) followed as the parser follows them (parsers/schema.resolved),
    so the grammar and the parser see the same type (bare text or JSON); the tool's `defs`
    beside it where $refs remain (a tree's children)."""
    if isinstance(schema, dict):
        schema = resolved(schema, {"$defs": defs})
    return {**schema, "$defs": defs} if refers(schema) else schema


def _nameable(key: str) -> bool:
    """Whether the parser reads `<parameter=key>` back as `key`."""
    return bool(key) and key == key.strip() and len(key) <= MAX_NAME and not set("<>\n") & set(key)


def _value(schema: Any) -> str:
    """What follows `<parameter=KEY>` for a value of `schema`, up to its close tag."""
    schema = schema if isinstance(schema, dict) else {}  # `true` takes anything
    members = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(members, list):
        written = [w for w in (_written(m, schema) for m in members) if w is not None]
        if written:  # members the parser cannot read back are left out
            return "(" + " | ".join(_literal(f"\n{w}{CLOSE_VALUE}") for w in written) + ")"
    types = declared_types(schema)
    if types and "string" not in types:
        subschema = {**schema, "x-guidance": JSON_OPTIONS}  # the template's tojson spacing
        return f"{_literal(chr(10))} %json {json.dumps(subschema)} {_literal(CLOSE_VALUE)}"
    return "VALUE"  # any bare text: a string's length, pattern or format is not held


def _written(member: Any, schema: dict) -> str | None:
    """`member` as the template writes it, if the parser reads that back as `member`."""
    text = member if isinstance(member, str) else json.dumps(member, ensure_ascii=False)
    readable = not any(end in f"\n{text}\n" for end in VALUE_ENDS)
    same = json.dumps(convert_value(text, schema)) == json.dumps(member)
    return text if readable and same else None


def _regex(text: str) -> str:
    return regex_literal(text).replace("\n", r"\n")


def _literal(text: str) -> str:
    """`text` as a Lark string literal. json.dumps escapes the C0 controls; DEL and the C1
    controls, which it writes raw, llguidance's lexer refuses raw (a grammar that fails to
    compile fails the request), so they are escaped too."""
    return _RAW_CONTROLS.sub(
        lambda m: f"\\u{ord(m.group()):04x}", json.dumps(text, ensure_ascii=False)
    )


_RAW_CONTROLS = re.compile("[\x7f-\x9f]")


# A bare value with its close tag, nothing ending it earlier. Its length is not held: counted
# repetitions (.{0,N}) inside this intersection cost llguidance's lexer dearly (ten tools of
# five strings with lengths near 1000 exhausted it, failing the request).
_ENDS = "|".join(_regex(end) for end in VALUE_ENDS)
_CLOSE = _regex(CLOSE_VALUE)
VALUE_LEXEME = rf"VALUE: /\n(?s:.*){_CLOSE}/ & ~/(?s:.*)({_ENDS})(?s:.*){_CLOSE}/"
# A parameter of a tool that is not strict: any name the parser reads as one, any value.
ANY_PARAMETER = [
    f'any_parameter: {_literal(PARAMETER)} KEY ">" VALUE',
    rf"KEY: /[^<>\n]{{1,{MAX_NAME}}}/ & ~/\s*/",
]
