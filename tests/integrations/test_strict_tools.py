"""Strict tools under tool_choice "auto" (integrations/strict_tools.py): the grammar lets free
text and thinking through, and holds every call to a known tool and, for strict tools, to its
schema. Tools, values and texts are drawn fresh each run; the demo model's tokenizer (Qwen's
added tokens: <tool_call>, <think>, <|im_end|>) is the one the grammar is built for."""

from __future__ import annotations

import json
import random
import string

import jsonschema
import pytest
from opener_push import OpenerPush
from random_schemas import random_instance, random_name, random_object_schema, random_tools

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine import runner as runner_module
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.integrations.strict_tools import strict_calls_grammar
from freetoken_agent.parsers import ToolCallEnd
from freetoken_agent.parsers.hermes import HermesParser


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def _tools(rng: random.Random) -> list[dict]:
    return random_tools(rng, lambda r: random_object_schema(r, ("name", "arguments")))


def _call(rng: random.Random, tool: dict) -> str:
    fn = tool["function"]
    args = random_instance(rng, fn["parameters"])
    body = json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _text(rng: random.Random) -> str:
    alphabet = string.ascii_letters + " .,:\n{}\"'<>/"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    return text.replace("<tool_call>", "")


def _accepts(engine: Engine, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (tokenized as the model's tokenizer does)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.eos_token_ids)
    matcher = compiler.matcher(Constraint("lark", grammar))
    return all(matcher.consume_token(t) for t in engine.tokenizer.encode(text))


def test_free_text_thinking_and_valid_calls_pass(engine, rng_seed):
    rng = random.Random(rng_seed)
    for _ in range(8):
        tools = _tools(rng)
        grammar = strict_calls_grammar(tools, engine.tokenizer)
        parts = [_text(rng)]
        if rng.random() < 0.5:
            parts.insert(0, f"<think>\n{_text(rng)}\n</think>\n\n")
        for _ in range(rng.randint(0, 3)):
            parts += [_call(rng, rng.choice(tools)), _text(rng)]
        text = "".join(parts)
        assert _accepts(engine, grammar, text), text


def test_calls_outside_the_schemas_are_refused(engine, rng_seed):
    """A strict tool's call with a value its schema refuses, a call of no tool, and a call
    opener spelled out of plain tokens (the parser would read it as a call) are refused;
    a non-strict tool's call may carry any object."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    grammar = strict_calls_grammar(tools, engine.tokenizer)
    lead = _text(rng)
    strict = [t for t in tools if t["function"]["strict"]]
    tool = rng.choice(strict)["function"]
    schema = tool["parameters"]
    key = rng.choice(list(schema["properties"]))
    bad_value = {"bogus": 1} if rng.random() < 0.5 else [1, 2]  # no scalar schema takes it
    args = {**random_instance(rng, schema), key: bad_value}
    bad = json.dumps({"name": tool["name"], "arguments": args})
    assert not _accepts(engine, grammar, f"{lead}<tool_call>\n{bad}\n</tool_call>")
    unknown = json.dumps({"name": random_name(rng, [t["function"]["name"] for t in tools]),
                          "arguments": {}})  # fmt: skip
    assert not _accepts(engine, grammar, f"{lead}<tool_call>\n{unknown}\n</tool_call>")
    spelled = [*engine.tokenizer.encode(lead + "<"), *engine.tokenizer.encode("tool_call>")]
    assert engine.tokenizer.token_to_id("<tool_call>") not in spelled
    compiler = GrammarCompiler(engine.tokenizer, engine.eos_token_ids)
    matcher = compiler.matcher(Constraint("lark", grammar))
    assert not all(matcher.consume_token(t) for t in spelled)
    loose = [t for t in tools if not t["function"]["strict"]]
    if loose:  # drawn at random: the refusals above are what this test is for
        extra = {random_name(rng): [1, {"x": None}]}
        call = json.dumps({"name": loose[0]["function"]["name"], "arguments": extra})
        assert _accepts(engine, grammar, f"<tool_call>\n{call}\n</tool_call>")


def test_the_engine_writes_a_valid_call_once_the_opener_comes(engine, rng_seed, monkeypatch):
    """The random demo model, pushed to open a call at a drawn step (its opener's logit
    raised), writes a call the Hermes parser reads and whose arguments the strict tool's
    schema takes: the grammar, not luck, wrote it (unconstrained, it writes no such thing)."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    for t in tools:
        t["function"]["strict"] = True
    opener = engine.tokenizer.token_to_id("<tool_call>")
    push = OpenerPush(monkeypatch, runner_module, opener, rng.randrange(0, 4))
    grammar = strict_calls_grammar(tools, engine.tokenizer)
    seed = rng.getrandbits(31)
    prompt = engine.tokenizer.encode(" ".join(random_name(rng) for _ in range(6)))
    sp = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar)
    out = engine.generate(prompt, sp)
    parser = HermesParser()
    events = parser.feed(out.text) + parser.finish()
    ends = [e for e in events if isinstance(e, ToolCallEnd)]
    assert ends, out.text
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for end in ends:
        jsonschema.validate(end.arguments, by_name[end.name])
    push.reset()
    free = engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=seed))
    parser = HermesParser()
    assert not [e for e in parser.feed(free.text) + parser.finish() if isinstance(e, ToolCallEnd)]
