"""Errors on the wire: the OpenAI error object, and the request errors that produce it.

OpenAI clients (the official SDKs, LangChain, most agent frameworks) read failures from
`{"error": {"message", "type", "param", "code"}}` and map the HTTP status to an exception class,
so every refusal of this server takes that shape, with a message that names the problem and,
where one field is at fault, `param` naming it (`messages[2]`, `tool_choice`, `max_tokens`).
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
from collections.abc import Mapping
from typing import Any

from starlette.responses import JSONResponse

from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError

log = logging.getLogger("freetoken.server")


class BadParam(InvalidRequestError):
    """An invalid request whose fault lies in one named field. `status` is the HTTP status it
    gets (400 unless a subclass says otherwise)."""

    status = 400

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFound(BadParam):
    """A request names a model this server does not serve: 404 `model_not_found`, the status
    and code OpenAI answers with, which its SDKs raise as NotFoundError."""

    status = 404

    def __init__(self, name: str, served: str) -> None:
        super().__init__(
            f"the model {name!r} does not exist on this server; it serves {served!r} "
            "(GET /v1/models lists it)",
            "model",
            "model_not_found",
        )


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status, headers=headers)


def unexpected_error_response(error: Exception, what: str) -> JSONResponse:
    """A 500 in OpenAI's shape for a bug met while `what` (a checker's, a route's), logged
    with its traceback: the client still gets an error object and keeps its connection (an
    exception left to Starlette answered in plain text and uvicorn closed the keep-alive).
    Called inside the `except` that caught it."""
    log.exception("could not %s", what)
    return error_response(500, f"{type(error).__name__}: {error}", "server_error")


_MESSAGE_INDEX = re.compile(r"^message (\d+)")


def describe_invalid(error: InvalidRequestError) -> tuple[str, str | None, str | None]:
    """(message, param, code) for an InvalidRequestError from any layer.

    The agent layer says "message 2: ..."; on the wire the field is `messages[2]`, so the text
    and `param` use that spelling. A prompt over the context is OpenAI's
    `context_length_exceeded`, which clients recognise (to trim a history, for instance)."""
    text = str(error)
    param = getattr(error, "param", None)
    code = getattr(error, "code", None)
    found = _MESSAGE_INDEX.match(text)
    if found:
        param = param or f"messages[{found.group(1)}]"
        text = _MESSAGE_INDEX.sub(lambda m: f"messages[{m.group(1)}]", text, count=1)
    if isinstance(error, ContextLengthError):
        param, code = param or "messages", code or "context_length_exceeded"
    return text, param, code


def invalid_response(error: InvalidRequestError) -> JSONResponse:
    message, param, code = describe_invalid(error)
    return error_response(getattr(error, "status", 400), message, param=param, code=code)


def body_flag(
    body: Mapping[str, Any], key: str, default: bool | None = False, where: str | None = None
) -> bool | None:
    """A true-or-false field of a request (absent or null: `default`, None for a caller that
    tells absent from false); anything else is refused, naming `where` (default: `key`)."""
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        where = where or key
        raise BadParam(f"{where} must be true or false, got {value!r:.40}", where)
    return value


def parse_json_body(raw: bytes | str, what: str = "the request body") -> Any:
    """A body (or WebSocket message) as JSON, or a BadParam saying where it stops being JSON."""
    if not raw:
        raise BadParam(f"{what} is empty; send a JSON object", code="invalid_json")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = raw[e.start : e.start + 1]
            raise BadParam(
                f"{what} is not UTF-8: byte {e.start} is {bad!r}", code="invalid_json"
            ) from None
    try:
        value = json.loads(
            raw, parse_constant=_no_constant, parse_float=lambda text: _finite_float(text, what)
        )
        if _SURROGATE_ESCAPE.search(raw):
            _check_text(value, what)  # json.dumps: recursive too
    except json.JSONDecodeError as e:
        raise BadParam(
            f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno} "
            f"(character {e.pos})",
            code="invalid_json",
        ) from None
    except _NotJSON as e:
        raise BadParam(f"{what} is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # json.loads recurses per level: "[[[[..." deeper than the stack
        raise BadParam(
            f"{what} is nested deeper than this server reads (Python's recursion limit, "
            f"about {sys.getrecursionlimit()} levels of arrays and objects)",
            code="invalid_json",
        ) from None
    except InvalidRequestError:  # _check_text's refusal (a ValueError too): as it is
        raise
    except ValueError:  # Python's limit on an int's digits (4300 by default; 3.10.7 and up)
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise BadParam(
            f"{what} holds an integer of more than {limit} digits", code="invalid_json"
        ) from None
    return value


# Levels of arrays and objects one field may nest (a tool's parameters schema, a message with
# its tool calls' arguments). Real ones use a handful; code that walks them recursively (the
# chat template's input conversion, its `tojson`, schema checks) must never meet a depth that
# reaches Python's recursion limit, which raised RecursionError there: a 500, not a 400.
MAX_NESTING = 64


def nesting_depth(value: Any, limit: int = MAX_NESTING) -> int:
    """Levels of arrays and objects in `value` (parsed JSON: 0 for a scalar, 1 for [] or {}),
    measured without recursion; it stops counting once past `limit` (returns limit + 1)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, Mapping):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if depth > limit:
            return depth
        deepest = max(deepest, depth)
        stack.extend((c, depth + 1) for c in children if isinstance(c, (Mapping, list, tuple)))
    return deepest


def check_nesting(value: Any, where: str, limit: int = MAX_NESTING) -> None:
    """BadParam naming `where` when `value` nests more than `limit` levels."""
    if nesting_depth(value, limit) > limit:
        raise BadParam(
            f"{where} is nested more than {limit} levels deep (arrays and objects); flatten it",
            where,
        )


class _NotJSON(ValueError):
    pass


def _finite_float(text: str, what: str) -> float:
    # A literal past a float's range (1e400) reads as inf: refused here, for every field at
    # once. A range check compares inf like any number, and a response that echoes the field
    # (Responses' metadata, tools) failed to render it: a 500 after the whole generation.
    value = float(text)
    if not math.isfinite(value):
        raise BadParam(
            f"{what} holds the number {text[:40]}, beyond a 64-bit float's range",
            code="invalid_json",
        )
    return value


def _no_constant(name: str) -> Any:
    # Python's json reads NaN and Infinity, which JSON does not have; a NaN would also slip
    # through every range check (all comparisons with it are false).
    raise _NotJSON(f"{name} is not a JSON value")


# A \uD800-\uDFFF escape: json.loads joins a pair of them into one character but keeps a lone one
# as a surrogate, which is no text at all: the tokenizer (Rust) refuses it deep inside a turn.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _check_text(value: Any, what: str) -> None:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        char = e.object[e.start : e.start + 1]
        raise BadParam(
            f"{what} holds a lone UTF-16 surrogate ({ascii(char)}), which is not text; "
            "escape characters outside the BMP as a surrogate pair",
            code="invalid_json",
        ) from None
