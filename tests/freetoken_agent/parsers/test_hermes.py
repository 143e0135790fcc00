"""Hermes / Qwen `<tool_call>{json}</tool_call>`: random transcripts in every chunking."""

from __future__ import annotations

import json

from freetoken_agent.parsers import (
    ContentDelta,
    HermesParser,
    ParseWarning,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallStart,
)

FORBID = ("<tool_call>",)


def hermes_call(rng, kit) -> tuple[tuple, str | None, str]:
    """A well-formed block in one of the shapes models write, the arguments text the parser
    must emit (None: not pinned down), and the shape."""
    name, args = kit.rand_name(rng), kit.rand_args(rng)
    ascii_only = rng.random() < 0.3

    def dumps(value) -> str:
        return json.dumps(value, ensure_ascii=ascii_only)

    shape = rng.choice(["plain", "plain", "args_first", "parameters", "string", "none", "indent"])
    args_text = dumps(args)
    if shape == "plain":
        body = f'{{"name": {dumps(name)}, "arguments": {args_text}}}'
    elif shape == "args_first":
        body = f'{{"arguments": {args_text}, "name": {dumps(name)}}}'
    elif shape == "parameters":
        body = f'{{"name": {dumps(name)}, "parameters": {args_text}}}'
    elif shape == "string":  # arguments as a JSON string holding the object
        body = f'{{"name": {dumps(name)}, "arguments": {dumps(args_text)}}}'
        args_text = json.dumps(args, ensure_ascii=False)  # decoded, then written once
    elif shape == "none":  # a tool without parameters
        args, args_text = {}, "{}"
        body = f'{{"name": {dumps(name)}}}'
    else:
        body = json.dumps({"name": name, "arguments": args}, indent=2, ensure_ascii=ascii_only)
        args_text = None  # re-indented inside the body; only the meaning is checked
    block = "<tool_call>\n" + body + "\n</tool_call>"
    return ("call", block, [("call", name, args)]), args_text, shape


def hermes_bad(rng, kit) -> tuple:
    """A malformed block: (bad, block, raw, voided); voided when the name was complete."""
    name = json.dumps(kit.rand_name(rng))
    args = json.dumps(kit.rand_args(rng))
    bodies = [
        (f'{{"name": {name}, "arguments": {args}', True),  # missing brace
        (f'{{"name": {name}, "arguments": {args},}}', True),  # trailing comma
        (f'{{"arguments": {args}}}', False),  # no name
        (f'{{"name": 5, "arguments": {args}}}', False),
        (f'{{"name": {name}, "arguments": [1, 2]}}', True),  # not an object
        (f'{{"name": {name}, "arguments": 7}}', True),
        (f'{{"name": {name}, "arguments": "not json"}}', True),
        (f'{{"name": {name}, "arguments": {{"a": "x\ny"}}}}', True),  # raw newline in a string
        (f'[{{"name": {name}, "arguments": {args}}}]', False),  # a list, not an object
        ("just words, no json", False),
        ("", False),
    ]
    body, voided = rng.choice(bodies)
    block = "<tool_call>\n" + body + "\n</tool_call>"
    return ("bad", block, block, voided)


def test_random_transcripts_in_every_chunking(rng, kit):
    for _ in range(40):
        blocks = []
        for _ in range(rng.randint(0, 4)):
            blocks.append(hermes_call(rng, kit)[0] if rng.random() < 0.75 else hermes_bad(rng, kit))
        segments = kit.transcript(rng, blocks, FORBID)
        text = "".join(s[1] for s in segments)
        kit.check_all_chunkings(rng, HermesParser, text, kit.expected_from(segments))


def test_args_stream_verbatim_before_the_call_closes(rng, kit):
    for _ in range(30):
        seg, args_text, shape = hermes_call(rng, kit)
        if args_text is None:
            continue
        block = seg[1]
        parser, first_delta_at, deltas = HermesParser(), None, []
        for fed, ch in enumerate(block, start=1):
            for e in parser.feed(ch):
                if isinstance(e, ToolCallArgsDelta):
                    deltas.append(e.text)
                    first_delta_at = first_delta_at or fed
        assert parser.finish() == []
        assert "".join(deltas) == args_text  # verbatim when the model wrote an object
        if shape in ("plain", "parameters"):
            # Name first: the first piece came with the arguments' first character, and the
            # rest followed piece by piece.
            assert first_delta_at == block.index(args_text) + 1, block
            assert len(deltas) == len(args_text)
        else:
            assert len(deltas) == 1


def test_start_comes_as_soon_as_the_name_is_complete():
    parser = HermesParser()
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert events[0].name == "get_weather" and events[1].text == '{"ci'
    events = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert isinstance(events[-1], ToolCallEnd) and events[-1].arguments == {"city": "Paris"}


def test_calls_get_distinct_ids_and_increasing_indexes(rng, kit):
    n = rng.randint(2, 6)
    calls = [hermes_call(rng, kit)[0] for _ in range(n)]
    text = "Let me look.\n" + "\n".join(c[1] for c in calls)
    events = kit.run(HermesParser(), [text])
    kit.normalize(events)  # checks the protocol: unique ids, indexes 0..n-1
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert [e.index for e in ends] == list(range(n))
    assert len({e.id for e in ends}) == n
    assert [(e.name, e.arguments) for e in ends] == [c[2][0][1:] for c in calls]


def test_close_tag_inside_a_json_string_is_data():
    args = {"code": "print('</tool_call>')", "s": "<tool_call>"}
    text = '<tool_call>\n{"name": "run", "arguments": ' + json.dumps(args) + "}\n</tool_call>"
    events = HermesParser().feed(text)
    assert events[-1] == ToolCallEnd(0, events[0].id, "run", args)


def test_unterminated_call_becomes_content_with_a_warning(rng, kit):
    """Cut inside its JSON: content and a warning (a cut after the whole JSON is a call:
    the test below)."""
    seg = hermes_call(rng, kit)[0]
    cut = seg[1][: rng.randint(len("<tool_call>"), seg[1].rfind("}"))]
    for chunks in kit.chunkings(rng, "before " + cut):
        events = kit.run(HermesParser(), chunks)
        kit.normalize(events)
        merged = kit.merge(events)
        content = "".join(e.text for e in merged if isinstance(e, ContentDelta))
        assert content == "before " + cut
        warnings = [e for e in merged if isinstance(e, ParseWarning)]
        assert len(warnings) == 1 and warnings[0].raw_text == cut
        assert not any(isinstance(e, ToolCallEnd) for e in merged)


def test_a_whole_call_the_output_ends_before_its_closer_is_a_call(rng, kit):
    """The output ended (or a stop string took `</tool_call>` off) after the whole JSON: a
    call, as vLLM's and SGLang's parsers read it; words after the JSON keep it content."""
    seg = hermes_call(rng, kit)[0]
    end = seg[1].rfind("}") + 1
    cut = seg[1][: rng.randint(end, len(seg[1]) - 1)]  # whitespace or part of the closer after
    for chunks in kit.chunkings(rng, "before " + cut):
        assert kit.summary(kit.run(HermesParser(), chunks)) == [("content", "before "), *seg[2]]
    worded = seg[1][:end] + " and then"
    for chunks in kit.chunkings(rng, worded):
        summary = kit.summary(kit.run(HermesParser(), chunks))
        assert summary[0] == ("content", worded) and summary[1][0] == "warning", summary


def test_unclosed_string_does_not_swallow_the_rest():
    # A raw newline cannot be inside a JSON string, so the close tag after it closes the block.
    bad = '<tool_call>\n{"name": "f", "arguments": {"a": "oops\n</tool_call>'
    good = '<tool_call>\n{"name": "g", "arguments": {"b": 1}}\n</tool_call>'
    events = HermesParser().feed(bad + "\nnext " + good)
    assert [type(e).__name__ for e in events] == [
        "ToolCallStart",  # index 0: the name was complete before the JSON broke
        "ToolCallArgsDelta",
        "ContentDelta",
        "ParseWarning",
        "ContentDelta",
        "ToolCallStart",
        "ToolCallArgsDelta",
        "ToolCallEnd",
    ]
    assert events[2].text == bad and events[3].index == 0
    assert events[4].text == "\nnext "
    assert events[-1].index == 1 and events[-1].arguments == {"b": 1}


def every_chunking(text: str) -> list[list[str]]:
    """One chunk, one character at a time, and two characters at a time."""
    return [[text], list(text), [text[i : i + 2] for i in range(0, len(text), 2)]]


def test_backslash_does_not_hide_a_newline_before_the_close_tag(kit):
    # Regression (fuzzing): `\` + newline was read as an escape, so the close tag after it
    # stayed inside the string and the block swallowed the rest of the output.
    bad = '<tool_call>\n{"name": "f", "arguments": {"path": "C:\\\n</tool_call>'
    good = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'  # no newline to break on
    for chunks in every_chunking(bad + " then " + good):
        summary = kit.summary(kit.run(HermesParser(), chunks))
        assert summary == [
            ("content", bad),
            ("warning", bad, True),
            ("content", " then "),
            ("call", "g", {}),
        ]


def test_repeated_keys_give_the_same_events_in_every_chunking(kit):
    # Regression (fuzzing): the scanner kept the last span of a repeated key, so a call with
    # "arguments" (or "name") written twice streamed, and ended, differently by chunking.
    # The first value is streamed; an arguments key written twice voids the call.
    bodies = [
        '{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}',
        '{"name": "f", "arguments": {"a": 1}, "arguments": 5}',
        '{"name": "f", "arguments": "{}", "arguments": {"b": 2}}',
        '{"name": "f", "name": "g", "arguments": {}}',
    ]
    for body in bodies:
        text = f"<tool_call>\n{body}\n</tool_call>"
        results = [kit.normalize(kit.run(HermesParser(), c)) for c in every_chunking(text)]
        assert results[1:] == results[:-1], body
        assert kit.summary(results[0]) == [("content", text), ("warning", text, True)], body
