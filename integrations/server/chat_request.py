"""An OpenAI chat-completions body, checked field by field into one `ChatRequest`.

Every refusal is a BadParam naming the field, so the client learns what to fix. Fields this
engine cannot honour (prediction, audio) are refused rather than silently ignored; `n` choices
(1..MAX_CHOICES) are served, each its own engine request (choices.py);
the penalties, `logit_bias` (its JSON keys are token ids written as strings) and logprobs are
honoured. Fields that change nothing here (user, metadata, store, service_tier) are accepted
when they have the right type. `parallel_tool_calls: false` is honoured: the turn stops at its
first complete call (one_call.py). `model` must name the served model or an alias
(`check_model`; 404 otherwise). Unknown fields are ignored, as vLLM does, since SDKs add new
ones faster than servers learn them; but other APIs' fields known to change the output (the
legacy `functions`, vLLM's extensions) are honoured or refused by name (foreign_fields.py).
The WebSocket `send` message shares the sampling and tool fields (`sampling_from`); text
completions (text_request.py) share the sampling fields and `check_envelope`. `logprobs` and
`top_logprobs` are served, and so is vLLM's `prompt_logprobs`: logprobs_request.py checks them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError, shown_number
from freetoken_agent.engine.sampling_params import (
    PENALTY_LIMIT,
    REPETITION_RANGE,
    SamplingParams,
    SamplingParamsError,
    token_id_key,
)
from freetoken_agent.integrations.choice_sampling import choice_count
from freetoken_agent.integrations.server.errors import (
    BadParam,
    ModelNotFound,
    body_flag,
    check_nesting,
)
from freetoken_agent.integrations.server.foreign_fields import (
    check_chat_fields,
    check_sampling_fields,
    continue_final_message,
    stop_token_ids,
)
from freetoken_agent.integrations.server.logprobs_request import (
    body_prompt_logprobs,
    chat_body_logprobs,
)
from freetoken_agent.integrations.server.thinking_switch import enable_thinking
from freetoken_agent.integrations.server.tool_choice import (
    ToolChoice,
    call_or_answer_schema,
    forced_schema,
    parse_tool_choice,
    parse_tools,
)
from freetoken_agent.messages import AssistantMessage, Message, messages_from_openai

_INT64 = (-(2**63), 2**63 - 1)

# Unsupported fields and the value that means "not used".
_UNSUPPORTED = {
    "prediction": (None,),
    "audio": (None,),
}

# Accepted (and, but for parallel_tool_calls, ignored) only with the type OpenAI documents:
# a wrong type is a client bug.
_IGNORED_TYPES: dict[str, tuple[type, str]] = {
    "user": (str, "a string"),
    "metadata": (dict, "an object"),
    "store": (bool, "true or false"),
    "parallel_tool_calls": (bool, "true or false"),
    "service_tier": (str, "a string"),
}


@dataclass(slots=True)
class TurnRequest:
    """What one turn asks for, checked: history, tools, tool choice, sampling, and how the
    prompt is rendered (`enable_thinking`: chat_template_kwargs; None, the template's default)."""

    messages: list[Message]
    tools: list[dict] | None
    tool_choice: ToolChoice
    sampling: SamplingParams
    parallel_tool_calls: bool = True  # False: at most one call (the turn stops at the first)
    enable_thinking: bool | None = None
    continue_final: bool = False  # the model goes on from the last message (continuation.py)
    # A WebSocket `append` send's: the kept history its messages were put after. The turn
    # puts them after the history kept when it runs, should another turn end in between.
    based_on: list[Message] | None = None
    shares_prompt: bool = False  # one of a request's `n` choices (AnchorOptions says why)

    @property
    def call_or_answer(self) -> bool:
        """Tools, tool_choice "auto" and a JSON response_format: the output is one call of a
        tool or the answer (tool_choice.py). Only then does such a turn carry a schema."""
        return (
            self.tool_choice.mode == "auto"
            and bool(self.tools)
            and self.sampling.json_schema is not None
        )


@dataclass(slots=True)
class ChatRequest:
    turn: TurnRequest
    stream: bool
    include_usage: bool
    n: int = 1  # choices: each a run of `turn` (choices.py)


def body_choice_count(body: Mapping[str, Any]) -> int:
    """OpenAI's `n`: how many choices to generate (absent or null: 1; choice_sampling.py)."""
    try:
        return choice_count(body.get("n"))
    except ValueError as e:
        raise BadParam(str(e), "n") from None


_MAX_TOKENS_KEYS = ("max_completion_tokens", "max_tokens")


def max_tokens_key(body: Mapping[str, Any]) -> str:
    """The field that sets the output's length: max_completion_tokens, the newer name, when
    a client sends it (null counts as not sent), else max_tokens."""
    return "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"


def _number(body: Mapping, key: str, lo: float, hi: float, *, lo_open: bool = False):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadParam(f"{key} must be a number, got {value!r:.40}", key)
    # An int is finite, whatever its size (math.isfinite would convert it to a float, and one
    # past 1e308 raises OverflowError: a 500).
    if isinstance(value, float) and not math.isfinite(value):
        raise BadParam(f"{key} must be a finite number, got {value}", key)
    if value > hi or value < lo or (lo_open and value == lo):
        low = f"({lo}" if lo_open else f"[{lo}"
        raise BadParam(f"{key} must be in {low}, {hi}], got {shown_number(value)}", key)
    return value


def _integer(body: Mapping, key: str, lo: int | None = None):
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadParam(f"{key} must be an integer, got {value!r:.40}", key)
    if not _INT64[0] <= value <= _INT64[1]:  # the engine's counters and seeds are 64-bit
        raise BadParam(f"{key} must fit in 64 bits, got {shown_number(value)}", key)
    if lo is not None and value < lo:
        raise BadParam(f"{key} must be >= {lo}, got {value}", key)
    return value


def sampling_from(
    body: Mapping[str, Any],
    tools: list[dict] | None,
    choice: ToolChoice,
    default_max: int,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    fewest_tokens: int = 1,
) -> SamplingParams:
    """SamplingParams from OpenAI fields (plus vLLM's top_k, min_p, min_tokens,
    repetition_penalty, ignore_eos, include_stop_str_in_output, stop_token_ids and
    thinking_token_budget); a forced call,
    or tools with a JSON response_format (a call or the answer), add their schema. `logprobs`,
    `prompt_logprobs`: SamplingParams' values, which chat and text completions read from their
    bodies each in its own way (logprobs_request.py). `fewest_tokens`: the smallest max_tokens
    taken (0: the legacy completions' echo, a prompt-only request)."""
    for key, neutral in _UNSUPPORTED.items():
        if key in body and body[key] not in neutral:
            raise BadParam(f"{key}={body[key]!r:.40} is not supported by this server", key)
    check_sampling_fields(body)
    # Both are checked; the newer name wins when a client sends both.
    checked = {key: _integer(body, key, fewest_tokens) for key in _MAX_TOKENS_KEYS}
    max_key = max_tokens_key(body)
    max_tokens = checked[max_key]
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
    either = None  # "a call or the answer": the response_format alone would rule out the tools
    if fmt is not None and choice.mode == "auto" and tools:
        either = call_or_answer_schema(tools, fmt)
    options: dict[str, Any] = {
        "max_tokens": default_max if max_tokens is None else max_tokens,
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1, lo_open=True),
        "top_k": _integer(body, "top_k", -1),  # -1: vLLM's "no top-k" (SamplingParams reads 0)
        "seed": _integer(body, "seed"),
        "stop": stop,
        "stop_token_ids": stop_token_ids(body),
        "ignore_eos": ignore_eos,
        "include_stop_str_in_output": body_flag(body, "include_stop_str_in_output"),
        "presence_penalty": _number(body, "presence_penalty", -PENALTY_LIMIT, PENALTY_LIMIT),
        "frequency_penalty": _number(body, "frequency_penalty", -PENALTY_LIMIT, PENALTY_LIMIT),
        "repetition_penalty": _number(body, "repetition_penalty", *REPETITION_RANGE),
        "min_p": _number(body, "min_p", 0, 1),
        "min_tokens": _integer(body, "min_tokens", 0),  # <= max_tokens: SamplingParams' check
        "thinking_token_budget": _integer(body, "thinking_token_budget", 0),
        "logit_bias": _logit_bias(body),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "response_format": None if either else fmt,
        "json_schema": forced_schema(choice, tools or []) if choice.forced else either,
    }
    try:
        return SamplingParams(**{k: v for k, v in options.items() if v is not None})
    except SamplingParamsError as e:
        field = e.fields[0]  # the first problem names the parameter, as a client reads one
        if field in ("json_schema", "response_format"):  # a forced call's schema is a tool's
            # (and so is the fault in a call-or-answer schema: its answer was checked alone)
            param = "tools" if choice.forced or either else "response_format"
        else:
            param = max_key if field == "max_tokens" else field
        raise BadParam(str(e), param) from None


def _logit_bias(body: Mapping[str, Any]) -> dict[int, Any] | None:
    """OpenAI's logit_bias: a JSON object whose keys are token ids written as strings of digits;
    the values (numbers in [-100, 100]) are SamplingParams' check, the vocabulary the engine's."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise BadParam(
            f"logit_bias must be an object mapping token ids to biases, got {value!r:.40}",
            "logit_bias",
        )
    bias = {}
    for key, number in value.items():
        token = token_id_key(key)  # the engine's check names an id outside its vocabulary
        if token is None:
            raise BadParam(
                f"logit_bias keys must be token ids (strings of up to 19 digits), got {key!r:.40}",
                "logit_bias",
            )
        bias[token] = number
    return bias or None


_TEXT_FIELDS = ("role", "name", "tool_call_id", "reasoning_content", "reasoning", "thinking")


def check_message_shapes(raw: list) -> None:
    """The JSON types of each message's fields, as OpenAI documents them, checked before the
    agent layer reads the history: it expects those types, and a wrong one (content `5`, a
    content part that is a list) must be a 400 naming the field, not a crash in there."""
    for i, msg in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(msg, Mapping):
            raise BadParam(f"{where} must be an object with a role, got {msg!r:.40}", where)
        # Before anything reads it: tool-call arguments given as an object are walked
        # recursively (rendering, cache keys), where hundreds of levels raised RecursionError.
        check_nesting(msg, where)
        for key in _TEXT_FIELDS:
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise BadParam(f"{where}.{key} must be a string, got {msg[key]!r:.40}", where)
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadParam(
                f"{where}.content must be a string or a list of content parts, got {content!r:.40}",
                where,
            )
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise BadParam(
                    f"{where}.content[{j}] must be an object with a 'type', got {part!r:.40}",
                    where,
                )
        calls = msg.get("tool_calls")
        if calls is not None and not isinstance(calls, list):
            raise BadParam(f"{where}.tool_calls must be a list, got {calls!r:.40}", where)
        for j, call in enumerate(calls or []):
            at = f"{where}.tool_calls[{j}]"
            fn = call.get("function") if isinstance(call, Mapping) else None
            if (
                not isinstance(fn, Mapping)
                or call.get("type", "function") != "function"
                or (call.get("id") is not None and not isinstance(call["id"], str))
                or not isinstance(fn.get("name"), str)
                or not isinstance(fn.get("arguments", "{}"), (str, Mapping))
            ):
                raise BadParam(
                    f"{at} must be {{'id': str, 'type': 'function', 'function': {{'name': str, "
                    f"'arguments': JSON text}}}}, got {call!r:.80}",
                    where,
                )


def turn_from(
    body: Mapping[str, Any], default_max: int, prompt_logprobs: int | None = None
) -> TurnRequest:
    """The turn part of a chat body (messages, tools, tool_choice, sampling fields);
    `prompt_logprobs`: vLLM's field, read with the envelope (logprobs_request.py)."""
    check_chat_fields(body)  # first: `functions` is refused as such, not as "no tools"
    messages = parse_messages(body.get("messages"))
    tools = parse_tools(body.get("tools"))
    choice = parse_tool_choice(body.get("tool_choice"), tools)
    logprobs = chat_body_logprobs(body)
    try:
        sampling = sampling_from(body, tools, choice, default_max, logprobs, prompt_logprobs)
    except BadParam:
        raise
    except InvalidRequestError as e:  # tool_call_schema on a malformed tool
        raise BadParam(str(e), "tools") from None
    parallel = body_flag(body, "parallel_tool_calls", True)
    turn = TurnRequest(messages, tools, choice, sampling, parallel, enable_thinking(body))
    turn.continue_final = continue_final_message(body)
    if turn.continue_final:
        check_continuable(turn)
    return turn


def check_continuable(turn: TurnRequest) -> None:
    """A continued turn (`continue_final`) ends with an assistant message of text, and carries
    no constraint on the reply's whole text: a JSON schema or a forced call is matched from
    the reply's first character, which a prefill has already written."""
    # Worded for both APIs: Anthropic's continues a last assistant message without a flag.
    i, last = len(turn.messages) - 1, turn.messages[-1]
    if not isinstance(last, AssistantMessage):
        raise BadParam(
            f"messages[{i}] ({last.role}): continue_final_message is true but the last message "
            "is not the assistant's; only an assistant message can be continued",
            f"messages[{i}]",
        )
    if last.tool_calls:
        raise BadParam(
            f"messages[{i}] (assistant): the last message has tool calls; only an assistant "
            "message of text can be continued",
            f"messages[{i}]",
        )
    if turn.sampling.json_schema is not None or turn.tool_choice.forced:
        field = "tool_choice" if turn.tool_choice.forced else "response_format"
        raise BadParam(
            f"a reply that goes on from the last (assistant) message cannot be constrained by "
            f"a forced tool call or a JSON response_format ({field}): the constraint is "
            "matched from the reply's start, which the continued message has already written",
            field,
        )


def parse_messages(raw: Any) -> list[Message]:
    """A body's `messages`, checked (a non-empty list, each message's shape) and read."""
    if not isinstance(raw, list) or not raw:
        raise BadParam("messages must be a non-empty list of messages", "messages")
    check_message_shapes(raw)
    try:
        return messages_from_openai(raw)  # InvalidRequestError naming "message i"
    except InvalidRequestError:
        raise
    except (TypeError, AttributeError, KeyError, ValueError) as e:
        # A shape the check above let through and the agent layer cannot read: still the
        # client's input, so still a 400 rather than a server error.
        raise BadParam(f"messages could not be read: {type(e).__name__}: {e}", "messages") from e


def check_model(name: Any, served: str, names: Collection[str]) -> None:
    """`model` names the served model or an alias (absent or null: the served one)."""
    if name is None:
        return
    if not isinstance(name, str):
        raise BadParam(f"model must be a string naming the model, got {name!r:.40}", "model")
    if name not in names:
        raise ModelNotFound(name, served)


def check_envelope(
    body: Any, served: str | None = None, names: Collection[str] = ()
) -> tuple[bool, bool]:
    """What every generation body shares (chat and text completions), checked: a JSON object,
    `model` (with `served`; first, so a request meant for another model is refused as such,
    whatever else is wrong with it), the ignored fields' types. Returns (stream, include_usage)."""
    if not isinstance(body, Mapping):
        raise BadParam(f"the request body must be a JSON object, got {type(body).__name__}")
    if served is not None:
        check_model(body.get("model"), served, names)
    for key, (kind, what) in _IGNORED_TYPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadParam(f"{key} must be {what}, got {value!r:.40}", key)
    stream = body_flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadParam("stream_options must be an object", "stream_options")
    return stream, body_flag(options or {}, "include_usage", where="stream_options.include_usage")


def parse_chat_request(
    body: Any, default_max: int, served: str | None = None, names: Collection[str] = ()
) -> ChatRequest:
    """The checked request (`check_envelope`, then the turn)."""
    stream, include_usage = check_envelope(body, served, names)
    prompt_logprobs = body_prompt_logprobs(body, stream)
    return ChatRequest(
        turn_from(body, default_max, prompt_logprobs),
        stream,
        include_usage,
        body_choice_count(body),
    )
