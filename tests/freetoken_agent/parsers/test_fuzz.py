"""Property tests (hypothesis): OutputParser on model outputs generated from a grammar, cut into
random chunks. (test_fuzz_text.py: random text and bytes; conftest.py: the shared checks.)

A generated output is a think block (none, closed, left open; opened in the output or by the
template) and then content: text pieces between call blocks. A block is well formed (arguments
drawn as JSON by hypothesis), malformed in a known way, or (last only) cut off by the end of
the output. For every tool format and reasoning mode:

- feed/finish never raise;
- the events after `coalesce`, ids replaced by indexes, are the same for every chunking: one
  chunk, one character at a time, and hypothesis-drawn cut points (empty chunks included);
- the call protocol holds (conftest's `check_stream`): starts count 0, 1, 2, ...; ids are
  unique `call_<24 hex>`; argument deltas and the end refer to an open call; every start is
  ended or voided (a warning with its index); an ended call's argument deltas concatenate to
  JSON equal to its arguments;
- every well-formed call appears exactly once, in order, as a ToolCallEnd with the generated
  name and arguments;
- text is conserved. The reasoning and content texts together equal the input less exactly
  these structural parts: `<think>` and one newline after it, one newline before `</think>`,
  `</think>` and the whitespace after it (the rules of reasoning.py); each well-formed block;
  whitespace alone between a well-formed block and the next block or the end (tool_parser.py).
  All else, malformed blocks included, comes back verbatim and in order;
- a malformed block is re-emitted as content followed by a ParseWarning whose raw_text is that
  content: the whole block, or for Mistral the prefix up to where it stopped being a call.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from freetoken_agent.parsers import (
    TOOL_FORMATS,
    ContentDelta,
    Event,
    ParseWarning,
    ReasoningDelta,
    ToolCallEnd,
)

# database=None: the repository does not ignore `.hypothesis/`, and tests must not write there.
# FREETOKEN_FUZZ_EXAMPLES raises the count for a longer hunt; the default keeps CI fast.
GRAMMAR = settings(
    max_examples=int(os.environ.get("FREETOKEN_FUZZ_EXAMPLES", "0")) or 300,
    deadline=None,
    database=None,
)

CHARS = "abyzAZ09 _-.\n\t\r<>/[]{}\":,=\\'éß中😀\xa0\u2028"
TAG_BITS = (
    *("<", "</", "<to", "<tool_cal", "<tool_call", "<tool_call>", "</tool_call", "</tool_call>"),
    *("<think", "<think>", "</think", "</think>", "[TOOL", "[TOOL_CALLS", "[TOOL_CALLS]"),
    *("[ARGS]", "[CALL_ID]", "<function=", "<function=f>", "</function>", "<parameter="),
    *("</parameter>", '{"name": "f", "arguments": ', '"arguments"', "{", "}", "NaN", "\\"),
)
OPEN_TAGS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}
CLOSE = "</tool_call>"
# A parameter value ends at these (qwen3_coder.py); generated values must not hold them.
VALUE_ENDS = ("</parameter>", "\n<parameter=", "\n</function>", "\n</tool_call>")
DEEP = "[" * 1500 + "]" * 1500  # past loads_strict's cap (and, often, the recursion limit)


def text_from(forbid: tuple[str, ...] = (), max_pieces: int = 8) -> st.SearchStrategy[str]:
    """Text of characters and tag pieces (partial, whole, stray) with none of `forbid`."""
    bits = [b for b in TAG_BITS if not any(f in b for f in forbid)]
    piece = st.text(alphabet=CHARS, max_size=5) | st.sampled_from(bits)
    text = st.lists(piece, max_size=max_pieces).map("".join)
    return text.filter(lambda s: not any(f in s for f in forbid))


STRINGS = st.text(max_size=8) | text_from(max_pieces=4)
NUMBERS = st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
SCALARS = st.none() | st.booleans() | NUMBERS | STRINGS
VALUES = st.recursive(
    SCALARS,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(STRINGS, kids, max_size=3),
    max_leaves=6,
)
ARGS = st.dictionaries(STRINGS, VALUES, max_size=4)
# Arguments for blocks whose end is found by searching for the close tag (malformed or nested).
SAFE_ARGS = ARGS.map(lambda a: {k: v for k, v in a.items() if CLOSE not in json.dumps([k, v])})
ANY_NAMES = st.text(min_size=1, max_size=8)
NAMES = st.text(alphabet="abxyzAZ09_-.中é", min_size=1, max_size=10)  # fits every format
FLAGS = st.booleans()

# Qwen3-Coder values are typed by the tool schema; a parameter's name carries its type, so the
# schema of every generated call can be rebuilt from the call alone ("text": not declared).
TYPED = {
    "text": STRINGS,
    "string": STRINGS,
    "integer": st.integers(-(2**70), 2**70),
    "number": NUMBERS,
    "boolean": st.booleans(),
    "null": st.none(),
    "array": st.lists(VALUES, max_size=3),
    "object": st.dictionaries(STRINGS, VALUES, max_size=3),
}

# A block is ("call", text, [(name, arguments), ...]) or ("bad", text, raw): `raw` (a prefix of
# the text) comes back as content with a warning, the rest of the text as plain content.


@st.composite
def hermes_call(draw: st.DrawFn, args: st.SearchStrategy[dict] = ARGS) -> tuple:
    name, arguments, ascii_only = draw(ANY_NAMES), draw(args), draw(FLAGS)

    def dumps(value: Any, **kw: Any) -> str:
        return json.dumps(value, ensure_ascii=ascii_only, **kw)

    n, a = dumps(name), dumps(arguments)
    shape = draw(st.sampled_from(["plain", "first", "param", "string", "none", "indent", "extra"]))
    body = {
        "plain": f'{{"name": {n}, "arguments": {a}}}',
        "first": f'{{"arguments": {a}, "name": {n}}}',
        "param": f'{{"name":{n},"parameters":{a}}}',
        "string": f'{{"name": {n}, "arguments": {dumps(a)}}}',  # a JSON string holding JSON
        "none": f'{{"name": {n}}}',  # a tool without parameters
        "indent": dumps({"name": name, "arguments": arguments}, indent=2),
        "extra": f'{{"id": "c1", "name": {n}, "arguments": {a}, "type": "function"}}',
    }[shape]
    arguments = {} if shape == "none" else arguments
    lead, trail = draw(st.sampled_from(["\n", "", " "])), draw(st.sampled_from(["\n", ""]))
    return ("call", f"<tool_call>{lead}{body}{trail}</tool_call>", [(name, arguments)])


@st.composite
def hermes_bad(draw: st.DrawFn) -> tuple:
    name = draw(ANY_NAMES)
    n, a = json.dumps(name), json.dumps(draw(SAFE_ARGS))
    good = f'{{"name": {n}, "arguments": {a}}}'
    bodies = [
        good[: draw(st.integers(0, len(good) - 1))],  # truncated JSON
        good[:-1] + ",}",
        f'{{"name": {n}, "arguments": {{"a": tru}}}}',
        f'{{"arguments": {a}}}',  # no name
        f'{{"name": "", "arguments": {a}}}',
        f'{{"name": 5, "arguments": {a}}}',
        f'{{"name": {n}, "arguments": [1, {a}]}}',  # arguments not an object
        f'{{"name": {n}, "arguments": 7}}',
        f'{{"name": {n}, "arguments": "not json"}}',
        f'{{"name": {n}, "arguments": {{"a": "x\ny"}}}}',  # raw newline in a string
        f'{{"name": {n}, "arguments": {{"path": "C:\\',  # cut after a backslash
        f'{{"name": {n}, "arguments": {{"x": {draw(st.sampled_from(["NaN", "-Infinity"]))}}}}}',
        f'{{"name": {n}, "arguments": {{"a": {DEEP}}}}}',
        f'{{"name": {n}, "name": {json.dumps(name + "2")}, "arguments": {a}}}',
        f'{{"name": {n}, "arguments": {a}, "arguments": {draw(st.sampled_from([a, "5"]))}}}',
        f"[{good}]",
        "just words",
        "",
        draw(hermes_call(SAFE_ARGS))[1],  # a nested open tag: one block up to the first close
    ]
    _, block, raw = closed_bad(draw(st.sampled_from(bodies)))
    if block.endswith("\\\n</tool_call>"):
        block += " then"  # text after the block with no newline: the string must end at `\`
    return ("bad", block, raw)


def closed_bad(body: str) -> tuple:
    """A malformed `<tool_call>` block: it ends at the first close tag, where a nested block's
    close is, so the close after it is a stray one (plain content)."""
    block = f"<tool_call>\n{body}\n</tool_call>"
    return ("bad", block, block[: block.index(CLOSE) + len(CLOSE)])


@st.composite
def coder_call(draw: st.DrawFn, safe: bool = False) -> tuple:
    name, arguments, params = draw(NAMES), {}, []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(sorted(TYPED)))
        key, value = f"{kind}_{draw(NAMES)}", draw(TYPED[kind])
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=draw(FLAGS))
        if any(t in f"\n{text}\n" for t in VALUE_ENDS) or (safe and CLOSE in text):
            continue  # it would end the value early
        arguments[key] = value
        # Models sometimes leave out `</parameter>`; then the next tag at a line start ends the
        # value, and a value ending in a newline would lose it (documented), so not there.
        close = "</parameter>\n" if text.endswith("\n") or draw(FLAGS) else ""
        params.append(f"<parameter={key}>\n{text}\n{close}")
    block = f"<tool_call>\n<function={name}>\n{''.join(params)}</function>\n</tool_call>"
    return ("call", block, [(name, arguments)])


def coder_tools(segments: list[tuple]) -> list[dict]:
    """The tool schemas the generated Qwen3-Coder calls were typed by (see TYPED)."""
    props: dict[str, dict] = {}
    for seg in segments:
        for name, arguments in seg[2] if seg[0] == "call" else []:
            for key in arguments:
                kind = key.split("_", 1)[0]
                if kind != "text":
                    props.setdefault(name, {})[key] = {"type": kind}
    return [
        {"name": n, "parameters": {"type": "object", "properties": p}} for n, p in props.items()
    ]


@st.composite
def coder_bad(draw: st.DrawFn) -> tuple:
    name = draw(NAMES)
    bodies = [
        "hello, no function here",
        "",
        f"<function={name}>\nstray words\n</function>",
        f"<function={name}\nbroken name>\n</function>",
        f"<function={name}\n>\n</function>",  # a newline before `>`
        f"<function=\n{name}>\n</function>",
        f"<function= {'n' * 256}>\n</function>",  # too long, counting the space
        f"<function={name}>\n</function>\n<function=two>\n</function>",
        f"<function={name}>\n</function>\ntrailing words",
        f"<function={name}>\n<parameter=a<b>\nx\n</parameter>\n</function>",
        draw(coder_call(safe=True))[1],  # a nested open tag
    ]
    return closed_bad(draw(st.sampled_from(bodies)))


@st.composite
def mistral_call(draw: st.DrawFn) -> tuple:
    sep, ascii_only = draw(st.sampled_from(["", " "])), draw(FLAGS)
    form = draw(st.sampled_from(["list", "object", "named", "named_id"]))
    if form in ("list", "object"):
        calls = draw(st.lists(st.tuples(ANY_NAMES, ARGS), min_size=1, max_size=3))
        items = [{"name": n, "arguments": a} for n, a in calls]
        if draw(FLAGS):
            items[0]["id"] = "abc123XYZ"
        value = items if form == "list" else items[0]
        calls = calls if form == "list" else calls[:1]
        return ("call", "[TOOL_CALLS]" + sep + json.dumps(value, ensure_ascii=ascii_only), calls)
    name, arguments = draw(NAMES), draw(ARGS)
    middle = "[CALL_ID]a1_B-2" if form == "named_id" else ""
    a = json.dumps(arguments, ensure_ascii=ascii_only)
    return ("call", f"[TOOL_CALLS]{sep}{name}{middle}[ARGS]{sep}{a}", [(name, arguments)])


@st.composite
def mistral_bad(draw: st.DrawFn) -> tuple:
    n, a = draw(NAMES), json.dumps(draw(ARGS))
    named = f"[TOOL_CALLS]{n}[ARGS]"
    cases = [
        (f'[TOOL_CALLS][{{"name": "{n}", "arguments": {{"a": tru}}}}]', None),
        (f'[TOOL_CALLS][{{"arguments": {a}}}]', None),
        ("[TOOL_CALLS][]", None),
        (f'[TOOL_CALLS][{{"name": "{n}", "arguments": [1]}}]', None),
        (f'[TOOL_CALLS] [{{"name": "{n}", "arguments": {{"x": NaN}}}}]', None),
        (named + '{"a": tru}', None),
        (named + '{"x": Infinity}', None),
        (named + f'{{"a": {DEEP}}}', None),
        (named + "[1, 2]", named),
        ("[TOOL_CALLS] is what I would call", "[TOOL_CALLS] is"),
        (f'[TOOL_CALLS]{n}{{"a": 1}}', f"[TOOL_CALLS]{n}"),  # no [ARGS]
        # A nested open tag; what follows the two tags is content, so it must hold no third.
        (
            "[TOOL_CALLS]" + draw(mistral_call().filter(lambda b: b[1].count("[TOOL_") == 1))[1],
            "[TOOL_CALLS][TOOL_CALLS]",
        ),
        (f"[TOOL_CALLS]{'n' * 300}[ARGS]{{}}", "[TOOL_CALLS]" + "n" * 257),  # name too long
    ]
    block, raw = draw(st.sampled_from(cases))
    return ("bad", block, raw or block)


@st.composite
def cut_off(draw: st.DrawFn, fmt: str) -> tuple:
    """A block the output's end cuts short: all of it comes back as content with a warning,
    but for a Qwen3-Coder block cut after its `</function>`, or a Hermes block after its whole
    JSON: a call (qwen3_coder.py, hermes.py)."""
    _, block, calls = draw(FORMATS[fmt][0])
    if fmt == "mistral" and draw(FLAGS):
        # Broken JSON has no end in this format: the block runs to the end of the output.
        block = '[TOOL_CALLS]f[ARGS]{"a": "line\nbreak"}' + draw(text_from())
    else:
        whole = len(block) - len("\n</tool_call>")  # where a coder block's function ends
        whole_json = block.rfind("}")  # a Hermes block's JSON ends just after
        block = block[: draw(st.integers(len(OPEN_TAGS[fmt]), len(block) - 1))]
        if fmt == "qwen3_coder" and len(block) >= whole:
            return ("call", block, calls)
        if fmt == "hermes" and len(block) > whole_json:  # its body: one JSON object
            return ("call", block, calls)
    return ("bad", block, block)


FORMATS = {
    "hermes": (hermes_call(), hermes_bad()),
    "qwen3_coder": (coder_call(), coder_bad()),
    "mistral": (mistral_call(), mistral_bad()),
}


@st.composite
def think_block(draw: st.DrawFn, fmt: str) -> tuple[str, bool, str, bool]:
    """(text, starts_in_reasoning, the reasoning it means, whether content may follow)."""
    mode = draw(st.sampled_from(["none", "closed", "open", "starts_closed", "starts_open"]))
    if mode == "none":
        return "", False, "", True
    starts, closed = mode.startswith("starts"), mode.endswith("closed")
    tag = not starts or draw(FLAGS)  # with starts_in_reasoning, some models repeat `<think>`
    draft = draw(st.just("") | FORMATS[fmt][0].map(lambda b: b[1]))  # a call drafted in thought
    body = draw(text_from(("</think>",))) + draft + draw(text_from(("</think>",)))
    assume("</think>" not in body and (tag or not body.startswith("<think>")))
    lead = "" if starts else draw(st.sampled_from(["", "\n", "  "]))
    nl_open = draw(st.sampled_from(["", "\n"])) if tag else ""
    nl_close = draw(st.sampled_from(["", "\n"])) if closed else ""
    after = draw(st.sampled_from(["", "\n\n", " \n"])) if closed else ""
    text = lead + ("<think>" if tag else "") + nl_open + body + nl_close
    text += "</think>" + after if closed else ""
    reasoning = nl_open + body + nl_close
    reasoning = reasoning.removeprefix("\n") if tag else reasoning
    reasoning = reasoning.removesuffix("\n") if closed else reasoning
    return text, starts, reasoning, closed


@st.composite
def transcript(draw: st.DrawFn, fmt: str) -> list[tuple]:
    """Text, block, text, ..., block, text; sometimes one more block cut off by the end."""
    good, bad = FORMATS[fmt]
    gap = st.sampled_from(["", "\n", "\n\n", " "]) | text_from((OPEN_TAGS[fmt],))
    segments = [("text", draw(gap))]
    for block in draw(st.lists(st.one_of(good, bad), min_size=1, max_size=4)):
        segments += [block, ("text", draw(gap))]
    if draw(FLAGS):
        segments.append(draw(cut_off(fmt)))
    return segments


def meaning(events: list[Event]) -> list[tuple]:
    """Reasoning, content, ended calls and warnings, in order."""
    items: list[tuple] = []
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            items.append(("content" if isinstance(e, ContentDelta) else "reasoning", e.text))
        elif isinstance(e, ToolCallEnd):
            items.append(("call", e.name, e.arguments))
        elif isinstance(e, ParseWarning):
            items.append(("warning", e.raw_text))
    return items


def expected_meaning(reasoning: str, segments: list[tuple], after_think: bool) -> list[tuple]:
    """What the parser must make of a generated output (the rules in the module docstring)."""
    items: list[tuple] = [("reasoning", reasoning)]
    after_call = False
    for i, seg in enumerate(segments):
        if seg[0] == "text":
            text = seg[1].lstrip() if i == 0 and after_think else seg[1]
            if text and not (after_call and text.isspace()):
                items.append(("content", text))
                after_call = False
        elif seg[0] == "call":
            items += [("call", name, args) for name, args in seg[2]]
            after_call = True
        else:
            _, block, raw = seg
            items += [("content", raw), ("warning", raw), ("content", block[len(raw) :])]
            after_call = False
    return items


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
@GRAMMAR
@given(data=st.data())
def test_generated_outputs(fuzz, fmt: str, data: st.DataObject) -> None:
    think, starts, reasoning, content_follows = data.draw(think_block(fmt), label="think")
    segments = data.draw(transcript(fmt), label="segments") if content_follows else []
    content = "".join(seg[1] for seg in segments)
    assume(think or starts or not content.lstrip().startswith("<think>"))  # else a think block
    text = think + content
    tools = coder_tools(segments) if fmt == "qwen3_coder" else None
    events = fuzz.run_every(fmt, starts, tools, text, fuzz.drawn_chunkings(data, text, 2))

    want = fuzz.merge_summary(expected_meaning(reasoning, segments, after_think=bool(think)))
    assert fuzz.merge_summary(meaning(events)) == want
    calls = [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]
    assert calls == [(seg[1], seg[2]) for seg in want if seg[0] == "call"]
    # Text conservation, stated on its own: nothing but the structure listed above is lost.
    kept = "".join(item[1] for item in want if item[0] in ("reasoning", "content"))
    assert fuzz.shown(events, ReasoningDelta) + fuzz.shown(events, ContentDelta) == kept
