"""Control-token text inside messages is encoded as text, not as the control token.

The rendered history is tokenized as one text, and a tokenizer splits its added tokens
(`<|im_end|>`, `<|im_start|>`, `<tool_call>`, ...) out of any text. So a tool result quoting a
web page or a log, a user pasting a transcript, or a tool description from an MCP server, that
holds "<|im_end|>\\n<|im_start|>system\\n" closed its turn and opened a system turn nobody
wrote: prompt injection through control tokens, which an agent reading untrusted text cannot
prevent. (transformers' apply_chat_template, vLLM and llama.cpp's server encode such text as
the control tokens; OpenAI's tokenizer treats it as text.) Here only the template makes them.

How, only when some string of the history or the tools (keys too) holds an added token's text,
or ends with the start of one or begins with the end of one (two characters or more: the
template's text beside it could complete the token, as `<function=` + name + `>` does):
1. `_marked`: the history and tools again, each such text replaced by a numbered private-use
   sentinel (no template or tokenizer gives those characters a meaning; equal texts share a
   number, so strings a template compares stay equal). Sentinel characters a string already
   holds are sentinels too, in every string, put back as they were: text cannot forge or
   spoil the marking.
2. `spans`: that rendered; where the sentinels land are the texts that came from messages.
   With them put back, the rendering must equal the real one. A template that reads or
   rewrites text at those strings (Qwen3's splits an assistant's content at "</think>", its
   multi-step check looks for a user turn starting with "<tool_response>") renders the marked
   history otherwise: then the largest set of units (messages, and the tools) that still
   renders the same is searched for by halves (`_MarkingSearch`): a group whose marking keeps
   the rendering is kept whole, one that does not is split, so k units the template reads
   among n cost about 2k log2(n/k) renders (at most 2n), not n. The text from outside (tool
   results and tool definitions, then the user's, then the system's) is searched before the
   assistant's own turns, with renders enough for all of it (two a unit); the assistant's
   turns get MAX_MARKING_RENDERS more, and past them (many turns the template reads: a
   client that sends each reply's reasoning back inline, `<think>...</think>` in its
   content) what is left unsearched is the model's own text, not a tool's. Units found
   unmarkable before (in this process, whichever client sent them) are tried alone first
   within their source, so a session's later turns take about k + 1 renders beside the real
   one. That is only an order: every set kept is verified by its own rendering, since
   whether a unit can be marked depends on the rest of the history. What cannot be marked,
   or is left unsearched, stays as the template renders it, with a warning (once).
3. `encode`: in the whole text's encoding, each added token overlapping such a text becomes
   the tokens of its text under the same tokenizer without added tokens (`_plain`, which also
   adds no word-start prefix: a span is mid-text). The tokens around it stay as they were: an
   added token splits the text there anyway.

The offsets stay character offsets into the real rendering, so anchors map as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import tokenizers

log = logging.getLogger("freetoken.chat")

# Private use area: characters no template filter escapes (tojson keeps non-ASCII) or strips.
_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d{{1,7}}){_CLOSE}")
_SENTINEL_CHARS = re.compile(f"[{_OPEN}{_CLOSE}]")
_TOOLS = -1  # the tool definitions' unit, beside the messages' indexes
# Renders spent on the assistant's own turns when marking all units renders otherwise (each
# is one rendering of the whole history; text from outside gets two a unit besides, enough
# to search all of it): dozens of turns the template reads, before the rest stay unmarked.
MAX_MARKING_RENDERS = 64
_SUSPECTS_KEPT = 4096  # units found unmarkable, remembered (their digests) to be tried last
# Render = (template messages, tools) -> the text; may raise on what the marking changed.
Render = Callable[[list[dict], Any], str]


class LiteralSpecials:
    """Added-token texts inside a history's messages and tools, encoded as text (module
    docstring)."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        added = backend.get_added_tokens_decoder()  # {id: AddedToken}
        self.added_ids = frozenset(added)  # ChatFormat reads them too
        texts = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._texts = re.compile("|".join(map(re.escape, texts))) if texts else None
        # What a marked string has replaced: those texts, and the sentinel characters.
        self._in_marked = re.compile("|".join(map(re.escape, [*texts, _OPEN, _CLOSE])))
        # A token's start ending a string, or its end beginning one (two characters or more).
        self._starts = {t[:i] for t in texts for i in range(2, len(t))}
        self._ends = {t[i:] for t in texts for i in range(1, len(t) - 1)}
        self._longest = max(map(len, texts), default=0)
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._warned = False
        # Digests of units whose marking changed the rendering (an order for the search only).
        self._suspects: OrderedDict[bytes, None] = OrderedDict()
        self._suspects_lock = threading.Lock()  # a server renders on several threads

    def held_by(self, messages: list[dict], tools: Any = None) -> bool:
        """Whether any string of the template messages or the tools holds control-token
        text (a whole one, or a part at its start or end)."""
        return self._texts is not None and any(map(self._holds, _strings([messages, tools])))

    def spans(
        self, render: Render, messages: list[dict], tools: Any, full: str
    ) -> list[tuple[int, int]]:
        """[(start, end)] character spans of `full` (the real rendering of `messages` and
        `tools`) that are control-token text written in them; the units the template renders
        otherwise when marked are left out (a warning, once)."""
        units = [i for i, m in enumerate(messages) if self.held_by([m])]
        if tools is not None and self.held_by([], tools):
            units.append(_TOOLS)
        keys = {u: _digest(tools if u == _TOOLS else messages[u]) for u in units}
        with self._suspects_lock:
            suspects = [u for u in units if keys[u] in self._suspects]
        source = {u: _source(messages, u) for u in units}
        outside = sum(source[u] < _SOURCES["assistant"] for u in units)
        search = _MarkingSearch(
            lambda group: self._spans_marking(render, messages, tools, full, group),
            renders=MAX_MARKING_RENDERS + 2 * outside,  # enough for every outside unit
        )
        rest = [u for u in units if u not in suspects]
        whole = search.grow(rest, split=False)  # else source by source:
        for turn in range(len(_SOURCES) + 1):
            for unit in suspects:  # alone first (each one render): mostly unmarkable again
                if source[unit] == turn:
                    search.grow([unit])
            if not whole:  # then the rest by halves
                search.grow([u for u in rest if source[u] == turn])
        with self._suspects_lock:
            for u in search.kept:
                self._suspects.pop(keys[u], None)
            for u in search.refused:
                self._suspects[keys[u]] = None
                self._suspects.move_to_end(keys[u])
            while len(self._suspects) > _SUSPECTS_KEPT:
                self._suspects.popitem(last=False)
        if len(search.kept) < len(units) and not self._warned:
            self._warned = True
            log.warning(
                "the chat template renders text holding control-token strings differently "
                "from other text: in %d of %d messages or tool lists they stay control tokens",
                len(units) - len(search.kept), len(units),
            )  # fmt: skip
        return search.spans

    def encode(
        self,
        text: str,
        ids: list[int],
        offsets: list[tuple[int, int]],
        spans: list[tuple[int, int]],
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """`ids` [T] and `offsets` [T] (the whole text's encoding) with each added token that
        overlaps a span replaced by the text tokens of its characters."""
        if not spans:
            return ids, offsets
        out_ids: list[int] = []
        out_offsets: list[tuple[int, int]] = []
        spans = sorted(spans)
        i = 0
        for token, (start, end) in zip(ids, offsets, strict=True):
            while i < len(spans) and spans[i][1] <= start:
                i += 1  # spans behind this token
            overlaps = i < len(spans) and spans[i][0] < end
            if not (overlaps and token in self.added_ids):
                out_ids.append(token)
                out_offsets.append((start, end))
                continue
            # The added token's whole span: the template's characters it took (the `>` after a
            # name ending "<|im_end|"), and the spaces an lstrip/rstrip token ate, are text too.
            plain = self._plain().encode(text[start:end], add_special_tokens=False)
            out_ids += plain.ids
            out_offsets += [(start + a, start + b) for a, b in plain.offsets]
        return out_ids, out_offsets

    def _holds(self, s: str) -> bool:
        assert self._texts is not None
        if self._texts.search(s):
            return True
        reach = min(len(s), self._longest - 1)
        return any(s[-i:] in self._starts or s[:i] in self._ends for i in range(2, reach + 1))

    def _spans_marking(
        self, render: Render, messages: list[dict], tools: Any, full: str, units: set[int]
    ) -> list[tuple[int, int]] | None:
        """`spans` with the control-token text of `units` marked; None when the rendering,
        texts put back, is not `full` (or the template refused the marked text)."""
        numbers: dict[tuple[str, bool], int] = {}  # (text, literal) -> its sentinel's number

        def sentinel(text: str, literal: bool) -> str:
            return f"{_OPEN}{numbers.setdefault((text, literal), len(numbers))}{_CLOSE}"

        def marked(value: Any, literal: bool) -> Any:
            change = self._literal_string if literal else _escaped_string
            return _map_strings(value, lambda s: change(s, sentinel))

        marked_messages = [marked(m, i in units) for i, m in enumerate(messages)]
        marked_tools = marked(tools, _TOOLS in units)
        try:
            rendered = render(marked_messages, marked_tools)
        except Exception:  # noqa: BLE001 - the real text rendered: the marking changed it
            return None
        texts = {k: key for key, k in numbers.items()}
        pieces, spans, at, cursor = [], [], 0, 0
        for m in _SENTINEL.finditer(rendered):
            text, literal = texts.get(int(m.group(1)), (None, False))
            if text is None:  # a template cannot invent one; never look past the table
                return None
            pieces.append(rendered[cursor : m.start()])
            at += m.start() - cursor
            if literal:  # not a sentinel character put back
                spans.append((at, at + len(text)))
            pieces.append(text)
            at += len(text)
            cursor = m.end()
        pieces.append(rendered[cursor:])
        return spans if "".join(pieces) == full else None

    def _literal_string(self, s: str, sentinel: Callable[[str, bool], str]) -> str:
        """`s` with its control-token text (whole tokens, a token's start ending it, a token's
        end beginning it) and its sentinel characters replaced by sentinels."""
        s = self._in_marked.sub(lambda m: sentinel(m.group(), m.group() not in (_OPEN, _CLOSE)), s)
        for i in range(min(len(s), self._longest - 1), 1, -1):  # the longest part first
            if s[:i] in self._ends:
                s = sentinel(s[:i], True) + s[i:]
                break
        for i in range(min(len(s), self._longest - 1), 1, -1):
            if s[-i:] in self._starts:
                s = s[:-i] + sentinel(s[-i:], True)
                break
        return s

    def _plain(self) -> tokenizers.Tokenizer:
        """The tokenizer without its added tokens and without a word-start prefix: text in,
        text tokens out (built once)."""
        if self._plain_backend is None:
            spec = json.loads(self._backend.to_str())
            spec["added_tokens"] = []
            spec["normalizer"] = _without_prepend(spec.get("normalizer"))
            _no_prefix_space(spec.get("pre_tokenizer"))
            self._plain_backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
        return self._plain_backend


class _MarkingSearch:
    """The units to mark, found by halves: `attempt(units)` gives the spans of a rendering with
    those units marked, or None when it renders otherwise. A group is tried with every unit
    kept so far; kept whole when it renders the same, else split (a unit alone is refused).
    Each unit kept was verified together with all kept before it, so the last spans found are
    those of the whole kept set."""

    def __init__(
        self, attempt: Callable[[set[int]], list[tuple[int, int]] | None], renders: int
    ) -> None:
        self._attempt = attempt
        self.kept: set[int] = set()
        self.refused: list[int] = []  # tried alone (beside the kept) and rendered otherwise
        self.spans: list[tuple[int, int]] = []
        self.renders_left = renders + 1  # + the first try of every unit at once
        self._failed: frozenset[int] = frozenset()  # the last set tried that rendered otherwise

    def grow(self, group: list[int], split: bool = True) -> bool:
        """Keeps what of `group` can be marked; whether all of it was (on its first try).
        `split=False`: only that try. A set that just failed is split without a render."""
        tried = frozenset(self.kept | set(group))
        if not group or (self.renders_left == 0 and tried != self._failed):
            return not group  # (renders spent: left unmarked)
        found = None
        if tried != self._failed:
            self.renders_left -= 1
            found = self._attempt(set(tried))
        if found is None:
            self._failed = tried
        else:
            self.kept.update(group)
            self.spans = found
            return True
        if len(group) == 1:
            self.refused.append(group[0])
        elif split:
            half = len(group) // 2
            self.grow(group[:half])
            self.grow(group[half:])
        return False


# The order in which units are searched: text from outside first (a tool's output and the
# tool list, then the user's), the assistant's own turns last.
_SOURCES = {"tool": 0, "user": 1, "system": 2, "assistant": 3}


def _source(messages: list[dict], unit: int) -> int:
    if unit == _TOOLS:
        return 0
    return _SOURCES.get(messages[unit].get("role"), len(_SOURCES))


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(repr(value).encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _escaped_string(s: str, sentinel: Callable[[str, bool], str]) -> str:
    """`s` with only its sentinel characters replaced (a unit left unmarked)."""
    return _SENTINEL_CHARS.sub(lambda m: sentinel(m.group(), False), s)


def _strings(value: Any) -> Iterator[str]:
    """Every string of JSON-like data, dict keys included, iteratively."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            stack += item


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    """A copy of JSON-like data with `change` applied to each string (dict keys too)."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {
            (change(k) if isinstance(k, str) else k): _map_strings(v, change)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, change) for v in value)
    return value


def _without_prepend(normalizer: dict | None) -> dict | None:
    """A normalizer spec without its Prepend steps (older SentencePiece tokenizers prepend
    the word-start mark to every text they are given)."""
    if normalizer is None or normalizer.get("type") == "Prepend":
        return None
    if normalizer.get("type") == "Sequence":
        steps = [n for n in normalizer["normalizers"] if n.get("type") != "Prepend"]
        return {**normalizer, "normalizers": steps}
    return normalizer


def _no_prefix_space(pre_tokenizer: dict | None) -> None:
    """No word-start prefix from a Metaspace or ByteLevel pre-tokenizer (in a Sequence too)."""
    if pre_tokenizer is None:
        return
    for step in pre_tokenizer.get("pretokenizers", [pre_tokenizer]):
        if step.get("type") == "Metaspace":
            step["prepend_scheme"] = "never"
            step.pop("add_prefix_space", None)
        elif step.get("type") == "ByteLevel":
            step["add_prefix_space"] = False
