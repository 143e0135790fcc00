"""Strict tools for Mistral-format models (integrations/strict_tools_mistral.py): calls written
as Mistral's templates write them, for random valid arguments of random strict schemas, pass
the grammar after free text, in both forms (the `[TOOL_CALLS] [...]` list of v3 tokenizers,
`[TOOL_CALLS]name[ARGS]{...}` of v11 ones), and the parser reads the same calls back; calls
outside the schemas, text after the calls and an opener spelled out of plain tokens are
refused; `strict_grammar` picks the form by the model's tokenizer and template. Tools, schemas,
values and texts are drawn fresh each run. The tokenizers are tests/helpers/mistral_tokenizer's
(Mixtral-8x22B's control tokens as special tokens), with `[ARGS]` and `[CALL_ID]` added for
the v11 form."""

from __future__ import annotations

import json
import random
import string
from types import SimpleNamespace
from typing import Any

import pytest
from mistral_tokenizer import CONFIG, mistral_v3_backend
from random_schemas import random_instance, random_name, random_object_schema, random_tools
from template_sources import TemplateSources
from tokenizers import AddedToken

from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.constrained import GrammarCompiler
from freetoken_agent.engine.sampling_params import Constraint
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.integrations.strict_tools import strict_calls_grammar, strict_grammar
from freetoken_agent.integrations.strict_tools_mistral import (
    list_calls_grammar,
    mistral_calls_grammar,
    named_calls_grammar,
    writes_named_calls,
)
from freetoken_agent.integrations.strict_tools_xml import xml_calls_grammar
from freetoken_agent.parsers import ContentDelta, OutputParser, ToolCallEnd, coalesce

FORMS = ("list", "named")
EOS = "</s>"
# What engine_tool_format reads in a template: the call syntax it renders.
LIST_TEMPLATE = '{%- if m.tool_calls %}[TOOL_CALLS] [{{ m.tool_calls|tojson }}]{{ "</s>" }}'
NAMED_TEMPLATE = "{%- for c in m.tool_calls %}[TOOL_CALLS]{{ c.name }}[ARGS]{{ c.arguments }}"


def v3_tokenizer(templates: dict[str, str] | None = None) -> Tokenizer:
    return Tokenizer(mistral_v3_backend(), dict(CONFIG), chat_templates=templates)


def v11_tokenizer() -> Tokenizer:
    """The v3 tokenizer with v11's `[ARGS]` and `[CALL_ID]` control tokens."""
    backend = mistral_v3_backend()
    added = [AddedToken(t, special=True, normalized=False) for t in ("[ARGS]", "[CALL_ID]")]
    backend.add_special_tokens(added)
    return Tokenizer(backend, dict(CONFIG))


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Tokenizer]:
    return {"list": v3_tokenizer(), "named": v11_tokenizer()}


def _accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """Whether the grammar takes `text` whole and may end there (tokenized as the model's
    tokenizer does: `[TOOL_CALLS]`, `[ARGS]` and eos as their special tokens)."""
    matcher = GrammarCompiler(tokenizer, tokenizer.eos_token_ids).matcher(
        Constraint("lark", grammar)
    )
    ok = all(matcher.consume_token(t) for t in tokenizer.encode(text))
    return ok and matcher.is_accepting()


def _specials(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.backend.get_added_tokens_decoder().values()]


def _text(rng: random.Random, specials: list[str]) -> str:
    """Free text, none of the added tokens' texts in it (the tokenizer would read them as
    those tokens; `[TOOL_CALLS]` would open a call)."""
    alphabet = string.ascii_letters + " .,:\n{}[]\"'<>/=_"
    while True:
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        if not any(s in text for s in specials):
            return text


def _parameters(rng: random.Random) -> dict:
    """A random closed object schema: random_schemas' scalars, some of them as arrays or
    nested objects."""
    schema = random_object_schema(rng)
    props = schema["properties"]
    for key in list(props):
        roll = rng.random()
        if roll < 0.2:
            props[key] = {"type": "array", "items": props[key], "maxItems": 3}
        elif roll < 0.35:
            props[key] = random_object_schema(rng)
    return schema


def _tools(rng: random.Random) -> list[dict]:
    return random_tools(rng, _parameters)


def _call_id(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits) for _ in range(9))


def _block(rng: random.Random, form: str, calls: list[tuple[str, dict]]) -> str:
    """`calls` as the model writes them. The list: Mixtral's template writes
    `[TOOL_CALLS] [`, each call's function as tojson less its `}`, then `, "id": "<9 chars>"}`,
    ", " between calls, `]`; Ministral's writes no space after the opener; a model may leave
    the id out. Named (v11): `[TOOL_CALLS]name[ARGS]` and the arguments as tojson, back to
    back, an optional `[CALL_ID]id` before `[ARGS]`."""
    if form == "list":
        items = []
        for name, args in calls:
            item = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            if rng.random() < 0.7:
                item = item[:-1] + f', "id": "{_call_id(rng)}"}}'
            items.append(item)
        return f"[TOOL_CALLS]{rng.choice(['', ' '])}[{', '.join(items)}]"
    out = ""
    for name, args in calls:
        call_id = f"[CALL_ID]{_call_id(rng)}" if rng.random() < 0.3 else ""
        out += f"[TOOL_CALLS]{name}{call_id}[ARGS]{json.dumps(args, ensure_ascii=False)}"
    return out


def _output(
    rng: random.Random, form: str, tools: list[dict], specials: list[str]
) -> tuple[str, str, list[tuple[str, dict]]]:
    """(free text, the whole output ending in eos, its calls)."""
    calls = []
    for _ in range(rng.randint(1, 3)):
        fn = rng.choice(tools)["function"]
        calls.append((fn["name"], random_instance(rng, fn["parameters"])))
    lead = _text(rng, specials)
    return lead, lead + _block(rng, form, calls) + EOS, calls


def _grammar(form: str, tools: list[dict], tokenizer: Tokenizer) -> str:
    assert writes_named_calls(tokenizer) == (form == "named")
    return mistral_calls_grammar(tools, tokenizer)


@pytest.mark.parametrize("form", FORMS)
def test_calls_as_the_model_writes_them_pass_after_free_text(tokenizers, form, rng_seed):
    rng = random.Random(rng_seed)
    tokenizer = tokenizers[form]
    specials = _specials(tokenizer)
    for _ in range(8):
        tools = _tools(rng)
        _, output, _ = _output(rng, form, tools, specials)
        assert _accepts(tokenizer, _grammar(form, tools, tokenizer), output), output


@pytest.mark.parametrize("form", FORMS)
def test_the_parser_reads_back_the_calls(tokenizers, form, rng_seed):
    """Written -> the grammar takes it -> the Mistral parser gives back the same calls, and
    the free text before them as content."""
    rng = random.Random(rng_seed)
    tokenizer = tokenizers[form]
    specials = _specials(tokenizer)
    for _ in range(8):
        tools = _tools(rng)
        lead, output, calls = _output(rng, form, tools, specials)
        assert _accepts(tokenizer, _grammar(form, tools, tokenizer), output), output
        parser = OutputParser("mistral", False, tools)
        events = coalesce(parser.feed(output.removesuffix(EOS)) + parser.finish())
        parsed = [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)]
        assert json.dumps(parsed) == json.dumps(calls), output
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert content == lead, output


def _checked_tool(rng: random.Random) -> tuple[dict, str, str]:
    """A strict tool whose required parameters include an integer and an enum (in random
    places among random others), and the names of those two."""
    params = _parameters(rng)
    keys = []
    for schema in (
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan"], 2)},
    ):
        keys.append(random_name(rng, [*params["properties"], *keys]))
        items = list(params["properties"].items())
        items.insert(rng.randint(0, len(items)), (keys[-1], schema))
        params["properties"] = dict(items)
        params["required"].append(keys[-1])
    fn = {"name": random_name(rng), "parameters": params, "strict": True}
    return {"type": "function", "function": fn}, keys[0], keys[1]


@pytest.mark.parametrize("form", FORMS)
def test_calls_outside_the_schemas_are_refused(tokenizers, form, rng_seed):
    """A call of no tool, and a strict tool's call missing a required argument, with an extra
    one, a value of the wrong type or an enum value outside the enum, are refused, as are
    text after the calls and an opener spelled out of plain tokens; the same call with valid
    arguments passes, and a non-strict tool's call may carry any object."""
    rng = random.Random(rng_seed)
    tokenizer = tokenizers[form]
    specials = _specials(tokenizer)
    tool, integer, enum = _checked_tool(rng)
    loose = _tools(rng)[0]
    loose["function"].update(strict=False, name=random_name(rng, [tool["function"]["name"]]))
    tools = [tool, loose]
    rng.shuffle(tools)
    grammar = _grammar(form, tools, tokenizer)
    fn = tool["function"]
    args = random_instance(rng, fn["parameters"])

    def passes(name: str, arguments: Any, after: str = "") -> bool:
        block = _block(rng, form, [(name, arguments)])
        return _accepts(tokenizer, grammar, _text(rng, specials) + block + after + EOS)

    assert passes(fn["name"], args)
    assert not passes(random_name(rng, [t["function"]["name"] for t in tools]), args)
    missing = dict(args)
    del missing[rng.choice(fn["parameters"]["required"])]
    assert not passes(fn["name"], missing)
    extra = list(args.items())
    extra.insert(rng.randint(0, len(extra)), (random_name(rng, args), rng.randint(0, 9)))
    assert not passes(fn["name"], dict(extra))
    wrong = rng.choice([str(args[integer]), [args[integer]], None, args[integer] + 0.5])
    assert not passes(fn["name"], {**args, integer: wrong})
    outside = random_name(rng, fn["parameters"]["properties"][enum]["enum"])
    assert not passes(fn["name"], {**args, enum: outside})
    assert not passes(fn["name"], args, after=_text(rng, specials) or "x")
    anything = {random_name(rng): [1, {"x": None}] for _ in range(rng.randint(0, 3))}
    assert passes(loose["function"]["name"], anything)
    lead = _text(rng, specials) + "[TOOL_CALLS"
    spelled = [*tokenizer.encode(lead), tokenizer.token_to_id("<0x5D>")]  # "]" as a byte
    assert tokenizer.token_to_id("[TOOL_CALLS]") not in spelled
    matcher = GrammarCompiler(tokenizer, tokenizer.eos_token_ids).matcher(
        Constraint("lark", grammar)
    )
    assert not all(matcher.consume_token(t) for t in spelled)


def test_strict_grammar_gives_mistral_models_their_form(tokenizers, rng_seed, tmp_path_factory):
    """Mistral-format models (by architecture or template) get the Mistral grammar: the list
    for a v3 tokenizer, named calls for one with `[ARGS]` or a template that writes it; Hermes
    and XML models get their grammars as before; a model of no format gets none."""
    rng = random.Random(rng_seed)
    tools = _tools(rng)
    v3, v11 = tokenizers["list"], tokenizers["named"]
    demo = Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))

    def model(arch: str, tokenizer: Any, sources: dict[str, str] | None = None) -> Any:
        wrapped = TemplateSources(tokenizer, sources) if sources is not None else tokenizer
        return SimpleNamespace(tokenizer=wrapped, spec=SimpleNamespace(arch=arch))

    listed = strict_grammar(model("mixtral", v3), tools)
    assert listed == list_calls_grammar(tools, v3)
    assert listed.splitlines()[0] == "start: free call?"
    assert '<[5]> " "? %json' in listed and "[ARGS]" not in listed
    assert strict_grammar(model("llama", v3, {"default": LIST_TEMPLATE}), tools) == listed
    named = strict_grammar(model("mixtral", v11), tools)
    assert named == named_calls_grammar(tools, v11) != listed
    args_id = v11.token_to_id("[ARGS]")
    assert all(f'"{t["function"]["name"]}" (<[' in named for t in tools)
    assert f"<[{args_id}]> %json" in named
    by_template = strict_grammar(model("llama", v3, {"tool_use": NAMED_TEMPLATE}), tools)
    assert by_template == named_calls_grammar(tools, v3) != named
    assert '"[ARGS]" %json' in by_template  # not a token of the v3 tokenizer: its text
    hermes = strict_grammar(model("qwen3_moe", demo, {}), tools)
    assert hermes == strict_calls_grammar(tools, demo)
    assert hermes.splitlines()[0] == "start: free (call free)*" and "TOOL_CALLS" not in hermes
    xml = strict_grammar(model("qwen3_5_moe", demo, {}), tools)
    assert xml == xml_calls_grammar(tools, demo) and "TOOL_CALLS" not in xml
    assert strict_grammar(model("gpt2", v3, {}), tools) is None
