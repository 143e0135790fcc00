"""AnchorLocator: where a history's semantic units begin and end in its rendered text.

    # C characters of the rendered text
    marks, gen_text = AnchorLocator(render, dicts, full, gen, cache, salt).locate()
    # marks: (character of `full`, anchor kind, message index)

Anchors are found by rendering variants of the history, never by searching marker strings, so
they hold for any template:

- turn starts: the history truncated before message i, rendered without generation prompt, is
  normally a prefix of the full text; message i starts where it ends. Templates that look ahead
  (Qwen3 drops the reasoning of turns followed by a newer user message; tool results grouped in
  one turn close it only after the last) render the truncated history differently. Then a point
  of message i-1 that both renderings share (the start of its last tool call, else the end of
  its content, each located as below) is aligned, and message i-1's tail is followed from there
  in the full text as far as it agrees; without such a point, the common prefix is used.
- turn starts the template refuses to render truncated: Qwen3.5 raises "No user query found" on
  [system] alone, exactly the prefix every session shares (system prompt and tools). The history
  before message i followed by sentinel user messages is accepted instead; the length of a user
  turn's header, measured on it, places message i's start (see `probe_start`).
- field spans (reasoning, tool output): the history is rendered with that field replaced by a
  sentinel whose first and last characters no text has; the common prefix and suffix with the
  real rendering bound the field. An empty field might change the template's structure
  (`if content`), so then two sentinels are compared with each other and the result must agree
  with the real text. A field the template leaves out (stripped reasoning) renders like the
  real text and gets no anchor.
- tool calls: the history with message i's calls cut before call j diverges where call j begins.
- generation prefix: where the rendering without add_generation_prompt ends.

The same probes show a template that does not render tool calls or tool results at all (Tulu /
OLMoE, plain ChatML): cutting the calls or replacing the result changes nothing. The model would
never see them, so that is refused (InvalidRequestError), not rendered silently.

Each probe is one render of a variant (anchor_probes.py); many at once, anchor_batch.py.

Cost: about one render per message plus one or two per reasoning span, tool call and tool
result, each of a history prefix (O(n^2) template work for n messages). Results are cached per
message prefix, so a Session's next turn renders only its new messages. Messages that share one
context (a user's follow-up after an agent run: the template re-renders the run without its
reasoning, so every run message is probed in the whole history) are probed at once in a few
renders (anchor_batch.py; 4.7 s to 0.08 s at 42k tokens), and the tail each message had as the
last one is cached as it is found (`tail`), so their turn starts need no render of their own.
Measured on the 2-core CI machine (fifty-third session, the history made plain data once a
render): a cold render of 802 agent messages (400 tool rounds, 93k tokens, a Qwen3-style template)
takes ~6 s; the next turn of such a session ~0.16 s. A server should keep one ChatFormat per
model to share the cache. That work grows with the square of the history while the context
bounds what can be sent, so ChatFormat.render refuses a rendering that does not fit the
engine's context (its `max_model_len`, which a Session passes) before locating anything: a
history of thousands of tiny messages costs one render and one tokenization, not thousands of
renders.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

from freetoken_agent.anchor_batch import probe_at_once
from freetoken_agent.anchor_probes import call_start, field_span, probe_start, unrendered
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.chat_template import ChatTemplateError
from freetoken_agent.text_prefix import common_prefix

# Per ChatFormat (a server's sessions share one); an entry is a few ints, a tail up to
# TAIL_KEPT characters (16-64 MB at most in all). The least recently used go first when it is
# full: clearing it whole made every live session's next turn a cold O(n^2) render of its
# history (~28 s at 120k tokens) once every ~4,000 agent turns.
_CACHE_ENTRIES = 16384
_MISSING = object()
UNRENDERED = object()  # a probed field the template does not render at all
REFUSED = object()  # a tail: the template refuses the history ending with the message
NO_POINT = object()  # a tail: the message has no point to align (see `end_point`)
TAIL_KEPT = 1024  # characters of a tail kept as they are (see `tail`)
# Messages sharing a context (and not cached) from which the batch probes them at once.
BATCH_MIN = 2

# render(dicts, add_generation_prompt, with_tools=True) -> text; raises ChatTemplateError
Render = Callable[..., str]


class Tail(NamedTuple):
    """How a message ends as the last one (AnchorLocator.tail)."""

    kept: str  # its first TAIL_KEPT characters
    length: int  # characters in all
    digest: bytes  # of all of it, UTF-8


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def key_bytes(data: Any) -> bytes:
    """Cache-key bytes of JSON-like template input: its repr, the same for the same input in
    this process. Not json.dumps(sort_keys=True), which raised TypeError on dicts mixing int and
    str keys (nested tool arguments, tool schemas), which templates render. repr also keeps what
    the template sees and sort_keys lost: key order (`tojson` does not sort) and key types."""
    return repr(data).encode("utf-8", "surrogatepass")


class AnchorLocator:
    """Finds anchor positions (characters of `full`) by rendering variants of `dicts`.

    Contexts: R_j = the history truncated to its first j messages, rendered without generation
    prompt, is "stable" when it is a prefix of the full text. A message's fields are probed in
    the smallest stable context that holds it (the full text when there is none), where the text
    up to R_j's end is the full text's own. What is found in a context depends only on the
    messages it holds, so it is cached under their digest: a Session's next turn, which mostly
    extends the history, renders only the new messages' contexts (agent histories grow to
    hundreds of messages; rendering every truncation each turn would cost O(n^2) renders).
    """

    def __init__(
        self,
        render: Render,
        dicts: list[dict],
        full: str,
        gen: bool,
        cache: OrderedDict,
        salt: bytes,
    ):
        self._render = render
        self.dicts = dicts
        self.full = full
        self.full_bytes = full.encode("utf-8", "surrogatepass")
        self.gen = gen
        self.cache = cache
        self.keys = [_digest(salt)]  # keys[i] identifies dicts[:i] (with template and tools)
        for d in dicts:
            self.keys.append(_digest(self.keys[-1] + key_bytes(d)))
        self._texts: dict[int, str | None] = {}
        # Probe results of this call, by (kind, context j, message, call or field): the turn
        # starts, the inner marks, the tails and the batch (anchor_batch.py) share them.
        self.probes: dict[tuple, Any] = {}

    def render(self, dicts: list[dict], gen: bool, with_tools: bool = True) -> str | None:
        """A variant's text, or None when the template refuses it (some templates raise on a
        history without a user query, as a truncated one can be)."""
        try:
            return self._render(dicts, gen, with_tools)
        except ChatTemplateError:
            return None

    def cached(self, key: tuple, compute):
        # One lookup, then a local value: another thread may evict from the shared cache
        # between a membership test and a read (servers render concurrently), hence the
        # KeyErrors let go of.
        cache = self.cache
        value = cache.get(key, _MISSING)
        if value is not _MISSING:
            with contextlib.suppress(KeyError):
                cache.move_to_end(key)  # recently used
            return value
        value = compute()
        while len(cache) >= _CACHE_ENTRIES:
            try:
                cache.popitem(last=False)
            except KeyError:
                break
        cache[key] = value
        return value

    def tools_rendered(self) -> bool:
        """Whether the tool list changes the rendering. Probed on the history up to its first
        user message (every template seen renders tools there or before), so it is cached for
        all of a Session's turns; on the whole history when the template refuses that."""
        k = next((i + 1 for i, d in enumerate(self.dicts) if d["role"] == "user"), len(self.dicts))

        def compute():
            for dicts, gen in ((self.dicts[:k], False), (self.dicts, self.gen)):
                bare = self.render(dicts, gen, with_tools=False)
                if bare is not None:
                    return bare != self.render(dicts, gen)
            return True  # refused without tools: it needs them, so it renders them

        return self.cached(("tools", self.keys[k]), compute)

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

    def stable(self) -> list[bool]:
        """Whether each R_j (j in 0..n; R_0 is empty) is a prefix of the full text: its digest
        against the digest of the full text's prefix of its length. The prefixes' digests come
        from one pass over the full text (a hasher copied at each length): hashing each prefix
        afresh cost O(messages x text), ~0.65 s a turn at 250k tokens."""
        heads = [self.head(j) for j in range(1, len(self.dicts) + 1)]
        total = len(self.full_bytes)
        lengths = sorted({h[1] for h in heads if h is not None and h[1] <= total})
        prefixes, hasher, done = {}, hashlib.blake2b(digest_size=16), 0
        data = memoryview(self.full_bytes)
        for length in lengths:
            hasher.update(data[done:length])
            done = length
            prefixes[length] = hasher.copy().digest()
        return [True] + [h is not None and prefixes.get(h[1]) == h[2] for h in heads]

    def ctx_dicts(self, j: int) -> list[dict]:
        return self.dicts[:j] if j <= len(self.dicts) else self.dicts

    def ctx_gen(self, j: int) -> bool:
        return self.gen if j > len(self.dicts) else False

    # --- the anchors --------------------------------------------------------------------
    def locate(self) -> tuple[list[tuple[int, str, int]], str]:
        n = len(self.dicts)
        stable = self.stable()
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
        self.batch_wide_contexts(ctx, stable)
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
        self.keep_tails(stable)
        return marks, gen_text

    def batch_wide_contexts(self, ctx: list[int], stable: list[bool]) -> None:
        """Probes at once, in one or a few renders, the messages that share a context and whose
        marks are not cached: a user's follow-up after an agent run makes the template render
        the run differently (Qwen3 drops its reasoning), so every run message is probed in the
        whole history; one by one that cost ~5 whole-history renders a message (16.7 s at 49k
        tokens). What the batch cannot vouch for is left to the single probes."""
        groups: dict[int, list[int]] = {}
        for m, j in enumerate(ctx):
            inner = ("inner", *self.ctx_key(j), m) not in self.cache
            start = m > 0 and not stable[m] and ("start", *self.ctx_key(j), m) not in self.cache
            if inner or start:
                groups.setdefault(j, []).append(m)
        for j, members in groups.items():
            if len(members) >= BATCH_MIN and self.text(j) is not None:
                self.batch(j, members, stable)

    def batch(self, j: int, members: list[int], stable: list[bool]) -> None:
        """Fills `probes` for context j with what the members' inner marks and turn starts
        will ask (see `inner_marks`, `turn_start`), as far as anchor_batch vouches for it."""
        fields: dict[tuple[int, str], None] = {}  # ordered sets
        calls: dict[tuple[int, int], None] = {}
        for m in members:
            d = self.dicts[m]
            if ("inner", *self.ctx_key(j), m) not in self.cache:
                if d["role"] == "assistant":
                    if d.get("reasoning_content"):
                        fields[(m, "reasoning_content")] = None
                    calls.update(((m, c), None) for c in range(len(d.get("tool_calls", []))))
                elif d["role"] == "tool":
                    fields[(m, "content")] = None
            if m > 0 and not stable[m] and ("start", *self.ctx_key(j), m) not in self.cache:
                before = self.dicts[m - 1].get("tool_calls")
                if before:
                    calls[(m - 1, len(before) - 1)] = None
                else:
                    fields[(m - 1, "content")] = None
        spans, absent, starts = probe_at_once(
            self.render,
            self.ctx_dicts(j),
            self.text(j),
            self.ctx_gen(j),
            [f for f in fields if ("field", j, *f) not in self.probes],
            [c for c in calls if ("call", j, *c) not in self.probes],
        )
        for (i, key), span in spans.items():
            self.probes[("field", j, i, key)] = span
        for i, key in absent:  # a tool result not printed is an error: its single probe says so
            if self.dicts[i]["role"] != "tool":
                self.probes[("field", j, i, key)] = UNRENDERED
        for (i, c), start in starts.items():
            self.probes[("call", j, i, c)] = start

    def keep_tails(self, stable: list[bool]) -> None:
        """Caches how each newly rendered assistant or tool message ends as the last one (see
        `tail`) while its context's text and probes are at hand (no render for a message with
        calls or a tool result; one for a reply without calls): a later user message that makes
        the template re-render the run then finds its turn starts without a render of each
        truncated history."""
        for m, d in enumerate(self.dicts):
            if stable[m + 1] and m + 1 in self._texts and d["role"] in ("assistant", "tool"):
                self.tail(m)

    def inner_marks(self, m: int, j: int) -> list[tuple[int, str]]:
        """Reasoning, tool-call and tool-output marks of message m, found in context j.
        Raises InvalidRequestError when the template ignores m's tool calls or tool result."""
        msg = self.dicts[m]
        out = []
        if self.text(j) is None:
            return out
        if msg["role"] == "assistant":
            if msg.get("reasoning_content"):
                span = self.field_span_in(j, m, "reasoning_content")
                if span is not None:
                    out += [(span[0], "reasoning_start"), (span[1], "reasoning_end")]
            for c in range(len(msg.get("tool_calls", []))):
                start = self.call_start_in(j, m, c)
                if start is not None:
                    out.append((start, "tool_call"))
        elif msg["role"] == "tool":
            span = self.field_span_in(j, m, "content", required="tool results")
            if span is not None:
                out.append((span[0], "tool_output"))
        return out

    # --- probes in context j, kept for this call ------------------------------------------
    def field_span_in(
        self, j: int, i: int, key: str, required: str | None = None
    ) -> tuple[int, int] | None:
        """`field_span` of message i's `key` in context j. Raises when the field is required
        and the template ignores it (kept as UNRENDERED: a caller not requiring it gets None)."""
        probe = ("field", j, i, key)
        if probe not in self.probes:
            try:
                ref = self.text(j)
                dicts, gen = self.ctx_dicts(j), self.ctx_gen(j)
                span = field_span(self.render, dicts, i, key, ref, gen, "it")
            except InvalidRequestError:
                span = UNRENDERED
            self.probes[probe] = span
        span = self.probes[probe]
        if span is UNRENDERED:
            if required:
                raise unrendered(required)
            return None
        return span

    def call_start_in(self, j: int, i: int, c: int) -> int | None:
        """`call_start` of call c of message i in context j."""
        probe = ("call", j, i, c)
        if probe not in self.probes:
            ref = self.text(j)
            dicts, gen = self.ctx_dicts(j), self.ctx_gen(j)
            self.probes[probe] = call_start(self.render, dicts, i, c, ref, gen)
        return self.probes[probe]

    def end_point(self, j: int, k: int) -> int | None:
        """A point of message k that renders alike wherever k stands: its last call's start,
        else its content's end; in context j."""
        calls = self.dicts[k].get("tool_calls")
        if calls:
            return self.call_start_in(j, k, len(calls) - 1)
        span = self.field_span_in(j, k, "content")
        return span[1] if span else None

    def tail(self, k: int) -> Tail | object:
        """The text message k ends with as the last message, from its `end_point` (R_k+1
        after it): REFUSED when the template refuses dicts[:k+1], NO_POINT without the point.
        It depends on dicts[:k+1] alone, so it is cached under their key: its first TAIL_KEPT
        characters, its length and digest (a last call's arguments can be long)."""

        def compute():
            head = self.text(k + 1)
            if head is None:
                return REFUSED
            here = self.end_point(k + 1, k)
            if here is None:
                return NO_POINT
            rest = head[here:].encode("utf-8", "surrogatepass")
            return Tail(head[here : here + TAIL_KEPT], len(head) - here, _digest(rest))

        return self.cached(("tail", self.keys[k + 1]), compute)

    def turn_start(self, m: int, j: int) -> int | None:
        """Where message m begins in context j when R_m is not a prefix of it: the template
        rendered message m-1 (or earlier ones) differently once it saw later messages. Align a
        point of message m-1 known in both renderings, then follow m-1's tail from there."""
        ref = self.text(j)
        if ref is None:
            return None
        tail = self.tail(m - 1)  # R_m from message m-1's point on: cached since m-1 was last
        if tail is REFUSED:
            return probe_start(self.render, self.dicts, m, ref)
        there = self.end_point(j, m - 1)
        if tail is NO_POINT or there is None:
            return common_prefix(self.text(m), ref)
        agree = common_prefix(tail.kept, ref[there : there + len(tail.kept)])
        if agree < len(tail.kept) or tail.length == agree:
            return there + agree
        whole = ref[there : there + tail.length].encode("utf-8", "surrogatepass")
        if _digest(whole) == tail.digest:
            return there + tail.length
        # They part beyond what is kept: follow the whole tail (R_m rendered again).
        here = self.end_point(m, m - 1)
        return there + common_prefix(self.text(m)[here:], ref[there:])
