"""Property tests (hypothesis): OutputParser on random text dense in tags, and on random bytes
decoded with errors="replace", cut into random chunks.

No grammar here, so what is checked is what holds for any text: feed/finish never raise; every
chunking gives the same events after `coalesce` (test_fuzz.py says how chunkings are drawn); the
call protocol of conftest's `check_stream`; reasoning exactly as reasoning.py defines it
(`reference_split`, written out for whole text); content a subsequence of the rest, and equal
to it when no call ended (only well-formed calls and whitespace beside them are ever removed).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freetoken_agent.parsers import TOOL_FORMATS, ContentDelta, ReasoningDelta, ToolCallEnd

# database=None: the repository does not ignore `.hypothesis/`. FREETOKEN_FUZZ_EXAMPLES
# raises the count for a longer hunt.
RANDOM = settings(
    max_examples=int(os.environ.get("FREETOKEN_FUZZ_EXAMPLES", "0")) or 100,
    deadline=None,
    database=None,
)
CHARS = "abyzAZ09 _-.\n\t\r<>/[]{}\":,=\\'éß中😀\xa0\u2028"
SOUP_BITS = (
    *("<", "</", "<to", "<tool_cal", "<tool_call", "<tool_call>", "</tool_call", "</tool_call>"),
    *("<think", "<think>", "</think", "</think>", "[TOOL", "[TOOL_CALLS", "[TOOL_CALLS]"),
    *("[ARGS]", "[CALL_ID]", "<function=", "<function=f>", "</function>", "<parameter="),
    *("</parameter>", '{"name": "f", "arguments": ', '"arguments"', "{", "}", "NaN", "\\"),
    '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>',
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>",
    '[TOOL_CALLS]f[ARGS]{"a": "b"}',
    '[TOOL_CALLS][{"name": "f", "arguments": {}}]',
    "n" * 260,  # longer than a name may be
)
SOUP = st.lists(st.text(alphabet=CHARS, max_size=4) | st.sampled_from(SOUP_BITS), max_size=24)
BYTES = st.lists(st.binary(max_size=6) | st.sampled_from([b.encode() for b in SOUP_BITS]))


def reference_split(text: str, starts: bool) -> tuple[str, str]:
    """(reasoning, content) by the rules of reasoning.py, for the whole text at once."""
    if not starts:
        rest = text.lstrip()
        if not rest.startswith("<think>"):
            return "", text
        inner = rest[len("<think>") :].removeprefix("\n")
    else:
        inner = text
        if inner.startswith("<think>"):
            inner = inner[len("<think>") :].removeprefix("\n")
    end = inner.find("</think>")
    if end < 0:
        return inner, ""
    return inner[:end].removesuffix("\n"), inner[end + len("</think>") :].lstrip()


def is_subsequence(short: str, long: str) -> bool:
    chars = iter(long)
    return all(c in chars for c in short)


def check_any_text(fuzz, fmt: str | None, starts: bool, text: str, data: st.DataObject) -> None:
    events = fuzz.run_every(fmt, starts, None, text, fuzz.drawn_chunkings(data, text, 1))
    reasoning, content = reference_split(text, starts)
    assert fuzz.shown(events, ReasoningDelta) == reasoning
    got = fuzz.shown(events, ContentDelta)
    if any(isinstance(e, ToolCallEnd) for e in events):
        assert is_subsequence(got, content)
    else:
        assert got == content


@pytest.mark.parametrize("fmt", [*TOOL_FORMATS, None])
@RANDOM
@given(pieces=SOUP, starts=st.booleans(), data=st.data())
def test_random_tag_soup(
    fuzz, fmt: str | None, pieces: list[str], starts: bool, data: st.DataObject
) -> None:
    check_any_text(fuzz, fmt, starts, "".join(pieces), data)


@pytest.mark.parametrize("fmt", [*TOOL_FORMATS, None])
@RANDOM
@given(pieces=BYTES, starts=st.booleans(), data=st.data())
def test_random_bytes(
    fuzz, fmt: str | None, pieces: list[bytes], starts: bool, data: st.DataObject
) -> None:
    check_any_text(fuzz, fmt, starts, b"".join(pieces).decode("utf-8", errors="replace"), data)
