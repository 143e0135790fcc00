"""Shared tools for the parser tests: fresh random text, chunkings, and the event protocol check.

Every test draws new inputs from `rng`, seeded from os.urandom and printed, so a failure can be
replayed by fixing the seed. Helpers are handed out through the `kit` fixture (test modules are
imported in importlib mode and cannot import one another).
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from types import SimpleNamespace

import pytest
from hypothesis import strategies as st

from freetoken_agent.parsers import (
    ContentDelta,
    Event,
    OutputParser,
    ParseWarning,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
    coalesce,
)
from freetoken_agent.parsers.json_scan import loads_strict

# Characters that stress the parsers: tag and JSON syntax, escapes, newlines, non-ASCII.
HARD = '<>/[]{}"\\\n\t :,=_'
UNICODE = "éß中文😀ñ∑"
LETTERS = "abcdefghijklmnopqrstuvwxyzABCXYZ0123456789"
# Pieces of tags that must be held back and then released as text.
TAG_BITS = ["<to", "<tool_cal", "</tool_call>", "<b>", "<", "[TOOL", "[TOOL_CALLS", "<think", "</"]
# OpenAI-style ids; Mistral's templates take back 9 letters and digits (template_call_ids.py)
ID_RE = re.compile(r"^(call_[0-9a-f]{24}|[A-Za-z0-9]{9})$")


@pytest.fixture
def rng() -> random.Random:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"parser test seed={seed}")
    return random.Random(seed)


def rand_text(rng: random.Random, lo: int = 0, hi: int = 24, bits: bool = True) -> str:
    """Random text over letters, syntax characters and unicode, with tag fragments mixed in."""
    out = []
    for _ in range(rng.randint(lo, hi)):
        roll = rng.random()
        if bits and roll < 0.08:
            out.append(rng.choice(TAG_BITS))
        elif roll < 0.35:
            out.append(rng.choice(HARD))
        elif roll < 0.5:
            out.append(rng.choice(UNICODE))
        else:
            out.append(rng.choice(LETTERS))
    return "".join(out)


def rand_name(rng: random.Random) -> str:
    return rng.choice("abcdefgh_") + "".join(rng.choice(LETTERS + "_") for _ in range(6))


def rand_value(rng: random.Random, depth: int = 0):
    kind = rng.choice(["int", "float", "bool", "null", "str", "str", "list", "dict"])
    if depth >= 2 and kind in ("list", "dict"):
        kind = "str"
    if kind == "int":
        return rng.randint(-(10**6), 10**6)
    if kind == "float":
        return round(rng.uniform(-1e3, 1e3), 3)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "str":
        return rand_text(rng, 0, 16)
    if kind == "list":
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rand_args(rng, depth + 1)


def rand_args(rng: random.Random, depth: int = 0) -> dict:
    """A random arguments object; keys and strings carry quotes, braces, tags and unicode."""
    return {rand_text(rng, 1, 8): rand_value(rng, depth) for _ in range(rng.randint(0, 4))}


def chunkings(rng: random.Random, text: str) -> list[list[str]]:
    """The whole text, one character at a time, and several random cuts."""
    ways = [[text], list(text)]
    for top in (2, 5, 17):
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, top)
            chunks.append(text[i : i + n])
            i += n
        ways.append(chunks)
    return ways


def run(parser, chunks: list[str]) -> list:
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def merge(events: list) -> list:
    """Neighbouring text of one kind joined (written here, not taken from the library)."""
    out: list = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (ContentDelta, ReasoningDelta)):
            out[-1] = type(e)(out[-1].text + e.text)
        elif (
            out
            and isinstance(e, ToolCallArgsDelta)
            and isinstance(out[-1], ToolCallArgsDelta)
            and out[-1].index == e.index
        ):
            out[-1] = ToolCallArgsDelta(e.index, out[-1].text + e.text)
        elif isinstance(e, (ContentDelta, ReasoningDelta)) and not e.text:
            raise AssertionError(f"empty text delta {e!r}")
        else:
            out.append(e)
    return out


def normalize(events: list) -> list:
    """Check the call protocol, then merge text and replace random ids by their index.

    Protocol: starts count 0, 1, 2, ...; ids are unique `call_<24 hex>`; argument deltas and the
    end refer to an open call; the end repeats its start's id and name; a call's argument deltas
    concatenate to JSON equal to its end's arguments (as loads_strict reads both: a number past
    a float's range is the largest float in each); a voided call (warning with its index)
    gets no end, and no event refers to it afterwards.
    """
    started: dict[int, ToolCallStart] = {}
    closed: set[int] = set()
    args_text: dict[int, str] = {}
    ids: set[str] = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(started), f"start index {e.index} after {len(started)} starts"
            assert ID_RE.match(e.id) and e.id not in ids, e.id
            assert e.name, e
            ids.add(e.id)
            started[e.index] = e
            args_text[e.index] = ""
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index in started and e.index not in closed, e
            args_text[e.index] += e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index in started and e.index not in closed, e
            s = started[e.index]
            assert (e.id, e.name) == (s.id, s.name), (e, s)
            assert isinstance(e.arguments, dict)
            assert loads_strict(args_text[e.index]) == e.arguments, (args_text[e.index], e)
            closed.add(e.index)
        elif isinstance(e, ParseWarning) and e.index is not None:
            assert e.index in started and e.index not in closed, e
            closed.add(e.index)
    out = []
    for e in merge(events):
        if isinstance(e, ToolCallStart):
            e = ToolCallStart(e.index, f"id{e.index}", e.name)
        elif isinstance(e, ToolCallEnd):
            e = ToolCallEnd(e.index, f"id{e.index}", e.name, e.arguments)
        out.append(e)
    return out


def summary(events: list) -> list[tuple]:
    """What the output means: reasoning, content, calls (name, args) and warnings, in order."""
    out: list[tuple] = []
    for e in merge(events):
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            kind = "content" if isinstance(e, ContentDelta) else "reasoning"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + e.text)
            else:
                out.append((kind, e.text))
        elif isinstance(e, ToolCallEnd):
            out.append(("call", e.name, e.arguments))
        elif isinstance(e, ParseWarning):
            out.append(("warning", e.raw_text, e.index is not None))
    return out


def merge_summary(items: list[tuple]) -> list[tuple]:
    """An expected summary with neighbouring text of one kind joined and empty text dropped."""
    out: list[tuple] = []
    for item in items:
        if item[0] in ("content", "reasoning"):
            if not item[1]:
                continue
            if out and out[-1][0] == item[0]:
                out[-1] = (item[0], out[-1][1] + item[1])
                continue
        out.append(item)
    return out


def check_all_chunkings(rng: random.Random, make_parser, text: str, expected: list[tuple]):
    """Every chunking gives the same merged events, and they mean `expected`."""
    first = None
    for chunks in chunkings(rng, text):
        assert "".join(chunks) == text
        events = run(make_parser(), chunks)
        got = normalize(events)
        if first is None:
            first = got
            assert summary(events) == merge_summary(expected), text
        else:
            assert got == first, (text, chunks)
    return first


def without(rng: random.Random, text_fn, *forbidden: str) -> str:
    """Draw text from `text_fn` until it contains none of `forbidden` (a tag formed by chance)."""
    while True:
        text = text_fn()
        if not any(f in text for f in forbidden):
            return text


def expected_from(segments: list[tuple]) -> list[tuple]:
    """The summary a tool parser must produce for a transcript built from segments.

    ("text", s): content; whitespace alone right after a well-formed call block is dropped.
    ("call", block, items): a well-formed block and the summary items it means.
    ("bad", block, raw, voided): a malformed block; `raw` (a prefix of the block) becomes
    content plus a warning, the rest of the block is plain content.
    """
    items: list[tuple] = []
    after_call = False
    for seg in segments:
        if seg[0] == "text":
            if seg[1] and not (after_call and seg[1].isspace()):
                items.append(("content", seg[1]))
                after_call = False
        elif seg[0] == "call":
            items += seg[2]
            after_call = True
        else:
            _, block, raw, voided = seg
            items += [("content", raw), ("warning", raw, voided), ("content", block[len(raw) :])]
            after_call = False
    return items


def transcript(rng: random.Random, blocks: list[tuple], forbidden: tuple[str, ...]) -> list:
    """Blocks in order, with random content (or template newlines, or nothing) around them."""

    def gap() -> tuple:
        roll = rng.random()
        if roll < 0.3:
            return ("text", rng.choice(["", "\n", "\n\n", " "]))
        return ("text", without(rng, lambda: rand_text(rng, 1, 30), *forbidden))

    segments = [gap()]
    for block in blocks:
        segments += [block, gap()]
    return segments


@pytest.fixture
def kit() -> SimpleNamespace:
    return SimpleNamespace(
        rand_text=rand_text,
        rand_name=rand_name,
        rand_value=rand_value,
        rand_args=rand_args,
        chunkings=chunkings,
        run=run,
        merge=merge,
        normalize=normalize,
        summary=summary,
        merge_summary=merge_summary,
        check_all_chunkings=check_all_chunkings,
        without=without,
        expected_from=expected_from,
        transcript=transcript,
    )


# The property tests (test_fuzz*.py) share the checks below through the `fuzz` fixture. It is
# module-scoped: hypothesis refuses function-scoped fixtures, which are not reset per example.


def drawn_chunkings(data: st.DataObject, text: str, n: int) -> list[list[str]]:
    """One chunk, one character at a time, and `n` cuttings drawn by hypothesis (a repeated
    cut gives an empty chunk)."""
    ways = [[text], list(text)]
    for _ in range(n):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=16), label="cuts"))
        ways.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)])
    return ways


def check_stream(events: list[Event], text: str, verbatim: bool) -> None:
    """The call protocol, stricter than `normalize`: every start is ended or voided by the end
    of the output; text deltas are not empty; a warning's raw text is input text and repeats
    the content just before it. `verbatim` (formats that stream the model's own argument text):
    a voided call streamed nothing from past its block, so its argument text is in the raw."""
    started: dict[int, ToolCallStart] = {}
    open_calls: set[int] = set()
    args_text: dict[int, str] = {}
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            assert e.text, e
        elif isinstance(e, ToolCallStart):
            assert e.index == len(started) and e.name, e
            assert ID_RE.match(e.id) and e.id not in {s.id for s in started.values()}, e
            started[e.index] = e
            open_calls.add(e.index)
            args_text[e.index] = ""
        elif isinstance(e, ToolCallArgsDelta):
            assert e.index in open_calls, e
            args_text[e.index] += e.text
        elif isinstance(e, ToolCallEnd):
            assert e.index in open_calls, e
            assert (e.id, e.name) == (started[e.index].id, started[e.index].name), e
            assert loads_strict(args_text[e.index]) == e.arguments, (args_text[e.index], e)
            open_calls.remove(e.index)
        elif e.index is not None:
            assert e.index in open_calls, e
            assert not verbatim or args_text[e.index] in e.raw_text, (args_text[e.index], e)
            open_calls.remove(e.index)
    assert not open_calls, f"calls neither ended nor voided: {open_calls}"
    merged = coalesce(events)
    for i, e in enumerate(merged):
        if isinstance(e, ParseWarning):
            assert e.raw_text and e.raw_text in text, e
            before = merged[i - 1] if i else None
            assert isinstance(before, ContentDelta) and before.text.endswith(e.raw_text), e


def canonical(events: list[Event]) -> list[Event]:
    """Coalesced events with the random ids replaced by the call index."""
    return [
        dataclasses.replace(e, id=f"#{e.index}")
        if isinstance(e, (ToolCallStart, ToolCallEnd))
        else e
        for e in coalesce(events)
    ]


def run_every(fmt: str | None, starts: bool, tools: list | None, text: str, ways: list) -> list:
    """OutputParser over every chunking in `ways`: each passes `check_stream` and gives the
    same canonical events. Returns the events of the first."""
    first: list[Event] = []
    for n, chunks in enumerate(ways):
        events = run(OutputParser(fmt, starts, tools), chunks)
        check_stream(events, text, verbatim=fmt in ("hermes", "mistral"))
        if n == 0:
            first, want = events, canonical(events)
        else:
            assert canonical(events) == want, chunks
    return first


def shown(events: list[Event], kind: type) -> str:
    """The text of the deltas of one kind, joined."""
    return "".join(e.text for e in events if isinstance(e, kind))


@pytest.fixture(scope="module")
def fuzz() -> SimpleNamespace:
    return SimpleNamespace(
        drawn_chunkings=drawn_chunkings,
        run_every=run_every,
        shown=shown,
        merge_summary=merge_summary,
    )
