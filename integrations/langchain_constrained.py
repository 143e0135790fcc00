"""Constrained turns: a forced tool call, JSON-schema output, or "a call or the answer's JSON".

The grammar (engine/constrained.py) starts at the first generated token, so such a turn
- renders with thinking off, and closes a think block the template left open anyway;
- ends its prompt with the tool-call opener when the model writes Hermes calls (`ForcedFormat`),
  so the model sees its usual context and the KV of the next turn lines up;
- replays to the output parser what the prompt (not the model) wrote, and closes the call
  block the grammar stops before (`PrefedParser`): the grammar writes the Hermes call body
  {"name": ..., "arguments": ...}, so a Hermes parser reads it whatever the model's own format.
The schemas, and the parser of "a call or the answer's JSON", are in constrained_output.py
(the server constrains the same way).
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.chat_format import ChatFormat, Prompt
from freetoken_agent.integrations.constrained_output import HERMES_OPEN, WrappedBlock, is_json
from freetoken_agent.parsers.reasoning import CLOSE as THINK_CLOSE
from freetoken_agent.parsers.reasoning import OPEN as THINK_OPEN
from freetoken_agent.parsers.reasoning import opens_think_block

THINK_END = THINK_CLOSE + "\n\n"


class ForcedFormat:
    """A ChatFormat whose prompts end with what a constrained turn must start from: the think
    block closed (when the template left it open) and, for a Hermes tool call, `<tool_call>\\n`.
    One per Session: `opened` describes the last rendered prompt for its parser."""

    def __init__(self, inner: ChatFormat, opener: str) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.opener = opener
        self.opened = False  # the inner prompt left a think block open

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **kw) -> Prompt:
        prompt = self.inner.render(messages, tools, add_generation_prompt, **kw)
        self.opened = opens_think_block(prompt, self.tokenizer)
        suffix = (THINK_END if self.opened else "") + self.opener
        return with_suffix(prompt, suffix, self.tokenizer)


class OpenedReasoning:
    """A ChatFormat whose prompts leave a think block open: a JSON answer after the reasoning
    (integrations/reasoned_json.py) has its grammar start inside the block. The format was
    chosen because an answer under it begins with reasoning (ChatFormat.reasons_first); a
    prompt that does not open the block (a hybrid template in thinking mode, whose model
    writes `<think>\\n` itself) is given `<think>\\n`, so the grammar and the prompt agree."""

    def __init__(self, inner: ChatFormat) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer

    def render(self, messages, tools=None, add_generation_prompt: bool = True, **kw) -> Prompt:
        prompt = self.inner.render(messages, tools, add_generation_prompt, **kw)
        opened = opens_think_block(prompt, self.tokenizer)
        return with_suffix(prompt, "" if opened else THINK_OPEN + "\n", self.tokenizer)


def with_suffix(prompt: Prompt, suffix: str, tokenizer: Any) -> Prompt:
    """`prompt` with `suffix` after it, as part of the generation prefix (which the Session
    counts as sent); `prompt` itself when there is none."""
    if not suffix:
        return prompt
    ids = tokenizer.backend.encode(suffix, add_special_tokens=False).ids
    return Prompt(
        prompt.token_ids + list(ids),
        prompt.text + suffix,
        prompt.anchors,
        prompt.messages,
        prompt.generation_prefix + suffix,
    )


class PrefedParser:
    """An OutputParser that first reads `head` (what the prompt, not the model, wrote: the think
    closer, the call opener) and at the end `tail` (the call closer the grammar stops before),
    the tail only when the body is complete JSON: a body cut by max_tokens stays unterminated,
    and the parser says so, rather than closing it into a misleading JSON error. When the parser
    voids the call block the head opened, its content and the invalid call's text are only
    what the model wrote: the opener and the closer are not the model's."""

    def __init__(self, inner: Any, head: str, tail: str) -> None:
        self.inner = inner
        self.head = head
        self.tail = tail
        self.body: list[str] = []
        self.block = WrappedBlock(HERMES_OPEN if head.endswith(HERMES_OPEN) else "")

    def feed(self, text: str) -> list:
        head, self.head = self.head, ""
        if self.tail:
            self.body.append(text)
        return self.block.as_written(self.inner.feed(head + text), "")

    def finish(self) -> list:
        head, self.head = self.head, ""
        tail = self.tail if self.tail and is_json("".join(self.body)) else ""
        closed = self.block.as_written(self.inner.feed(head + tail), tail)
        return closed + self.block.as_written(self.inner.finish(), "")
