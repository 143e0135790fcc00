"""with_structured_output for ChatFreeToken: the bound model plus a strict parser.

"json_schema" binds a response_format, so the answer is constrained to the schema by the
grammar; "function_calling" forces a (constrained) call of a tool made from the schema;
"json_mode" constrains the answer to some JSON object only (the caller's prompt names the
keys), and the schema just validates it. Either way the result is parsed strictly: LangChain's
JSON parsers complete a truncated object (and its tool parsers return None when no call came),
which would hand back a record missing the fields after a max_tokens cut without a word. Here
that is an OutputParserException, which `include_raw=True` reports as `parsing_error` beside
the raw message.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import BaseModel, ValidationError
from pydantic.v1 import BaseModel as BaseModelV1
from pydantic.v1 import ValidationError as ValidationErrorV1

from freetoken_agent.parsers.json_scan import loads_strict


def structured_runnable(
    llm: BaseChatModel, schema: dict[str, Any] | type, method: str, include_raw: bool
) -> Runnable:
    """The chain `with_structured_output` returns (see the module docstring)."""
    pydantic = is_basemodel_subclass(schema) if isinstance(schema, type) else False
    trace = {"kwargs": {"method": method}, "schema": schema}
    schema = _held_schema(schema)
    if method == "json_schema":
        json_schema = _json_schema(schema)
        fmt = {"type": "json_schema", "json_schema": {"name": "output", "schema": json_schema}}
        bound = llm.bind(response_format=fmt, ls_structured_output_format=trace)
        parser: Runnable = RunnableLambda(_strict_json(schema if pydantic else None))
    elif method == "json_mode":
        bound = llm.bind(response_format={"type": "json_object"}, ls_structured_output_format=trace)
        parser = RunnableLambda(_strict_json(schema if pydantic else None))
    elif method == "function_calling":
        tool = convert_to_openai_tool(schema)
        name = tool["function"]["name"]
        bound = llm.bind_tools([tool], tool_choice=name, ls_structured_output_format=trace)
        parser = RunnableLambda(_first_call(name, schema if pydantic else None))
    else:
        raise ValueError(
            f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}"
        )
    if not include_raw:
        return bound | parser
    # The parse's error is caught by the parse itself, not by a fallback around the chain:
    # streamed, `raw`'s chunks go out first, and a fallback switches only on an error raised
    # before the first chunk, so stream() and astream() raised what invoke() reported. Each
    # key parses the message once (assign computes its keys apart; the read is a small JSON's).
    parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | RunnableLambda(_or_none(parser)),
        parsing_error=itemgetter("raw") | RunnableLambda(_error_of(parser)),
    )
    return RunnableMap(raw=bound) | parsed


def _or_none(parser: Runnable) -> Callable[[AIMessage], Any]:
    def parsed(raw: AIMessage) -> Any:
        try:
            return parser.invoke(raw)
        except Exception:  # noqa: BLE001 - reported by _error_of, as LangChain's include_raw
            return None

    return parsed


def _error_of(parser: Runnable) -> Callable[[AIMessage], Exception | None]:
    def error(raw: AIMessage) -> Exception | None:
        try:
            parser.invoke(raw)
        except Exception as e:  # noqa: BLE001 - any parse failure, as LangChain's include_raw
            return e
        return None

    return error


# Keywords of a JSON schema at its root: a dict with one is a schema already (title optional).
_SCHEMA_ROOT_KEYS = {"type", "properties", "anyOf", "oneOf", "allOf", "$ref", "enum", "const"}


def _held_schema(schema: dict[str, Any] | type) -> dict[str, Any] | type:
    """The JSON schema an OpenAI response_format object holds, which ChatOpenAI takes too and
    people copy from OpenAI code: `{"type": "json_schema", "json_schema": {...}}` and its
    inner `{"name", "schema", "strict"?, "description"?}` (titled by the name, described by
    the description where the schema is not). LangChain's conversion reads the inner form as a
    function without parameters: the answer would be constrained to nothing. Any other
    schema is returned as it is."""
    if not isinstance(schema, dict):
        return schema
    if schema.get("type") == "json_schema" and isinstance(schema.get("json_schema"), dict):
        schema = schema["json_schema"]
    if "name" not in schema or not isinstance(schema.get("schema"), dict):
        return schema
    held = dict(schema["schema"])
    held.setdefault("title", schema["name"])
    if isinstance(schema.get("description"), str):
        held.setdefault("description", schema["description"])
    return held


def _json_schema(schema: dict[str, Any] | type) -> dict[str, Any]:
    """A JSON schema from a pydantic model, TypedDict, OpenAI tool or plain JSON schema.
    A pydantic (v2) model gives its own schema, its $defs and $refs kept: LangChain's
    conversion inlines them and cuts a recursive one to {} (a tree's children would be
    anything); the grammar compiler resolves them (engine/constrained.py). So does a plain
    schema whose root is a $ref into its $defs, as pydantic writes a recursive model's."""
    if isinstance(schema, type) and issubclass(schema, BaseModel):
        return schema.model_json_schema()
    plain = isinstance(schema, dict) and not {"function", "parameters"} & schema.keys()
    if plain and _SCHEMA_ROOT_KEYS & schema.keys():
        return schema
    converted = convert_to_json_schema(schema)
    if not _SCHEMA_ROOT_KEYS & converted.keys():  # {"name": ...} alone: a title, no schema
        raise ValueError(
            f"schema {schema!r:.80} gives no JSON schema to hold the answer to (no type, "
            "properties or other schema keyword): pass a JSON schema, a pydantic model, a "
            "TypedDict, an OpenAI tool with parameters or {'name': ..., 'schema': {...}}"
        )
    return converted


def _strict_json(model: type | None) -> Callable[[AIMessage], Any]:
    """The answer parsed as whole JSON (then validated by the pydantic model, if any).
    LangChain's JSON parsers accept a truncated object (they complete it), which would hand
    back a dict missing the fields after the max_tokens cut without a word."""

    def parse(message: AIMessage) -> Any:
        # .text, not .content: with output_version="v1" the content is a list of blocks.
        text = message.text
        try:
            # JSON as a tool call's arguments are read: a number past a float's range the
            # largest float (not inf), a lone surrogate refused (no text it could be).
            value = loads_strict(text)
        except ValueError as e:
            reason = message.response_metadata.get("finish_reason")
            hint = " (the output hit max_tokens: raise it)" if reason == "length" else ""
            raise OutputParserException(
                f"the answer is not complete JSON{hint}: {e}", llm_output=text
            ) from e
        return _validated(model, value, text)

    return parse


def _first_call(name: str, model: type | None) -> Callable[[AIMessage], Any]:
    """The arguments of the first call of `name` (validated by the pydantic model, if any); no
    such call (cut by max_tokens: an invalid_tool_call) is an error, never a silent None."""

    def parse(message: AIMessage) -> Any:
        for call in message.tool_calls:
            if call["name"] == name:
                return _validated(model, call["args"], message.text)
        errors = [c.get("error") for c in message.invalid_tool_calls]
        reason = message.response_metadata.get("finish_reason")
        raise OutputParserException(
            f"no complete call of {name} (finish_reason {reason}; invalid calls: {errors})",
            llm_output=message.text,
        )

    return parse


def _validated(model: type | None, value: Any, raw: str) -> Any:
    """As LangChain's pydantic parsers do: a validation failure is an OutputParserException.
    Models of pydantic's v1 API (`pydantic.v1`, still accepted by LangChain) validate with
    `parse_obj` and raise their own ValidationError."""
    if model is None:
        return value
    try:
        if issubclass(model, BaseModelV1):
            return model.parse_obj(value)
        return model.model_validate(value)
    except (ValidationError, ValidationErrorV1) as e:
        problem = f"the answer does not fit {model.__name__}: {e}"
        raise OutputParserException(problem, llm_output=raw) from e
