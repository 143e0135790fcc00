"""Qwen3-Coder XML calls: typed by the schema, in every chunking."""

from __future__ import annotations

import json

from freetoken_agent.parsers import ParseWarning, Qwen3CoderParser, ToolCallArgsDelta, ToolCallEnd

FORBID = ("<tool_call>",)
# Terminators of a parameter value: random values must not contain them.
VALUE_FORBID = ("</parameter>", "\n<parameter=", "\n</function>", "\n</tool_call>")
TYPES = ["string", "integer", "number", "boolean", "object", "array"]


def typed_param(rng, kit, kind: str) -> tuple[str, object]:
    """(text the model writes, value the parser must return) for a parameter of `kind`."""
    if kind == "integer":
        v = rng.randint(-(10**9), 10**9)
        return rng.choice([str(v), f" {v} "]), v
    if kind == "number":
        v = round(rng.uniform(-1e4, 1e4), rng.randint(0, 4))
        return str(v), v
    if kind == "boolean":
        v = rng.random() < 0.5
        # Jinja's `string` filter writes Python's True/False; JSON writes true/false.
        return rng.choice([str(v), str(v).lower()]), v
    if kind == "object":
        v = kit.rand_args(rng)
        return json.dumps(v, ensure_ascii=rng.random() < 0.5), v
    if kind == "array":
        v = [kit.rand_value(rng) for _ in range(rng.randint(0, 4))]
        return json.dumps(v), v
    while True:  # the template writes "\n" + value + "\n"; no terminator may appear in it
        v = kit.rand_text(rng, 0, 30)
        if not any(t in f"\n{v}\n" for t in VALUE_FORBID):
            return v, v


def coder_call(rng, kit, schemas: dict | None) -> tuple:
    """A block as the Qwen3-Coder template writes it; `schemas` collects the tool schema."""
    name = kit.rand_name(rng)
    props, args, params = {}, {}, []
    for _ in range(rng.randint(0, 4)):
        pname = kit.rand_name(rng)
        kind = rng.choice(TYPES) if schemas is not None else "string"
        text, value = typed_param(rng, kit, kind)
        if schemas is not None and rng.random() < 0.15:
            # Declared as a number but written as words: stays the string the model wrote.
            kind, text = "integer", kit.without(rng, lambda: "n" + kit.rand_text(rng, 0, 8))
            text = text.replace("\n", " ")
            value = text
        props[pname] = {"type": kind}
        args[pname] = value
        params.append(f"<parameter={pname}>\n{text}\n</parameter>\n")
    if schemas is not None:
        schemas[name] = props
    block = f"<tool_call>\n<function={name}>\n{''.join(params)}</function>\n</tool_call>"
    return ("call", block, [("call", name, args)])


def as_tools(schemas: dict) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {"name": n, "parameters": {"type": "object", "properties": p}},
        }
        for n, p in schemas.items()
    ]


def coder_bad(rng, kit) -> tuple:
    name = kit.rand_name(rng)
    bodies = [
        ("hello, no function here", False),
        ("", False),
        (f"<function={name}>\nstray words\n</function>", True),
        (f"<function={name}\nbroken name>\n</function>", False),
        (f"<function={name}>\n</function>\n<function=two>\n</function>", True),
        (f"<function={name}>\n</function>\ntrailing words", True),
    ]
    body, voided = rng.choice(bodies)
    block = f"<tool_call>\n{body}\n</tool_call>"
    return ("bad", block, block, voided)


def test_random_transcripts_typed_by_schema(rng, kit):
    for _ in range(30):
        schemas: dict | None = {} if rng.random() < 0.7 else None
        blocks = [
            coder_call(rng, kit, schemas) if rng.random() < 0.75 else coder_bad(rng, kit)
            for _ in range(rng.randint(0, 4))
        ]
        segments = kit.transcript(rng, blocks, FORBID)
        text = "".join(s[1] for s in segments)
        tools = as_tools(schemas) if schemas is not None else None
        kit.check_all_chunkings(
            rng, lambda t=tools: Qwen3CoderParser(t), text, kit.expected_from(segments)
        )


def test_values_stay_strings_without_a_schema(rng, kit):
    schemas: dict = {}
    seg = coder_call(rng, kit, schemas)
    while not seg[2][0][2]:
        seg = coder_call(rng, kit, schemas)
    end = [e for e in kit.run(Qwen3CoderParser(), [seg[1]]) if isinstance(e, ToolCallEnd)][0]
    assert end.arguments.keys() == seg[2][0][2].keys()
    assert all(isinstance(v, str) for v in end.arguments.values())


def test_each_parameter_streams_when_it_completes(rng, kit):
    schemas: dict = {}
    seg = coder_call(rng, kit, schemas)
    while len(seg[2][0][2]) < 2:
        seg = coder_call(rng, kit, schemas)
    parser, deltas = Qwen3CoderParser(as_tools(schemas)), []
    block = seg[1]
    for i, ch in enumerate(block):
        for e in parser.feed(ch):
            if isinstance(e, ToolCallArgsDelta):
                deltas.append((i, e.text))
    ends = [i for i in range(len(block)) if block.startswith("</parameter>", i)]
    # One delta per parameter, each as soon as its close tag is complete, then the brace.
    assert [i for i, _ in deltas[:-1]] == [i + len("</parameter>") - 1 for i in ends]
    assert json.loads("".join(t for _, t in deltas)) == seg[2][0][2]


def test_missing_parameter_close_tag_is_tolerated():
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\nx\n</function>\n"
    text += "</tool_call>"
    events = Qwen3CoderParser().feed(text)
    assert events[-1].arguments == {"a": "1", "b": "x"}
    assert not any(isinstance(e, ParseWarning) for e in events)


def test_unterminated_call_becomes_content_with_a_warning(rng, kit):
    """Cut before its `</function>`: content and a warning. Cut after it (its closer missing,
    as vLLM and SGLang read it): the call."""
    seg = coder_call(rng, kit, None)
    cut = seg[1][: rng.randint(len("<tool_call>"), len(seg[1]) - 1)]
    for chunks in kit.chunkings(rng, cut):
        summary = kit.summary(kit.run(Qwen3CoderParser(), chunks))
        if "</function>" in cut:
            assert summary == seg[2], summary
            continue
        voided = "<function=" in cut and ">" in cut[cut.index("<function=") :]
        assert summary == [("content", cut), ("warning", cut, voided)]


def test_a_block_the_output_ends_before_its_closer_is_a_call(rng, kit):
    seg = coder_call(rng, kit, None)
    text = seg[1].removesuffix("</tool_call>") + "</tool_call>"[: rng.randrange(0, 11)]
    for chunks in kit.chunkings(rng, text):
        assert kit.summary(kit.run(Qwen3CoderParser(), chunks)) == seg[2], chunks


def _bare(rng, kit) -> tuple[str, list, list[tuple]]:
    """A call as Qwen3-Coder sometimes writes it, without `<tool_call>`: (its text, the tools
    offered, what it means)."""
    schemas: dict = {}
    seg = coder_call(rng, kit, schemas)
    body = seg[1].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    return body, as_tools(schemas), seg[2]


def test_a_call_without_its_opener_is_a_call_of_an_offered_tool(rng, kit):
    """`<function=NAME>` at a line start naming an offered tool opens a call; an orphan
    `</tool_call>` after it is its closer; text around it stays content."""
    body, tools, meaning = _bare(rng, kit)
    before = rng.choice(["", "I'll call it.\n", "x\n\n"])
    closer = rng.choice(["", "\n</tool_call>"])
    after = rng.choice(["", "\nDone: " + kit.rand_text(rng, 1, 20).replace("<", "(")])
    text = before + body + closer + after
    expected = ([("content", before)] if before else []) + meaning
    if after and not after.isspace():
        expected.append(("content", after))
    for chunks in kit.chunkings(rng, text):
        assert kit.summary(kit.run(Qwen3CoderParser(tools), chunks)) == expected, chunks


def test_a_function_tag_that_opens_no_call_stays_text(rng, kit):
    """Not a tool offered, no tools at all, or not at a line start: text, no warning."""
    body, tools, _ = _bare(rng, kit)
    other = [{"type": "function", "function": {"name": "zz_" + kit.rand_name(rng)}}]
    cases = [(body, other), (body, None), ("see " + body, tools)]
    for text, offered in cases:
        for chunks in kit.chunkings(rng, text):
            assert kit.summary(kit.run(Qwen3CoderParser(offered), chunks)) == [("content", text)], (
                text,
                offered,
            )


def test_names_are_judged_on_their_raw_text_in_every_chunking(kit):
    # Regression (fuzzing): a complete name was stripped before its checks, a partial one was
    # not, so `<function=f\n>` was a call in one chunk and broken in several.
    for head in ["<function=f\n>", "<function=\nf>", "<function= " + "n" * 256 + ">"]:
        text = f"<tool_call>\n{head}\n</function>\n</tool_call>"
        for chunks in ([text], list(text)):
            assert kit.summary(kit.run(Qwen3CoderParser(), chunks)) == [
                ("content", text),
                ("warning", text, False),
            ]
    text = (
        "<tool_call>\n<function= f >\n<parameter= a >\n1\n</parameter>\n</function>\n</tool_call>"
    )
    for chunks in ([text], list(text)):  # spaces around a name are still allowed
        assert kit.summary(kit.run(Qwen3CoderParser(), chunks)) == [("call", "f", {"a": "1"})]


def test_a_function_tag_in_prose_at_a_line_start_is_text_and_a_later_call_stays_one(rng, kit):
    """`<function=TOOL>` naming an offered tool, then prose: that line is text (a warning),
    and a real block after it is still a call, in every chunking (the implicit block waited
    for a closer that never came and swallowed the real call)."""
    body, tools, meaning = _bare(rng, kit)
    name = meaning[0][1]
    prose = f"The syntax is:\n<function={name}> takes {kit.rand_name(rng)}.\n"
    text = prose + "<tool_call>\n" + body + "\n</tool_call>"
    for chunks in kit.chunkings(rng, text):
        summary = kit.summary(kit.run(Qwen3CoderParser(tools), chunks))
        assert summary[-len(meaning) :] == meaning, summary
        content = "".join(x[1] for x in summary if x[0] == "content")
        assert content == prose, summary
