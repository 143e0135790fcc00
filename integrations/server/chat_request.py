"""An OpenAI chat-completions body, checked field by field into one `ChatRequest`.

Every refusal is a BadParam naming the field, so the client learns what to fix. Fields this
engine cannot honour (n > 1, logprobs, penalties, logit_bias) are refused rather than silently
ignored; fields that change nothing here (user, metadata, store, parallel_tool_calls, the
model name: one model is served) are accepted. The WebSocket `send` message shares the
sampling and tool fields (`sampling_from`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.sampling_params import SamplingParams
from freetoken_agent.integrations.server.errors import BadParam
from freetoken_agent.integrations.server.tool_choice import (
    ToolChoice,
    forced_schema,
    parse_tool_choice,
    parse_tools,
)
from freetoken_agent.messages import Message, messages_from_openai

# Unsupported fields and the value that means "not used".
_UNSUPPORTED = {
    "n": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "prediction": (None,),
    "audio": (None,),
}


@dataclass(slots=True)
class TurnRequest:
    """What one turn asks for, checked: history, tools, tool choice, sampling."""

    messages: list[Message]
    tools: list[dict] | None
    tool_choice: ToolChoice
    sampling: SamplingParams


@dataclass(slots=True)
class ChatRequest:
    turn: TurnRequest
    stream: bool
    include_usage: bool


def _number(body: Mapping, key: str, lo: float, hi: float, *, lo_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadParam(f"{key} must be a number, got {value!r:.40}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        low = f"({lo}" if lo_open else f"[{lo}"
        raise BadParam(f"{key} must be in {low}, {hi}], got {value}", key)
    return value


def _integer(body: Mapping, key: str, lo: int | None = None):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadParam(f"{key} must be an integer, got {value!r:.40}", key)
    if lo is not None and value < lo:
        raise BadParam(f"{key} must be >= {lo}, got {value}", key)
    return value


def sampling_from(
    body: Mapping[str, Any], tools: list[dict] | None, choice: ToolChoice, default_max: int
) -> SamplingParams:
    """SamplingParams from OpenAI fields (plus vLLM's top_k and ignore_eos); a forced call
    adds its schema."""
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise BadParam(f"{key}={body[key]!r:.40} is not supported by this server", key)
    max_tokens = _integer(body, "max_completion_tokens", 1)
    max_key = "max_completion_tokens"
    if max_tokens is None:
        max_tokens, max_key = _integer(body, "max_tokens", 1), "max_tokens"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)
    ):
        raise BadParam("stop must be a non-empty string or a list of them", "stop")
    ignore_eos = body.get("ignore_eos")  # vLLM's extension: benchmarks want fixed lengths
    if ignore_eos is not None and not isinstance(ignore_eos, bool):
        raise BadParam(f"ignore_eos must be true or false, got {ignore_eos!r:.40}", "ignore_eos")
    fmt = body.get("response_format")
    if fmt is not None and choice.forced:
        raise BadParam(
            "response_format and a forced tool_choice both constrain the output; give one",
            "response_format",
        )
    options: dict[str, Any] = {
        "max_tokens": max_tokens or default_max,
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        "top_k": _integer(body, "top_k", 0),
        "seed": _integer(body, "seed"),
        "stop": stop,
        "ignore_eos": ignore_eos,
        "response_format": fmt,
        "json_schema": forced_schema(choice, tools or []) if choice.forced else None,
    }
    try:
        return SamplingParams(**{k: v for k, v in options.items() if v is not None})
    except ValueError as e:
        param = "response_format" if "schema" in str(e) or "response_format" in str(e) else None
        raise BadParam(str(e), param or (max_key if "max_tokens" in str(e) else None)) from None


def turn_from(body: Mapping[str, Any], default_max: int) -> TurnRequest:
    """The turn part of a chat body (messages, tools, tool_choice, sampling fields)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadParam("messages must be a non-empty list of messages", "messages")
    messages = messages_from_openai(raw)  # InvalidRequestError naming "message i"
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    try:
        sampling = sampling_from(body, tools, choice, default_max)
    except BadParam:
        raise
    except InvalidRequestError as e:  # tool_call_schema on a malformed tool
        raise BadParam(str(e), "tools") from None
    return TurnRequest(messages, tools, choice, sampling)


def parse_chat_request(body: Any, default_max: int) -> ChatRequest:
    if not isinstance(body, Mapping):
        raise BadParam(f"the request body must be a JSON object, got {type(body).__name__}")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadParam(f"stream must be true or false, got {stream!r:.40}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadParam("stream_options must be an object", "stream_options")
    include_usage = bool((options or {}).get("include_usage", False))
    return ChatRequest(turn_from(body, default_max), bool(stream), include_usage)
