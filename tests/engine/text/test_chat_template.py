"""ChatTemplate renders exactly as transformers does (transformers is the oracle here)."""

from __future__ import annotations

import json
import random

import jinja2
import pytest

from freetoken_agent.engine.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    TemplateRaisedError,
)
from freetoken_agent.engine.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# Words that stress escaping, JSON and multi-byte text, plus strings that look like markers.
_WORD_TEXT = (
    "the model calls a tool then answers weather Paris json {braces} <b>html</b> "
    '"quotes" back\\slash tab\there new\nline café naïve 你好 世界 🙂 🚀 ∑ ≠ ℃ </think> <tool_call>'
)
WORDS = _WORD_TEXT.split(" ")


def rand_text(rng: random.Random, max_words: int = 8) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, max_words)))
    if rng.random() < 0.2:
        text = "\n" + text + "\n"
    return text


def rand_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rand_text(rng, 3)
    if kind == 1:
        return rng.randint(-1000, 1000)
    if kind == 2:
        return rng.uniform(-10, 10)
    if kind == 3:
        return rng.choice([True, False, None])
    if kind == 4:
        return rng.choice(["", "ünï", "🙂"])
    if kind == 5:
        return [rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {f"k{i}": rand_value(rng, depth + 1) for i in range(rng.randint(0, 3))}


def rand_tool(rng: random.Random, i: int) -> dict:
    props = {
        f"arg{j}": {"type": rng.choice(["string", "number"]), "description": rand_text(rng, 4)}
        for j in range(rng.randint(0, 3))
    }
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": rand_text(rng),
            "parameters": {"type": "object", "properties": props, "required": list(props)[:1]},
        },
    }


def rand_tools(rng: random.Random, at_least: int) -> list[dict] | None:
    if rng.random() < 0.5:
        return None
    return [rand_tool(rng, i) for i in range(rng.randint(at_least, 3))]


def rand_tool_call(rng: random.Random) -> dict:
    args = {f"arg{j}": rand_value(rng) for j in range(rng.randint(0, 3))}
    call = {"name": f"tool_{rng.randint(0, 3)}", "arguments": args}
    if rng.random() < 0.3:
        call["arguments"] = json.dumps(args)  # some clients send arguments as a JSON string
    if rng.random() < 0.8:
        return {"id": f"call_{rng.randint(0, 99)}", "type": "function", "function": call}
    return call


def rand_conversation(rng: random.Random) -> list[dict]:
    messages: list[dict] = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rand_text(rng)})
    for _ in range(rng.randint(1, 4)):
        content = rand_text(rng)
        if rng.random() < 0.15:
            content = f"<tool_response>{content}</tool_response>"
        messages.append({"role": "user", "content": content})
        for _ in range(rng.randint(0, 2)):
            msg: dict = {"role": "assistant", "content": rand_text(rng)}
            r = rng.random()
            if r < 0.3:
                msg[rng.choice(["reasoning_content", "thinking", "reasoning"])] = rand_text(rng)
            elif r < 0.45:
                msg["content"] = f"<think>\n{rand_text(rng)}\n</think>\n\n{msg['content']}"
            if rng.random() < 0.4:
                msg["tool_calls"] = [rand_tool_call(rng) for _ in range(rng.randint(1, 3))]
                if rng.random() < 0.3:
                    msg["content"] = None  # OpenAI-style: no text beside the calls
                messages.append(msg)
                for _ in range(rng.randint(1, 2)):
                    messages.append({"role": "tool", "content": rand_text(rng)})
            else:
                if rng.random() < 0.2:
                    msg["tool_calls"] = None
                messages.append(msg)
    return messages


def test_demo_template_matches_transformers(ours: Tokenizer, hf_tok, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    for _ in range(150):
        messages = rand_conversation(rng)
        tools = rand_tools(rng, 1)
        kwargs = {}
        if rng.random() < 0.7:
            kwargs["enable_thinking"] = rng.random() < 0.5
        gen = rng.random() < 0.7
        expected = hf_tok.apply_chat_template(
            messages, tools=tools, add_generation_prompt=gen, tokenize=False, **kwargs
        )
        got = ours.apply_chat_template(messages, tools=tools, add_generation_prompt=gen, **kwargs)
        assert got == expected, (messages, tools, kwargs)
        # Token ids too: the rendered prompt's special-token strings become single ids.
        assert ours.encode(got) == hf_tok.encode(got, add_special_tokens=False)


FEATURES = """\
{%- set ns = namespace(n=0) -%}
{% for m in messages %}
  {% if m.role == 'skip' %}{% continue %}{% endif %}
  {% if ns.n > 6 %}{% break %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  [{{ m.role }}] {{ m | tojson }}
  {{ m | tojson(indent=2) }} {{ m | tojson(sort_keys=true) }} {{ m | tojson(ensure_ascii=true) }}
  {% generation %}{{ m.content }}{% endgeneration %}
{% endfor %}
{{ ns.n }} {{ dict(a=1, b=tools) | tojson }} {{ strftime_now('%Y') }}
{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ custom | tojson }}
{{ tools | tojson(separators=(',', ':')) }} {{ documents | tojson }}
{%- if add_generation_prompt %}GEN{% endif %}"""


def test_environment_features_match_transformers(ours: Tokenizer, hf_tok, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    template = ChatTemplate(FEATURES, ours.special_tokens)
    for _ in range(60):
        messages = rand_conversation(rng)
        for m in messages:
            if rng.random() < 0.1:
                m["role"] = "skip"
        tools = rand_tools(rng, 0)
        documents = None
        if rng.random() < 0.3:
            documents = [{"title": rand_text(rng, 2), "text": rand_text(rng)}]
        custom = rand_value(rng)
        gen = rng.random() < 0.5
        expected = hf_tok.apply_chat_template(
            messages,
            tools=tools,
            documents=documents,
            chat_template=FEATURES,
            add_generation_prompt=gen,
            tokenize=False,
            custom=custom,
        )
        got = template.render(
            messages, tools=tools, documents=documents, add_generation_prompt=gen, custom=custom
        )
        assert got == expected


def test_extra_kwargs_override_special_tokens() -> None:
    template = ChatTemplate("{{ eos_token }}", {"eos_token": "<e>"})
    assert template.render([{"role": "user", "content": ""}]) == "<e>"
    assert template.render([{"role": "user", "content": ""}], eos_token="X") == "X"


def test_caller_messages_are_not_changed() -> None:
    template = ChatTemplate("{{ messages | tojson }}", {})
    messages = [{"role": "assistant", "content": None, "reasoning": "r"}]
    out = json.loads(template.render(messages))
    # None values dropped, reasoning aliased under the names templates read.
    aliased = {"thinking": "r", "role": "assistant", "reasoning": "r", "reasoning_content": "r"}
    assert out == [aliased]
    assert messages == [{"role": "assistant", "content": None, "reasoning": "r"}]


def test_raise_exception_is_a_clear_template_error() -> None:
    template = ChatTemplate("{{ raise_exception('only user and assistant roles') }}", {})
    with pytest.raises(TemplateRaisedError, match="only user and assistant roles") as info:
        template.render([{"role": "user", "content": "x"}])
    assert isinstance(info.value, jinja2.TemplateError)
    assert isinstance(info.value, ValueError)


def test_demo_template_rejects_unknown_role(ours: Tokenizer) -> None:
    with pytest.raises(TemplateRaisedError, match="unknown message role: narrator"):
        ours.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_syntax_error_names_the_line() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile.*line 2"):
        ChatTemplate("ok\n{% for m in messages %}{{ m }", {})


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        ("{{ messages[0].content + 1 }}", "TypeError"),
        ("{{ undefined_function() }}", "UndefinedError"),
        ("{{ messages.__class__.__mro__ }}", "SecurityError"),
        ("{% set ns = namespace(_x=1) %}", "SecurityError"),
        ("{{ messages.append(1) }}", "SecurityError"),
    ],
)
def test_render_errors_name_the_problem(source: str, problem: str) -> None:
    template = ChatTemplate(source, {})
    with pytest.raises(ChatTemplateError, match=f"failed to render: {problem}"):
        template.render([{"role": "user", "content": "x"}])


def test_bad_inputs() -> None:
    template = ChatTemplate("{{ messages | length }}", {})
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    with pytest.raises(TypeError, match="message 1 must be a dict"):
        template.render([{"role": "user", "content": "x"}, "hello"])
    with pytest.raises(TypeError, match="tool 0 must be a JSON-schema dict"):
        template.render([{"role": "user", "content": "x"}], tools=[print])
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("   ", {})


# What the environment's quick attribute paths answer (a dict's keys, Jinja's loop, namespace
# values): keys shadowed by dict methods, missing keys, loop values and methods, a namespace's.
ATTRIBUTES = """\
{%- set ns = namespace(n=0, seen=[]) -%}
{% for m in messages %}
  {{ m.role }}|{{ m.content }}|{{ m.missing is defined }}|{{ m.tool_calls is none }}
  {{ m.items is defined }}|{{ m.get('role') }}|{{ m.keys() | list | length }}
  {{ loop.index0 }}{{ loop.first }}{{ loop.last }}{{ loop.revindex }}{{ loop.length }}
  {{ loop.cycle('a', 'b') }}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}
  {% set ns.n = ns.n + loop.index %}{{ ns.n }}{{ ns.seen | length }}{{ ns.absent is defined }}
  {{ (m.content or '').startswith('the') }}{{ loop.__doc__ is defined }}{{ ns.__doc__ is defined }}
{% endfor %}"""


def test_quick_attribute_paths_render_as_transformers(ours: Tokenizer, hf_tok, rng_seed: int):
    """The environment answers `m.role`, `loop.index0` and `ns.n` without the sandbox's
    exception per access (2.3x faster anchor probes); every answer stays the sandbox's, as
    transformers renders it, for keys named like dict methods too."""
    rng = random.Random(rng_seed)
    template = ChatTemplate(ATTRIBUTES, ours.special_tokens)
    for _ in range(40):
        messages = rand_conversation(rng)
        for m in messages:
            if rng.random() < 0.3:
                m[rng.choice(["items", "get", "keys", "copy"])] = rand_text(rng, 2)
        expected = hf_tok.apply_chat_template(messages, chat_template=ATTRIBUTES, tokenize=False)
        assert template.render(messages) == expected, messages


@pytest.mark.parametrize(
    "source",
    [
        "{% for m in messages %}{{ loop.__class__.__mro__ }}{% endfor %}",
        "{% set ns = namespace(a=1) %}{{ ns.__class__.__init__.__globals__ }}",
        "{% for m in messages %}{{ m.__class__.__subclasses__() }}{% endfor %}",
        "{% for m in messages %}{{ m.pop('role') }}{% endfor %}",
        "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    ],
)
def test_quick_attribute_paths_keep_the_sandbox(source: str) -> None:
    """Underscore names and a dict's own methods still go the sandbox's way."""
    with pytest.raises(ChatTemplateError, match="SecurityError|UndefinedError"):
        ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])
