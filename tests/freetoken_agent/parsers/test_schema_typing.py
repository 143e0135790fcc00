"""Bare-text parameter values typed by their tool schema (parsers/schema.py), for the schema
shapes pydantic and the OpenAI Agents SDK send: values behind local $refs (nested models,
IntEnums, optional models), enums and consts without a `type`, mixed enums, and allOf. The
XML tool-call format writes a string bare and anything else as JSON (the template's tojson);
reading it back must give the value written, or a strict tool's call fails its own schema."""

from __future__ import annotations

import json
import random

import jsonschema

from freetoken_agent.parsers.schema import convert_value, parameter_schemas


def _written(value) -> str:
    """A value as the XML templates write it."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _pydantic_like(rng: random.Random) -> tuple[dict, dict]:
    """(a tool's parameters with $defs as pydantic writes them, random valid arguments)."""
    levels = sorted(rng.sample(range(-5, 50), rng.randint(2, 5)))
    defs = {
        "Level": {"type": "integer", "enum": levels, "title": "Level"},
        "Point": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
            "required": ["x", "y"],
            "title": "Point",
        },
    }
    params = {
        "type": "object",
        "$defs": defs,
        "properties": {
            "level": {"$ref": "#/$defs/Level"},
            "point": {"$ref": "#/$defs/Point", "description": "where"},
            "maybe": {"anyOf": [{"$ref": "#/$defs/Point"}, {"type": "null"}], "default": None},
            "tag": {"type": "string"},
        },
        "required": ["level", "point", "maybe", "tag"],
    }
    args = {
        "level": rng.choice(levels),
        "point": {"x": rng.uniform(-9, 9), "y": rng.randint(-9, 9)},
        "maybe": rng.choice([None, {"x": rng.randint(0, 9) + 0.5, "y": 1}]),
        "tag": rng.choice(["2", "null", "true", "{}", "plain words"]),  # a string stays one
    }
    return params, args


def test_values_behind_refs_read_back_as_written(rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(20):
        params, args = _pydantic_like(rng)
        jsonschema.validate(args, params)
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        schemas = parameter_schemas(tools)["f"]
        got = {k: convert_value(_written(v), schemas[k]) for k, v in args.items()}
        assert _same(got, args), (got, args)
        jsonschema.validate(got, params)


def test_listed_values_read_back_as_the_member_written(rng_seed):
    """enum / const without a type, mixed enums (a string "2" and a number 2 both listed),
    and allOf parts that give the type."""
    rng = random.Random(rng_seed)
    pool = [1, 2, 2.5, -3, True, False, None, "x", "2", "true", "null", [1, 2], {"a": 1}]
    for _ in range(50):
        members = rng.sample(pool, rng.randint(1, 6))
        schema = {"const": members[0]} if len(members) == 1 else {"enum": members}
        member = rng.choice(members)
        got = convert_value(_written(member), schema)
        # A string member written bare equal to another member's JSON ("2" beside 2) reads as
        # the string: the text is the string exactly as written.
        want = _written(member) if _written(member) in members else member
        assert _same(got, want) and type(got) is type(want), (members, member, got)
    value = rng.randint(0, 99)
    assert convert_value(str(value), {"allOf": [{"type": "integer"}, {"minimum": 0}]}) == value


def test_text_outside_the_listed_values_stays_text(rng_seed):
    rng = random.Random(rng_seed)
    members = rng.sample([1, 2, 3, True, None], 3)
    for text in ("banana", "4", "1.5x"):
        got = convert_value(text, {"enum": members})
        assert got == text or (text == "4" and got == 4), got
