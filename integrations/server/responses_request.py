"""A Responses API body (POST /v1/responses), translated into an OpenAI chat body and checked by
the chat route's own code (chat_request.parse_chat_request), as anthropic_request.py does for
Anthropic's: every check, tool and grammar rule and sampling field is the chat route's, only
the translation is the Responses API's. The OpenAI Agents SDK (its default model class) and
Codex speak it.

Fields:
- `model` (checked first), `input` and `instructions` (responses_input.py), `stream`,
  `temperature`, `top_p`, `parallel_tool_calls`: as they are; `max_output_tokens` -> max_tokens.
- The chat route's other fields (`seed`, `stop`, the penalties, `logit_bias`, vLLM's `top_k`,
  `min_p`, `min_tokens`, `stop_token_ids`, `ignore_eos`, `thinking_token_budget`,
  `chat_template_kwargs`, ...: `_CHAT_FIELDS`) pass as they are, and the fields the chat route
  refuses by name (vLLM's guided decoding and beam search, the legacy `functions`, `echo`, a
  `chat_template`: foreign_fields.py) are refused here too. Why: they are not Responses
  fields, but clients send them in its body (LangChain's ChatOpenAI with use_responses_api
  puts seed, the penalties and logit_bias at the top level; extra_body adds the rest), and a
  field that changes the output must be honoured or refused, never dropped. `reasoning.effort`
  goes as the chat route's `reasoning_effort`, so a `chat_template_kwargs` that says
  otherwise is refused there; with a top-level `reasoning_effort` too it is refused here. `n`
  other than 1 is refused: a response holds one output.
- `tools`: function tools `{type: "function", name, description, parameters, strict}` -> chat
  function tools. Hosted tools (web_search, file_search, code_interpreter, computer_use, mcp,
  image_generation, local_shell, custom) are refused by name: this server runs no tools and
  the model knows none built in.
- `tool_choice`: "auto" | "none" | "required" | {type: "function", name} -> the same choice.
- `text.format`: {type: "text"} (free), {type: "json_object"}, {type: "json_schema", name,
  schema, strict} -> the chat route's response_format.
- `reasoning.effort` -> the chat route's reasoning_effort: "none" turns thinking off (the
  template's enable_thinking false), any other effort on (thinking_switch.thinking_of_effort;
  a budget is the chat route's thinking_token_budget).
- `previous_response_id`: the stored response's conversation (its input, then its output
  items) goes before `input` (responses_store.py: kept in memory, the most recent ones; not
  its instructions, as OpenAI does not carry them); an unknown id is refused.
  `conversation` refused (send the whole input, or previous_response_id); `background: true`
  refused. `store: false` keeps the response out of the store.
- Log-probabilities: `include: ["message.output_text.logprobs"]` asks for the message's
  (`top_logprobs`, 0..20, alternatives a token; above 0 it asks too, as the user plainly wants
  them) -> the chat route's logprobs / top_logprobs (responses_format.py writes them).
  `metadata`, `include` (but for the two values above: responses_format.py),
  `truncation`, `user`, `service_tier`, `prompt_cache_key`, `safety_identifier`,
  `stream_options` are accepted and ignored, each only with the type OpenAI documents
  (`_TYPES`): a wrong type is a client bug, refused naming the field, as the chat route
  refuses its own (`store: "false"` must not read as "store").
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.integrations.server.anthropic_messages import with_origins
from freetoken_agent.integrations.server.anthropic_request import NO_SERVER_TOOLS
from freetoken_agent.integrations.server.chat_request import (
    ChatRequest,
    body_choice_count,
    check_model,
    parse_chat_request,
)
from freetoken_agent.integrations.server.errors import BadParam, describe_invalid
from freetoken_agent.integrations.server.foreign_fields import (
    check_chat_fields,
    check_sampling_fields,
)
from freetoken_agent.integrations.server.responses_input import chat_history, input_items
from freetoken_agent.integrations.server.responses_store import ResponseStore
from freetoken_agent.integrations.server.thinking_switch import thinking_of_effort

_SAME = ("stream", "temperature", "top_p", "parallel_tool_calls")
# The chat route's fields that are not the Responses API's own (module docstring).
_CHAT_FIELDS = (
    "seed", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "top_k", "min_p",
    "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos",
    "include_stop_str_in_output", "thinking_token_budget", "prediction", "audio",
    "chat_template_kwargs", "reasoning_effort",
)  # fmt: skip

# The Responses-only fields this server reads or ignores, with the type OpenAI documents
# (the shared ones, stream and the sampling fields, are the chat route's checks).
_TYPES: dict[str, tuple[type, str]] = {
    "store": (bool, "true or false"),
    "background": (bool, "true or false"),
    "metadata": (dict, "an object"),
    "text": (dict, "an object"),
    "include": (list, "a list of strings"),
    "user": (str, "a string"),
    "service_tier": (str, "a string"),
    "prompt_cache_key": (str, "a string"),
    "safety_identifier": (str, "a string"),
}
_TRUNCATION = ("auto", "disabled")


@dataclass(slots=True)
class ResponsesRequest:
    chat: ChatRequest  # the checked turn, and `stream`
    body: Mapping[str, Any]  # as sent: the response echoes its settings
    origins: list[str]  # per chat message: the Responses field it came from
    items: list[Any]  # the conversation as input items (a previous response's first), to store
    own: list[Any]  # this request's input items (after the previous response's)


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadParam(f"tools must be a list of tools, got {type(raw).__name__}", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind != "function":
            raise BadParam(
                f"{where}: tools of type {kind!r:.60} are not supported: {NO_SERVER_TOOLS}; "
                "declare a function tool {type: 'function', name, description, parameters}",
                where,
            )
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                    if tool.get(k) is not None}  # fmt: skip
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    named = isinstance(raw, Mapping) and raw.get("type") == "function"
    if named and isinstance(raw.get("name"), str) and raw["name"]:
        return {"type": "function", "function": {"name": raw["name"]}}
    raise BadParam(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}, "
        f"got {raw!r:.80}",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """The chat route's response_format of `text.format`."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise BadParam("text.format.name is required for a json_schema format", "text")
        if "schema" in fmt and not isinstance(fmt["schema"], Mapping):
            raise BadParam(
                f"text.format.schema must be a JSON schema (an object), got {fmt['schema']!r:.60}",
                "text",
            )
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise BadParam(
        f"text.format must be of type 'text', 'json_object' or 'json_schema', got {fmt!r:.80}",
        "text",
    )


def _effort(reasoning: Any) -> str | None:
    """reasoning.effort, checked (the chat route reads it as its reasoning_effort)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, Mapping):
        raise BadParam(f"reasoning must be an object, got {reasoning!r:.40}", "reasoning")
    thinking_of_effort(reasoning.get("effort"), "reasoning")  # named as this API's field
    return reasoning.get("effort")


def _check_types(body: Mapping[str, Any]) -> None:
    for key, (kind, what) in _TYPES.items():
        value = body.get(key)
        if value is not None and not isinstance(value, kind):
            raise BadParam(f"{key} must be {what}, got {value!r:.40}", key)
    include = body.get("include") or []
    if not all(isinstance(item, str) for item in include):
        raise BadParam(f"include must be a list of strings, got {include!r:.60}", "include")
    truncation = body.get("truncation")
    if truncation is not None and truncation not in _TRUNCATION:
        raise BadParam(
            f"truncation must be 'auto' or 'disabled', got {truncation!r:.40}", "truncation"
        )


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    if body.get("conversation") is not None:
        raise BadParam("conversation is not supported: conversations are not stored here: "
                       "send the whole input", "conversation")  # fmt: skip
    if body.get("background") is True:
        raise BadParam("background responses are not supported: this server answers at once",
                       "background")  # fmt: skip
    # The legacy function calling, pointed at this API's own (flat) forms before the chat
    # route's refusal, which names the chat forms.
    if body.get("functions") is not None:
        raise BadParam("functions is not supported: it is the legacy form of tools: send "
                       "tools=[{'type': 'function', 'name': ..., 'parameters': ...}]",
                       "functions")  # fmt: skip
    if body.get("function_call") is not None:
        raise BadParam("function_call is not supported: it is the legacy form of tool_choice: "
                       "send tool_choice 'auto', 'none', 'required' or {'type': 'function', "
                       "'name': ...}", "function_call")  # fmt: skip
    if body_choice_count(body) != 1:  # (its type and range checked as the chat route does)
        raise BadParam(f"n={body['n']!r:.40} is not supported: a response holds one output; "
                       "send n requests", "n")  # fmt: skip


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _logprobs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat body's logprobs fields: asked by `include` or by `top_logprobs` above 0; the
    count is checked by the chat route's own rule (its param is `top_logprobs` in both APIs)."""
    include, top = body.get("include"), body.get("top_logprobs")
    listed = isinstance(include, list) and LOGPROBS_INCLUDE in include
    wanted = isinstance(top, int) and not isinstance(top, bool) and top > 0
    if listed or wanted:
        return {"logprobs": True, "top_logprobs": top}
    return {"top_logprobs": top}  # null or 0 ask for nothing; anything else is refused there


def chat_body(
    body: Mapping[str, Any], earlier: list[Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The OpenAI chat body of a Responses one, and its messages' origins; `earlier`: the
    conversation of its previous_response_id, as input items."""
    _check_types(body)
    _refuse_unserved(body)
    check_sampling_fields(body)  # vLLM's guided decoding and beam search, by name
    check_chat_fields(body)  # the legacy functions, echo, a chat_template, best_of, by name
    history = chat_history(body.get("instructions"), body.get("input"), earlier)
    out = {key: body[key] for key in (*_SAME, *_CHAT_FIELDS) if key in body}
    effort = _effort(body.get("reasoning"))
    if effort is not None and body.get("reasoning_effort") is not None:
        raise BadParam("give reasoning.effort or reasoning_effort, not both", "reasoning")
    extra = {
        "messages": history.messages,
        "max_tokens": body.get("max_output_tokens"),
        "tools": _tools(body.get("tools")),
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "response_format": _response_format(body.get("text")),
        "reasoning_effort": effort,
        **_logprobs(body),
    }
    out.update((key, value) for key, value in extra.items() if value is not None)
    return out, history.origins


def parse_responses_request(
    body: Any, default_max: int, served: str, names: Collection[str], store: ResponseStore
) -> ResponsesRequest:
    """The checked request; `store`: the kept responses a previous_response_id names."""
    if not isinstance(body, Mapping):
        raise BadParam(f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body.get("model"), served, names)  # first, as the chat route does
    earlier = _earlier(body.get("previous_response_id"), store)
    chat, origins = chat_body(body, earlier)
    own = input_items(body.get("input"))
    try:
        checked = parse_chat_request(chat, default_max)
        return ResponsesRequest(checked, body, origins, [*earlier, *own], own)
    except InvalidRequestError as e:
        raise responses_refusal(e, origins) from None


def _earlier(previous: Any, store: ResponseStore) -> list[Any]:
    """The conversation of `previous_response_id` as input items ([] without one). Its
    instructions are not carried over, as OpenAI does not carry them."""
    if previous is None:
        return []
    items = store.conversation(previous) if isinstance(previous, str) else None
    if items is None:
        raise BadParam(
            f"previous_response_id {previous!r:.60} is not a response this server keeps (it "
            f"keeps the last {store.max_kept} stored ones, fewer when they are large, in "
            "memory, for its life; a request with store false is not kept): send the whole "
            "input",
            "previous_response_id",
        )
    return items


def responses_refusal(error: InvalidRequestError, origins: list[str]) -> BadParam:
    """A refusal of the shared checks (or of the engine) naming the Responses fields: the chat
    history's `messages[i]` is the input item it came from (a tool message: a
    function_call_output); `max_tokens` is `max_output_tokens`; `response_format` is `text`;
    a tool's fields sit on the tool itself (`tools[i].name`, not `tools[i].function.name`)."""
    text, param, code = describe_invalid(error)
    text = with_origins(text, origins).replace(" (tool)", " (function_call_output)")
    param = None if param is None else with_origins(param, origins)
    for ours, theirs in (("max_tokens", "max_output_tokens"), ("response_format", "text")):
        text = text.replace(ours, theirs)
        param = theirs if param == ours else param
    if param is not None and param.startswith("tools"):
        text, param = text.replace(".function.", "."), param.replace(".function.", ".")
    param = "input" if param == "messages" else param  # the whole history (its length)
    renamed = BadParam(text, param, code)
    renamed.status = getattr(error, "status", 400)
    return renamed
