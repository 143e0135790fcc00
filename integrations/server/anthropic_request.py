"""An Anthropic Messages body, translated into an OpenAI chat body and checked by the chat
route's own code (chat_request.parse_chat_request): every check, tool and grammar rule and
sampling field is the same for both APIs, and only the translation is Anthropic's.

Fields:
- `model`: checked first, as the chat route checks it (404 when another model is named).
- `max_tokens`: required, as Anthropic requires it (count_tokens takes none).
- `messages`, `system`: anthropic_messages.py. A last message of the assistant's is continued
  (the chat route's `continue_final_message`): the reply is the continuation alone, as
  Anthropic answers a prefilled reply.
- `stop_sequences` -> stop; `temperature`, `top_p`, `top_k`, `stream`: the same fields.
- `metadata`: ignored, but its type is checked (an object).
- `tools`: custom tools `{name, description, input_schema, strict}` -> OpenAI function tools.
  Anthropic-defined tools (a `type` such as "web_search_20250305", "bash_20250124",
  "text_editor_20250728") are refused by name: this server runs no tools itself, and the model
  knows no built-in tool definitions. `mcp_servers` is refused for the same reason.
- `tool_choice`: {type: auto | any | tool (with `name`) | none} -> "auto", "required", a named
  function, "none"; `disable_parallel_tool_use: true` -> parallel_tool_calls false.
- `thinking`: {type: "enabled" | "adaptive" | "between_tools"} -> chat_template_kwargs
  enable_thinking true, {type: "disabled"} -> false, absent -> the template's default.
  `budget_tokens` -> thinking_token_budget: the think block is closed for the model after
  that many tokens (engine/thinking_budget.py); for a model without think tokens it is dropped
  (`budgets=False`), as Anthropic clients send one whenever thinking is on, and such a model
  has no block to end (the chat route's explicit thinking_token_budget is refused there).
  Thinking with a prefilled last assistant message is refused, as Anthropic refuses it (the
  template would close that turn's empty think block before the prefill).
  Anthropic's own floor (1024) and its rule that the budget stay under max_tokens are not
  imposed: a small local model may want less, and max_tokens bounds the whole reply anyway.
  `display` ("omitted" would hide the thinking text) is not honoured: the thinking is always
  shown.
- `output_format` / `output_config.format` (structured outputs) are refused by name; the rest of
  `output_config` (effort) and unknown fields are ignored, as the chat route ignores them.

Refusals from the shared checks name OpenAI's fields (`stop`, `messages[3]` of the translated
history, `tools[0].function.parameters`); `anthropic_refusal` renames them to the Anthropic
body's (`stop_sequences`, the message they came from, `tools[0].input_schema`). A history
over the context is refused as Anthropic words it, "prompt is too long: ...".
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from freetoken_agent.engine.outputs import ContextLengthError, InvalidRequestError
from freetoken_agent.integrations.server.anthropic_messages import openai_history, with_origins
from freetoken_agent.integrations.server.chat_request import (
    ChatRequest,
    check_model,
    parse_chat_request,
)
from freetoken_agent.integrations.server.errors import BadParam, describe_invalid

# Fields with the same name and meaning in both APIs: passed as they are.
_SAME = ("max_tokens", "temperature", "top_p", "top_k", "stream", "metadata")

# Said when a request names a tool the provider would run (web search, code execution, ...).
NO_SERVER_TOOLS = "this server runs no tools itself and knows no built-in tool definitions"

# OpenAI field -> the Anthropic field a refusal should name.
_PARAMS = {
    "stop": "stop_sequences",
    "max_completion_tokens": "max_tokens",
    "parallel_tool_calls": "tool_choice",
    "chat_template_kwargs": "thinking",
    "thinking_token_budget": "thinking",
}
# How the shared checks' messages spell a tool's parts, and the Anthropic spelling.
_TOOL_WORDS = ((".function.parameters", ".input_schema"), (".function.", "."))


@dataclass(slots=True)
class MessagesRequest:
    chat: ChatRequest  # the checked turn, and `stream`
    origins: list[str]  # per message of the turn's history: the Anthropic field it came from


def _stop(raw: Any) -> list[str] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not all(isinstance(s, str) and s for s in raw):
        raise BadParam("stop_sequences must be a list of non-empty strings", "stop_sequences")
    return raw or None


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise BadParam(f"tools must be a list of tools, got {type(raw).__name__}", "tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise BadParam(f"{where} must be an object {{name, description, input_schema}}", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise BadParam(
                f"{where}: the Anthropic-defined tool {kind!r:.60} is not supported: "
                f"{NO_SERVER_TOOLS}; declare a custom tool (name, description, input_schema)",
                where,
            )
        function = {"name": tool.get("name")}
        for ours, theirs in (("description", "description"), ("parameters", "input_schema"),
                             ("strict", "strict")):  # fmt: skip
            if tool.get(theirs) is not None:
                function[ours] = tool[theirs]
        tools.append({"type": "function", "function": function})
    return tools


_CHOICES = "{'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}"


def _tool_choice(raw: Any, tools: list | None) -> tuple[Any, bool | None]:
    """(OpenAI's tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise BadParam(f"tool_choice must be {_CHOICES}, got {raw!r:.80}", "tool_choice")
    disable = raw.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise BadParam(
            f"tool_choice.disable_parallel_tool_use must be true or false, got {disable!r:.40}",
            "tool_choice",
        )
    if kind in ("any", "tool") and not tools:
        raise BadParam(f"tool_choice {kind!r} needs at least one tool in tools", "tool_choice")
    if kind == "tool":
        name = raw.get("name")
        if not isinstance(name, str):
            raise BadParam("tool_choice {'type': 'tool'} needs the tool's name", "tool_choice")
        choice: Any = {"type": "function", "function": {"name": name}}
    else:
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    return choice, (False if disable else None)


def _thinking(raw: Any) -> tuple[bool | None, int | None]:
    """(enable_thinking, thinking_token_budget) of Anthropic's `thinking`."""
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, Mapping) else None
    if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
        raise BadParam(
            f"thinking must be {{'type': 'enabled', 'budget_tokens': n}}, {{'type': 'adaptive'}}, "
            f"{{'type': 'between_tools'}} or {{'type': 'disabled'}}, got {raw!r:.60}",
            "thinking",
        )
    budget = raw.get("budget_tokens")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
        raise BadParam(f"thinking.budget_tokens must be an integer, got {budget!r:.40}", "thinking")
    if budget is not None and not 0 <= budget < 2**63:  # checked here to name Anthropic's field
        raise BadParam(
            f"thinking.budget_tokens must be a non-negative integer, got {budget!r:.40}",
            "thinking",
        )
    return kind != "disabled", (budget if kind == "enabled" else None)


def _continues(messages: list) -> bool | None:
    """True when the last message is the assistant's: Anthropic continues it (checked lists
    only: openai_history has read `messages` by then)."""
    return True if messages[-1].get("role") == "assistant" else None


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    config = body.get("output_config")
    for field, value in (
        ("output_format", body.get("output_format")),
        ("output_config.format", config.get("format") if isinstance(config, Mapping) else None),
    ):
        if value is not None:
            raise BadParam(
                f"{field} is not supported on /v1/messages; /v1/chat/completions takes a JSON "
                "schema as response_format",
                field.split(".")[0],
            )
    if body.get("mcp_servers"):
        raise BadParam(f"mcp_servers is not supported: {NO_SERVER_TOOLS}", "mcp_servers")


def openai_body(body: Mapping[str, Any], budgets: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The OpenAI chat body of an Anthropic one, and its messages' origins; `budgets`: the
    model has think tokens, so `thinking.budget_tokens` is passed on."""
    _refuse_unserved(body)
    history = openai_history(body.get("system"), body.get("messages"))
    out = {key: body[key] for key in _SAME if key in body}
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    thinking, budget = _thinking(body.get("thinking"))
    continuing = _continues(body.get("messages"))
    if thinking and continuing:
        # As Anthropic refuses it: the template renders the prefilled turn's think block
        # closed (empty) before the prefill, so the thinking would silently not happen.
        raise BadParam(
            "thinking cannot be enabled with a prefilled last assistant message: the "
            "continuation comes after that turn's (empty) thinking; disable thinking or end "
            "the messages with the user's turn",
            "thinking",
        )
    extra = {
        "messages": history.messages,
        "stop": _stop(body.get("stop_sequences")),
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": None if thinking is None else {"enable_thinking": thinking},
        "continue_final_message": continuing,
        "thinking_token_budget": budget if budgets else None,
    }
    out.update((key, value) for key, value in extra.items() if value is not None)
    return out, history.origins


def anthropic_refusal(error: InvalidRequestError, origins: list[str]) -> BadParam:
    """A refusal of the shared checks (or of the engine) with the Anthropic body's names."""
    message, param, code = describe_invalid(error)
    message = with_origins(message, origins).replace(" (tool)", " (tool_result)")
    if param is not None:
        param = with_origins(param, origins)
        param = _PARAMS.get(param, param)
    if param is not None and param.startswith("tools"):
        for ours, theirs in _TOOL_WORDS:
            message, param = message.replace(ours, theirs), param.replace(ours, theirs)
    if isinstance(error, ContextLengthError):
        # Anthropic's own wording leads ("prompt is too long: N tokens > M maximum"): agents
        # (Claude Code among them) recognise an over-long history by it, and read the counts,
        # to compact the history and retry.
        n, most = error.prompt_tokens, error.max_prompt_tokens
        counts = f"{n} tokens > {most} maximum; " if n is not None and most is not None else ""
        message, param = f"prompt is too long: {counts}{message}", None
    renamed = BadParam(message, param, code)
    renamed.status = getattr(error, "status", 400)
    return renamed


def parse_messages_request(
    body: Any,
    default_max: int,
    served: str,
    names: Collection[str],
    *,
    counting: bool = False,
    budgets: bool = True,
) -> MessagesRequest:
    """The checked request; `counting` (count_tokens): max_tokens is not required; `budgets`:
    as `openai_body`'s."""
    if not isinstance(body, Mapping):
        raise BadParam(f"the request body must be a JSON object, got {type(body).__name__}")
    check_model(body.get("model"), served, names)  # first, as the chat route does
    if not counting and body.get("max_tokens") is None:
        raise BadParam("max_tokens is required: the most tokens to generate", "max_tokens")
    chat_body, origins = openai_body(body, budgets)
    try:
        chat = parse_chat_request(chat_body, default_max)
    except InvalidRequestError as e:
        raise anthropic_refusal(e, origins) from None
    return MessagesRequest(chat, origins)
