"""coalesce, call ids, tag suffixes and schema typing."""

from __future__ import annotations

import json

import pytest

from freetoken_agent.parsers import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    coalesce,
    convert_value,
    new_call_id,
    parameter_schemas,
)
from freetoken_agent.parsers.tags import partial_tag_len


def test_coalesce_matches_an_independent_merge(rng, kit):
    kinds = [ReasoningDelta, ContentDelta, ContentDelta, "args0", "args1", "start"]
    events = []
    for _ in range(200):
        kind = rng.choice(kinds)
        text = kit.rand_text(rng, 1, 4)
        if kind == "start":
            events.append(ToolCallStart(rng.randint(0, 3), new_call_id(), "f"))
        elif isinstance(kind, str):
            events.append(ToolCallArgsDelta(int(kind[-1]), text))
        else:
            events.append(kind(text))
    assert coalesce(events) == kit.merge(events)
    assert "".join(e.text for e in coalesce(events) if isinstance(e, ContentDelta)) == "".join(
        e.text for e in events if isinstance(e, ContentDelta)
    )


def test_call_ids_are_fresh():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_partial_tag_len(rng, kit):
    tag = "<tool_call>"
    for _ in range(200):
        text = kit.rand_text(rng, 0, 10) + tag[: rng.randint(0, len(tag) - 1)]
        k = partial_tag_len(text, tag)
        want = max(j for j in range(len(tag)) if text.endswith(tag[:j]))
        assert k == want, text


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        (" 42\n", {"type": "integer"}, 42),
        ("4.0", {"type": "integer"}, 4),
        ("4.5", {"type": "integer"}, "4.5"),  # not an integer: the model's text stays
        ("forty", {"type": "integer"}, "forty"),
        ("-1.5e3", {"type": "number"}, -1500.0),
        ("NaN", {"type": "number"}, "NaN"),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("null", {"type": ["integer", "null"]}, None),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 7),
        ("007", {"type": "string"}, "007"),
        ("007", {}, "007"),
        ("007", None, "007"),
    ],
)
def test_convert_value(text, schema, value):
    got = convert_value(text, schema)
    assert got == value and type(got) is type(value)


def test_parameter_schemas_reads_both_tool_shapes():
    props = {"n": {"type": "integer"}}
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"properties": props}}},
        {"name": "b", "parameters": {"type": "object", "properties": props}},
        {"type": "function", "function": {"name": "c"}},
        "not a tool",
    ]
    assert parameter_schemas(tools) == {"a": props, "b": props, "c": {}}
    assert json.dumps(parameter_schemas(None)) == "{}"
