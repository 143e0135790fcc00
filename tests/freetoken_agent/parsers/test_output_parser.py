"""OutputParser (reasoning + one tool format), tool_format_for, and text held at tag starts."""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from freetoken_agent.parsers import (
    TOOL_FORMATS,
    ContentDelta,
    OutputParser,
    ParseWarning,
    ReasoningDelta,
    ToolCallEnd,
    coalesce,
    tool_format_for,
)
from freetoken_agent.parsers.json_scan import MAX_DEPTH, loads_strict

# One well-formed call per format, with the same meaning.
CALLS = {
    "hermes": lambda n, a: f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>",
    "qwen3_coder": lambda n, a: (
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
    ),
    "mistral": lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}",
}
OPEN_TAGS = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def plain_args(rng, kit) -> dict:
    """Arguments that read the same in every format: string values, no tags, no newlines."""
    return {
        kit.rand_name(rng): "".join(
            rng.choice("abc xyz{}\"'中😀") for _ in range(rng.randint(1, 12))
        )
        for _ in range(rng.randint(0, 3))
    }


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_reasoning_then_calls_in_every_chunking(rng, kit, fmt):
    for _ in range(15):
        starts = rng.random() < 0.5
        calls = [(kit.rand_name(rng), plain_args(rng, kit)) for _ in range(rng.randint(1, 3))]
        # The model "drafts" a call while thinking: it must stay reasoning.
        draft = CALLS[fmt](*calls[0])
        thought = kit.without(rng, lambda: kit.rand_text(rng, 0, 30), "</think>", "<think>")
        reasoning = f"{thought}{draft}"
        forbid = (OPEN_TAGS[fmt], "</think>", "<think>")
        intro = kit.without(rng, lambda: kit.rand_text(rng, 1, 30), *forbid).lstrip() or "ok"
        outro = kit.without(rng, lambda: kit.rand_text(rng, 1, 20), *forbid)
        body = "\n".join(CALLS[fmt](n, a) for n, a in calls)
        text = ("" if starts else "<think>\n") + f"{reasoning}\n</think>\n\n{intro}\n{body}{outro}"
        expected = [("reasoning", reasoning), ("content", intro + "\n")]
        expected += [("call", n, a) for n, a in calls]
        expected += [] if outro.isspace() else [("content", outro)]
        kit.check_all_chunkings(
            rng, lambda s=starts: OutputParser(fmt, starts_in_reasoning=s), text, expected
        )


def test_no_tool_format_leaves_calls_as_content():
    text = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parser = OutputParser(None)
    events = coalesce(parser.feed(text) + parser.finish())
    assert events == [ReasoningDelta("hm"), ContentDelta(text.split("\n\n", 1)[1])]


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_partial_tag_held_then_released(fmt):
    open_tag = OPEN_TAGS[fmt]
    parser = OutputParser(fmt)
    assert parser.feed("Hi <b>") == [ContentDelta("Hi <b>")]  # cannot become a tag: released
    assert parser.feed(" a" + open_tag[:3]) == [ContentDelta(" a")]  # could: held
    assert parser.feed("") == []
    assert parser.finish() == [ContentDelta(open_tag[:3])]  # the output ended: released


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_garbage_never_raises(rng, kit, fmt):
    """Random text dense in tag and JSON fragments: never an exception, nothing lost."""
    pieces = [OPEN_TAGS[fmt], "</tool_call>", "<function=f>", "[ARGS]", "{", '"name"', "</think>"]
    for _ in range(30):
        text = "x" + "".join(
            rng.choice(pieces) if rng.random() < 0.3 else kit.rand_text(rng, 0, 5)
            for _ in range(rng.randint(1, 30))
        )
        # What must come back when no call completes: all of it but the close tag, one
        # newline before it and the whitespace after it.
        before, tag, after = text.partition("</think>")
        if tag:
            before, after = before.removesuffix("\n"), after.lstrip()
        shown_if_no_call = before + after
        for chunks in kit.chunkings(rng, text)[:3]:
            events = kit.run(OutputParser(fmt, starts_in_reasoning=True), chunks)
            kit.normalize(events)
            if not any(isinstance(e, ToolCallEnd) for e in events):
                kinds = (ReasoningDelta, ContentDelta)
                shown = "".join(e.text for e in events if isinstance(e, kinds))
                assert shown == shown_if_no_call
            for e in events:
                if isinstance(e, ParseWarning):
                    assert e.raw_text and e.raw_text in text


def test_feed_after_finish_is_a_programming_error():
    parser = OutputParser("hermes")
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError):
        OutputParser("json_blob")


@pytest.mark.parametrize(
    ("model_type", "template", "fmt"),
    [
        ("qwen3_moe", "{{'<tool_call>\\n<function=' + name + '>'}}", "qwen3_coder"),
        ("qwen3_moe", '{{- \'<tool_call>\\n{"name": "\' }}', "hermes"),
        ("llama", "{{ '[TOOL_CALLS]' + tool_calls|tojson }}", "mistral"),
        ("mixtral", "{{ '<tool_call>' }}", "hermes"),  # the template wins over the type
        ("qwen3_moe", None, "hermes"),
        ("qwen2_moe", None, "hermes"),
        ("qwen3_next", None, "hermes"),
        ("qwen3_5_moe", None, "qwen3_coder"),
        ("mixtral", None, "mistral"),
        ("olmoe", None, "hermes"),
        ("mixtral", "{{ messages }} no tool syntax", "mistral"),  # falls back to the type
        ("gpt2", None, None),
        ("gpt2", "{{ messages }}", None),
    ],
)
def test_tool_format_for(model_type, template, fmt):
    assert tool_format_for(model_type, template) == fmt


# Values Python's json.loads takes but a tool call must not: not JSON, nested so deep that the
# decoder raises RecursionError (100000 is past any recursion limit), or a string holding a lone
# UTF-16 surrogate (no Unicode text: the tokenizer failed on the history holding it). A number
# past a float's range is JSON: test_a_number_past_a_floats_range_is_the_largest_float.
NOT_JSON = ["NaN", "-Infinity", "[" * 100_000 + "]" * 100_000, '"a\\ud83d"']
NOT_JSON_IDS = ["nan", "-inf", "deep", "lone-surrogate"]


@pytest.mark.parametrize("value", NOT_JSON, ids=NOT_JSON_IDS)
@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_arguments_that_are_not_plain_json_void_the_call(fmt, value):
    # Regression (fuzzing): NaN became a call whose arguments differ from their own deltas
    # (nan != nan) and cannot be sent on as JSON; deep nesting raised RecursionError.
    call = {
        "hermes": f'<tool_call>\n{{"name": "f", "arguments": {{"x": {value}}}}}\n</tool_call>',
        "mistral": f'[TOOL_CALLS]f[ARGS]{{"x": {value}}}',
    }[fmt]
    text = "ok " + call
    for chunks in [[text], [text[:20], text[20:]]]:
        parser = OutputParser(fmt)
        events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
        assert not any(isinstance(e, ToolCallEnd) for e in events)
        merged = coalesce(events)
        assert "".join(e.text for e in merged if isinstance(e, ContentDelta)) == text
        assert [e.raw_text for e in merged if isinstance(e, ParseWarning)] == [call]


@pytest.mark.parametrize("fmt", ["hermes", "mistral"])
def test_a_number_past_a_floats_range_is_the_largest_float(fmt, rng_seed, kit):
    """JSON sets no range: a grammar-constrained call's exponent is free, and a weak model
    writes 36E13696858390141301 (voiding the call failed a forced call). The call stands,
    the number read as the largest float of its sign; one within range is read as it is."""
    rng = random.Random(rng_seed)
    sign = rng.choice(["", "-"])
    big = f"{sign}{rng.randint(1, 9)}{rng.choice('eE')}{rng.randint(309, 10**12)}"
    small = f"{rng.randint(1, 9)}e{rng.randint(-300, 300)}"
    args = f'{{"x": {big}, "y": {small}, "z": [{big}]}}'
    call = {
        "hermes": f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>',
        "mistral": f"[TOOL_CALLS]f[ARGS]{args}",
    }[fmt]
    parser = OutputParser(fmt)
    cut = rng.randrange(1, len(call))
    events = parser.feed(call[:cut]) + parser.feed(call[cut:]) + parser.finish()
    (end,) = [e for e in events if isinstance(e, ToolCallEnd)]
    kit.normalize(events)  # the call protocol holds (its deltas read as loads_strict reads them)
    largest = math.copysign(sys.float_info.max, -1.0 if sign else 1.0)
    assert end.arguments == {"x": largest, "y": float(small), "z": [largest]}
    assert json.loads(json.dumps(end.arguments)) == end.arguments  # JSON still


@pytest.mark.parametrize("value", NOT_JSON, ids=NOT_JSON_IDS)
def test_schema_typed_values_that_are_not_plain_json_stay_text(value):
    tools = [{"name": "f", "parameters": {"properties": {"x": {"type": ["array", "number"]}}}}]
    text = f"<tool_call>\n<function=f>\n<parameter=x>\n[{value}]\n</parameter>\n</function>\n"
    parser = OutputParser("qwen3_coder", tools=tools)
    events = parser.feed(text + "</tool_call>") + parser.finish()
    assert events[-1].arguments == {"x": f"[{value}]"}


def test_loads_strict_caps_nesting():
    assert loads_strict("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(ValueError):
        loads_strict("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert loads_strict('{"a": "NaN", "b": 1e300}') == {"a": "NaN", "b": 1e300}


def test_loads_strict_refuses_lone_surrogates(rng):
    def escape(code: int) -> str:
        return f"\\u{code:04x}" if rng.random() < 0.5 else f"\\u{code:04X}"

    for _ in range(50):
        high, low = rng.randint(0xD800, 0xDBFF), rng.randint(0xDC00, 0xDFFF)
        text = "".join(rng.choice("ab 中😀") for _ in range(rng.randint(0, 6)))
        cut = rng.randint(0, len(text))
        # A pair decodes to one character; alone, or in the wrong order, each is refused.
        pair = json.loads(f'"{escape(high)}{escape(low)}"')
        good = f'{{"k": ["{text[:cut]}{escape(high)}{escape(low)}{text[cut:]}"]}}'
        assert loads_strict(good) == {"k": [text[:cut] + pair + text[cut:]]}
        lone = rng.choice([escape(high), escape(low), escape(low) + escape(high)])
        bad = f"{text[:cut]}{lone}{text[cut:]}"
        for doc in (f'{{"k": ["{bad}"]}}', f'{{"{bad}": 1}}', f'[{{"x": {{"{bad}": null}}}}]'):
            with pytest.raises(ValueError, match="lone surrogate"):
                loads_strict(doc)
