"""Strict tools for models that write XML calls (integrations/strict_tools_xml.py): what the
Qwen3.5 chat template itself renders for random valid arguments of random strict schemas passes
the grammar, with thinking and free text around the calls, and the parser reads back the
arguments rendered; calls outside the schemas are refused; `strict_grammar` picks the grammar
by the model's tool format. Tools, schemas, values and texts are drawn fresh each run; the demo
model's tokenizer (Qwen's added tokens: <tool_call>, <think>, <|im_end|>) is the one the
grammar is built for."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import pytest
from opener_push import OpenerPush
from random_schemas import random_name, random_tools
from template_sources import TemplateSources

from freetoken_agent import Engine, SamplingParams
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine import runner as runner_module
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.engine.text.chat_template import ChatTemplate
from freetoken_agent.integrations.constrained_output import closed
from freetoken_agent.integrations.strict_tools import strict_calls_grammar, strict_grammar
from freetoken_agent.integrations.strict_tools_mistral import mistral_calls_grammar
from freetoken_agent.integrations.strict_tools_xml import xml_calls_grammar
from freetoken_agent.parsers import OutputParser, ToolCallEnd
from freetoken_agent.parsers.qwen3_coder import VALUE_ENDS

TEMPLATE_FILE = Path(__file__).parents[1] / "freetoken_agent" / "qwen3_5_chat_template.jinja"
QWEN3_5 = ChatTemplate(TEMPLATE_FILE.read_text())
# Pieces of string values: code, markup, newlines, near misses of the parser's value ends.
PIECES = ["def f(x):", "\n", "    return x < 1", "if a<b and b>c:", "<div>", "</div>", "\t",
          "é", "你好", "{", "}", '"', "\\", " ", "</paramete", "<parameter", " </function>",
          "x = {'k': [1, 2]}", "<b>bold</b>", "a\n\nb", "=>", "null", "42"]  # fmt: skip
WORDS = ["red", "dark blue", "a<b", "x/y", "on-off", "ünï", "1", "true"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = ensure_demo_model(tmp_path_factory.mktemp("cache"))
    return Engine.load(path, device="cpu", progress=False, kv_tokens=4096, max_model_len=1024)


def _specials(engine: Engine) -> list[str]:
    return [t.content for t in engine.tokenizer.backend.get_added_tokens_decoder().values()]


def _clean(text: str, specials: list[str]) -> bool:
    """Whether `text` is free of the added tokens' texts (the tokenizer would read them as
    those tokens: a grammar's text never holds one, and <tool_call> opens a call)."""
    return not any(s in text for s in specials)


def _string(rng: random.Random, specials: list[str]) -> str:
    """A string value the parser can read back (no value end inside it)."""
    while True:
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 8)))
        if _clean(text, specials) and not any(end in f"\n{text}\n" for end in VALUE_ENDS):
            return text


def _text(rng: random.Random, specials: list[str]) -> str:
    alphabet = string.ascii_letters + " .,:\n{}\"'<>/=_"
    while True:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        if _clean(text, specials):
            return text


def _schema(rng: random.Random, depth: int, bounded: bool = False) -> dict:
    """A random parameter schema; `bounded`: only values of bounded length (no strings and
    no plain numbers, which a random model may write on forever)."""
    kinds = ["integer", "boolean", "enum", "int_enum"]
    kinds += [] if bounded else ["string", "string", "number"]
    kinds += ["object", "array"] if depth == 0 else []
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "description": random_name(rng)}
    if kind == "integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number"}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":  # sometimes without a type, as some schemas write it
        members = rng.sample(WORDS, rng.randint(1, 4))
        return {"enum": members} if rng.random() < 0.3 else {"type": "string", "enum": members}
    if kind == "int_enum":
        return {"type": "integer", "enum": rng.sample(range(-5, 50), rng.randint(1, 4))}
    if kind == "object":
        return _object(rng, depth + 1, bounded)
    return {"type": "array", "items": _schema(rng, depth + 1, bounded), "maxItems": 3}


def _object(rng: random.Random, depth: int = 0, bounded: bool = False) -> dict:
    names = list(dict.fromkeys(random_name(rng) for _ in range(rng.randint(1, 5))))
    return {
        "type": "object",
        "properties": {n: _schema(rng, depth, bounded) for n in names},
        "required": rng.sample(names, rng.randint(1 if depth == 0 else 0, len(names))),
    }


def _value(rng: random.Random, schema: dict, specials: list[str]) -> Any:
    """A random value valid against `schema` (the shapes drawn above)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        keys = [k for k in props if k in schema["required"] or rng.random() < 0.5]
        return {k: _value(rng, props[k], specials) for k in keys}
    if kind == "array":
        return [_value(rng, schema["items"], specials) for _ in range(rng.randint(0, 3))]
    if kind == "string":
        return _string(rng, specials)
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        return rng.choice([rng.randint(-99, 99), round(rng.uniform(-1e4, 1e4), rng.randint(0, 6))])
    return rng.random() < 0.5


def _tools(rng: random.Random, bounded: bool = False) -> list[dict]:
    return random_tools(rng, lambda r: _object(r, 0, bounded))


def _tool_call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def _render(tools: list[dict], turn: dict) -> str:
    """What the template writes for the assistant `turn` after the generation prompt (the
    output a model would write there), up to its <|im_end|>."""
    user = {"role": "user", "content": "go"}
    prompt = QWEN3_5.render([user], tools=tools)
    full = QWEN3_5.render([user, turn], tools=tools, add_generation_prompt=False)
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n")
    return full[len(prompt) : -1]


def _block(tools: list[dict], name: str, args: dict) -> str:
    """One call block as the template writes it."""
    turn = {"role": "assistant", "content": "", "tool_calls": [_tool_call(name, args)]}
    text = _render(tools, turn)
    return text[text.index("<tool_call>") : text.rindex("</tool_call>") + len("</tool_call>")]


def _turn(rng: random.Random, tools: list[dict], specials: list[str]) -> tuple[str, list]:
    """An output for `tools` and the calls in it: the template's turn (thinking, text and
    calls), then more text and calls."""

    def call() -> tuple[str, dict]:
        fn = rng.choice(tools)["function"]
        return fn["name"], _value(rng, fn["parameters"], specials)

    calls = [call() for _ in range(rng.randint(1, 3))]
    thinking, text = _text(rng, specials), _text(rng, specials)
    turn = {"role": "assistant", "reasoning_content": thinking, "content": text,
            "tool_calls": [_tool_call(*c) for c in calls]}  # fmt: skip
    output = _render(tools, turn).removesuffix("<|im_end|>")
    for _ in range(rng.randint(0, 2)):
        calls.append(call())
        output += _text(rng, specials) + _block(tools, *calls[-1])
    return output + _text(rng, specials) + "<|im_end|>", calls


def _accepts(engine: Engine, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole (tokenized as the model's tokenizer does)."""
    compiler = GrammarCompiler(engine.tokenizer, engine.eos_token_ids)
    matcher = compiler.matcher(Constraint("lark", grammar))
    return all(matcher.consume_token(t) for t in engine.tokenizer.encode(text))


def _parsed(tools: list[dict], output: str, in_reasoning: bool) -> list[tuple[str, dict]]:
    parser = OutputParser("qwen3_coder", in_reasoning, tools)
    events = parser.feed(output.removesuffix("<|im_end|>")) + parser.finish()
    return [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]


def test_the_templates_calls_pass_with_thinking_and_text_around(engine, rng_seed):
    rng = random.Random(rng_seed)
    specials = _specials(engine)
    for _ in range(6):
        tools = _tools(rng)
        grammar = xml_calls_grammar(tools, engine.tokenizer)
        output, _ = _turn(rng, tools, specials)
        assert output.count("<tool_call>") >= 1 and "</think>" in output
        assert _accepts(engine, grammar, output), output


def test_the_parser_reads_back_the_arguments_rendered(engine, rng_seed):
    """Template -> the grammar takes it -> the parser gives back the same calls, values of
    the same JSON types (an integer stays an integer, a string "42" a string)."""
    rng = random.Random(rng_seed)
    specials = _specials(engine)
    for _ in range(6):
        tools = _tools(rng)
        output, calls = _turn(rng, tools, specials)
        assert _accepts(engine, xml_calls_grammar(tools, engine.tokenizer), output), output
        assert json.dumps(_parsed(tools, output, True)) == json.dumps(calls), output


def _checked_tool(rng: random.Random) -> tuple[dict, dict[str, str]]:
    """A strict tool whose required parameters include an integer, an enum, an object and a
    string (in random places among random others), and the names of those four."""
    params = _object(rng)
    roles = {"integer": {"type": "integer", "minimum": 0, "maximum": 99},
             "string": {"type": "string"},
             "enum": {"type": "string", "enum": rng.sample(WORDS, 2)},
             "object": _object(rng, 1)}  # fmt: skip
    names = {}
    for role, schema in roles.items():
        names[role] = random_name(rng, [*params["properties"], *names.values()])
        items = list(params["properties"].items())
        items.insert(rng.randint(0, len(items)), (names[role], schema))
        params["properties"] = dict(items)
        params["required"].append(names[role])
    fn = {"name": random_name(rng), "parameters": params, "strict": True}
    return {"type": "function", "function": fn}, names


def test_calls_outside_the_schemas_are_refused(engine, rng_seed):
    """A call of no tool, and a strict tool's call missing a required parameter, with an extra
    one, an integer written "abc", an enum value outside the enum, an object with a key its
    schema lacks, or a string the parser would cut short (a value end inside it) are refused;
    the same call with valid arguments passes, and a non-strict tool's call may carry any
    parameters."""
    rng = random.Random(rng_seed)
    specials = _specials(engine)
    tool, roles = _checked_tool(rng)
    loose = _tools(rng)[0]
    loose["function"]["strict"] = False
    loose["function"]["name"] = random_name(rng, [tool["function"]["name"]])
    tools = [tool, loose]
    rng.shuffle(tools)
    grammar = xml_calls_grammar(tools, engine.tokenizer)
    fn = tool["function"]
    args = _value(rng, fn["parameters"], specials)

    def passes(name: str, arguments: dict) -> bool:
        lead, tail = _text(rng, specials), _text(rng, specials)
        return _accepts(engine, grammar, lead + _block(tools, name, arguments) + tail)

    assert passes(fn["name"], args)
    assert not passes(random_name(rng, [t["function"]["name"] for t in tools]), args)
    missing = dict(args)
    del missing[rng.choice(fn["parameters"]["required"])]
    assert not passes(fn["name"], missing)
    extra = list(args.items())
    extra.insert(rng.randint(0, len(extra)), (random_name(rng, args), _string(rng, specials)))
    assert not passes(fn["name"], dict(extra))
    assert not passes(fn["name"], {**args, roles["integer"]: "abc"})
    outside = random_name(rng, fn["parameters"]["properties"][roles["enum"]]["enum"])
    assert not passes(fn["name"], {**args, roles["enum"]: outside})
    inner = args[roles["object"]]
    assert not passes(fn["name"], {**args, roles["object"]: {**inner, random_name(rng, inner): 1}})
    for end in VALUE_ENDS:  # inside the value, and at its start (after the template's newline)
        for cut in (_string(rng, specials) + end, end.lstrip("\n")):
            cut += _string(rng, specials)
            assert not passes(fn["name"], {**args, roles["string"]: cut}), cut
    anything = {random_name(rng): _string(rng, specials) for _ in range(rng.randint(0, 3))}
    assert passes(loose["function"]["name"], anything)


def test_strict_grammar_follows_the_models_tool_format(engine, rng_seed):
    """XML-format models (a Qwen3.5 template, whatever the architecture says) get the XML
    grammar, Hermes-format ones the Hermes grammar as before, Mistral-format ones the Mistral
    grammar (test_strict_tools_mistral.py)."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)

    def model(arch: str, sources: dict[str, str], tokenizer: Any = engine.tokenizer) -> Any:
        wrapped = TemplateSources(tokenizer, sources) if tokenizer is not None else None
        return SimpleNamespace(tokenizer=wrapped, spec=SimpleNamespace(arch=arch))

    xml = strict_grammar(model("qwen3_moe", {"default": QWEN3_5.source}), tools)
    assert xml == xml_calls_grammar(tools, engine.tokenizer)
    assert all(f"<function={t['function']['name']}>" in xml for t in tools)
    assert strict_grammar(model("qwen3_5_moe", {}), tools) == xml
    hermes = strict_calls_grammar(tools, engine.tokenizer)
    assert strict_grammar(model("qwen3_moe", {}), tools) == hermes != xml
    assert strict_grammar(engine, tools) == hermes  # the demo model's Hermes template
    mistral = mistral_calls_grammar(tools, engine.tokenizer)
    assert strict_grammar(model("mixtral", {}), tools) == mistral != hermes
    assert strict_grammar(model("qwen3_5_moe", {}, None), tools) is None


def test_the_engine_writes_valid_xml_calls_once_the_opener_comes(engine, rng_seed, monkeypatch):
    """The random demo model, pushed to open a call at a drawn step (its opener's logit
    raised), writes XML calls the parser reads and whose arguments the strict tools' schemas
    take (closed, as in strict mode): the grammar, not luck, wrote them (unconstrained, it
    writes no such thing). Values of bounded length only: a random model would ramble in a
    string value to max_tokens."""
    rng = random.Random(rng_seed)
    tools = _tools(rng, bounded=True)
    for t in tools:
        t["function"]["strict"] = True
    opener = engine.tokenizer.token_to_id("<tool_call>")
    push = OpenerPush(monkeypatch, runner_module, opener, rng.randrange(0, 4))
    grammar = xml_calls_grammar(tools, engine.tokenizer)
    seed = rng.getrandbits(31)
    prompt = engine.tokenizer.encode(" ".join(random_name(rng) for _ in range(6)))
    sp = SamplingParams(max_tokens=400, temperature=1.0, seed=seed, grammar=grammar)
    out = engine.generate(prompt, sp)
    calls = _parsed(tools, out.text, False)
    assert calls, out.text
    schemas = {t["function"]["name"]: closed(t["function"]["parameters"]) for t in tools}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])
    push.reset()
    free = engine.generate(prompt, SamplingParams(max_tokens=400, temperature=1.0, seed=seed))
    assert not _parsed(tools, free.text, False), free.text
