"""The structured history: what an agent said, thought, called and got back.

Records, one per message kind, each a `@dataclass(slots=True)` (message_records.py holds them;
they are re-exported here, where callers import them):

    SystemMessage(content)
    UserMessage(content)
    AssistantMessage(content, reasoning, tool_calls, invalid_call_ids)
                                                         tool_calls: list[ToolCall]
    ToolCall(id, name, arguments)                        arguments: a dict, never a JSON string
    ToolResult(tool_call_id, content, is_error, name)    the answer to one ToolCall

`content` is a string or a list of OpenAI-style content parts ({"type": "text", "text": ...}).
Records check their own fields when built; `validate_history` checks the conversation as a whole
(every ToolResult answers an earlier, still unanswered ToolCall). Both raise
`InvalidRequestError` (a ValueError) with a message naming the message index and the problem.
`in_call_order` validates and puts tool results into the order of their calls: chat templates
render results by position, without ids (see there); `coerce_messages` and
`messages_from_openai` return histories in that order, so every renderer gets it.

Conversions: `to_template_messages` gives the plain dicts chat templates expect (OpenAI roles,
`reasoning_content`, tool-call arguments as dicts, text parts joined); `to_openai_messages`
gives the OpenAI wire form (arguments as JSON strings); `messages_from_openai` reads that form.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.message_records import (
    MESSAGE_TYPES,
    AssistantMessage,
    Content,
    Message,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
)
from freetoken_agent.parsers.json_scan import loads_strict


def content_text(content: Content, where: str = "message") -> str:
    """A content value as one string: text parts joined with newlines (as vLLM does for
    templates that expect strings). The engine is text-only: other part types are refused
    rather than silently dropped.

    The same for assistant turns (messages_from_openai once joined theirs with "", so a history
    rendered differently as records and after an OpenAI round trip): OpenAI names no joiner,
    vLLM's server uses "\\n" for every role, and a client re-sending our history should get the
    prompt vLLM would render; "" could also glue two parts' words together."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise InvalidRequestError(
            f"{where}: content must be a string or a list of parts, got {type(content).__name__}"
        )
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict):
            raise InvalidRequestError(
                f"{where}: content part {j} must be an object, got {type(part).__name__}"
            )
        if part.get("type") != "text":
            raise InvalidRequestError(
                f"{where}: content part {j} has type {part.get('type')!r}; this engine takes "
                "text only"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}: content part {j} has no string 'text'")
        texts.append(part["text"])
    return "\n".join(texts)


def validate_history(messages: Sequence[Message]) -> None:
    """Check every record and the pairing of tool calls with results.

    A ToolResult must answer a call made earlier and not answered yet (a parsed call, or one
    of an assistant message's `invalid_call_ids`). Ids may be reused once answered (some models
    number calls from 0 every turn): a result pairs with the latest pending call of its id."""
    _pair_results(messages)


def _pair_results(messages: Sequence[Message]) -> dict[int, tuple[int, int]]:
    """validate_history's checks; for each ToolResult (by index) the call it answers, as
    (index of the assistant message, place of the call in its rendering): the invalid calls
    first (their text is in the content, which templates render before the calls), then the
    parsed calls in their order."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of message records")
    # call id -> (assistant index, place, parsed?) for calls not answered yet. An invalid call
    # needs no answer: a later call may take its id.
    pending: dict[str, tuple[int, int, bool]] = {}
    answered: set[str] = set()
    pairs: dict[int, tuple[int, int]] = {}
    for i, msg in enumerate(messages):
        if not isinstance(msg, MESSAGE_TYPES):
            role = msg.get("role") if isinstance(msg, Mapping) else None
            hint = f" (a dict with role {role!r}: use messages_from_openai)" if role else ""
            raise InvalidRequestError(
                f"message {i}: unknown message type {type(msg).__name__}{hint}; expected "
                "SystemMessage, UserMessage, AssistantMessage or ToolResult"
            )
        where = f"message {i} ({msg.role})"
        msg.check(where)
        if isinstance(msg, AssistantMessage):
            ids = [*msg.invalid_call_ids, *(call.id for call in msg.tool_calls)]
            n_invalid = len(msg.invalid_call_ids)
            for place, cid in enumerate(ids):
                if cid in pending and pending[cid][2]:
                    raise InvalidRequestError(
                        f"{where}: tool call id {cid!r} is still waiting for its result "
                        "from an earlier turn"
                    )
                pending[cid] = (i, place, place >= n_invalid)
        elif isinstance(msg, ToolResult):
            cid = msg.tool_call_id
            if cid not in pending:
                state = "was already answered" if cid in answered else "matches no earlier call"
                raise InvalidRequestError(f"{where}: tool result for id {cid!r} {state}")
            pairs[i] = pending.pop(cid)[:2]
            answered.add(cid)
    return pairs


def in_call_order(messages: Sequence[Message]) -> list[Message]:
    """The history validated, each run of consecutive ToolResults put into the order of the
    calls they answer (the rest as given).

    Chat templates (Hermes/Qwen: `<tool_response>` blocks) render results by position, without
    their ids: the model reads the first result as the answer to its first call. Frameworks do
    not always send results in call order (LangChain's HumanInTheLoopMiddleware puts a rejected
    call's message before the results of the calls that ran). The order depends only on the
    history, so a history renders the same every time (prefix/KV reuse is kept)."""
    pairs = _pair_results(messages)
    out = list(messages)
    i = 0
    while i < len(out):
        if not isinstance(out[i], ToolResult):
            i += 1
            continue
        j = i
        while j < len(out) and isinstance(out[j], ToolResult):
            j += 1
        # Keys are distinct (a call is answered once), so the order is a function of the calls.
        out[i:j] = [messages[k] for k in sorted(range(i, j), key=pairs.__getitem__)]
        i = j
    return out


# --------------------------------------------------------------------------- conversions


def _call_dict(call: ToolCall, json_arguments: bool) -> dict[str, Any]:
    args: Any = json.dumps(call.arguments, ensure_ascii=False) if json_arguments else call.arguments
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": args}}


def _to_dict(msg: Message, index: int, template: bool) -> dict[str, Any]:
    where = f"message {index} ({msg.role})"
    # Templates mostly expect strings (a list becomes '' in Qwen's); the wire form keeps parts.
    content = content_text(msg.content, where) if template else msg.content
    out: dict[str, Any] = {"role": msg.role, "content": content}
    if isinstance(msg, AssistantMessage):
        if msg.reasoning is not None:
            out["reasoning_content"] = msg.reasoning
        if msg.tool_calls:
            out["tool_calls"] = [_call_dict(c, json_arguments=not template) for c in msg.tool_calls]
        if msg.invalid_call_ids and not template:
            # No OpenAI field: kept (non-standard) so that the wire form reads back as the same
            # history, the results that answer these ids included. Templates render content.
            out["invalid_call_ids"] = list(msg.invalid_call_ids)
    elif isinstance(msg, ToolResult):
        out["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            out["name"] = msg.name
    return out


def to_template_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Plain dicts for a chat template: arguments stay dicts (templates `tojson` them), reasoning
    travels as `reasoning_content`, text parts are joined into one string."""
    return [_to_dict(m, i, template=True) for i, m in enumerate(messages)]


def to_openai_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The OpenAI chat-completions form: arguments as JSON strings, content parts kept.
    `ToolResult.is_error` has no field there and is left out (the content says what failed)."""
    return [_to_dict(m, i, template=False) for i, m in enumerate(messages)]


_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")


def _calls_from_openai(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise InvalidRequestError(f"{where}: tool_calls must be a list")
    calls = []
    for j, item in enumerate(raw):
        w = f"{where}: tool call {j}"
        if not isinstance(item, Mapping):
            raise InvalidRequestError(f"{w} must be a dict")
        fn = item.get("function", item)  # the nested OpenAI form, or a flat {name, arguments}
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{w}: 'function' must be a dict")
        args = fn.get("arguments")
        if args is None or args == "":
            args = {}
        elif isinstance(args, str):
            # Strict, as for the model's own calls: json.loads would take NaN, lone surrogates,
            # and raise RecursionError on deep nesting (a client's bug must not crash us).
            try:
                args = loads_strict(args)
            except ValueError as e:
                raise InvalidRequestError(
                    f"{w} ({fn.get('name')}): arguments are not JSON: {e}"
                ) from e
        try:
            calls.append(ToolCall(id=item.get("id"), name=fn.get("name"), arguments=args))
        except InvalidRequestError as e:
            raise _relocated(e, "tool call", w) from None
    return calls


def _relocated(error: InvalidRequestError, generic: str, where: str) -> InvalidRequestError:
    """The error a record raised while being built, its generic place name made specific."""
    text = str(error)
    if text.startswith(generic):
        text = where + text[len(generic) :]
    return InvalidRequestError(text)


def _message_from_openai(item: Any, i: int) -> Message:
    try:
        return _record_from_openai(item, i)
    except InvalidRequestError as e:
        if str(e).startswith("message "):
            raise
        role = item.get("role") if isinstance(item, Mapping) else None
        kind = {"developer": "system", "tool": "tool result"}.get(role, role)
        raise _relocated(
            e, f"{kind} message" if role != "tool" else kind, f"message {i} ({role})"
        ) from None


def _refusal_as_text(part: Any) -> Any:
    """An assistant's `refusal` part (OpenAI's, {"type": "refusal", "refusal": text}) as a
    text part: what the model said, as the template renders any other text."""
    refusal = isinstance(part, Mapping) and part.get("type") == "refusal"
    if refusal and isinstance(part.get("refusal"), str):
        return {"type": "text", "text": part["refusal"]}
    return part


def _record_from_openai(item: Any, i: int) -> Message:
    if not isinstance(item, Mapping):
        raise InvalidRequestError(f"message {i} must be a dict, got {type(item).__name__}")
    role = item.get("role")
    where = f"message {i} ({role})"
    content = item.get("content")
    if role in ("system", "developer"):
        return SystemMessage(content if content is not None else "")
    if role == "user":
        if content is None:
            raise InvalidRequestError(f"{where}: a user message needs content")
        return UserMessage(content)
    if role == "assistant":
        reasoning = next((item[k] for k in _REASONING_KEYS if item.get(k) is not None), None)
        calls = _calls_from_openai(item.get("tool_calls"), where)
        if isinstance(content, list):
            content = [_refusal_as_text(part) for part in content]
            content_text(content, where)  # text parts only: refused here, naming the message
        # Parts are kept, as for every role: content_text joins them for the template, so the
        # record and its OpenAI form render the same prompt.
        invalid = item.get("invalid_call_ids")
        return AssistantMessage(content or "", reasoning, calls, [] if invalid is None else invalid)
    if role == "tool":
        is_error = item.get("is_error")
        return ToolResult(
            tool_call_id=item.get("tool_call_id"),
            content=content if content is not None else "",
            # A real bool only (the record checks): bool("false") was True. null means absent.
            is_error=False if is_error is None else is_error,
            name=item.get("name"),
        )
    raise InvalidRequestError(
        f"message {i}: unknown role {role!r}; expected system, developer, user, assistant or tool"
    )


def messages_from_openai(items: Iterable[Mapping[str, Any]]) -> list[Message]:
    """Records from OpenAI-style dicts (role/content/tool_calls/tool_call_id; reasoning under
    `reasoning_content`, `reasoning` or `thinking`), validated as a history; tool results in
    the order of their calls (`in_call_order`)."""
    if isinstance(items, (str, bytes, Mapping)):
        raise InvalidRequestError("messages must be a list of message dicts")
    messages = [_message_from_openai(item, i) for i, item in enumerate(items)]
    return in_call_order(messages)


def coerce_messages(items: Iterable[Message | Mapping[str, Any]]) -> list[Message]:
    """Records as given, dicts converted; then the whole history is validated and its tool
    results put in the order of their calls (`in_call_order`): ChatFormat.render and
    Session.render come through here."""
    if isinstance(items, (str, bytes, Mapping)):
        raise InvalidRequestError("messages must be a list of messages")
    out = [
        m if isinstance(m, MESSAGE_TYPES) else _message_from_openai(m, i)
        for i, m in enumerate(items)
    ]
    return in_call_order(out)
