"""Templates that do not render tools, tool calls or tool results (Tulu/OLMoE, plain ChatML)
are refused with a message saying so, instead of a prompt that silently lacks them (regression:
the model answered a history whose tool round it never saw, and a tool_call anchor was placed
for a call never rendered). Histories without tools still render with them."""

from __future__ import annotations

import itertools
import random

import pytest

from freetoken_agent.chat_format import ChatFormat
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.outputs import InvalidRequestError
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    to_template_messages,
)

# The Tulu template OLMoE-Instruct ships (model data used as a fixture): no tools, no calls, and
# tool messages are skipped.
TULU = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{% if not loop.last %}"
    "{{ '<|assistant|>\n'  + message['content'] + eos_token + '\n' }}"
    "{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)
# Generic ChatML: every role's content (tool results too), but neither tools nor calls.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\n' + (message.content or '') + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
# Tools and calls, but tool messages skipped.
NO_RESULTS = (
    "{%- if tools %}{{- '<|im_start|>system\n' }}{%- for t in tools %}{{- t | tojson }}"
    "{%- endfor %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'tool' %}"
    "{{- '<|im_start|>' + message.role + '\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '<tool_call>' + call.function.name + '</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
WORDS = ["alpha", "beta", "café", "你好", "🙂", "x,", "{a:", "1}", "!?"]
_serial = itertools.count()


def rand_text(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, 6))]
    return " ".join([f"w{next(_serial)}", *words, "end"])


def rand_tools(rng: random.Random) -> list[dict]:
    return [
        {"name": f"f{i}", "description": rand_text(rng), "parameters": {"type": "object"}}
        for i in range(rng.randint(1, 3))
    ]


def plain_history(rng: random.Random) -> list:
    history: list = [SystemMessage(rand_text(rng))] if rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 3)):
        history += [UserMessage(rand_text(rng)), AssistantMessage(rand_text(rng))]
    return [*history, UserMessage(rand_text(rng))]


def tool_round(rng: random.Random) -> list:
    calls = [
        ToolCall(f"c{next(_serial)}", f"f{rng.randrange(3)}", {"q": rand_text(rng)})
        for _ in range(rng.randint(1, 2))
    ]
    content = rand_text(rng) if rng.random() < 0.5 else ""
    results = [ToolResult(c.id, rand_text(rng) if rng.random() < 0.7 else "") for c in calls]
    return [AssistantMessage(content, None, calls), *results]


def with_tool_round(rng: random.Random) -> list:
    history = plain_history(rng)
    return [*history, *tool_round(rng), UserMessage(rand_text(rng))]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


@pytest.mark.parametrize("source", [TULU, CHATML], ids=["tulu", "chatml"])
def test_histories_without_tools_still_render(tok: Tokenizer, rng_seed: int, source) -> None:
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=source)
    for _ in range(3):
        history = plain_history(rng)
        for tools in (None, []):  # an empty tool list has nothing to render
            prompt = fmt.render(history, tools=tools)
            text = fmt.template(None).render(to_template_messages(history))
            assert prompt.text == text
            assert prompt.token_ids == tok.encode(text)
            assert [a.kind for a in prompt.anchors] == ["turn_start"] * len(history) + [
                "generation_prefix"
            ]


@pytest.mark.parametrize("source", [TULU, CHATML], ids=["tulu", "chatml"])
def test_tool_definitions_not_rendered_are_refused(tok: Tokenizer, rng_seed: int, source) -> None:
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=source)
    for _ in range(3):
        with pytest.raises(InvalidRequestError, match="does not render tool definitions"):
            fmt.render(plain_history(rng), tools=rand_tools(rng))


@pytest.mark.parametrize("source", [TULU, CHATML], ids=["tulu", "chatml"])
def test_tool_calls_not_rendered_are_refused(tok: Tokenizer, rng_seed: int, source) -> None:
    """No tool list given, so only the calls in the history show it (plain ChatML does render
    the results: the calls alone are missing)."""
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=source)
    for _ in range(3):
        history = with_tool_round(rng)
        with pytest.raises(InvalidRequestError, match="does not render tool calls.*never see"):
            fmt.render(history)
        if source is TULU:  # the whole round vanishes from the text the model would see
            text = fmt.template(None).render(to_template_messages(history))
            results = [m.content for m in history if isinstance(m, ToolResult) and m.content]
            assert not any(r in text for r in results)


def test_tool_results_not_rendered_are_refused(tok: Tokenizer, rng_seed: int) -> None:
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=NO_RESULTS)
    for _ in range(3):
        tools = rand_tools(rng)
        history = with_tool_round(rng)
        with pytest.raises(InvalidRequestError, match="does not render tool results"):
            fmt.render(history, tools=tools)
        # The calls alone (a turn awaiting its results) are rendered, and anchored.
        pending = history[: next(i for i, m in enumerate(history) if isinstance(m, ToolResult))]
        prompt = fmt.render(pending, tools=tools)
        calls = pending[-1].tool_calls
        anchors = [a for a in prompt.anchors_of(len(pending) - 1) if a.kind == "tool_call"]
        assert len(anchors) == len(calls)
        for anchor, call in zip(anchors, calls, strict=True):
            assert prompt.text[anchor.char_offset :].startswith(f"<tool_call>{call.name}")
