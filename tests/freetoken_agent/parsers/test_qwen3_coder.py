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
    seg = coder_call(rng, kit, None)
    cut = seg[1][: rng.randint(len("<tool_call>"), len(seg[1]) - 1)]
    for chunks in kit.chunkings(rng, cut):
        summary = kit.summary(kit.run(Qwen3CoderParser(), chunks))
        voided = "<function=" in cut and ">" in cut[cut.index("<function=") :]
        assert summary == [("content", cut), ("warning", cut, voided)]


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
