"""Turn starts under a template that refuses the truncated history: the Qwen3.5 template raises
"No user query found" on [system] alone (and on [system, assistant]), which is exactly the
prefix every agent session shares. Regression: the first user turn got no anchor, so two
sessions sharing system prompt and tools resumed a hybrid model from offset 0.

qwen3_5_chat_template.jinja is a Qwen3.5 chat template taken from a public model repository
(text-only content macro; model data used as a fixture)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from freetoken_agent.chat_format import ChatFormat, Prompt, common_prefix
from freetoken_agent.demo_model import ensure_demo_model
from freetoken_agent.engine.text.chat_template import ChatTemplateError
from freetoken_agent.engine.text.tokenizer import Tokenizer
from freetoken_agent.messages import (
    AssistantMessage,
    SystemMessage,
    ToolCall,
    ToolResult,
    UserMessage,
    to_template_messages,
)

QWEN3_5 = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text()
WORDS = ["alpha", "beta", "rules", "café", "你好", "🙂", "x,", "{a:", "1}", "!?", "\n"]
_serial = itertools.count()


def rand_text(rng: random.Random, max_words: int = 12) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(0, max_words))]
    return " ".join([f"w{next(_serial)}", *words, "end"])  # trim leaves it unchanged


def rand_tools(rng: random.Random) -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool{i}",
                "description": rand_text(rng, 20),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for i in range(rng.randint(1, 4))
    ]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(ensure_demo_model(tmp_path_factory.mktemp("cache")))


def check_exact_prefix(tok: Tokenizer, prompt: Prompt, char: int, offset: int) -> None:
    """ids[:offset] are the full rendering's own tokens and exactly the text before `char`:
    what the engine checkpoints there is what a prompt ending at the boundary would compute."""
    assert tok.encode(prompt.text[:char]) == prompt.token_ids[:offset]
    assert tok.decode(prompt.token_ids[:offset], skip_special_tokens=False) == prompt.text[:char]


@pytest.mark.parametrize("with_tools", [True, False])
def test_branches_share_the_first_user_turn_anchor(
    tok: Tokenizer, rng_seed: int, with_tools: bool
) -> None:
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=QWEN3_5)
    for _ in range(3):
        tools = rand_tools(rng) if with_tools else None
        system = SystemMessage(rand_text(rng, 40))
        with pytest.raises(ChatTemplateError, match="No user query"):  # the case under test
            fmt.template(tools).render(to_template_messages([system]), tools=tools)
        a = fmt.render([system, UserMessage(rand_text(rng))], tools)
        later = [AssistantMessage(rand_text(rng)), UserMessage(rand_text(rng))]
        b = fmt.render([system, UserMessage(rand_text(rng)), *later[: rng.randint(0, 2)]], tools)
        turns = [p.find("turn_start", 1) for p in (a, b)]
        for prompt, turn in zip((a, b), turns, strict=True):
            assert turn is not None and turn.exact
            # The first user turn's header is where message 1 starts (system/tools turn before).
            assert turn.char_offset == prompt.text.index("<|im_start|>user")
            check_exact_prefix(tok, prompt, turn.char_offset, turn.offset)
        assert turns[0].offset == turns[1].offset > 0
        shared = common_prefix(a.token_ids, b.token_ids)
        assert a.token_ids[: turns[0].offset] == b.token_ids[: turns[0].offset]
        # The deepest anchor before the divergence: resume after the whole system/tools turn.
        assert b.deepest_anchor(shared) == turns[1]
        assert a.deepest_anchor(shared) == turns[0]


def test_refused_prefixes_past_the_first_message(tok: Tokenizer, rng_seed: int) -> None:
    """[system, assistant] is refused too: both messages before the first user query get their
    exact turn start, and later turns (tool rounds included) still do."""
    rng = random.Random(rng_seed)
    fmt = ChatFormat(tok, chat_template=QWEN3_5)
    for _ in range(4):
        tools = rand_tools(rng) if rng.random() < 0.5 else None
        call = ToolCall(f"c{next(_serial)}", "tool0", {"path": rand_text(rng, 2)})
        history = [
            SystemMessage(rand_text(rng)),
            AssistantMessage(rand_text(rng)),  # a scripted greeting before the first query
            UserMessage(rand_text(rng)),
            AssistantMessage(rand_text(rng, 3), rand_text(rng), [call]),
            ToolResult(call.id, rand_text(rng)),
            UserMessage(rand_text(rng)),
        ]
        history = history[: rng.randint(3, len(history))]
        if isinstance(history[-1], AssistantMessage):
            history.append(UserMessage(rand_text(rng)))
        prompt = fmt.render(history, tools)
        # Each message opens one turn (the tools turn holds the system message; one result per
        # tool round), so message i starts at the i-th <|im_start|>.
        starts = [i for i in range(len(prompt.text)) if prompt.text.startswith("<|im_start|>", i)]
        assert len(starts) == len(history) + 1  # + the generation prompt
        for i in range(len(history)):
            turn = prompt.find("turn_start", i)
            assert turn is not None and turn.exact, i
            assert turn.char_offset == starts[i], (i, prompt.text[starts[i] - 20 :][:60])
            check_exact_prefix(tok, prompt, turn.char_offset, turn.offset)
