"""Strict tools' schemas as clients send them: annotation keys beside the parameters (`$id`,
`x-order`, `propertyOrdering`, `readOnly`) keep an XML-call tool strict, a property named like
a keyword ("$ref", "$defs") builds every format's grammar, and an enum member holding a control
character (DEL, C1) compiles in the XML grammar."""

from __future__ import annotations

import random

import pytest

from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.integrations.strict_tools import strict_calls_grammar
from freetoken_agent.integrations.strict_tools_mistral import mistral_calls_grammar
from freetoken_agent.integrations.strict_tools_xml import strict_parameters, xml_calls_grammar

ANNOTATIONS = {
    "$id": "https://example.com/tool.json",
    "x-order": ["city", "days"],
    "propertyOrdering": ["city", "days"],
    "readOnly": False,
    "$schema": "https://json-schema.org/draft/2020-12/schema",
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


def _tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters, "strict": True}}


def test_annotations_keep_a_tool_strict(rng_seed):
    rng = random.Random(rng_seed)
    params = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
        **dict(rng.sample(sorted(ANNOTATIONS.items()), rng.randint(1, len(ANNOTATIONS)))),
    }
    held = strict_parameters(_tool(params))
    assert held is not None and [(k, r) for k, r, _ in held] == [("city", True), ("days", True)]
    # A keyword that constrains the object beyond its properties still makes it non-strict.
    assert strict_parameters(_tool({**params, "minProperties": 1})) is None


@pytest.mark.parametrize("name", ["$ref", "$defs", "definitions", "properties"])
def test_a_property_named_like_a_keyword_builds(tok, name):
    params = {
        "type": "object",
        "properties": {name: {"type": "string"}},
        "required": [name],
        "additionalProperties": False,
    }
    for build in (strict_calls_grammar, xml_calls_grammar, mistral_calls_grammar):
        assert "start:" in build([_tool(params)], tok)


def test_a_control_character_in_an_enum_member_compiles(tok, rng_seed):
    rng = random.Random(rng_seed)
    odd = f"a\x7f{chr(rng.choice(range(0x80, 0xA0)))}b"  # DEL (raw, the lexer refused it)
    params = {
        "type": "object",
        "properties": {"k": {"type": "string", "enum": [odd, "z"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    grammar = xml_calls_grammar([_tool(params)], tok)
    compiler = GrammarCompiler(tok, frozenset({tok.token_to_id("<|im_end|>")}))

    def accepts(value: str) -> bool:
        matcher = compiler.matcher(Constraint("lark", grammar))
        call = (
            f"<tool_call>\n<function=f>\n<parameter=k>\n{value}\n</parameter>\n"
            "</function>\n</tool_call>"
        )
        return all(matcher.consume_token(t) for t in tok.encode(call))

    assert accepts(odd) and accepts("z") and not accepts("q")
