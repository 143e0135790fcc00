"""The schemas constrained turns are held to (integrations/constrained_output.py): objects
closed where that keeps what the schema allows (`closed`), and each part's $defs hoisted to
the root of a combined schema (`output_schema`), where recursive refs still hold."""

from __future__ import annotations

import random

import jsonschema
import pytest

from freetoken_agent.integrations.constrained_output import closed, hoisted, output_schema

NODE = {
    "type": "object",
    "properties": {"v": {"type": "integer"},
                   "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
    "required": ["v", "kids"],
}  # fmt: skip


def _valid(schema: dict, value) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


def test_closing_keeps_what_combined_objects_allow(rng_seed):
    """An object's parts (allOf branches, anyOf branches constraining its own properties, an
    object beside a combination) stay open: closed separately they would forbid each other's
    keys, and the schema admit nothing. Whole alternatives and plain objects are closed."""
    rng = random.Random(rng_seed)
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    tagged = {"type": "object", "required": ["kind"],
              "properties": {"kind": {"enum": ["a", "b"]}, "x": {"type": "integer"},
                             "y": {"type": "integer"}},
              "anyOf": [{"properties": {"kind": {"const": "a"}}, "required": ["x"]},
                        {"properties": {"kind": {"const": "b"}}, "required": ["y"]}]}  # fmt: skip
    merged = {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}  # fmt: skip
    for schema, value in [(tagged, {"kind": "a", "x": a}), (tagged, {"kind": "b", "y": b}),
                          (merged, {"a": a, "b": b})]:  # fmt: skip
        assert _valid(schema, value) and _valid(closed(schema), value), (schema, value)
    either = {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                        {"type": "object", "properties": {"b": {"type": "integer"}}}]}  # fmt: skip
    assert not _valid(closed(either), {"a": a, "z": b})  # whole alternatives: closed
    assert _valid(either, {"a": a, "z": b})
    plain = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert closed(plain)["additionalProperties"] is False


def _tree(rng: random.Random, depth: int) -> dict:
    kids = [_tree(rng, depth - 1) for _ in range(rng.randint(1, 2))] if depth else []
    return {"v": rng.randint(-9, 9), "kids": kids}


@pytest.mark.parametrize("mode", ["required", "json_or_call"])
def test_recursive_refs_hold_in_a_combined_schema(rng_seed, mode):
    """A tool's (or the answer's) recursive $defs move to the root under their part's name:
    a tree's children are still nodes at every depth (inlining cut the cycle to {})."""
    rng = random.Random(rng_seed)
    params = {"type": "object", "properties": {"root": {"$ref": "#/$defs/Node"}},
              "required": ["root"], "$defs": {"Node": NODE}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": n, "parameters": params}}
             for n in ("grow", "prune")[: rng.randint(1, 2)]]  # fmt: skip
    answer = {"type": "object", "properties": {"tree": {"$ref": "#/$defs/Node"}},
              "required": ["tree"], "$defs": {"Node": NODE}}  # fmt: skip
    schema = output_schema(mode, tools, answer if mode == "json_or_call" else None)
    tree = _tree(rng, rng.randint(1, 3))
    call = {"name": tools[-1]["function"]["name"], "arguments": {"root": tree}}
    assert _valid(schema, call)
    if mode == "json_or_call":
        assert _valid(schema, {"tree": tree})
    node = tree
    while node["kids"]:
        node = rng.choice(node["kids"])
    node["kids"] = [rng.choice(["x", 3, None, {"v": 1}])]  # a leaf that is no node
    assert not _valid(schema, call)


def test_hoisting_renames_refs_or_declines():
    body, defs = hoisted({"$ref": "#/$defs/Node", "$defs": {"Node": NODE}}, "p.")
    assert body == {"$ref": "#/$defs/p.Node"} and set(defs) == {"p.Node"}
    assert defs["p.Node"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/p.Node"}
    for elsewhere in ("https://x/y", "#/$defs/Missing", "other.json#/a"):
        assert hoisted({"properties": {"a": {"$ref": elsewhere}}, "$defs": {}}, "p.") is None


# zod-to-json-schema's recursion (z.lazy): through the root itself, common in MCP tools
CHAIN = {
    "type": "object",
    "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                   "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"],
    "additionalProperties": False,
}  # fmt: skip


def _chain(rng: random.Random, depth: int) -> dict:
    return {"v": rng.randint(0, 9), "next": _chain(rng, depth - 1) if depth else None}


@pytest.mark.parametrize("mode", ["required", "json_or_call"])
def test_a_ref_through_the_root_holds_in_a_combined_schema(rng_seed, mode):
    """ "$ref": "#" points to the tool's schema, at every depth (inlining cut it to {}, and a
    forced call wrote `"next": true`); a pointer into the schema ("#/properties/v") too."""
    rng = random.Random(rng_seed)
    params = {**CHAIN, "properties": {**CHAIN["properties"], "w": {"$ref": "#/properties/v"}}}
    tools = [{"type": "function", "function": {"name": "link", "parameters": params}}]
    answer = {**CHAIN, "$id": "https://example.com/chain"} if mode == "json_or_call" else None
    schema = output_schema(mode, tools, answer)
    chain = _chain(rng, rng.randint(1, 4))
    assert _valid(schema, {"name": "link", "arguments": chain})
    if answer:
        assert _valid(schema, _chain(rng, rng.randint(1, 4)))
    node = chain
    while node["next"] is not None:
        node = node["next"]
    node["next"] = rng.choice([True, 3, "x", {"v": 1}])  # no link and not null
    assert not _valid(schema, {"name": "link", "arguments": chain})
    bad_w = {**_chain(rng, 1), "w": 10}  # w is held as v is: 0..9
    assert not _valid(schema, {"name": "link", "arguments": bad_w})
    if mode == "required":  # the arguments keep their properties in place (MCP pins read them)
        assert set(schema["properties"]["arguments"]["properties"]) == {"v", "next", "w"}


@pytest.mark.parametrize("name", ["My Def", "a/b", "t~x", "naïve"])
def test_defs_whose_names_need_escaping_are_hoisted(rng_seed, name):
    """A $ref writes a def's name as a URI fragment's pointer token (%20, ~1 for /, ~0 for ~):
    decoded to find the def (forced calls were refused: "Pointer does not exist")."""
    from urllib.parse import quote

    rng = random.Random(rng_seed)
    token = quote(name.replace("~", "~0").replace("/", "~1"), safe="~")
    params = {"type": "object", "properties": {"p": {"$ref": f"#/$defs/{token}"}},
              "required": ["p"], "$defs": {name: {"type": "integer", "maximum": 9}}}  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    schema = output_schema("required", tools, None)
    value = rng.randint(0, 9)
    assert _valid(schema, {"name": "f", "arguments": {"p": value}})
    assert not _valid(schema, {"name": "f", "arguments": {"p": value + 10}})


def test_combined_objects_are_closed_over_every_name_their_parts_list(rng_seed):
    """An object whose properties sit in its parts (allOf branches, anyOf branches beside its
    own): closed over the union, so a key no part names is refused (a weak model would add
    keys until max_tokens) while every part still holds its own values."""
    rng = random.Random(rng_seed)
    a, b, z = rng.randint(0, 9), rng.choice(["x", "y"]), f"k{rng.randint(0, 99)}"
    merged = {"type": "object", "allOf": [
        {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}]}  # fmt: skip
    schema = closed(merged)
    assert _valid(schema, {"a": a, "b": b})
    assert not _valid(schema, {"a": a, "b": b, z: 1})  # no part names it
    assert not _valid(schema, {"a": str(a), "b": b})  # the part still holds its value
    assert _valid(merged, {"a": a, "b": b, z: 1})  # (open as given)
    # A part that opens the object itself, or one read through a $ref, leaves it open.
    for opened in ({"additionalProperties": True}, {"$ref": "#/$defs/X"}):
        part = {**merged, "allOf": [*merged["allOf"], opened], "$defs": {"X": {}}}
        assert "additionalProperties" not in closed(part)


def test_an_object_with_pattern_properties_stays_open(rng_seed):
    """Names its patterns allow are its keys too: closing it over its listed names would
    refuse them (it did, when combined with branches)."""
    rng = random.Random(rng_seed)
    key = f"x_{rng.randint(0, 999)}"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "patternProperties": {"^x_": {"type": "integer"}},
              "anyOf": [{"required": ["a"]}, {"properties": {"b": {}}}]}  # fmt: skip
    assert _valid(closed(schema), {"a": 1, key: rng.randint(0, 9)})


@pytest.mark.parametrize("opened", ["additionalProperties", "patternProperties", "$ref"])
def test_an_mcp_forced_call_may_pin_a_name_an_open_object_takes(rng_seed, opened):
    from freetoken_agent.integrations.mcp_turn import call_schema

    rng = random.Random(rng_seed)
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    ways = {"additionalProperties": {"additionalProperties": True},
            "patternProperties": {"patternProperties": {"^p": {}}},
            "$ref": {"$ref": "#/$defs/P", "$defs": {"P": {"type": "object"}}}}  # fmt: skip
    params |= ways[opened]
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    name = f"p{rng.randint(0, 99)}"
    value = rng.randint(0, 9)
    schema = call_schema(tool, {name: value}, {})
    assert schema["properties"]["arguments"]["properties"][name] == {"const": value}
    closed_params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    closed_tool = {"type": "function", "function": {"name": "f", "parameters": closed_params}}
    with pytest.raises(ValueError, match="does not take"):
        call_schema(closed_tool, {name: value}, {})


BASE = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("shape", ["allOf", "beside", "required"])
def test_closing_never_refuses_a_value_of_the_names_the_schema_mentions(rng_seed, shape):
    """A def read as a part of an object (an allOf branch, a $ref beside properties) stays
    open, and a required name the properties leave out is a key: closed, each admitted
    nothing (a 400 "Unsatisfiable schema" for forced calls, strict tools and LangChain)."""
    rng = random.Random(rng_seed)
    extra = {"properties": {"b": {"type": "integer"}}, "required": ["b"]}
    schema = {
        "allOf": {"type": "object", "allOf": [{"$ref": "#/$defs/Base"}, extra],
                  "$defs": {"Base": BASE}},
        "beside": {"$ref": "#/$defs/Base", **extra, "$defs": {"Base": BASE}},
        "required": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "required": ["a", "b"]},
    }[shape]  # fmt: skip
    value = {"a": rng.randint(0, 9), "b": rng.randint(0, 9)}
    assert _valid(schema, value) and _valid(closed(schema), value)
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert _valid(output_schema("required", tools, None), {"name": "f", "arguments": value})
    if shape == "required":  # still closed to names it does not mention
        assert not _valid(closed(schema), {**value, f"z{rng.randint(0, 9)}": 1})


def test_a_def_read_as_a_whole_value_is_still_closed(rng_seed):
    rng = random.Random(rng_seed)
    schema = {"type": "object", "properties": {"solo": {"$ref": "#/$defs/Base"}},
              "$defs": {"Base": BASE}}  # fmt: skip
    a = rng.randint(0, 9)
    assert _valid(closed(schema), {"solo": {"a": a}})
    assert not _valid(closed(schema), {"solo": {"a": a, "z": 1}})
    assert _valid(schema, {"solo": {"a": a, "z": 1}})  # (open as given)


def test_a_lone_allof_around_a_ref_keeps_the_def_closed(rng_seed):
    """pydantic v1 and OpenAPI 3.0 wrap a $ref in a one-branch allOf to give it a description:
    that def is the whole value, not a part, and still refuses names it does not list."""
    rng = random.Random(rng_seed)
    schema = {"type": "object",
              "properties": {"home": {"description": "d", "allOf": [{"$ref": "#/$defs/Base"}]},
                             "work": {"$ref": "#/$defs/Base"}},
              "$defs": {"Base": BASE}}  # fmt: skip
    a = rng.randint(0, 9)
    value = {"home": {"a": a}, "work": {"a": a}}
    assert _valid(closed(schema), value)
    for where in ("home", "work"):
        assert not _valid(closed(schema), {**value, where: {"a": a, "z": 1}})


@pytest.mark.parametrize("shape", ["anyOf", "allOf"])
def test_a_combined_object_is_closed_over_the_names_its_parts_require(rng_seed, shape):
    """A required name no part lists is a key too: closed over the listed names alone, the
    object admitted nothing."""
    rng = random.Random(rng_seed)
    schema = {
        "anyOf": {"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a", "id"], "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
        "allOf": {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                              {"required": ["id"]}]},
    }[shape]  # fmt: skip
    value = {"a": rng.randint(0, 9), "id": rng.randint(0, 9)}
    assert _valid(schema, value) and _valid(closed(schema), value)
    assert not _valid(closed(schema), {**value, f"z{rng.randint(0, 9)}": 1})
