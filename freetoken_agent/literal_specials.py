"""Control-token text inside messages is encoded as text, not as the control token.

The rendered history is tokenized as one text, and a tokenizer splits its added tokens
(`<|im_end|>`, `<|im_start|>`, `<tool_call>`, ...) out of any text. So a tool result quoting a
web page or a log, or a user pasting a transcript, that holds "<|im_end|>\\n<|im_start|>system\\n"
closed its turn and opened a system turn nobody wrote: prompt injection through control tokens,
which an agent reading untrusted tool output cannot prevent. (transformers' apply_chat_template,
vLLM and llama.cpp's server encode such text as the control tokens; OpenAI's tokenizer treats it
as text.) Here only the template makes control tokens.

How, only when some string of the history holds an added token's text (one regex over them):
1. `mark`: the history again, each such occurrence replaced by a numbered private-use sentinel
   (no template or tokenizer gives those characters a meaning; ones a message already holds are
   sentinels too, put back as they were, so a message cannot forge or spoil the marking).
2. `spans`: that history rendered; where the sentinels land are the occurrences that came from
   messages. With the occurrences put back, the rendering must equal the real one. A template
   that reads or rewrites content at those strings (Qwen3's splits an assistant's content at
   "</think>") renders differently: then only the other roles' messages are marked (the model's
   own turns are the ones templates take apart, untrusted text comes as user and tool turns),
   and if that differs too nothing is changed for that history, with a warning.
3. `encode`: in the whole text's encoding, each such occurrence is one added token. It becomes
   the tokens of its text under the same tokenizer without added tokens (`_plain`). The tokens
   around it stay as they were: an added token splits the text there anyway.

The offsets stay character offsets into the real rendering, so anchors map as before.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

import tokenizers

log = logging.getLogger("freetoken.chat")

# Private use area: characters no template filter escapes (tojson keeps non-ASCII) or strips.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
# Fields that name, not say: a role or a content part's type is never message text.
_NOT_TEXT = frozenset({"role", "type"})
# The turns a template takes apart at control-token texts (module docstring, step 2).
_OWN_TURNS = frozenset({"assistant"})


class LiteralSpecials:
    """Added-token texts inside a history's messages, encoded as text (module docstring)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self._added_ids = frozenset(added)
        texts = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._pattern = re.compile("|".join(map(re.escape, texts))) if texts else None
        # What `mark` replaces: those texts, and the sentinel characters themselves.
        self._marked = re.compile("|".join(map(re.escape, [*texts, _OPEN, _CLOSE])))
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._warned = False

    def held_by(self, messages: list[dict]) -> bool:
        """Whether any string of the template messages holds an added token's text."""
        if self._pattern is None:
            return False
        return any(self._pattern.search(s) for s in _strings(messages))

    def mark(
        self, messages: list[dict], skip_roles: frozenset[str] = frozenset()
    ) -> tuple[list[dict], list[str]]:
        """The messages (but those of `skip_roles`) with each added-token text, and each
        sentinel character already there, replaced by a numbered sentinel; the texts, by the
        sentinels' numbers."""
        texts: list[str] = []

        def sentinel(m: re.Match) -> str:
            texts.append(m.group())
            return f"{_OPEN}{len(texts) - 1}{_CLOSE}"

        def marked(message: dict) -> dict:
            if message.get("role") in skip_roles:
                return message
            return _map_strings(message, lambda s: self._marked.sub(sentinel, s))

        return [marked(m) for m in messages], texts

    def spans(
        self, render: Callable[[list[dict]], str], messages: list[dict], full: str
    ) -> list[tuple[int, int]]:
        """[(start, end)] character spans of `full` (the real rendering of `messages`) that are
        added-token texts written in messages; [] when the template renders the marked history
        differently whichever turns are marked (then none can be told apart: a warning, once)."""
        for skip in (frozenset(), _OWN_TURNS):
            found = self._spans_when_marked(render, messages, full, skip)
            if found is not None:
                return found
        if not self._warned:
            self._warned = True
            log.warning(
                "the chat template renders message text holding control-token strings "
                "differently from other text: those strings stay control tokens in this history"
            )
        return []

    def _spans_when_marked(
        self,
        render: Callable[[list[dict]], str],
        messages: list[dict],
        full: str,
        skip_roles: frozenset[str],
    ) -> list[tuple[int, int]] | None:
        """`spans` with the messages of `skip_roles` left unmarked; None when the rendering
        with the texts put back is not `full`."""
        marked, texts = self.mark(messages, skip_roles)
        rendered = render(marked)
        pieces, spans, at, cursor = [], [], 0, 0
        for m in _SENTINEL.finditer(rendered):
            k = int(m.group(1))
            if k >= len(texts):  # a template cannot invent one; never index past the list
                return None
            pieces.append(rendered[cursor : m.start()])
            at += m.start() - cursor
            if texts[k] not in (_OPEN, _CLOSE):  # a sentinel character put back is no span
                spans.append((at, at + len(texts[k])))
            pieces.append(texts[k])
            at += len(texts[k])
            cursor = m.end()
        pieces.append(rendered[cursor:])
        return spans if "".join(pieces) == full else None

    def encode(
        self,
        text: str,
        ids: list[int],
        offsets: list[tuple[int, int]],
        spans: list[tuple[int, int]],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`ids` [T] and `offsets` [T] (the whole text's encoding) with each added token that
        covers a span replaced by the text tokens of what it covers."""
        if not spans:
            return ids, offsets
        out_ids: list[int] = []
        out_offsets: list[tuple[int, int]] = []
        spans_left = sorted(spans)
        i = 0
        for token, (start, end) in zip(ids, offsets, strict=True):
            while i < len(spans_left) and spans_left[i][1] <= start:
                i += 1  # spans behind this token
            covers = i < len(spans_left) and start <= spans_left[i][0] < end
            if not (covers and token in self._added_ids):
                out_ids.append(token)
                out_offsets.append((start, end))
                continue
            # The added token's whole span: one with lstrip/rstrip also holds the spaces it ate.
            plain = self._plain().encode(text[start:end], add_special_tokens=False)
            out_ids += plain.ids
            out_offsets += [(start + a, start + b) for a, b in plain.offsets]
        return out_ids, out_offsets

    def _plain(self) -> tokenizers.Tokenizer:
        """The tokenizer without its added tokens: text in, text tokens out (built once)."""
        if self._plain_backend is None:
            spec = json.loads(self._backend.to_str())
            spec["added_tokens"] = []
            self._plain_backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return self._plain_backend


def _strings(value: Any):
    """Every string value of JSON-like data (keys and _NOT_TEXT fields aside), iteratively."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [v for k, v in item.items() if k not in _NOT_TEXT]
        elif isinstance(item, (list, tuple)):
            stack += item


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of JSON-like data with `change` applied to each string value (as `_strings`)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {k: v if k in _NOT_TEXT else _map_strings(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, change) for v in value)
    return value
