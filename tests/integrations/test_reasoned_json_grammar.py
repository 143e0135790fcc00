"""The reasoned grammar itself (integrations/reasoned_json.py): reasoning, `</think>`, then JSON
held to the schema whole, its $refs resolved by llguidance (recursive ones too), or inside the
call block a Hermes model's forced call is written in."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.integrations.reasoned_json import reasoned_json_grammar
from freetoken_agent.integrations.strict_tools import call_marks

pytest.importorskip("llguidance")

TREE = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "v": {"type": "integer"},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
            },
            "required": ["v", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    path = ensure_demo_model(Path(tmp_path_factory.mktemp("demo")))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=1024, max_model_len=512)


def _accepts(engine: Engine, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole, to its end (tokenized as the model does)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.eos_token_ids)
    matcher = compiler.matcher(Constraint("lark", grammar))
    ids = engine.tokenizer.encode(text)
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


def _tree(rng: random.Random, depth: int) -> dict:
    kids = [_tree(rng, depth - 1) for _ in range(rng.randint(1, 2))] if depth else []
    return {"v": rng.randint(-99, 99), "kids": kids}


def test_a_recursive_schema_holds_at_every_depth(engine, rng_seed):
    """The schema goes into the grammar whole: a $ref back to its own node is kept at every
    depth (inlining it would cut the cycle to {} and let anything in)."""
    rng = random.Random(rng_seed)
    grammar = reasoned_json_grammar(engine.tokenizer, TREE, engine.eos_token_ids)
    assert grammar is not None
    for _ in range(4):
        tree = _tree(rng, rng.randint(1, 3))
        head = f"<think>\n{rng.choice(['so', 'a b', ''])}\n</think>\n\n"[len("<think>\n") :]
        assert _accepts(engine, grammar, head + json.dumps(tree)), tree
        node = tree
        while node["kids"]:  # a leaf deep down that is no node
            node = rng.choice(node["kids"])
        node["kids"] = [rng.choice(["x", 3, None, {"v": 1}])]
        assert not _accepts(engine, grammar, head + json.dumps(tree)), tree


def test_the_frame_writes_a_call_block_around_the_json(engine, rng_seed):
    rng = random.Random(rng_seed)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    opener, closer = call_marks(engine.tokenizer)
    frame = (f'{opener} "\\n"', f'"\\n" {closer}')
    grammar = reasoned_json_grammar(engine.tokenizer, schema, engine.eos_token_ids, frame)
    body = json.dumps({"n": rng.randint(0, 999)})
    assert _accepts(engine, grammar, f"a\n</think>\n\n<tool_call>\n{body}\n</tool_call>")
    assert not _accepts(engine, grammar, f"a\n</think>\n\n{body}")  # the block is the grammar's
    assert not _accepts(engine, grammar, f"a\n</think>\n\n<tool_call>\n{body}")  # and its end


def test_at_most_two_whitespace_characters_come_between_the_block_and_the_json(engine, rng_seed):
    """The templates write `</think>\\n\\n`: the grammar takes at most that much, so a weak
    model does not ramble there and the next turn's prompt meets the KV."""
    rng = random.Random(rng_seed)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    grammar = reasoned_json_grammar(engine.tokenizer, schema, engine.eos_token_ids)
    body = json.dumps({"n": rng.randint(0, 999)})
    for count in range(5):
        gap = "".join(rng.choice(" \n") for _ in range(count))
        assert _accepts(engine, grammar, f"so\n</think>{gap}{body}") == (count <= 2), repr(gap)


def test_the_reasoning_opens_no_second_block(engine, rng_seed):
    """Other added tokens may come in the reasoning, but not `<think>`: a block does not nest
    (and the output parsers would read the opener as reasoning text)."""
    rng = random.Random(rng_seed)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    grammar = reasoned_json_grammar(engine.tokenizer, schema, engine.eos_token_ids)
    body = json.dumps({"n": rng.randint(0, 999)})
    assert _accepts(engine, grammar, f"a <tool_call> b\n</think>\n\n{body}")
    assert not _accepts(engine, grammar, f"a <think> b\n</think>\n\n{body}")
