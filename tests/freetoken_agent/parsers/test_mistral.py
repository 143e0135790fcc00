"""Mistral `[TOOL_CALLS]`, list form and name form, in every chunking."""

from __future__ import annotations

import json

from freetoken_agent.parsers import MistralParser, ToolCallArgsDelta, ToolCallStart

FORBID = ("[TOOL_CALLS]",)


def list_block(rng, kit) -> tuple:
    """`[TOOL_CALLS] [{...}, ...]`: several calls at once."""
    calls = [(kit.rand_name(rng), kit.rand_args(rng)) for _ in range(rng.randint(1, 3))]
    items = []
    for name, args in calls:
        item = {"name": name, "arguments": args}
        if rng.random() < 0.3:
            item["id"] = "".join(rng.choice("abcdef0123456789") for _ in range(9))
        items.append(item)
    sep = rng.choice(["", " "])
    block = "[TOOL_CALLS]" + sep + json.dumps(items, ensure_ascii=rng.random() < 0.5)
    return ("call", block, [("call", n, a) for n, a in calls])


def named_block(rng, kit) -> tuple:
    """`[TOOL_CALLS]name[ARGS]{...}`, sometimes with a `[CALL_ID]`."""
    name, args = kit.rand_name(rng), kit.rand_args(rng)
    call_id = "[CALL_ID]" + "".join(rng.choice("abcXYZ0189") for _ in range(9))
    middle = call_id if rng.random() < 0.3 else ""
    block = f"[TOOL_CALLS]{name}{middle}[ARGS]{json.dumps(args, ensure_ascii=False)}"
    return ("call", block, [("call", name, args)])


def bad_block(rng, kit) -> tuple:
    """(bad, block, raw, voided): raw is the prefix that becomes content with the warning."""
    name = kit.rand_name(rng)
    args = json.dumps(kit.rand_args(rng))
    cases = [
        (f'[TOOL_CALLS] [{{"name": "{name}", "arguments": {{"a": tru}}}}]', None, False),
        (f'[TOOL_CALLS][{{"arguments": {args}}}]', None, False),  # no name
        ("[TOOL_CALLS][]", None, False),
        (f'[TOOL_CALLS][{{"name": "{name}", "arguments": [1]}}]', None, False),
        (f'[TOOL_CALLS]{name}[ARGS]{{"a": tru}}', None, True),
        (f"[TOOL_CALLS]{name}[ARGS][1, 2]", f"[TOOL_CALLS]{name}[ARGS]", True),
        (f"[TOOL_CALLS] {name} is what I would call", f"[TOOL_CALLS] {name}", False),
    ]
    block, raw, voided = rng.choice(cases)
    return ("bad", block, raw or block, voided)


def test_random_transcripts_in_every_chunking(rng, kit):
    for _ in range(40):
        makers = [list_block, named_block, named_block, bad_block]
        blocks = [rng.choice(makers)(rng, kit) for _ in range(rng.randint(0, 4))]
        segments = kit.transcript(rng, blocks, FORBID)
        text = "".join(s[1] for s in segments)
        kit.check_all_chunkings(rng, MistralParser, text, kit.expected_from(segments))


def test_named_form_streams_arguments_verbatim(rng, kit):
    name, args = kit.rand_name(rng), kit.rand_args(rng)
    args_text = json.dumps(args, ensure_ascii=False)
    block = f"[TOOL_CALLS]{name}[ARGS]{args_text}"
    parser, deltas, start_at = MistralParser(), [], None
    for i, ch in enumerate(block):
        for e in parser.feed(ch):
            if isinstance(e, ToolCallStart):
                start_at = i
            elif isinstance(e, ToolCallArgsDelta):
                deltas.append(e.text)
    assert start_at == block.index("[ARGS]") + len("[ARGS]") - 1
    assert deltas == list(args_text)


def test_broken_json_waits_for_the_end_then_becomes_content():
    text = '[TOOL_CALLS]f[ARGS]{"a": "line\nbreak"} and more'
    parser = MistralParser()
    events = parser.feed(text)
    assert [type(e).__name__ for e in events] == ["ToolCallStart", "ToolCallArgsDelta"]
    tail = parser.finish()
    assert [(type(e).__name__, e.index) for e in tail[1:]] == [("ParseWarning", 0)]
    assert tail[0].text == text


def test_too_long_name_is_cut_at_the_same_place_in_every_chunking(kit):
    # Regression (fuzzing): the raw text of the warning ended wherever the chunk did.
    text = "[TOOL_CALLS]" + "n" * 300 + "[ARGS]{}"
    raw = "[TOOL_CALLS]" + "n" * 257
    for chunks in ([text], list(text), [text[:100], text[100:280], text[280:]]):
        assert kit.summary(kit.run(MistralParser(), chunks)) == [
            ("content", raw),
            ("warning", raw, False),
            ("content", text[len(raw) :]),
        ]
