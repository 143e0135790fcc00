"""ChatFormat: a structured history rendered into token ids, with semantic anchors.

    # C characters of the rendered text, T its tokens
    prompt = ChatFormat(tokenizer).render(messages, tools)    # Prompt(token_ids [T], text [C],
                                                              #        anchors sorted by offset)

An anchor is a token index where a semantic unit begins or ends: `turn_start` (each message),
`reasoning_start` / `reasoning_end` (the reasoning text of an assistant turn, markers such as
`<think>` outside it), `tool_call` (where each call's block starts, separator included),
`tool_output` (where a tool result's text starts) and `generation_prefix` (the end of the
history, just before what the template appends with add_generation_prompt, e.g.
`<|im_start|>assistant\\n<think>\\n`). The engine checkpoints recurrent state at anchors and a
Session resumes from the deepest anchor before the point where a new history diverges.

Anchors are found by rendering, never by searching marker strings, so they hold for any template:

- turn starts: the history truncated before message i, rendered without generation prompt, is
  normally a prefix of the full text; message i starts where it ends. Templates that look ahead
  (Qwen3 drops the reasoning of turns followed by a newer user message; tool results grouped in
  one turn close it only after the last) render the truncated history differently. Then a point
  of message i-1 that both renderings share (the start of its last tool call, else the end of
  its content, each located as below) is aligned, and message i-1's tail is followed from there
  in the full text as far as it agrees; without such a point, the common prefix is used.
- field spans (reasoning, tool output): the history is rendered with that field replaced by a
  sentinel whose first and last characters no text has; the common prefix and suffix with the
  real rendering bound the field. An empty field might change the template's structure
  (`if content`), so then two sentinels are compared with each other and the result must agree
  with the real text. A field the template leaves out (stripped reasoning) renders like the
  real text and gets no anchor.
- tool calls: the history with message i's calls cut before call j diverges where call j begins.
- generation prefix: where the rendering without add_generation_prompt ends.

Tokens: the text is tokenized once, as a whole (what the model sees); character positions map to
tokens by the tokenizer's offsets. A position inside a token moves back to the start of that token
(`ids[:offset]` then lies entirely before the boundary: resuming there recomputes a little, never
skips a token that belongs to the unit). Boundaries of chat templates sit next to special tokens or
newlines in practice, where BPE splits anyway, so the prefix tokenizes the same alone or in the
whole; `Anchor.exact` says whether the token prefix ends exactly at the boundary.

Cost: about one render per message plus one or two per reasoning span, tool call and tool
result, each of a history prefix (O(n^2) template work for n messages). Results are cached per
message prefix (see _Locator), so a Session's next turn renders only its new messages. Measured
on the 2-core CI machine: a cold render of 100 messages takes ~0.9 s (200: ~3.3 s); the next
turn of such a session ~0.1 s. A server should keep one ChatFormat per model to share the cache.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.chat_template import ChatTemplate, ChatTemplateError
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import Message, coerce_messages, to_template_messages

ANCHOR_KINDS = (
    "turn_start",
    "reasoning_start",
    "reasoning_end",
    "tool_call",
    "tool_output",
    "generation_prefix",
)
_KIND_ORDER = {kind: i for i, kind in enumerate(ANCHOR_KINDS)}
# Sentinels for field probes: private-use characters no template tests for, differing in their
# first and last characters so the common prefix/suffix of two renderings stops exactly at them.
_SENTINELS = ("\U000f0001\U000f0101\U000f0003", "\U000f0002\U000f0102\U000f0004")


@dataclass(slots=True, frozen=True)
class Anchor:
    """A semantic boundary of a Prompt: text position `char_offset`, token index `offset`.

    `token_ids[:offset]` holds the tokens lying wholly before the boundary. When `exact`, they
    decode to `text[:char_offset]`; otherwise token `offset` straddles the boundary (BPE merged
    across it) and the prefix stops short of it, at that token's start."""

    offset: int
    kind: str
    message_index: int  # into Prompt.messages; len(messages) for generation_prefix
    char_offset: int
    exact: bool = True


@dataclass(slots=True)
class Prompt:
    """A rendered history. Owned by whoever rendered it; a Session keeps the last one it sent,
    with the generated tokens appended. Invariant: anchors sorted by (offset, kind order), every
    offset in [0, len(token_ids)]."""

    token_ids: list[int]
    text: str
    anchors: list[Anchor] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    generation_prefix: str = ""  # what add_generation_prompt appended ("" when it was off)

    def __len__(self) -> int:
        return len(self.token_ids)

    def find(self, kind: str, message_index: int) -> Anchor | None:
        """The first anchor of this kind for that message (None if the template left it out)."""
        return next(
            (a for a in self.anchors if a.kind == kind and a.message_index == message_index), None
        )

    def anchors_of(self, message_index: int) -> list[Anchor]:
        return [a for a in self.anchors if a.message_index == message_index]

    def deepest_anchor(self, offset: int) -> Anchor | None:
        """The last anchor at or before token `offset` (ties: the later kind)."""
        best = None
        for anchor in self.anchors:
            if anchor.offset > offset:
                break
            best = anchor
        return best


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the longest common prefix (strings or lists), by halving slices (C speed)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def common_suffix(a: str, b: str) -> int:
    return common_prefix(a[::-1], b[::-1])


def normalize_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict] | None:
    """Tools as OpenAI JSON-schema dicts; a bare {"name", "parameters", ...} gets wrapped."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise InvalidRequestError(f"tool {i} must be a dict, got {type(tool).__name__}")
        if "type" not in tool and "name" in tool:
            tool = {"type": "function", "function": dict(tool)}
        out.append(dict(tool))
    return out


class ChatFormat:
    """A tokenizer, a chat template and fixed template variables (`enable_thinking=False`...).

    The template is the tokenizer's (`template_name` picks a named one; by default "tool_use"
    when tools are given and the model has it) unless `chat_template` gives Jinja source, as
    transformers' `apply_chat_template(chat_template=...)` does."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        template_name: str | None = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> None:
        if tokenizer is None:
            raise InvalidRequestError(
                "this model folder has no tokenizer.json: a chat history cannot be rendered"
            )
        self.tokenizer = tokenizer
        self.template_name = template_name
        self.template_kwargs = template_kwargs
        self._override = (
            ChatTemplate(chat_template, tokenizer.special_tokens) if chat_template else None
        )
        self._added_ids = frozenset(tokenizer.backend.get_added_tokens_decoder())
        self._cache: dict[tuple, Any] = {}  # what renders found, by message-prefix digest

    def template(self, tools: list[dict] | None) -> ChatTemplate:
        if self._override is not None:
            return self._override
        return self.tokenizer.get_chat_template(self.template_name, tools)

    def render(
        self,
        messages: Sequence[Message | Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> Prompt:
        records = coerce_messages(messages)
        if not records:
            raise InvalidRequestError("cannot render an empty history: give at least one message")
        dicts = to_template_messages(records)
        tools = normalize_tools(tools)
        template = self.template(tools)
        variables = {**self.template_kwargs, **kwargs}

        def render(ds: list[dict], gen: bool) -> str:
            return template.render(ds, tools=tools, add_generation_prompt=gen, **variables)

        try:
            full = render(dicts, add_generation_prompt)
        except ChatTemplateError as e:
            raise InvalidRequestError(f"the chat template rejected this history: {e}") from e
        # Cache entries are valid for one template, tool list and set of variables. (A template
        # printing strftime_now() changes text without changing these; the stability check below
        # compares digests of real text, so it only costs cache misses there.)
        # Variables are keywords, whose order the template cannot see: sorted by name.
        salt = _key_bytes([template.source, tools, sorted(variables.items())])
        locator = _Locator(render, dicts, full, add_generation_prompt, self._cache, salt)
        marks, gen_text = locator.locate()
        encoding = self.tokenizer.backend.encode(full, add_special_tokens=False)
        ids = list(encoding.ids)  # [T]
        ends = [end for _, end in encoding.offsets]  # [T] character end of each token
        starts = [start for start, _ in encoding.offsets]
        anchors = []
        for char, kind, index in marks:
            tok = bisect.bisect_right(ends, char)  # tokens lying wholly before `char`
            next_start = starts[tok] if tok < len(starts) else len(full)
            if next_start < char and ids[tok] in self._added_ids:
                # Added tokens (<|im_end|>, <tool_call>) are indivisible markers: a boundary
                # inside one only means two compared renderings continued with markers that
                # share leading characters ("<|im_end|>" vs "<tool_call>"). It is its start.
                char = next_start
            anchors.append(Anchor(tok, kind, index, char, exact=next_start >= char))
        anchors.sort(key=lambda a: (a.offset, a.char_offset, _KIND_ORDER[a.kind]))
        return Prompt(ids, full, anchors, records, gen_text)


_CACHE_ENTRIES = 16384  # per ChatFormat; an entry is a few ints, cleared whole when full


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _key_bytes(data: Any) -> bytes:
    """Cache-key bytes of JSON-like template input: its repr, the same for the same input in
    this process. Not json.dumps(sort_keys=True), which raised TypeError on dicts mixing int and
    str keys (nested tool arguments, tool schemas), which templates render. repr also keeps what
    the template sees and sort_keys lost: key order (`tojson` does not sort) and key types."""
    return repr(data).encode("utf-8", "surrogatepass")


_MISSING = object()


class _Locator:
    """Finds anchor positions (characters of `full`) by rendering variants of `dicts`.

    Contexts: R_j = the history truncated to its first j messages, rendered without generation
    prompt, is "stable" when it is a prefix of the full text. A message's fields are probed in
    the smallest stable context that holds it (the full text when there is none), where the text
    up to R_j's end is the full text's own. What is found in a context depends only on the
    messages it holds, so it is cached under their digest: a Session's next turn, which mostly
    extends the history, renders only the new messages' contexts (agent histories grow to
    hundreds of messages; rendering every truncation each turn would cost O(n^2) renders).
    """

    def __init__(self, render, dicts: list[dict], full: str, gen: bool, cache: dict, salt: bytes):
        self._render = render
        self.dicts = dicts
        self.full = full
        self.full_bytes = full.encode("utf-8", "surrogatepass")
        self.gen = gen
        self.cache = cache
        self.keys = [_digest(salt)]  # keys[i] identifies dicts[:i] (with template and tools)
        for d in dicts:
            self.keys.append(_digest(self.keys[-1] + _key_bytes(d)))
        self._texts: dict[int, str | None] = {}

    def render(self, dicts: list[dict], gen: bool) -> str | None:
        """A variant's text, or None when the template refuses it (some templates raise on a
        history without a user query, as a truncated one can be)."""
        try:
            return self._render(dicts, gen)
        except ChatTemplateError:
            return None

    def cached(self, key: tuple, compute):
        # One lookup, then a local value: another thread may clear the shared cache between
        # a membership test and a read (servers render concurrently).
        value = self.cache.get(key, _MISSING)
        if value is _MISSING:
            value = compute()
            if len(self.cache) >= _CACHE_ENTRIES:
                self.cache.clear()
            self.cache[key] = value
        return value

    # --- contexts: j in 1..n is R_j; n + 1 is the full text -----------------------------
    def text(self, j: int) -> str | None:
        if j > len(self.dicts):
            return self.full
        if j not in self._texts:
            self._texts[j] = self.render(self.dicts[:j], False)
        return self._texts[j]

    def ctx_key(self, j: int) -> tuple:
        n = len(self.dicts)
        return (self.keys[n], self.gen) if j > n else (self.keys[j],)

    def head(self, j: int) -> tuple[int, int, bytes] | None:
        """(characters, UTF-8 bytes, digest) of R_j, or None when the template refuses it."""

        def compute():
            text = self.text(j)
            if text is None:
                return None
            data = text.encode("utf-8", "surrogatepass")
            return len(text), len(data), _digest(data)

        return self.cached(("head", *self.ctx_key(j)), compute)

    def stable(self, j: int) -> bool:
        head = self.head(j)
        if head is None or head[1] > len(self.full_bytes):
            return False
        return _digest(memoryview(self.full_bytes)[: head[1]]) == head[2]

    def ctx_dicts(self, j: int) -> list[dict]:
        return self.dicts[:j] if j <= len(self.dicts) else self.dicts

    def ctx_gen(self, j: int) -> bool:
        return self.gen if j > len(self.dicts) else False

    # --- the anchors --------------------------------------------------------------------
    def locate(self) -> tuple[list[tuple[int, str, int]], str]:
        n = len(self.dicts)
        stable = [True] + [self.stable(j) for j in range(1, n + 1)]
        ctx = [n + 1] * n  # smallest stable context holding message m
        best = n + 1
        for m in range(n - 1, -1, -1):
            if stable[m + 1]:
                best = m + 1
            ctx[m] = best
        end = len(self.full)
        gen_text = ""
        if self.gen:
            if stable[n]:
                end = self.head(n)[0]
            elif self.text(n) is not None:
                end = common_prefix(self.text(n), self.full)
            gen_text = self.full[end:]
        starts: list[int | None] = [0]
        for m in range(1, n):
            if stable[m]:
                starts.append(self.head(m)[0])
            else:
                key = ("start", *self.ctx_key(ctx[m]), m)
                starts.append(self.cached(key, lambda m=m: self.turn_start(m, ctx[m])))
        marks: list[tuple[int, str, int]] = []
        last = 0
        for m in range(n):
            start = starts[m]
            if start is not None:
                start = last = max(start, last)  # boundaries never go backwards
                marks.append((start, "turn_start", m))
            stop = next((s for s in starts[m + 1 :] if s is not None), end)
            key = ("inner", *self.ctx_key(ctx[m]), m)
            for char, kind in self.cached(key, lambda m=m: self.inner_marks(m, ctx[m])):
                if last <= char <= stop:  # anything else did not resolve: no anchor
                    marks.append((char, kind, m))
        if self.gen:
            marks.append((end, "generation_prefix", n))
        return marks, gen_text

    def inner_marks(self, m: int, j: int) -> list[tuple[int, str]]:
        """Reasoning, tool-call and tool-output marks of message m, found in context j."""
        msg = self.dicts[m]
        dicts, ref, gen = self.ctx_dicts(j), self.text(j), self.ctx_gen(j)
        out = []
        if ref is None:
            return out
        if msg["role"] == "assistant":
            if msg.get("reasoning_content"):
                span = self.field_span(dicts, m, "reasoning_content", ref, gen)
                if span is not None:
                    out += [(span[0], "reasoning_start"), (span[1], "reasoning_end")]
            for c in range(len(msg.get("tool_calls", []))):
                start = self.call_start(dicts, m, c, ref, gen)
                if start is not None:
                    out.append((start, "tool_call"))
        elif msg["role"] == "tool":
            span = self.field_span(dicts, m, "content", ref, gen)
            if span is not None:
                out.append((span[0], "tool_output"))
        return out

    def turn_start(self, m: int, j: int) -> int | None:
        """Where message m begins in context j when R_m is not a prefix of it: the template
        rendered message m-1 (or earlier ones) differently once it saw later messages. Align a
        point of message m-1 known in both renderings, then follow m-1's tail from there."""
        head, ref = self.text(m), self.text(j)
        if head is None or ref is None:
            return None
        dicts, gen, k = self.ctx_dicts(j), self.ctx_gen(j), m - 1
        if self.dicts[k].get("tool_calls"):
            last_call = len(self.dicts[k]["tool_calls"]) - 1
            here = self.call_start(self.dicts[:m], k, last_call, head, False)
            there = self.call_start(dicts, k, last_call, ref, gen)
        else:
            span_here = self.field_span(self.dicts[:m], k, "content", head, False)
            span_there = self.field_span(dicts, k, "content", ref, gen)
            here = span_here[1] if span_here else None
            there = span_there[1] if span_there else None
        if here is None or there is None:
            return common_prefix(head, ref)
        return there + common_prefix(head[here:], ref[there:])

    def field_span(
        self, dicts: list[dict], i: int, key: str, reference: str, gen: bool
    ) -> tuple[int, int] | None:
        """[start, end) of message i's `key` in `reference` (= the rendering of `dicts`).

        A non-empty value is compared with one sentinel rendering: the sentinel's first and
        last characters differ from the value's, so the common prefix and suffix stop exactly
        at the field. An empty value might change the template's structure (`if content`), so
        two sentinels are compared with each other and the result checked against the text."""
        value = dicts[i].get(key)
        single = (
            isinstance(value, str)
            and value != ""
            and value[0] not in (_SENTINELS[0][0], _SENTINELS[1][0])
            and value[-1] not in (_SENTINELS[0][-1], _SENTINELS[1][-1])
        )
        variants = []
        for sentinel in _SENTINELS[:1] if single else _SENTINELS:
            probe = [*dicts]
            probe[i] = {**dicts[i], key: sentinel}
            variants.append(self.render(probe, gen))
        a, b = variants[0], variants[-1] if not single else reference
        if a is None or b is None or a == b:
            return None  # refused, or the template does not render the field
        pre = common_prefix(a, b)
        post = min(common_suffix(a, b), len(a) - pre, len(b) - pre)
        start, end = pre, len(reference) - post
        ok = reference.startswith(a[:pre]) and reference.endswith(a[len(a) - post :])
        return (start, end) if ok and start <= end else None

    def call_start(
        self, dicts: list[dict], i: int, j: int, reference: str, gen: bool
    ) -> int | None:
        """Where call j of message i begins in `reference`: cut the calls before it."""
        probe = [*dicts]
        probe[i] = {**dicts[i], "tool_calls": dicts[i]["tool_calls"][:j]}
        if not probe[i]["tool_calls"]:
            del probe[i]["tool_calls"]
        text = self.render(probe, gen)
        return None if text is None else common_prefix(text, reference)
