"""A Responses API `input` (and `instructions`) as OpenAI chat messages, the form the chat route
checks and reads (chat_request.parse_messages), as anthropic_messages.py does for Anthropic's.

Items and what they become:
- `instructions`, and the system or developer messages that open `input`: one system message
  first, their texts joined (Codex sends both every turn; templates such as Qwen3.5's refuse
  a second system message).
- a string `input`: one user message.
- `message` items (with or without `"type": "message"`): role user, system, developer or
  assistant; content a string or parts, `input_text` / `output_text` (annotations and logprobs
  dropped) joined as text parts; `refusal` parts as text. `input_image`, `input_file` and
  `input_audio` are refused by name (this server's models read text).
- `function_call` {call_id, name, arguments}: a tool call of the assistant turn it belongs to:
  calls that follow an assistant message (or each other) join that turn, as the chat form
  writes one turn's text and calls.
- `function_call_output` {call_id, output}: a `tool` message answering `call_id` (output a
  string, or text parts joined).
- `reasoning` {summary, content}: the reasoning of the assistant turn that follows it (its
  `reasoning_text` content, else its summary texts; several in one turn joined); reasoning no
  assistant item follows is dropped; `encrypted_content` is read only where this server wrote
  it (`SEALED`: the text itself, for clients that send reasoning back in that field alone).
- `item_reference` and every other type: refused by name (continue a stored response with
  previous_response_id instead).

`origins` says where each chat message came from ("instructions", "input[3]"), so a refusal of
the shared checks, which index the chat messages, names the Responses item.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from freetoken_agent.integrations.server.anthropic_messages import OpenAIHistory
from freetoken_agent.integrations.server.errors import BadParam

_ROLES = ("user", "system", "developer", "assistant")
# What opens the `encrypted_content` this server writes: the reasoning's own text, not
# encrypted (it never leaves the user's machine); another server's is not read.
SEALED = "freetoken-reasoning:"
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def input_items(items: Any) -> list[Any]:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadParam("input must be a string or a non-empty list of items", "input")
    return items


def chat_history(instructions: Any, items: Any, earlier: list[Any] | None = None) -> OpenAIHistory:
    """The chat messages of `instructions`, the `earlier` items (a previous response's
    conversation) and `input`, with their origins."""
    history = OpenAIHistory()
    if instructions is not None and not isinstance(instructions, str):
        raise BadParam(f"instructions must be a string, got {instructions!r:.40}", "instructions")
    single = isinstance(items, str)  # one user message, named `input`
    earlier = earlier or []
    items = [*earlier, *input_items(items)]
    first = _system_prompt(instructions, items, history)
    reasoning: str | None = None  # a reasoning item's text, for the assistant turn it precedes
    turn: dict[str, Any] | None = None  # the assistant turn calls may still join
    for i, item in enumerate(items[first:], start=first):
        j = i - len(earlier)  # its place in `input`
        at = "previous_response_id" if j < 0 else "input" if single else f"input[{j}]"
        if not isinstance(item, Mapping):
            raise BadParam(f"{at} must be an object, got {item!r:.40}", at)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "reasoning":
            reasoning = _joined(reasoning, _reasoning_text(item, at))
            continue
        if kind == "function_call":
            call = _call(item, at)
            if turn is None:
                turn = {"role": "assistant", "content": "", "tool_calls": []}
                history.add(turn, at)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "message":
            message = _message(item, at)
            history.add(message, at)
            turn = message if message["role"] == "assistant" else None
        elif kind == "function_call_output":
            history.add(_output(item, at), at)
            turn = None
        else:
            raise BadParam(f"{at}: items of type {kind!r} are not supported by this server", at)
        if turn is not None and reasoning is not None:  # several join (interleaved thinking)
            turn["reasoning_content"] = _joined(turn.get("reasoning_content"), reasoning)
        reasoning = None  # reasoning no assistant item followed belongs to no later turn
    return history


def _system_prompt(instructions: str | None, items: list, history: OpenAIHistory) -> int:
    """One system message of `instructions` and the system or developer messages that lead
    `input` (Codex sends both every turn; templates such as Qwen3.5's refuse a second system
    message), added to `history`; the index of the first item after them."""
    texts = [] if instructions is None else [instructions]
    first = 0
    for item in items:
        if not isinstance(item, Mapping) or item.get("type", "message") != "message":
            break
        if item.get("role") not in ("system", "developer"):
            break
        content = _message(item, f"input[{first}]")["content"]
        texts.append(content if isinstance(content, str) else "".join(p["text"] for p in content))
        first += 1
    if texts:
        origin = "instructions" if instructions is not None else "input[0]"
        history.add({"role": "system", "content": "\n\n".join(texts)}, origin)
    return first


def _joined(before: str | None, text: str) -> str:
    return text if not before else f"{before}\n\n{text}"


def _message(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise BadParam(f"{at}.role must be one of {', '.join(_ROLES)}, got {role!r:.40}", at)
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    return {"role": role, "content": _text_parts(content, f"{at}.content", at)}


def _text_parts(content: Any, where: str, param: str) -> list[dict[str, str]]:
    if not isinstance(content, list):
        raise BadParam(f"{where} must be a string or a list of parts, got {content!r:.40}", param)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in _TEXT_PARTS:
            raise BadParam(f"{where}[{j}]: {kind!r} parts are not supported by this server (it "
                           "reads text)", param)  # fmt: skip
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise BadParam(f"{where}[{j}] has no text", param)
        parts.append({"type": "text", "text": text})
    return parts


def _call(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    for field, value in (("call_id", call_id), ("name", name), ("arguments", arguments)):
        if not isinstance(value, str):
            raise BadParam(f"{at}.{field} must be a string, got {value!r:.40}", at)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _output(item: Mapping[str, Any], at: str) -> dict[str, Any]:
    call_id, output = item.get("call_id"), item.get("output")
    if not isinstance(call_id, str):
        raise BadParam(f"{at}.call_id must be a string, got {call_id!r:.40}", at)
    if not isinstance(output, str):
        output = _text_parts(output, f"{at}.output", at)
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _reasoning_text(item: Mapping[str, Any], at: str) -> str:
    """A reasoning item's text: its reasoning_text content, else the text this server put in
    its `encrypted_content` (clients such as Codex send reasoning back in that field alone),
    else its summary texts."""
    sealed = item.get("encrypted_content")
    if not item.get("content") and isinstance(sealed, str) and sealed.startswith(SEALED):
        return sealed[len(SEALED) :]
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise BadParam(f"{at}.{field} must be a list, got {parts!r:.40}", at)
        texts = [p.get("text") for p in parts if isinstance(p, Mapping) and p.get("type") == kind]
        if any(not isinstance(t, str) for t in texts):
            raise BadParam(f"{at}.{field}: a {kind} part has no text", at)
        if texts:
            return "\n\n".join(texts)
    return ""
