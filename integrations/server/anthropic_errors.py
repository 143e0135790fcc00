"""Errors on the Anthropic wire: `{"type": "error", "error": {"type", "message"}}`.

Anthropic's SDKs (and Claude Code) map the HTTP status to an exception class and show the
message; the error's `type` names the kind (`invalid_request_error`, `not_found_error`...), so
the same status always carries the same type here. The object has no `param`: where one field
is at fault and the message does not name it, it is put first (`<field>: ...`), as
Anthropic's own messages name theirs.

Every path under /v1/messages answers in this shape, the refusals of the middleware (a missing
key, a body over the limit, a foreign page) and Starlette's (no such route, wrong method)
included; every other path keeps the OpenAI object (`api_error_response` picks by path).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.errors import describe_invalid, error_response

MESSAGES_PATH = "/v1/messages"

# HTTP status -> Anthropic's error type (its documented pairs).
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def anthropic_error_body(message: str, type_: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, error_type(status)), status, headers=headers)


def with_param(message: str, param: str | None) -> str:
    """The message led by the field at fault, unless it names it already."""
    if param is None or param in message:
        return message
    return f"{param}: {message}"


def api_error_response(
    path: str,
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error object of the API `path` belongs to: Anthropic's under /v1/messages, else
    OpenAI's (with `code`, which Anthropic's has no field for)."""
    if is_anthropic_path(path):
        return anthropic_error_response(status, message, headers)
    return error_response(status, message, code=code, headers=headers)


def anthropic_invalid_response(error: InvalidRequestError) -> JSONResponse:
    """A refusal (its status: 400 unless the error carries another), the field leading."""
    message, param, _ = describe_invalid(error)
    return anthropic_error_response(getattr(error, "status", 400), with_param(message, param))
