"""What schema with_structured_output(method="json_schema") asks the engine for: a pydantic
model's own (its $defs and $refs kept, recursive ones too), a plain schema as given (a root
$ref included), a TypedDict or an OpenAI tool through LangChain's conversion."""

from __future__ import annotations

import json
import math
import random
import sys

import jsonschema
import pytest
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import HumanMessage
from pydantic import BaseModel
from scripted_engine import ScriptedEngine
from typing_extensions import TypedDict

from freetoken_agent import Engine
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.integrations.langchain import ChatFreeToken
from freetoken_agent.service import EngineService


class Node(BaseModel):
    v: int
    kids: list[Node] = []


class Flat(TypedDict):
    a: int


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory):
    engine = Engine.load(ensure_demo_model(tmp_path_factory.mktemp("demo")), device="cpu",
                         progress=False, kv_tokens=2048, max_model_len=512)  # fmt: skip
    fake = ScriptedEngine(engine)
    service = EngineService(fake)
    yield fake, service
    service.close()


def _tree(rng: random.Random, depth: int) -> dict:
    kids = [_tree(rng, depth - 1) for _ in range(rng.randint(1, 2))] if depth else []
    return {"v": rng.randint(-9, 9), "kids": kids}


def test_a_recursive_model_keeps_its_recursion(scripted, rng_seed):
    """The schema the engine holds the answer to is the model's own: a child that is no node
    fails it at any depth (LangChain's conversion cut the $ref to {}, which lets it in)."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    tree = _tree(rng, rng.randint(1, 3))
    fake.replies = [(json.dumps(tree), "stop")] * 2
    for schema in (Node, Node.model_json_schema()):  # the model, or its schema as a dict
        llm = ChatFreeToken(engine=service, max_tokens=200, reasoning=False)
        out = llm.with_structured_output(schema).invoke([HumanMessage("ka")])
        assert (out.model_dump() if isinstance(out, Node) else out) == tree
        held = fake.samplings[-1].json_schema
        jsonschema.validate(tree, held)
        bad = {"v": 1, "kids": [{"v": 2, "kids": [rng.choice(["x", 3, None])]}]}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, held)


def test_a_typeddict_still_goes_through_the_conversion(scripted):
    fake, service = scripted
    fake.replies = [('{"a": 3}', "stop")]
    llm = ChatFreeToken(engine=service, max_tokens=50, reasoning=False)
    assert llm.with_structured_output(Flat).invoke([HumanMessage("ka")]) == {"a": 3}
    assert fake.samplings[-1].json_schema["properties"] == {"a": {"type": "integer"}}


def test_the_answer_is_read_as_strict_json(scripted, rng_seed):
    """A number past a float's range is the largest float (json.loads made it inf, no JSON);
    a lone surrogate escape is a parsing error, not a str no text can hold."""
    rng = random.Random(rng_seed)
    fake, service = scripted
    exponent = rng.randint(309, 10**9)
    fake.replies = [(f'{{"n": -7e{exponent}, "s": "ok"}}', "stop"),
                    ('{"n": 1, "s": "a\\ud83d"}', "stop")]  # fmt: skip
    schema = {"type": "object", "properties": {"n": {"type": "number"}, "s": {"type": "string"}}}
    llm = ChatFreeToken(engine=service, max_tokens=50, reasoning=False)
    out = llm.with_structured_output(schema).invoke([HumanMessage("ka")])
    assert out == {"n": math.copysign(sys.float_info.max, -1.0), "s": "ok"}
    with pytest.raises(OutputParserException, match="lone surrogate"):
        llm.with_structured_output(schema).invoke([HumanMessage("ka")])


def test_a_schema_that_holds_nothing_is_refused(scripted, rng_seed):
    """A dict LangChain reads as a function without parameters ({"name": ...}) would let any
    JSON through: refused when the structured model is made, naming what to pass."""
    rng = random.Random(rng_seed)
    _, service = scripted
    llm = ChatFreeToken(engine=service, max_tokens=50, reasoning=False)
    name = f"F{rng.randrange(10**6)}"
    for schema in ({"name": name}, {"name": name, "description": "d"}, {"title": name}):
        with pytest.raises(ValueError, match="gives no JSON schema"):
            llm.with_structured_output(schema)
