"""Continuing the final assistant message ("prefill"): where its written text ends in a rendering.

    dicts = continuation_probe(dicts)       # the last message's content with a mark at its end
    full = template.render(dicts, add_generation_prompt=False)
    text = full[:continuation_end(full)]    # the history, the last message open after its text

OpenAI-compatible servers take it as `continue_final_message` (vLLM), Anthropic's Messages API
whenever the last message is the assistant's: the model goes on from the text given (a "{" that
starts a JSON answer, "Sure, " that steers a reply) instead of starting a new turn.

The cut is found by rendering, as anchors are (anchor_locator.py), never by searching the
template's markers or the content itself: a mark that no text holds is appended to the content
and the rendering is cut where the mark appears. transformers cuts at the last occurrence of
the content instead, which a template that trims or rewrites the content (Qwen3's `lstrip`, a
`trim`) defeats; the mark sits after the content's last character, so whitespace the caller
wrote at its end is kept, which they asked for (a content of whitespace alone is lost where
the template strips the content's start, as Qwen's `lstrip('\\n')` does). A template that
drops the content, renders it twice or escapes it leaves no single mark: refused, naming it.

Only text can be continued: a final message with tool calls is refused (its calls are rendered
after the content, and the model would have to go on from inside a call's JSON). Reasoning given
in the final message is rendered as the template renders it, closed (Qwen3: `<think>...</think>`
before the content): the continuation is the answer, as in transformers and vLLM.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.messages import AssistantMessage, content_text

# A private-use mark no text holds (anchor_locator's sentinels are 0xF0001-0xF0004 and
# 0xF0101-0xF0102: different characters, so probes of both kinds can meet in one rendering).
_MARK = "\U000f0005\U000f0105\U000f0006"


def continuation_probe(dicts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The template messages with the mark after the final message's content. Raises
    InvalidRequestError when the final message cannot be continued (not the assistant's, or
    with tool calls)."""
    if not dicts or dicts[-1].get("role") != "assistant":
        role = dicts[-1].get("role") if dicts else None
        raise InvalidRequestError(
            f"the last message is {role!r}, not 'assistant': only an assistant message can be "
            "continued (continue_final_message)"
        )
    last = dicts[-1]
    if last.get("tool_calls"):
        raise InvalidRequestError(
            f"message {len(dicts) - 1} (assistant) has tool calls: only an assistant message's "
            "text can be continued (continue_final_message)"
        )
    content = last.get("content") or ""
    return [*dicts[:-1], {**last, "content": content + _MARK}]


def continuation_end(full: str) -> int:
    """Where the final message's written text ends in `full`, the rendering of
    `continuation_probe`'s messages (without a generation prompt)."""
    at = full.find(_MARK)
    if at < 0 or full.find(_MARK, at + 1) >= 0:
        raise InvalidRequestError(
            "this chat template does not render the final assistant message's text once and "
            "as written, so the message cannot be continued (continue_final_message)"
        )
    return at


def continued_message(written: AssistantMessage, reply: AssistantMessage) -> AssistantMessage:
    """The whole message a continued turn leaves in the history: the text written, then the
    reply's; the reasoning given (else the reply's, when the model wrote some); the reply's
    calls."""
    text = content_text(written.content, "the continued message") + content_text(reply.content)
    reasoning = written.reasoning if written.reasoning is not None else reply.reasoning
    return AssistantMessage(text, reasoning, reply.tool_calls, reply.invalid_call_ids)
