"""Many of a history's probes in one or a few renders (AnchorLocator's single probes, at once).

    spans, absent, starts = probe_at_once(render, dicts, ref, gen, fields, calls)
    # fields: [(message, key)]  ->  spans {(message, key): (start, end) in ref}, absent {...}
    # calls:  [(message, call)] ->  starts {(message, call): character of ref}

AnchorLocator probes one field or call per render of the history (anchor_probes.py): a field
replaced by a sentinel bounds it by common prefix and suffix with the real text; a message's
calls cut before call c diverge from it where call c begins. When many messages share a context
(a user's follow-up after an agent run makes the template re-render the whole run), that is a
few renders of the whole history per message. Here:

- Fields: every field gets a sentinel of its own in ONE render B = T0 s1 T1 s2 ... sK TK (the
  T are template text). The real text must then read T0 c1 T1 ... cK TK, each c the field's
  value as the template prints it (itself or stripped); c_k's place there is exactly what the
  single probe of field k finds, since that probe's text differs from the real one only in c_k.
  A field whose sentinel B lacks is one the template does not print (stripped reasoning).
- Calls: one more render per call index c, with the calls of every probed message cut before
  call c (fields still sentinels). Compared segment by segment with B, each segment that changed
  must lie between the sentinels around exactly one cut message, and each such message must own
  exactly one changed segment: the first differing character there is where its call c begins,
  as the single probe finds it (its text before that point is the real text's). A template
  that looks ahead at later messages' calls (gpt-oss's asks whether any later message has
  some) would change an earlier message's text as a later one's calls are cut: one more render
  per call index, the last message cut alone, must change only text near no other cut message.

Anything that does not decompose exactly, or is ambiguous, is left out of the results and the
caller probes it singly, so the batch changes no result, only the number of renders. What is
not checked: a template printing, in a cut message's own text, what depends on another's calls
that the last one's cut does not reveal (none of the 28 templates tested). An anchor is where a
checkpoint is taken, never a result: a misplaced one costs reuse, not correctness.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from freetoken_agent.anchor_probes import Render
from freetoken_agent.text_prefix import common_prefix

# A sentinel: a start character, a number in three digits of base 256, an end character, all
# private-use characters no template tests for; a value holding any of them is not batched.
_START, _END, _DIGIT0 = "\U000f0011", "\U000f0013", 0xF0200
_SENTINEL = re.compile("\U000f0011([\U000f0200-\U000f02ff]{3})\U000f0013")
_PRIVATE = re.compile("[\U000f0000-\U000f02ff]")

Field = tuple[int, str]  # (message index, key)
Call = tuple[int, int]  # (message index, call index)
Mark = tuple[int, int, int]  # (start, end, sentinel number) in a probe's text


def sentinel(number: int) -> str:
    digits = "".join(chr(_DIGIT0 + (number >> shift & 255)) for shift in (16, 8, 0))
    return _START + digits + _END


def _number(digits: str) -> int:
    return sum((ord(ch) - _DIGIT0) << shift for ch, shift in zip(digits, (16, 8, 0), strict=True))


def _renderings(value: str) -> set[str]:
    """How templates print a value: as is, or stripped of whitespace or newlines."""
    return {
        value,
        *(getattr(value, f)(*a) for f in ("strip", "lstrip", "rstrip") for a in ((), ("\n",))),
    }


def _marks(text: str, numbers: set[int]) -> list[Mark] | None:
    """The sentinels in `text` by position; None unless each is one of ours, at most once."""
    marks = [(m.start(), m.end(), _number(m.group(1))) for m in _SENTINEL.finditer(text)]
    seen = [n for _, _, n in marks]
    if len(set(seen)) != len(seen) or not set(seen) <= numbers:
        return None
    return marks


def _decompose(
    text: str, ref: str, marks: list[Mark], values: dict[int, str]
) -> dict[int, tuple[int, int]] | None:
    """Each sentinel's field as a span of `ref`, when `ref` reads as `text` with every sentinel
    replaced by one rendering of its value, in exactly one way; else None."""
    spans: dict[int, tuple[int, int]] = {}
    at_text = at_ref = 0
    for k, (start, end, number) in enumerate(marks):
        before = text[at_text:start]
        if not ref.startswith(before, at_ref):
            return None
        at_ref += len(before)
        after = text[end : marks[k + 1][0] if k + 1 < len(marks) else len(text)]
        fits = {
            len(shown)
            for shown in _renderings(values[number])
            if ref.startswith(shown, at_ref) and ref.startswith(after, at_ref + len(shown))
        }
        if len(fits) != 1:
            return None
        width = fits.pop()
        spans[number] = (at_ref, at_ref + width)
        at_ref, at_text = at_ref + width, end
    return spans if text[at_text:] == ref[at_ref:] else None


def _segments(text: str, marks: list[Mark]) -> list[str]:
    """The template text around the sentinels: len(marks) + 1 pieces."""
    cuts = [0, *(x for start, end, _ in marks for x in (start, end)), len(text)]
    return [text[cuts[2 * k] : cuts[2 * k + 1]] for k in range(len(marks) + 1)]


def probe_at_once(
    render: Render,
    dicts: list[dict],
    ref: str,
    gen: bool,
    fields: list[Field],
    calls: list[Call],
) -> tuple[dict[Field, tuple[int, int]], set[Field], dict[Call, int]]:
    """Field spans, fields not printed, and call starts in `ref` (the rendering of `dicts`),
    each as AnchorLocator's single probe in the same context finds it; whatever the batch
    cannot vouch for is missing from all three."""
    probe: list[dict[str, Any]] = list(dicts)
    values: dict[int, str] = {}
    owners: dict[int, Field] = {}
    for number, (i, key) in enumerate(fields):
        value = dicts[i].get(key)
        if isinstance(value, str) and value and not _PRIVATE.search(value):
            values[number], owners[number] = value, (i, key)
            probe[i] = {**probe[i], key: sentinel(number)}
    text = render(probe, gen) if values else None
    marks = _marks(text, set(values)) if text is not None else None
    spans = _decompose(text, ref, marks, values) if marks is not None else None
    if spans is None:
        return {}, set(), {}
    found = {owners[n]: span for n, span in spans.items()}
    absent = {owners[n] for n in values if n not in spans}
    # Messages between the sentinels around each segment (the first and last segments reach
    # the history's ends).
    ranges = [
        (
            owners[marks[k - 1][2]][0] if k else 0,
            owners[marks[k][2]][0] if k < len(marks) else len(dicts),
        )
        for k in range(len(marks) + 1)
    ]
    at_ref = [0, *(spans[n][1] for _, _, n in marks)]  # where each segment starts in ref
    layout = _Layout(marks, _segments(text, marks), at_ref, ranges)
    starts: dict[Call, int] = {}
    for c in sorted({c for _, c in calls}):
        cut_messages = sorted({i for i, cc in calls if cc == c})
        changes = layout.changes(render(_cut(probe, cut_messages, c), gen))
        found_c = _cut_starts(layout, changes, c, cut_messages) if changes is not None else {}
        last = cut_messages[-1]
        if found_c and len(cut_messages) > 1:
            # A template that looks ahead at later messages' calls (gpt-oss's does) changes an
            # earlier message's text when a later one's calls are cut, and the batch would read
            # that change as the earlier message's call: the last message cut alone must change
            # only text that is its alone (no other cut message near), else every call here is
            # left to the single probes.
            alone = layout.changes(render(_cut(probe, [last], c), gen))
            if alone is None or any(layout.near(k, cut_messages) != [last] for k in alone):
                found_c = {}
        starts.update(found_c)
    return found, absent, starts


def _cut(probe: list[dict], messages: list[int], c: int) -> list[dict]:
    """`probe` with the calls of `messages` cut before call c."""
    cut = list(probe)
    for i in messages:
        kept = {**cut[i], "tool_calls": cut[i]["tool_calls"][:c]}
        if not kept["tool_calls"]:
            del kept["tool_calls"]
        cut[i] = kept
    return cut


@dataclass(frozen=True, slots=True)
class _Layout:
    """The fields' render: its sentinels, the template text between them (len(marks) + 1
    segments), where each segment starts in the real text, and the messages around each."""

    marks: list[Mark]
    segments: list[str]
    at_ref: list[int]
    ranges: list[tuple[int, int]]

    def changes(self, other: str | None) -> dict[int, str] | None:
        """The segments another render (calls cut) changed, as they read there; None when its
        sentinels are not these."""
        numbers = [n for *_, n in self.marks]
        other_marks = _marks(other, set(numbers)) if other is not None else None
        if other_marks is None or [n for *_, n in other_marks] != numbers:
            return None
        pairs = zip(self.segments, _segments(other, other_marks), strict=True)
        return {k: theirs for k, (ours, theirs) in enumerate(pairs) if ours != theirs}

    def near(self, k: int, messages: list[int]) -> list[int]:
        """Those of `messages` between the sentinels around segment k."""
        lo, hi = self.ranges[k]
        return [i for i in messages if lo <= i <= hi]


def _cut_starts(
    layout: _Layout, changes: dict[int, str], c: int, cut_messages: list[int]
) -> dict[Call, int]:
    """Call c's start of each cut message, from the segments the cut changed: see the
    module's docstring for what makes a start certain."""
    owned: dict[int, list[int]] = {i: [] for i in cut_messages}
    for k in changes:
        near = layout.near(k, cut_messages)
        if not near:
            return {}  # a change no cut message explains: trust none of this render
        for i in near:
            owned[i].append(k if len(near) == 1 else -1)
    out: dict[Call, int] = {}
    for i, ks in owned.items():
        if len(ks) != 1 or ks[0] < 0:
            continue
        k = ks[0]
        ours, theirs = layout.segments[k], changes[k]
        p = common_prefix(ours, theirs)
        if p < min(len(ours), len(theirs)):  # else it runs into a field
            out[(i, c)] = layout.at_ref[k] + p
    return out
