"""Strict tools whose parameters refer to their $defs, recursively (a tree of nodes): every call
format's grammar holds the refs at every depth (the Hermes block, Mistral's list and named
calls, the XML calls), and two tools' defs of the same name stay apart. Inlining cut a cycle
to {}, so a node's children could be anything. Trees, tools and the broken leaf are drawn
fresh each run."""

from __future__ import annotations

import json
import random

import pytest
from mistral_tokenizer import CONFIG, mistral_v3_backend
from tokenizers import AddedToken

from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.integrations.strict_tools import strict_calls_grammar
from freetoken_agent.integrations.strict_tools_mistral import (
    list_calls_grammar,
    named_calls_grammar,
)
from freetoken_agent.integrations.strict_tools_xml import xml_calls_grammar

FORMS = ("hermes", "xml", "list", "named")
VALUE_TYPES = {"integer": int, "string": str}


def _node(value_type: str) -> dict:
    return {
        "type": "object",
        "properties": {
            "v": {"type": value_type},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}},
        },
        "required": ["v", "kids"],
    }


def _tool(name: str, value_type: str) -> dict:
    """A strict tool taking one tree whose nodes' values are of `value_type`; its defs under
    the same name ("Node") as every other such tool's."""
    params = {
        "type": "object",
        "properties": {"root": {"$ref": "#/$defs/Node"}},
        "required": ["root"],
        "$defs": {"Node": _node(value_type)},
    }
    return {"type": "function", "function": {"name": name, "parameters": params, "strict": True}}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    demo = Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))
    v11 = mistral_v3_backend()  # with v11's control tokens: the named form
    v11.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("[ARGS]",)])
    return {
        "hermes": demo,
        "xml": demo,
        "list": Tokenizer(mistral_v3_backend(), dict(CONFIG)),
        "named": Tokenizer(v11, dict(CONFIG)),
    }


BUILD = {
    "hermes": strict_calls_grammar,
    "xml": xml_calls_grammar,
    "list": list_calls_grammar,
    "named": named_calls_grammar,
}


def _call_text(form: str, name: str, tree: dict) -> str:
    """One call of `name` on `tree`, as the model writes it in `form` (JSON as tojson writes)."""
    arguments = {"root": tree}
    if form == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
    if form == "xml":
        return (
            f"<tool_call>\n<function={name}>\n<parameter=root>\n{json.dumps(tree)}\n"
            "</parameter>\n</function>\n</tool_call>"
        )
    if form == "list":
        return f"[TOOL_CALLS] [{json.dumps({'name': name, 'arguments': arguments})}]</s>"
    return f"[TOOL_CALLS]{name}[ARGS]{json.dumps(arguments)}</s>"


def _accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    compiler = GrammarCompiler(tokenizer, frozenset(tokenizer.eos_token_ids))
    matcher = compiler.matcher(Constraint("lark", grammar))
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and (
        matcher.is_accepting()
    )


def _value(rng: random.Random, value_type: str):
    return rng.randint(-99, 99) if value_type == "integer" else f"w{rng.randint(0, 999)}"


def _tree(rng: random.Random, depth: int, value_type: str) -> dict:
    kids = [_tree(rng, depth - 1, value_type) for _ in range(rng.randint(1, 2))] if depth else []
    return {"v": _value(rng, value_type), "kids": kids}


def _broken(rng: random.Random, tree: dict, value_type: str) -> dict:
    """`tree` (a copy) with one node's children, or its value, no longer a node's: at a random
    depth, the root's own children included."""
    tree = json.loads(json.dumps(tree))
    node = tree
    while node["kids"] and rng.random() < 0.7:
        node = rng.choice(node["kids"])
    other = "string" if value_type == "integer" else "integer"
    if rng.random() < 0.5:
        node["kids"] = [rng.choice([3, "x", None, {"v": _value(rng, value_type)}])]
    else:  # a node below the root with the other tool's value type
        node["kids"] = [{"v": _value(rng, other), "kids": []}]
    return tree


@pytest.mark.parametrize("form", FORMS)
def test_recursive_defs_hold_at_every_depth(tokenizers, rng_seed, form):
    rng = random.Random(rng_seed)
    types = ["integer", "string"]
    rng.shuffle(types)
    tools = [_tool(f"grow_{t}", t) for t in types]  # both name their def "Node"
    tokenizer = tokenizers[form]
    grammar = BUILD[form](tools, tokenizer)
    for tool, value_type in zip(tools, types, strict=True):
        name = tool["function"]["name"]
        tree = _tree(rng, rng.randint(1, 3), value_type)
        assert _accepts(tokenizer, grammar, _call_text(form, name, tree)), (form, name, tree)
        bad = _broken(rng, tree, value_type)
        assert not _accepts(tokenizer, grammar, _call_text(form, name, bad)), (form, name, bad)
