"""Splits decoded text into reasoning (`<think>` ... `</think>`) and content.

Only a think block at the very start of the output counts (leading whitespace allowed): every
supported model thinks once, first. A later `<think>` is content, so an answer that talks about
the tag, or a tool argument that contains it, is never mistaken for reasoning.

Newline conventions: Qwen writes `<think>\\n...\\n</think>\\n\\n`. One newline after `<think>` and
one before `</think>` belong to the tags and are dropped, as is whitespace between `</think>`
and the answer. Every other character, newlines included, is kept.
"""

from __future__ import annotations

from typing import Any

from freetoken_agent.engine.thinking_budget import ThinkingMarkers, prompt_opens
from freetoken_agent.parsers.events import ContentDelta, ReasoningDelta
from freetoken_agent.parsers.tags import partial_tag_len

OPEN = "<think>"
CLOSE = "</think>"

_START = 0  # before any text: a think block may open
_HEAD = 1  # just inside the block: drop a redundant `<think>`, then one newline
_REASONING = 2
_AFTER = 3  # just after `</think>`: drop whitespace
_CONTENT = 4


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when a rendered generation prompt leaves a think block open (Qwen3 thinking mode
    ends the prompt with `<think>\\n`), so the output starts inside reasoning."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def added_think_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` where the tokenizer (the engine's:
    engine/text/tokenizer.py) has both as added tokens, which plain text never spells; else
    None (no think tokens, vocabulary words only, or no tokenizer)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return None
    added = backend.get_added_tokens_decoder()
    ids = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
    return ids if all(i is not None and i in added for i in ids) else None


def opens_think_block(prompt: Any, tokenizer: Any) -> bool:
    """`prompt_opens_reasoning` for a rendered Prompt (its `text` and `token_ids`), where the
    block is open by the engine's thinking budget's rule too (`prompt_opens`: by ids, the last
    `<think>` token after the last `</think>`), so the parser and the budget agree. A continued
    assistant message whose content ends with the text `<think>` is encoded as characters
    (literal_specials.py: content never becomes control tokens), which opens nothing: the
    output then starts as content. Without think tokens (`added_think_ids`) the text tells."""
    if not prompt_opens_reasoning(prompt.text):
        return False
    ids = added_think_ids(tokenizer)
    if ids is None:
        return True
    return prompt_opens(list(prompt.token_ids), ThinkingMarkers(*ids, forced=()))


class ReasoningSplitter:
    """Streams text into ReasoningDelta / ContentDelta, safe on any chunk boundary.

    `starts_in_reasoning`: the chat template opened the block in the prompt, so the output
    starts inside it and only `</think>` appears.
    """

    def __init__(self, starts_in_reasoning: bool = False) -> None:
        self._state = _HEAD if starts_in_reasoning else _START
        self._buf = ""
        self._may_repeat_open = starts_in_reasoning  # some models write `<think>` again

    def feed(self, text: str) -> list[ReasoningDelta | ContentDelta]:
        out: list[ReasoningDelta | ContentDelta] = []
        self._buf += text
        while self._step(out):
            pass
        return out

    def finish(self) -> list[ReasoningDelta | ContentDelta]:
        """Release held text: an unclosed block stays reasoning (the output was cut short)."""
        out: list[ReasoningDelta | ContentDelta] = []
        buf, self._buf = self._buf, ""
        if buf and self._state in (_HEAD, _REASONING):
            out.append(ReasoningDelta(buf))
        elif buf and self._state in (_START, _CONTENT):
            out.append(ContentDelta(buf))
        self._state = _CONTENT
        return out

    def _step(self, out: list[ReasoningDelta | ContentDelta]) -> bool:
        """Advance one state on the buffer; True when another step may make progress."""
        buf, state = self._buf, self._state
        if not buf:
            return False
        if state == _START:
            rest = buf.lstrip()
            if rest.startswith(OPEN):
                self._buf, self._state = rest[len(OPEN) :], _HEAD
                return True
            if not rest or OPEN.startswith(rest):
                return False  # whitespace or a partial `<think>`: wait
            self._state = _CONTENT
            return True
        if state == _HEAD:
            if self._may_repeat_open:
                # The template opened the block; only a repeated `<think>` brings its newline.
                if OPEN.startswith(buf) and buf != OPEN:
                    return False
                self._may_repeat_open = False
                if not buf.startswith(OPEN):
                    self._state = _REASONING
                    return True
                buf = self._buf = buf[len(OPEN) :]
                if not buf:
                    return False
            self._buf = buf[1:] if buf.startswith("\n") else buf
            self._state = _REASONING
            return True
        if state == _REASONING:
            i = buf.find(CLOSE)
            if i >= 0:
                reasoning = buf[:i]
                reasoning = reasoning[:-1] if reasoning.endswith("\n") else reasoning
                if reasoning:
                    out.append(ReasoningDelta(reasoning))
                self._buf, self._state = buf[i + len(CLOSE) :], _AFTER
                return True
            # Hold a partial `</think>` and a newline that may precede it.
            cut = len(buf) - partial_tag_len(buf, CLOSE, "\n" + CLOSE)
            if cut:
                out.append(ReasoningDelta(buf[:cut]))
                self._buf = buf[cut:]
            return False
        if state == _AFTER:
            rest = buf.lstrip()
            self._buf = rest
            if not rest:
                return False
            self._state = _CONTENT
            return True
        out.append(ContentDelta(buf))
        self._buf = ""
        return False
